"""MiniMax-M2 against transformers, through the store, in both expert layouts.

OLMo-2-style full-width q/k norms, Mixtral's expert tensor names, a sigmoid
router whose ``e_score_correction_bias`` (a buffer: set here to random values
large enough to change the choice) biases the selection and not the weights,
the chosen sigmoids renormalised: logits within 1e-5, greedy equal at full
and quarter cache, byte-identical export.
"""

from __future__ import annotations

import pytest
import torch

from czyx.testing.archparity import run_parity
from czyx.testing.tiny_models import build_tiny_model


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_mounted_minimax_m2_matches_transformers(tmp_path, fused):
    model = build_tiny_model("minimax_m2", 0, initializer_range=0.2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.e_score_correction_bias
            bias.copy_(torch.rand(bias.shape, generator=g) * 0.5)
    r = run_parity("minimax_m2", tmp_path, fused=fused, model=model)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5
