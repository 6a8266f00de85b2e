"""Llama 4 text against transformers, through the store.

Chunked attention (chunks of 4 positions), a NoPE layer with attention
temperature tuning, L2 q/k norms on the rope layers, the complex (interleaved)
rope, dense and MoE layers interleaved, a sigmoid top-k router whose weight
scales each routed expert's *input*, beside a shared expert. transformers
keeps the experts stacked and transposed (``gate_up_proj [E, H, 2I]``, gate
and up as its halves) and ``save_pretrained`` writes them that way, so there
is one file form: logits within 1e-5, greedy equal at full and quarter cache,
byte-identical export; the mount-time ``gate_up_t`` transform is an exact
inverse pair.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from czyx.inference.models.base import attention
from czyx.store.models.expert_transform import from_contract, to_contract
from czyx.testing.archparity import run_parity


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # top-2 routing on every layer, no qk norm, attention biases, llama3 rope
        dict(
            num_experts_per_tok=2,
            interleave_moe_layer_step=1,
            use_qk_norm=False,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8,
            ),
        ),
    ],
    ids=["default", "top2_biases_llama3_rope"],
)
def test_mounted_llama4_text_matches_transformers(tmp_path, overrides):
    r = run_parity("llama4_text", tmp_path, fused=False, initializer_range=0.2, **overrides)
    assert r.refused is None, r.refused
    assert r.source_layout == "fused"
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5


def test_chunked_attention_sees_only_its_own_chunk():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 4)).astype(np.float32)
    k = rng.standard_normal((1, 7, 4)).astype(np.float32)
    v = rng.standard_normal((1, 7, 4)).astype(np.float32)
    pos = np.array([4, 5, 6])
    got = attention(q, k, v, pos, None, chunk=4)
    # the same as attending over the chunk's keys alone (positions 4..6)
    want = attention(q, k[:, 4:], v[:, 4:], pos - 4, None)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not np.allclose(got, attention(q, k, v, pos, None))


@given(
    inter=st.integers(1, 9),
    hidden=st.integers(1, 9),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_gate_up_halves_transform_is_an_exact_inverse_pair(inter, hidden, itemsize, seed):
    n = 3 * inter * hidden * itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    ext = to_contract(raw, inter, hidden, itemsize, "gate_up_t")
    assert np.array_equal(from_contract(ext, inter, hidden, itemsize, "gate_up_t"), raw)
    # gate is the first half of each [H, 2I] row, transposed
    el = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    gu = el[: 2 * inter * hidden].reshape(hidden, 2 * inter)
    gate = ext.view(el.dtype)[: inter * hidden].reshape(inter, hidden)
    assert np.array_equal(gate, gu[:, :inter].T)


def test_input_weighted_experts_never_take_the_output_weighting_c_path(monkeypatch):
    """The C MoE calls weight each expert's output; a decoder that weights the input
    (Llama 4's flag) must decode through the numpy routed path even when it routes as
    the base does, so its decode equals its own prefill."""
    from czyx.inference.engine import Engine
    from czyx.inference.models.mixtral import MixtralDecoder
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    monkeypatch.setattr(MixtralDecoder, "weight_expert_input", True)
    eng = Engine(StateDictConsumer(tiny_model("mixtral", seed=3)), threads=1)
    model = eng.model
    assert not model.decode_in_c() and not model._direct_moe
    prompt = [3, 17, 5, 60, 1, 88, 42]
    want = eng.prefill(prompt, all_logits=True)[-1]
    eng.reset()
    eng.prefill(prompt[:-1])
    got = eng.decode(prompt[-1])
    eng.close()
    assert np.abs(got - want).max() <= 1e-5 * float(want.max() - want.min())
