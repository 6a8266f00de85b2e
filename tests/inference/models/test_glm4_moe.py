"""GLM-4.5 (``glm4_moe``) and Qwen3-MoE with ``attention_bias`` against transformers.

Mounted from both expert layouts: logits within 1e-5, greedy tokens equal to
transformers' at full and quarter cache, byte-identical export. GLM variants
(no q/k norms, no biases, more groups) run on an in-memory consumer.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.testing.archparity import reference, run_parity
from czyx.testing.refmodels import StateDictConsumer
from czyx.testing.tiny_models import build_tiny_model

BASE = dict(initializer_range=0.2, num_hidden_layers=3)
CASES = [("glm4_moe", BASE), ("qwen3_moe", dict(initializer_range=0.2, attention_bias=True))]


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
@pytest.mark.parametrize("arch, overrides", CASES, ids=["glm4_moe", "qwen3_moe_bias"])
def test_mounted_model_matches_transformers(tmp_path, arch, overrides, fused):
    r = run_parity(arch, tmp_path, fused=fused, **overrides)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5


@pytest.mark.parametrize(
    "overrides",
    [
        dict(use_qk_norm=False, attention_bias=False),
        dict(n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.0),
        dict(partial_rotary_factor=1.0, n_shared_experts=0),
    ],
)
def test_glm4_moe_variants_match_transformers(overrides):
    model = build_tiny_model("glm4_moe", 1, **{**BASE, **overrides})
    prompt = np.random.default_rng(4).integers(0, 96, 12)
    want, want_tokens = reference(model, prompt, 20)
    got = Engine(StateDictConsumer(model)).prefill(prompt, all_logits=True)
    assert np.abs(got - want).max() < 1e-5
    tokens, _ = generate_ids(Engine(StateDictConsumer(model)), prompt.tolist(), 20)
    assert tokens == want_tokens
