"""A torch module for one MoE layer, on the same consumer interface, agrees with the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from czyx.inference.engine import Engine
from czyx.inference.torch_moe import TorchMoELayer
from czyx.testing.refmodels import StateDictConsumer, tiny_model


@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "qwen3_moe"])
def test_torch_layer_matches_numpy_engine_and_transformers(arch):
    model = tiny_model(arch, seed=1)
    consumer = StateDictConsumer(model)
    eng = Engine(consumer, cache_fraction=0.5)
    cfg = eng.cfg
    x = np.random.default_rng(4).standard_normal((9, cfg.hidden_size)).astype(np.float32)
    layer = 1
    ours = eng.model._routed(layer, eng.model.layers[layer], x)
    torch_layer = TorchMoELayer(consumer, layer, cfg.top_k, cfg.renormalize)
    theirs = torch_layer(torch.from_numpy(x)).numpy()
    with torch.no_grad():
        ref = model.model.layers[layer].mlp(torch.from_numpy(x)[None])[0].numpy()
    scale = float(np.abs(ref).max())
    assert np.abs(theirs - ours).max() < 1e-5 * scale
    assert np.abs(theirs - ref).max() < 1e-5 * scale
    assert 0 < torch_layer.reads <= cfg.n_experts
