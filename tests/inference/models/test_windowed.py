"""The new architectures under a trunk window (lazy trunk, one layer's matrices at a time).

MLA's extra projections and GPT-OSS's sinks and expert biases must be read
by the window like every other role: logits match transformers and greedy
tokens match with a quarter of the experts cached.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.testing.archparity import reference, write_checkpoint
from czyx.testing.tiny_models import build_tiny_model


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_trunk_window_matches_transformers(tmp_path, arch):
    model = build_tiny_model(arch, 0, initializer_range=0.2, num_hidden_layers=3)
    src = write_checkpoint(model, tmp_path / "ckpt", fused=False)
    prompt = np.arange(10)
    want, want_tokens = reference(model, prompt, 8)
    store = Store.open(tmp_path / "store")
    try:
        mount(store, src, "m@1")
    finally:
        store.close()
    opened = OpenedModel(str(tmp_path / "store"), "m@1", None, lazy_trunk=True)
    try:
        got = Engine(opened.consumer, trunk_window=1).prefill(prompt, all_logits=True)
        eng = Engine(opened.consumer, trunk_window=1, cache_fraction=0.25)
        tokens, _ = generate_ids(eng, prompt.tolist(), 8)
        assert eng.model.window_stats().peak_layers <= 1
    finally:
        opened.close()
    assert np.abs(got - want).max() < 1e-5
    assert tokens == want_tokens
