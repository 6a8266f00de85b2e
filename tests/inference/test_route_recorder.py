"""``RouteRecorder``: the engine's per-token routing equals transformers' router choices."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.profile import ProfileError, RouteRecorder, RoutingProfile
from czyx.inference.trace import trace_from_router_logits
from czyx.testing.refmodels import StateDictConsumer, tiny_model


def test_recorded_trace_matches_transformers_router():
    import torch

    hf = tiny_model("mixtral")
    eng = Engine(StateDictConsumer(hf))
    cfg = eng.cfg
    rec = RouteRecorder(cfg.sparse_layers, cfg.n_experts, cfg.top_k)
    eng.model.recorder = rec
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 24)
    rec.new_segment(len(ids))
    eng.prefill(ids)
    ours = rec.trace("ours", "0" * 64, "topk_renormalized")

    with torch.no_grad():
        out = hf(torch.tensor(ids[None]), output_router_logits=True)
    logits = [r.reshape(len(ids), -1).numpy() for r in out.router_logits]
    ref = trace_from_router_logits(
        logits, cfg.top_k, normalize_topk=True, model_id="hf", text_sha256="0" * 64
    )
    assert np.array_equal(ours.experts, ref.experts)
    assert np.allclose(ours.weights, ref.weights, atol=1e-5)
    # Counts from the trace equal the engine's own running counts.
    prof = RoutingProfile.from_trace(ours, cfg.n_layers, cfg.n_experts)
    assert np.array_equal(prof.counts, eng.model.route_counts)


def test_empty_recorder_refuses():
    rec = RouteRecorder((True, True), 4, 2)
    with pytest.raises(ProfileError, match="nothing was recorded"):
        rec.trace("m", "0" * 64, "softmax")
