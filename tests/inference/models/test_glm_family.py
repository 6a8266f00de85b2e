"""Small variants of supported architectures, against transformers through the store.

dots.llm1 (Qwen3 attention with biases and sliding layers on GLM-4.5's MoE),
Solar-Open (Llama attention on it, every layer MoE), Sarvam-MLA
(``DeepseekV3ForCausalLM`` under its own config class) and GLM-4.5-Lite
(DeepSeek-V3's layers, dense ones listed in ``mlp_layer_types``; its
``rms_norm_eps`` of 1e-5 is not the latent norms' 1e-6), each expert layout
at least once: logits within 1e-5, greedy equal at full and quarter cache,
byte-identical export.
"""

from __future__ import annotations

import pytest

from czyx.testing.archparity import run_parity


@pytest.mark.parametrize(
    ("arch", "fused"),
    # the stacked layout once per decoder (Sarvam-MLA's is DeepSeek-V3's, tested there)
    [
        ("dots1", False),
        ("dots1", True),
        ("solar_open", True),
        ("sarvam_mla", False),
        ("glm4_moe_lite", False),
    ],
)
def test_variant_matches_transformers(tmp_path, arch, fused):
    r = run_parity(arch, tmp_path, fused=fused, initializer_range=0.2, num_hidden_layers=3)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5
