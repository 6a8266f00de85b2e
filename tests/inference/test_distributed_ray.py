"""Both sharded shapes on a local Ray cluster against the single-process engine.

Skipped when Ray is not installed (``czyx[ray]``). One Ray instance for the
module (started here on 127.0.0.1, bounded, shut down at the end); each shape
runs at full and partial cache, and the pipeline with several requests in
flight. ``CZYX_RAY_NODES=3`` runs them on a head and two worker nodes instead
of one node (slower to start).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from czyx.inference.distributed.ray_cluster import (  # noqa: E402
    NodeSpec,
    RayExpertParallel,
    RayPipeline,
    local_ray,
)
from czyx.inference.distributed.stages import greedy  # noqa: E402
from czyx.inference.engine import Engine  # noqa: E402
from czyx.inference.opened import OpenedModel  # noqa: E402
from czyx.inference.options import EngineOptions  # noqa: E402
from czyx.store import Store  # noqa: E402
from czyx.store.models.mount import mount  # noqa: E402
from czyx.testing.cluster_stores import node_store  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ASSET = Path(__file__).resolve().parents[2] / "inference" / "assets" / "czyx-moe-stdlib"
PROMPTS = [[5, 17, 99, 3, 44, 8], [1, 2, 3], [200, 100, 50, 25]]
N = 5


def _single_process(om, prompt):
    e = Engine(om.consumer, options=EngineOptions(stream=False))
    try:
        return greedy(lambda r, t: e.prefill(t) if len(t) > 1 else e.decode(int(t[0])), prompt, N)
    finally:
        e.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    with Store.open(root / "src") as src:
        mount(src, ASSET, "m@1")
        tok = {
            "full0": node_store(src, "m@1", root / "full0"),
            "full1": node_store(src, "m@1", root / "full1"),
            "sub0": node_store(src, "m@1", root / "sub0", classes=(0, 5)),
            "sub1": node_store(src, "m@1", root / "sub1", classes=(6, 255)),
        }
    om = OpenedModel(str(root / "src"), "m@1", None)
    refs = []
    try:
        for p in PROMPTS:
            refs.append(_single_process(om, p))
    finally:
        om.close()
    nodes = int(os.environ.get("CZYX_RAY_NODES", "1"))
    with local_ray(num_cpus=2 if nodes == 1 else 1, nodes=nodes):
        yield root, tok, refs, nodes


def _spec(root, tok, name, i, nodes):
    opts = {"num_cpus": 0}
    if nodes > 1:
        opts["resources"] = {f"node{1 + i % (nodes - 1)}": 0.01}
    return NodeSpec(str(root / name), "m@1", tok[name], tuple(opts.items()))


@pytest.mark.parametrize("fraction", [None, 0.05])
def test_pipeline_on_ray(setup, fraction):
    root, tok, refs, nodes = setup
    specs = [_spec(root, tok, f"full{i}", i, nodes) for i in range(2)]
    with RayPipeline(specs, [(0, 2), (2, 4)], cache_fraction=fraction) as pipe:
        toks, logits = greedy(pipe.step, PROMPTS[0], N, req="a")
        assert toks == refs[0][0]
        for a, b in zip(logits, refs[0][1]):
            np.testing.assert_array_equal(a, b)
        if fraction is None:  # several requests in flight through both stages
            out = pipe.generate(PROMPTS, N, in_flight=3)
            assert out == [r[0] for r in refs]
            c = pipe.counters()
            assert c[1]["bytes_in"] > 0 and c[0]["bytes_out"] == c[1]["bytes_in"]


@pytest.mark.parametrize("fraction", [None, 0.05])
def test_expert_parallel_on_ray(setup, fraction):
    root, tok, refs, nodes = setup
    specs = [_spec(root, tok, f"sub{i}", i, nodes) for i in range(2)]
    with RayExpertParallel(specs, [(0, 5), (6, 255)], cache_fraction=fraction) as ep:
        out = ep.generate(PROMPTS[:2], N, in_flight=2)  # one request homed on each shard
        assert out == [r[0] for r in refs[:2]]
        toks, logits = greedy(ep.step, PROMPTS[2], N, req="b")
        assert toks == refs[2][0]
        for a, b in zip(logits, refs[2][1]):
            np.testing.assert_array_equal(a, b)
        assert all(c["remote_calls"] > 0 for c in ep.counters())


def test_cli_run_ray_prints_the_single_process_text(setup, capsys):
    from czyx.cli import main

    root, tok, _, _ = setup
    base = ["run", "m@1", "--prompt", "def main(", "--max-tokens", "6", "--store"]
    assert main([*base, str(root / "src")]) == 0
    want = capsys.readouterr().out
    extra = ["--node-store", str(root / "sub0"), "--node-store", str(root / "sub1")]
    extra += ["--node-portal", tok["sub0"], "--node-portal", tok["sub1"]]
    extra += ["--node-classes", "0-5", "--node-classes", "6-255"]
    # --ray local reuses the module's Ray instance (a connected driver is reused)
    assert main([*base, str(root / "src"), "--ray", "local", "--shape", "experts", *extra]) == 0
    got = capsys.readouterr()
    assert got.out == want and "experts over 2 Ray actors" in got.err
