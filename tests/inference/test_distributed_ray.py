"""Both sharded shapes on a local Ray cluster against the single-process engine.

Skipped when Ray is not installed (``czyx[ray]``). One Ray cluster for the
module (the only one that uses Ray): a head and two worker nodes started here
on this machine (``CZYX_RAY_NODES=1``: one node on 127.0.0.1, quicker to
start), the sharded actors placed on the worker nodes. Each shape runs at
full and partial cache, the pipeline with several requests in flight; ``czyx
run --ray`` and ``czyx serve --ray`` (asked by the real openai client) give
the single-process text. At the end the cluster is shut down within a bound
and every Ray process it started is checked gone (leftovers are killed by
pid and fail the module).
"""

from __future__ import annotations

import os
import time
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
from czyx.store import Store  # noqa: E402
from czyx.testing.cluster_stores import bundled_node_stores, greedy_reference  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ASSET = Path(__file__).resolve().parents[2] / "inference" / "assets" / "czyx-moe-stdlib"
PROMPTS = [[5, 17, 99, 3, 44, 8], [1, 2, 3], [200, 100, 50, 25]]
N = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    tok = bundled_node_stores(root)
    refs = [greedy_reference(root, p, N) for p in PROMPTS]
    nodes = int(os.environ.get("CZYX_RAY_NODES", "3"))
    cluster = local_ray(num_cpus=2 if nodes == 1 else 1, nodes=nodes)
    cluster.__enter__()
    try:
        yield root, tok, refs, nodes
    finally:
        _shut_down_bounded(cluster)


def _ray_descendants() -> dict[int, str]:
    """This process's descendants whose command line names Ray (raylets, GCS, workers)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    out = {}
    for pid in found:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "ray" in cmd:
            out[pid] = cmd[:80]
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _shut_down_bounded(cluster, bound_s: float = 60.0) -> None:
    """Leave the cluster (``ray.shutdown``, then each node's processes) within ``bound_s``;
    every Ray process it started must be gone by then (else killed by pid, and fail)."""
    import signal
    import threading

    procs = _ray_descendants()
    done = threading.Thread(target=cluster.__exit__, args=(None, None, None), daemon=True)
    done.start()
    done.join(bound_s)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.2)
    left = {p: c for p, c in procs.items() if _alive(p)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert procs, "no Ray process was found under this test process"
    assert not done.is_alive(), f"Ray shutdown took longer than {bound_s} s"
    assert not left, f"Ray processes left after shutdown: {left}"


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
    assert main([*base, str(root / "src"), "--ray", "local", "--ray-shape", "experts", *extra]) == 0
    got = capsys.readouterr()
    assert got.out == want and "experts over 2 Ray actors" in got.err


def _serve_args(root, tok, shape, *extra):
    from czyx.cli import build_parser

    names = ["full0", "full1"] if shape == "pipeline" else ["sub0", "sub1"]
    argv = ["serve", "m@1", "--store", str(root / "src"), "--no-audit"]
    argv += ["--ray", "local", "--ray-shape", shape, "--ray-nodes", "2", *extra]
    for n in names:
        argv += ["--node-store", str(root / n), "--node-portal", tok[n]]
    if shape == "experts":  # the class ranges the subset stores hold
        argv += ["--node-classes", "0-5", "--node-classes", "6-255"]
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("shape", ["pipeline", "experts"])
def test_serve_over_ray_answers_the_single_process_tokens(setup, shape):
    """``czyx serve --ray``'s options, served on loopback, asked by the real openai client:
    each request's greedy text is the single-process engine's (several in flight)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from czyx import portals
    from czyx.cli.commands.serve import serve_options
    from czyx.server import create_app
    from czyx.server.threaded import serve_in_thread

    root, tok, refs, _ = setup
    with Store.open(root / "src") as s:
        token = portals.root_token(s)
    opts = serve_options(_serve_args(root, tok, shape, "--ray-in-flight", "3"))
    app = create_app(str(root / "src"), ["m@1"], opts)
    served = app.state.czyx.models["m@1"]
    want = [served.tokenizer.decode(r[0]) for r in refs]
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=60)

        def ask(p):
            r = client.completions.create(model="m@1", prompt=p, max_tokens=N, temperature=0)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(ask, PROMPTS))
        assert [g[0] for g in got] == want
        assert all(g[1] == "length" and g[2] == N for g in got)
        stats = served.scheduler.stats()
        assert stats.generated == N * len(PROMPTS) and stats.waiting == stats.active == 0
        if shape == "pipeline":
            stream = client.completions.create(
                model="m@1", prompt=PROMPTS[1], max_tokens=N, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in stream if c.choices) == want[1]
            # a client leaving mid-stream cancels its request: nothing stays in flight
            stream = client.completions.create(
                model="m@1", prompt=PROMPTS[2], max_tokens=200, temperature=0, stream=True
            )
            next(iter(stream))
            stream.close()
            deadline = time.monotonic() + 30
            while served.scheduler.stats().active and time.monotonic() < deadline:
                time.sleep(0.05)
            assert served.scheduler.stats().active == 0
            assert served.scheduler.stats().generated < N * (len(PROMPTS) + 1) + 200
            # sessions live on the actors' side: refused, not ignored
            with pytest.raises(openai.BadRequestError, match="not served over Ray"):
                client.completions.create(
                    model="m@1", prompt=PROMPTS[0], max_tokens=2,
                    extra_headers={"X-Czyx-Session": "s1"},
                )  # fmt: skip


def test_serve_ray_flags_fail_closed(setup):
    from czyx.cli.commands.serve import serve_options

    root, tok, _, _ = setup
    with pytest.raises(ValueError, match="--kv-mb"):
        serve_options(_serve_args(root, tok, "pipeline", "--kv-mb", "4"))
    with pytest.raises(ValueError, match="--ray-in-flight"):
        serve_options(_serve_args(root, tok, "pipeline", "--ray-in-flight", "0"))


def test_serve_over_ray_fails_a_request_closed(setup):
    """A node that lacks experts it was told to own: the request ends with the error
    (HTTP 500 naming it), nothing stays in flight, and the server keeps answering."""
    import httpx
    import openai

    from czyx import portals
    from czyx.cli import build_parser
    from czyx.cli.commands.serve import serve_options
    from czyx.server import create_app
    from czyx.server.threaded import serve_in_thread

    root, tok, _, _ = setup
    with Store.open(root / "src") as s:
        token = portals.root_token(s)
    argv = ["serve", "m@1", "--store", str(root / "src"), "--no-audit", "--ray", "local"]
    argv += ["--ray-shape", "experts", "--ray-nodes", "2"]
    for n in ("sub0", "sub1"):  # the subsets hold 0-5 / 6-255; the default split is 0-7 / 8-255
        argv += ["--node-store", str(root / n), "--node-portal", tok[n]]
    app = create_app(str(root / "src"), ["m@1"], serve_options(build_parser().parse_args(argv)))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=60)
        failed = []
        for p in PROMPTS:  # a prompt that routes only to experts the nodes hold succeeds
            try:
                client.completions.create(model="m@1", prompt=p, max_tokens=N, temperature=0)
            except openai.InternalServerError as exc:
                failed.append(str(exc))
        assert failed and all("no routed expert" in f for f in failed)
        st = app.state.czyx.models["m@1"].scheduler.stats()
        assert st.active == 0 and st.waiting == 0
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_serve_over_ray_ends_a_request_whose_sampler_fails(setup, monkeypatch):
    """An error choosing a token (a sampler raising) ends that request with the error
    (HTTP 500 naming it); nothing stays in flight and the next request is served."""
    import openai

    import czyx.inference.distributed.serving as serving
    from czyx import portals
    from czyx.cli.commands.serve import serve_options
    from czyx.inference.sampling import Sampler
    from czyx.server import create_app
    from czyx.server.threaded import serve_in_thread

    class Failing(Sampler):
        def __call__(self, logits):
            if self.params.seed == 666:
                raise ValueError("probabilities do not sum to 1")
            return super().__call__(logits)

    monkeypatch.setattr(serving, "Sampler", Failing)
    root, tok, refs, _ = setup
    with Store.open(root / "src") as s:
        token = portals.root_token(s)
    app = create_app(str(root / "src"), ["m@1"], serve_options(_serve_args(root, tok, "pipeline")))
    served = app.state.czyx.models["m@1"]
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="probabilities do not sum"):
            client.completions.create(
                model="m@1", prompt=PROMPTS[0], max_tokens=N, temperature=0.5, seed=666
            )
        r = client.completions.create(model="m@1", prompt=PROMPTS[0], max_tokens=N, temperature=0)
        assert r.choices[0].text == served.tokenizer.decode(refs[0][0])
        st = served.scheduler.stats()
        assert st.active == 0 and st.waiting == 0
