"""MiniMax-M2, Hunyuan-V3 and EXAONE-MoE against transformers, through the store, both
expert layouts.

Both route by sigmoid scores whose ``e_score_correction_bias`` (a buffer: set
here to random values large enough to change the choice) biases the selection
and not the weights, the chosen sigmoids renormalised. MiniMax-M2: OLMo-2-style
full-width q/k norms, Mixtral's expert tensor names. Hunyuan-V3: per-head q/k
norms, q/k/v/o biases, shared experts, ``router_scaling_factor``, dense layers
listed in ``mlp_layer_types``, and ``save_pretrained`` names of its own
(``mlp.router.gate``, ``mlp.expert_bias``, ``mlp.shared_mlp``). EXAONE-MoE:
per-head q/k norms, sliding rope layers beside NoPE full layers (windows of 4),
DeepSeek-V3's grouped routing with shared experts. Logits within
1e-5, greedy equal at full and quarter cache, byte-identical export.
"""

from __future__ import annotations

import pytest
import torch

from czyx.testing.archparity import run_parity
from czyx.testing.tiny_models import build_tiny_model


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
@pytest.mark.parametrize("arch", ["minimax_m2", "hy_v3", "exaone_moe"])
def test_mounted_biased_sigmoid_router_matches_transformers(tmp_path, arch, fused):
    model = build_tiny_model(arch, 0, initializer_range=0.2)
    g = torch.Generator().manual_seed(1)
    biased = 0
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            bias = getattr(layer.mlp, "e_score_correction_bias", None)
            bias = getattr(gate, "e_score_correction_bias", bias)
            if bias is not None:  # (dense layers have none)
                bias.copy_(torch.rand(bias.shape, generator=g) * 0.5)
                biased += 1
    assert biased > 0
    r = run_parity(arch, tmp_path, fused=fused, model=model)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5
