"""A torch module for one MoE layer, on the same consumer and expert-read interface, agrees
with the engine (in memory, and on a mounted store model through a portal on both reader kinds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from czyx.inference.engine import Engine
from czyx.inference.torch_moe import TorchMoELayer
from czyx.portals import open_consumer
from czyx.store import Store
from czyx.store.io import readpool
from czyx.store.models.mount import mount
from czyx.testing.refmodels import StateDictConsumer, tiny_model
from czyx.testing.tiny_models import make_tiny_checkpoint


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
    try:
        theirs = torch_layer(torch.from_numpy(x)).numpy()
        assert torch_layer.expert_reads.kind == "threads"  # no block file: read_expert
    finally:
        torch_layer.close()
    with torch.no_grad():
        ref = model.model.layers[layer].mlp(torch.from_numpy(x)[None])[0].numpy()
    scale = float(np.abs(ref).max())
    assert np.abs(theirs - ours).max() < 1e-5 * scale
    assert np.abs(theirs - ref).max() < 1e-5 * scale
    assert 0 < torch_layer.reads <= cfg.n_experts


@pytest.mark.parametrize("native", [True, False])
def test_torch_layer_reads_a_mounted_model_through_the_store_interface(tmp_path, native):
    if native and not readpool.available():
        pytest.fail("store._iopaths is not built: the native read pool cannot run")
    ck = make_tiny_checkpoint("mixtral", tmp_path / "ck", seed=2)
    with Store.open(tmp_path / "s") as s:
        mount(s, ck, "t@1")
        with open_consumer(s, None, "t@1") as m:
            eng = Engine(m, cache_fraction=0.5)
            cfg = eng.cfg
            layer = next(i for i, lw in enumerate(eng.model.layers) if hasattr(lw, "router"))
            x = np.random.default_rng(5).standard_normal((7, cfg.hidden_size), np.float32)
            ours = eng.model._routed(layer, eng.model.layers[layer], x)
            torch_layer = TorchMoELayer(m, layer, cfg.top_k, cfg.renormalize, native=native)
            try:
                theirs = torch_layer(torch.from_numpy(x)).numpy()
                assert torch_layer.expert_reads.kind == ("native" if native else "threads")
                assert [src.name for src in torch_layer.expert_reads.opened_sources()]
            finally:
                torch_layer.close()
                eng.close()
    scale = float(np.abs(ours).max())
    assert np.abs(theirs - ours).max() < 1e-5 * scale
    assert torch_layer.reads > 0
