"""GPT-OSS against transformers, through the store, and its expert layout transform.

transformers 5.x keeps GPT-OSS experts stacked and transposed
(``gate_up_proj [E, H, 2I]``, gate and up interleaved; ``down_proj [E, I, H]``)
and ``save_pretrained`` writes them the same way, so both layouts are that one
file form. Mounted: logits within 1e-5 of transformers (attention sinks,
alternating sliding/full attention, YaRN rope, clamped SwiGLU with biases,
biased router), greedy tokens equal at full and quarter cache, export
byte-identical. The mount-time transform is an exact, invertible permutation.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from czyx.store.models.expert_transform import from_contract, to_contract
from czyx.testing.archparity import run_parity, write_checkpoint
from czyx.testing.tiny_models import build_tiny_model

BASE = dict(initializer_range=0.2, num_hidden_layers=3)


def test_save_pretrained_writes_stacked_transposed_experts(tmp_path):
    model = build_tiny_model("gpt_oss", 0, **BASE)
    path = write_checkpoint(model, tmp_path / "ckpt", fused=False)
    with safe_open(str(path / "model.safetensors"), "np") as f:
        names = set(f.keys())
        shape = f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert "model.layers.0.mlp.experts.down_proj" in names
    assert not any(".experts.0." in n for n in names)
    h, i = model.config.hidden_size, model.config.intermediate_size
    assert shape == [model.config.num_local_experts, h, 2 * i]


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(attention_bias=False, swiglu_limit=0.5, sliding_window=3)],
    ids=["default", "no_attention_bias"],
)
def test_mounted_gpt_oss_matches_transformers(tmp_path, overrides):
    r = run_parity("gpt_oss", tmp_path, fused=False, prompt_len=14, **{**BASE, **overrides})
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5


@given(
    inter=st.integers(1, 9),
    hidden=st.integers(1, 9),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_expert_transform_is_an_exact_inverse_pair(inter, hidden, itemsize, seed):
    n = 3 * inter * hidden * itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    ext = to_contract(raw, inter, hidden, itemsize)
    assert ext.nbytes == n
    assert np.array_equal(from_contract(ext, inter, hidden, itemsize), raw)
    # gate row r, column c is the source's gate_up[c, 2r] (interleaved columns)
    el = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    gu = el[: 2 * inter * hidden].reshape(hidden, 2 * inter)
    gate = ext.view(el.dtype)[: inter * hidden].reshape(inter, hidden)
    assert np.array_equal(gate, gu[:, 0::2].T)
