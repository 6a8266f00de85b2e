"""PhiMoE against transformers, through the store, in both expert layouts.

LayerNorm with biases instead of RMSNorm, sparsemixer routing (its
inference-time top-2), q/k/v/o and lm_head biases, one sliding window, and
PhiMoE's own longrope (short factors, a per-pass mscale): logits within 1e-5,
greedy equal at full and quarter cache, byte-identical export.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from czyx.inference.models.phimoe import layer_norm, sparsemixer
from czyx.testing.archparity import run_parity

LONGROPE = dict(
    max_position_embeddings=128,
    sliding_window=9,
    rope_parameters=dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0, 1.5, 2.0, 3.0],
        long_factor=[2.0, 3.0, 5.0, 8.0],
        short_mscale=1.1,
        long_mscale=1.3,
        # the 12-token prompt plus 16 greedy tokens cross it: both mscales act
        original_max_position_embeddings=16,
    ),
)


@pytest.mark.parametrize(
    ("fused", "overrides"),
    [(False, {}), (True, {}), (False, LONGROPE)],
    ids=["per_expert", "fused", "longrope_sliding"],
)
def test_mounted_phimoe_matches_transformers(tmp_path, fused, overrides):
    r = run_parity("phimoe", tmp_path, fused=fused, initializer_range=0.2, **overrides)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.3, 2.0])
def test_sparsemixer_matches_transformers(eps):
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as reference

    scores = np.random.default_rng(3).standard_normal((64, 8)).astype(np.float32)
    scores[:8] -= 5.0  # all-negative rows: the threshold's scale is |score|, clamped
    want_w, want_idx = reference(torch.from_numpy(scores), jitter_eps=eps, training=False)
    idx, w = sparsemixer(scores, eps)
    assert np.array_equal(idx, want_idx.numpy())
    np.testing.assert_allclose(w, want_w.numpy(), rtol=1e-6, atol=1e-7)
    # the threshold acts: with a wide eps the first weight is a softmax over several logits
    if eps == 2.0:
        assert (w[:, 0] < 0.999).all()


def test_sparsemixer_never_picks_a_forbidden_expert():
    scores = np.random.default_rng(4).standard_normal((32, 8)).astype(np.float32)
    allowed = np.array([True, False, True, True, False, True, False, True])
    idx, w = sparsemixer(np.where(allowed, scores, np.float32(-np.inf)), 0.3)
    assert allowed[idx].all() and (idx[:, 0] != idx[:, 1]).all()
    assert np.isfinite(w).all() and (w > 0).all()


def test_layer_norm_matches_torch():
    x = np.random.default_rng(5).standard_normal((6, 32)).astype(np.float32) * 3 + 1
    w, b = np.float32(1.5) * np.ones(32, np.float32), np.linspace(-1, 1, 32, dtype=np.float32)
    ln = torch.nn.LayerNorm(32, eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(torch.from_numpy(w))
        ln.bias.copy_(torch.from_numpy(b))
        want = ln(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(layer_norm(x, w, b, 1e-5), want, rtol=1e-5, atol=1e-6)
