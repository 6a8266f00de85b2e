"""ERNIE-4.5-MoE against transformers, through the store, in both expert layouts.

Softmax routing with a selection bias (``moe_statics``: named
``mlp.gate.moe_statics`` in memory and ``mlp.moe_statics`` on disk), shared
experts, a routed layer range, interleaved rope: logits within 1e-5, greedy
equal at full and quarter cache, byte-identical export.
"""

from __future__ import annotations

import pytest

from czyx.testing.archparity import run_parity


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_mounted_ernie_matches_transformers(tmp_path, fused):
    r = run_parity(
        "ernie4_5_moe", tmp_path, fused=fused, initializer_range=0.2, num_hidden_layers=3
    )
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5
