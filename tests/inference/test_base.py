"""The numerical building blocks against torch / brute-force references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.models import decoder_class
from czyx.inference.models.base import (
    KVCache,
    RopeConfig,
    Rotary,
    attention,
    rms_norm,
    rope_config,
    route_topk,
    softmax,
)

finite = st.floats(-20, 20, width=32)


@settings(max_examples=80, deadline=None)
@given(
    logits=hnp.arrays(
        np.float32, st.tuples(st.integers(1, 6), st.integers(2, 16)), elements=finite
    ),
    k=st.integers(1, 16),
    renorm=st.booleans(),
)
def test_route_topk_matches_torch(logits, k, renorm):
    k = min(k, logits.shape[1])
    idx, w = route_topk(logits, k, renorm)
    probs = torch.softmax(torch.from_numpy(logits), dim=-1)
    tv, _ = torch.topk(probs, k, dim=-1)
    if renorm:
        tv = tv / tv.sum(-1, keepdim=True)
    np.testing.assert_allclose(w, tv.numpy(), rtol=1e-5, atol=1e-7)
    # Chosen experts are distinct and carry the largest probabilities.
    p = softmax(logits)
    for row in range(logits.shape[0]):
        assert len(set(idx[row].tolist())) == k
        chosen = p[row, idx[row]]
        assert np.all(np.diff(chosen) <= 0)
        assert chosen.min() >= np.sort(p[row])[-k] - 1e-7


def test_rms_norm_matches_formula():
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    want = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), want, rtol=1e-5)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_preserves_norms_and_relative_positions(partial):
    rope = rope_config(
        {"rope_parameters": {"rope_theta": 500.0, "partial_rotary_factor": partial}}, 16
    )
    assert rope.rotary_dim == int(16 * partial)
    rot = Rotary(rope, initial=4)  # grows on demand
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 16)).astype(np.float32)
    qa, ka = rot.apply(q, np.array([3])), rot.apply(k, np.array([1]))
    qb, kb = rot.apply(q, np.array([40])), rot.apply(k, np.array([38]))
    np.testing.assert_allclose(np.linalg.norm(qa), np.linalg.norm(q), rtol=1e-5)
    # A dot product depends only on the distance between positions.
    np.testing.assert_allclose((qa * ka).sum(), (qb * kb).sum(), rtol=1e-4)
    # Channels past the rotary width pass through unchanged.
    np.testing.assert_array_equal(qa[..., rope.rotary_dim :], q[..., rope.rotary_dim :])


def test_rope_config_reads_legacy_and_linear_and_refuses_others():
    assert rope_config({"rope_theta": 1e6}, 8) == RopeConfig(1e6, 8, 1.0)
    lin = rope_config({"rope_theta": 10.0, "rope_scaling": {"type": "linear", "factor": 4.0}}, 8)
    assert lin.linear_factor == 4.0
    with pytest.raises(UnsupportedModelError, match="yarn"):
        rope_config({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, 8)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        rope_config({"partial_rotary_factor": 0.1}, 8)


@pytest.mark.parametrize("window", [None, 3])
def test_gqa_attention_matches_brute_force(window):
    rng = np.random.default_rng(2)
    n_heads, n_kv, hd, length, t = 4, 2, 8, 7, 3
    q = rng.standard_normal((n_heads, t, hd)).astype(np.float32)
    k = rng.standard_normal((n_kv, length, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, length, hd)).astype(np.float32)
    pos = np.arange(length - t, length)
    got = attention(q, k, v, pos, window)
    want = np.zeros((t, n_heads * hd))
    for h in range(n_heads):
        g = h // (n_heads // n_kv)
        for i, p in enumerate(pos):
            keys = [j for j in range(length) if j <= p and (window is None or p - j < window)]
            s = np.array([q[h, i] @ k[g, j] for j in keys]) / np.sqrt(hd)
            a = np.exp(s - s.max())
            a /= a.sum()
            want[i, h * hd : (h + 1) * hd] = sum(w * v[g, j] for w, j in zip(a, keys))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_kv_cache_grows_and_truncates():
    kv = KVCache(2, 1, 4, capacity=2)
    kv.reserve(5)
    assert kv.capacity >= 5
    kv.write(1, 0, np.ones((1, 5, 4), np.float32), np.ones((1, 5, 4), np.float32))
    kv.length = 5
    kv.truncate(2)
    assert kv.length == 2
    with pytest.raises(ValueError):
        kv.truncate(3)


def test_unknown_architecture_is_refused():
    with pytest.raises(UnsupportedModelError, match="no_such_moe"):
        decoder_class("no_such_moe")


@pytest.mark.parametrize("arch", ["olmoe"])
def test_attention_bias_is_refused(arch):
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        decoder_class(arch).reject_attention_bias({"attention_bias": True})
    decoder_class(arch).reject_attention_bias({"attention_bias": False})
