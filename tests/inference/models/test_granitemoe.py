"""GraniteMoE against transformers, through the store, in both expert layouts.

Embedding, attention, residual and logit multipliers all away from 1;
``save_pretrained`` writes the stacked ``input_linear``/``output_linear`` and
``router.layer`` names, memory holds ``experts.gate_up_proj`` and ``router``:
logits within 1e-5, greedy equal at full and quarter cache, export identical.
"""

from __future__ import annotations

import pytest

from czyx.testing.archparity import run_parity


@pytest.mark.parametrize("fused", [False, True], ids=["saved_names", "in_memory_names"])
def test_mounted_granitemoe_matches_transformers(tmp_path, fused):
    r = run_parity("granitemoe", tmp_path, fused=fused, initializer_range=0.2, num_hidden_layers=3)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5


@pytest.mark.parametrize("shared", [24, 0], ids=["shared_mlp", "no_shared_mlp"])
def test_mounted_granitemoeshared_matches_transformers(tmp_path, shared):
    """GraniteMoeShared: GraniteMoE plus an ungated shared MLP (input_linear / output_linear)."""
    r = run_parity(
        "granitemoeshared",
        tmp_path,
        fused=False,
        initializer_range=0.2,
        num_hidden_layers=3,
        shared_intermediate_size=shared,
    )
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5
