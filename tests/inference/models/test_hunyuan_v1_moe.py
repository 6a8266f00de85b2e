"""HunYuan-MoE-V1 against transformers, through the store, in both expert layouts.

Per-head q/k norms after RoPE, q/k/v/o biases, a shared MLP on every layer:
logits within 1e-5, greedy equal at full and quarter cache, byte-identical
export. HunYuan's NTK-alpha rope ("dynamic" with ``alpha``) is refused.
"""

from __future__ import annotations

import pytest

from czyx.store.models.rope import UnsupportedRopeError, rope_params
from czyx.testing.archparity import run_parity


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_mounted_hunyuan_matches_transformers(tmp_path, fused):
    r = run_parity("hunyuan_v1_moe", tmp_path, fused=fused, initializer_range=0.2)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5


def test_ntk_alpha_rope_is_refused():
    cfg = {"rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}}
    with pytest.raises(UnsupportedRopeError, match="NTK-alpha"):
        rope_params({**cfg, "max_position_embeddings": 64}, 8)
