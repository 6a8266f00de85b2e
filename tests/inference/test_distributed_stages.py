"""Sharded inference without a transport: pipeline stages and expert shards in one
process (each on its own replicated store) against the single-process engine."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.distributed.stages import ExpertShard, LayerStage, class_owners, greedy
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.testing.cluster_stores import bundled_node_stores, greedy_reference

PROMPT = [5, 17, 99, 3, 44, 8]
N = 6


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    nodes = bundled_node_stores(root)
    toks, logits = greedy_reference(root, PROMPT, N)
    return root, nodes, toks, logits


@pytest.mark.parametrize("fraction", [None, 0.05])
def test_pipeline_stages_equal_single_process(stores, fraction):
    root, tok, ref_toks, ref_logits = stores
    st = [
        LayerStage(str(root / "full0"), "m@1", tok["full0"], 0, 1, cache_fraction=fraction),
        LayerStage(str(root / "full1"), "m@1", tok["full1"], 1, 4, cache_fraction=fraction),
    ]
    try:
        assert st[0].engine.model.layers[2] is None  # holds only its own layers

        def step(req, x):
            for s in st:
                x = s.forward(req, x)
            return x

        toks, logits = greedy(step, PROMPT, N)
        if fraction:  # a partial cache really evicts
            assert all(s.engine.stats().evictions > 0 for s in st)
    finally:
        for s in st:
            s.close()
    assert toks == ref_toks
    for a, b in zip(logits, ref_logits):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fraction", [None, 0.05])
def test_expert_shards_equal_single_process(stores, fraction):
    root, tok, ref_toks, ref_logits = stores
    ranges = [(0, 5), (6, 255)]
    sh = [
        ExpertShard(
            str(root / f"sub{i}"), "m@1", tok[f"sub{i}"], i, ranges, cache_fraction=fraction
        )
        for i in range(2)
    ]
    try:

        def dispatch(layer, jobs, decode):
            res = {p: sh[p].partial(layer, *j, decode) for p, j in jobs.items()}
            return lambda: res

        for s in sh:
            s.dispatch = dispatch
        toks, logits = greedy(lambda r, t: sh[1].forward(r, t), PROMPT, N)
        c = sh[1].counters()
        assert c["remote_calls"] > 0 and c["bytes_sent"] > 0  # shard 0's experts were used
        if fraction:  # a partial cache really evicts
            assert all(s.engine.stats().evictions > 0 for s in sh)
    finally:
        for s in sh:
            s.close()
    assert toks == ref_toks
    for a, b in zip(logits, ref_logits):
        np.testing.assert_array_equal(a, b)


def test_class_owners_refuses_gaps_and_overlaps():
    cmap = np.arange(16)[None, :].repeat(2, axis=0)
    assert (class_owners(cmap, [(0, 7), (8, 255)])[:, 8:] == 1).all()
    with pytest.raises(ValueError, match="no shard"):
        class_owners(cmap, [(0, 7), (9, 255)])
    with pytest.raises(ValueError, match="overlaps"):
        class_owners(cmap, [(0, 8), (8, 255)])


def test_expert_shard_refuses_input_weighted_experts(tmp_path):
    """Llama 4 scales an expert's input by its weight; a shard's partial products weight
    outputs, so it is refused rather than run wrong."""
    from czyx.inference.errors import UnsupportedModelError
    from czyx.testing.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("llama4_text", tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as store:
        mount(store, ckpt, "l@1")
    with pytest.raises(UnsupportedModelError, match="input is weighted"):
        ExpertShard(str(tmp_path / "s"), "l@1", None, 0, [(0, 255)])
