"""Sampling: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from czyx.inference.errors import SamplingError
from czyx.inference.sampling import Sampler, SamplingParams

logits_st = hnp.arrays(np.float32, st.integers(2, 40), elements=st.floats(-10, 10, width=32))


@given(logits=logits_st)
def test_greedy_is_argmax(logits):
    assert Sampler(SamplingParams())(logits) == int(np.argmax(logits))


@settings(max_examples=50)
@given(logits=logits_st, k=st.integers(1, 40), temp=st.floats(0.1, 3.0))
def test_top_k_support_is_the_k_largest(logits, k, temp):
    probs = Sampler(SamplingParams(temperature=temp, top_k=k)).probabilities(logits)
    assert abs(probs.sum() - 1) < 1e-9
    kth = np.sort(logits)[-min(k, logits.size)]
    assert np.all(probs[logits < kth] == 0)


@settings(max_examples=50)
@given(logits=logits_st, p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(logits, p):
    s = Sampler(SamplingParams(temperature=1.0, top_p=p))
    probs = s.probabilities(logits)
    full = Sampler(SamplingParams(temperature=1.0)).probabilities(logits)
    kept = probs > 0
    assert full[kept].sum() >= p - 1e-9 or kept.all()
    # Every kept token is at least as likely as every dropped one.
    if (~kept).any():
        assert full[kept].min() >= full[~kept].max()


def test_seed_reproduces_and_differs():
    logits = np.zeros(50, np.float32)
    draw = lambda seed: [Sampler(SamplingParams(1.0, seed=seed))(logits) for _ in range(1)]  # noqa: E731
    a = Sampler(SamplingParams(temperature=1.0, seed=5))
    b = Sampler(SamplingParams(temperature=1.0, seed=5))
    c = Sampler(SamplingParams(temperature=1.0, seed=6))
    sa = [a(logits) for _ in range(30)]
    assert sa == [b(logits) for _ in range(30)]
    assert sa != [c(logits) for _ in range(30)]
    assert draw(1) == draw(1)


def test_tiny_top_p_or_top_k_1_is_greedy():
    logits = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    for params in (SamplingParams(1.0, top_k=1, seed=0), SamplingParams(1.0, top_p=1e-6, seed=0)):
        assert Sampler(params)(logits) == int(np.argmax(logits))


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)]
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


# Values on a 1/8 grid: the penalized logits are exact in float32, so the reference's
# argmax is the sampler's whatever the order of the arithmetic.
eighths = st.integers(-40, 40).map(lambda i: i / 8)


@settings(max_examples=60)
@given(
    steps=st.lists(st.lists(eighths, min_size=6, max_size=6), min_size=1, max_size=12),
    presence=st.integers(-16, 16).map(lambda i: i / 8),
    frequency=st.integers(-16, 16).map(lambda i: i / 8),
)
def test_presence_and_frequency_penalties_are_openais(steps, presence, frequency):
    """Each step's greedy token is the argmax of the logits less, for every token chosen
    so far, frequency_penalty x its count plus presence_penalty once (OpenAI's formula)."""
    from collections import Counter

    s = Sampler(SamplingParams(presence_penalty=presence, frequency_penalty=frequency))
    chosen: Counter[int] = Counter()
    for row in steps:
        logits = np.array(row, np.float32)
        before = logits.copy()
        want = [
            row[j] - frequency * chosen[j] - (presence if chosen[j] else 0.0)
            for j in range(len(row))
        ]
        tok = s(logits)
        assert tok == int(np.argmax(want))
        assert np.array_equal(logits, before)  # the caller's logits are left alone
        chosen[tok] += 1


def test_no_penalty_keeps_the_logits_as_they_are():
    logits = np.random.default_rng(1).standard_normal(20).astype(np.float32)
    s = Sampler(SamplingParams())
    for _ in range(3):
        s(logits)
        assert s.penalized(logits) is logits
    with pytest.raises(SamplingError, match="presence_penalty"):
        SamplingParams(presence_penalty=float("nan"))
