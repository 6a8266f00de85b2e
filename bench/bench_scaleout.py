"""Scale-out on a local Ray cluster: per-hop cost, throughput in flight, and a cost model.

Measured (on this machine, a Ray head and ``--nodes - 1`` worker nodes on
127.0.0.1; the bundled ``czyx-moe-stdlib`` model, each actor on its own
replicated store):

* Ray's per-call latency: a round trip to an actor with no payload, and
  with one token's residual stream (``H`` float32) as argument and result;
* activation bytes per token per hop, from the actors' own counters
  (pipeline: the residual stream between stages; expert-parallel: routed
  hidden rows out, partial outputs back);
* aggregate greedy tok/s with 1, 2, 4 and 8 requests in flight for both
  shapes (the same 8 requests each time), against the single-process engine
  running the same requests one after the other, in the same run.

Modelled (``model_tables``): a DeepSeek-V3-shaped model on 1-8 machines over
10 and 100 Gbit/s links: bytes read per token per node, single-stream decode
latency, prefill throughput and link bytes for pipeline and expert-parallel,
with every assumption printed next to the figures.

Writes ``bench/SCALEOUT.json``; ``bench/SCALE-OUT.md`` quotes it.

Usage: ``python bench/bench_scaleout.py [--nodes 3] [--tokens 16] [--reps 2]``
(``--model-only`` prints the model tables without starting Ray).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ASSET = Path(__file__).resolve().parents[1] / "inference" / "assets" / "czyx-moe-stdlib"
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(8)] for i in range(8)]

# --------------------------------------------------------------------------- cost model

#: DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3): 61 layers, the first 3 dense,
#: hidden 7168, 256 routed experts of intermediate 2048, top-8, one shared expert;
#: 671 B parameters, 37 B active per token.
DSV3 = {
    "hidden": 7168,
    "layers": 61,
    "moe_layers": 58,
    "experts": 256,
    "top_k": 8,
    "expert_params": 3 * 7168 * 2048,
    "total_params": 671e9,
    "active_params": 37e9,
}


def model_tables(
    bytes_per_param: float = 1.0,
    mem_gbs: float = 400.0,
    prefill_tok_s_node: float = 400.0,
    act_bytes: int = 2,
    rtts_us: dict[str, float] | None = None,
    prompt: int = 65536,
    chunk: int = 2048,
) -> dict:
    """The cost model (see bench/SCALE-OUT.md for its derivation and assumptions)."""
    m = DSV3
    rtts_us = rtts_us or {"10Gbit": 50.0, "100Gbit": 10.0}
    links = {"10Gbit": 1.25e9, "100Gbit": 12.5e9}
    routed_active = m["top_k"] * m["moe_layers"] * m["expert_params"]  # params per token
    trunk_active = m["active_params"] - routed_active
    routed_total = m["moe_layers"] * m["experts"] * m["expert_params"]
    trunk_total = m["total_params"] - routed_total
    b = bytes_per_param
    out: dict = {
        "assumptions": {
            "bytes_per_param": b,
            "node_memory_GBps": mem_gbs,
            "prefill_tok_s_per_node": prefill_tok_s_node,
            "activation_bytes_per_value": act_bytes,
            "rtt_us": rtts_us,
            "prompt_tokens": prompt,
            "prefill_chunk": chunk,
            "trunk_active_params": trunk_active,
            "routed_active_params": routed_active,
        },
        "rows": [],
    }
    h = m["hidden"] * act_bytes  # one token's residual stream
    one_node_s = m["active_params"] * b / (mem_gbs * 1e9)
    for n in (1, 2, 4, 8):
        # distinct remote owners among a token's top-k (uniform routing, no self)
        remote = 0.0 if n == 1 else (n - 1) * (1 - (1 - 1 / n) ** m["top_k"])
        for link, bw in links.items():
            rtt = rtts_us[link] * 1e-6
            # pipeline: each node reads its 1/n of the layers; n hops per token
            pipe_read = m["active_params"] * b / n
            pipe_hop = rtt / 2 + h / bw
            pipe_decode = one_node_s + (n if n > 1 else 0) * pipe_hop
            chunks = prompt / chunk
            pipe_prefill_x = n * chunks / (chunks + n - 1) if n > 1 else 1.0
            pipe_prefill_link = prompt * h / bw
            # expert-parallel: every node reads the trunk, the routed experts split n ways
            ep_read = trunk_active * b + routed_active * b / n
            ep_link_tok = m["moe_layers"] * remote * 2 * h  # hidden out + partial back
            ep_decode = ep_read / (mem_gbs * 1e9) + (
                m["moe_layers"] * (rtt + 2 * h / bw) if n > 1 else 0.0
            )
            ep_prefill_link_s = prompt * ep_link_tok / bw
            # one prompt: its trunk runs on its home node, only the routed FLOPs split
            trunk_share = trunk_active / m["active_params"]
            ep_compute = prefill_tok_s_node / (trunk_share + (1 - trunk_share) / n)
            ep_prefill_tok_s = min(ep_compute, bw / ep_link_tok if ep_link_tok else float("inf"))
            out["rows"].append(
                {
                    "nodes": n,
                    "link": link,
                    "resident_GB_per_node": {
                        "pipeline": m["total_params"] * b / n / 1e9,
                        "experts": (trunk_total + routed_total / n) * b / 1e9,
                    },
                    "pipe_read_GB_per_token_per_node": pipe_read / 1e9,
                    "ep_read_GB_per_token_per_node": ep_read / 1e9,
                    "pipe_link_bytes_per_token_per_hop": h,
                    "ep_link_bytes_per_token": ep_link_tok,
                    "single_stream_decode_tok_s": {
                        "one_node": 1 / one_node_s,
                        "pipeline": 1 / pipe_decode,
                        "experts": 1 / ep_decode,
                    },
                    "prefill_speedup_pipeline_ideal": pipe_prefill_x,
                    "prefill_tok_s": {
                        "pipeline": min(
                            pipe_prefill_x * prefill_tok_s_node, prompt / pipe_prefill_link
                        ),
                        "experts": ep_prefill_tok_s,
                    },
                    "prefill_link_seconds": {
                        "pipeline": pipe_prefill_link,
                        "experts": ep_prefill_link_s,
                    },
                }
            )
    return out


# --------------------------------------------------------------------------- measured


def _stores(root: Path, n: int) -> dict:
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.testing.cluster_stores import node_store

    with Store.open(root / "src") as src:
        mount(src, ASSET, "m@1")
        tok = {f"full{i}": node_store(src, "m@1", root / f"full{i}") for i in range(n)}
        tok.update(
            {
                "sub0": node_store(src, "m@1", root / "sub0", classes=(0, 7)),
                "sub1": node_store(src, "m@1", root / "sub1", classes=(8, 255)),
            }
        )
    return tok


def _single_process(root: Path, tokens: int) -> float:
    from czyx.inference.distributed.stages import greedy
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import EngineOptions

    with OpenedModel(str(root / "src"), "m@1", None) as om:
        e = Engine(om.consumer, options=EngineOptions(stream=False))
        t0 = time.perf_counter()
        for p in PROMPTS:
            e.reset()
            greedy(lambda r, t: e.prefill(t) if len(t) > 1 else e.decode(int(t[0])), p, tokens)
        dt = time.perf_counter() - t0
        e.close()
    return len(PROMPTS) * tokens / dt


def _latency(ray, node: str, hidden: int, calls: int = 300) -> dict:
    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self, x=None):
            return x

    a = Echo.options(resources={node: 0.01}).remote()
    ray.get(a.ping.remote())
    x = np.zeros(hidden, np.float32)
    out = {}
    for name, arg in (("empty", None), (f"{hidden}xf32", x)):
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(a.ping.remote(arg))
            ts.append(time.perf_counter() - t0)
        out[name] = {
            "median_ms": statistics.median(ts) * 1e3,
            "p90_ms": float(np.percentile(ts, 90)) * 1e3,
        }
    ray.kill(a)
    return out


def measure(args: argparse.Namespace) -> dict:
    from czyx.inference.distributed.ray_cluster import (
        NodeSpec,
        RayExpertParallel,
        RayPipeline,
        local_ray,
    )

    work = Path(tempfile.mkdtemp(prefix="czyx-scale-"))
    tok = _stores(work, 2)
    nodes = args.nodes

    def spec(name: str, i: int) -> NodeSpec:
        opts = {
            "num_cpus": 0,
            "resources": {f"node{1 + i % max(nodes - 1, 1)}" if nodes > 1 else "node0": 0.01},
        }
        return NodeSpec(str(work / name), "m@1", tok[name], tuple(opts.items()))

    res: dict = {"nodes": nodes, "tokens_per_request": args.tokens, "requests": len(PROMPTS)}
    res["single_process_tok_s"] = [_single_process(work, args.tokens) for _ in range(args.reps)]
    t0 = time.perf_counter()
    with local_ray(num_cpus=1 if nodes > 1 else 2, nodes=nodes):
        import ray

        res["ray_start_s"] = time.perf_counter() - t0
        res["latency"] = _latency(ray, "node1" if nodes > 1 else "node0", 128)
        shapes = {
            "pipeline": lambda: RayPipeline([spec("full0", 0), spec("full1", 1)], [(0, 2), (2, 4)]),
            "experts": lambda: RayExpertParallel(
                [spec("sub0", 0), spec("sub1", 1)], [(0, 7), (8, 255)]
            ),
        }
        for shape, make in shapes.items():
            with make() as d:
                d.generate(PROMPTS[:2], 4, in_flight=2)  # warm: first calls, cache fills
                base = d.counters()
                rows: dict[int, list[float]] = {k: [] for k in (1, 2, 4, 8)}
                for _ in range(args.reps):
                    for k in (1, 2, 4, 8):
                        t1 = time.perf_counter()
                        d.generate(PROMPTS, args.tokens, in_flight=k)
                        rows[k].append(len(PROMPTS) * args.tokens / (time.perf_counter() - t1))
                after = d.counters()
            processed = args.reps * 4 * len(PROMPTS) * (args.tokens - 1 + len(PROMPTS[0]))
            if shape == "pipeline":
                hop = (after[0]["bytes_out"] - base[0]["bytes_out"]) / processed
                steps = args.reps * 4 * len(PROMPTS) * args.tokens
                res["pipeline_logits_bytes_per_step"] = (
                    after[1]["bytes_out"] - base[1]["bytes_out"]
                ) / steps
            else:
                hop = (
                    sum(
                        (a["bytes_sent"] - b["bytes_sent"])
                        + (a["bytes_received"] - b["bytes_received"])
                        for a, b in zip(after, base)
                    )
                    / processed
                )
            res[shape] = {
                "tok_s": {k: statistics.median(v) for k, v in rows.items()},
                "tok_s_all": rows,
                "activation_bytes_per_token": hop,
                "x4_vs_x1": statistics.median(rows[4]) / statistics.median(rows[1]),
                "x8_vs_x1": statistics.median(rows[8]) / statistics.median(rows[1]),
            }
            print(shape, json.dumps(res[shape]["tok_s"]), flush=True)
        res["serve"] = _serve(work, spec, args)
        print("serve", json.dumps(res["serve"]["tok_s"]), flush=True)
    res["loadavg"] = os.getloadavg()
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return res


def _serve(work: Path, spec, args: argparse.Namespace) -> dict:
    """The OpenAI server over the Ray pipeline (``czyx serve --ray``'s scheduler, 8 in
    flight) against the local batched server, the same 8 completion requests sent
    1 and 4 at a time, interleaved per repetition; aggregate generated tok/s."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from czyx import portals
    from czyx.inference.batch import BatchOptions
    from czyx.inference.distributed.ray_cluster import RayPipeline
    from czyx.inference.distributed.serving import RayScheduler
    from czyx.server import ServeOptions, create_app
    from czyx.server.threaded import serve_in_thread
    from czyx.store import Store

    def root(d: Path) -> str:
        with Store.open(d, create=False) as s:
            return portals.root_token(s)

    def sched(ref, engine, batch, on_step):
        pipe = RayPipeline([spec("full0", 0), spec("full1", 1)], [(0, 2), (2, 4)])
        return RayScheduler(pipe, engine.cfg.vocab_size, batch, on_step, in_flight=8)

    batch = BatchOptions(max_batch=8, max_queue=64)
    made = {
        "ray_pipeline": (work / "src", ServeOptions(batch=batch, audit=False, scheduler=sched)),
        "local_batched": (work / "full1", ServeOptions(batch=batch, audit=False)),
    }
    tokens = {name: root(d) for name, (d, _) in made.items()}
    apps = {name: create_app(str(d), ["m@1"], o) for name, (d, o) in made.items()}
    rows: dict = {name: {1: [], 4: []} for name in apps}
    texts: dict = {}
    with serve_in_thread(apps["ray_pipeline"]) as u1, serve_in_thread(apps["local_batched"]) as u2:
        urls = {"ray_pipeline": u1, "local_batched": u2}

        def ask(name: str, prompt: list[int]) -> tuple[int, str]:
            r = httpx.post(
                f"{urls[name]}/v1/completions",
                json={"model": "m@1", "prompt": prompt, "max_tokens": args.tokens,
                      "temperature": 0},
                headers={"Authorization": f"Bearer {tokens[name]}"},
                timeout=120,
            )  # fmt: skip
            r.raise_for_status()
            body = r.json()
            return body["usage"]["completion_tokens"], body["choices"][0]["text"]

        for name in apps:  # warm: first calls, cache fills
            ask(name, PROMPTS[0])
        for _ in range(args.reps):
            for k in (1, 4):
                for name in apps:
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(k) as pool:
                        got = list(pool.map(lambda p, n=name: ask(n, p), PROMPTS))
                    rows[name][k].append(sum(g[0] for g in got) / (time.perf_counter() - t0))
                    texts[name] = [g[1] for g in got]
    return {
        "tok_s": {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()},
        "tok_s_all": rows,
        "ray_x4_vs_x1": statistics.median(rows["ray_pipeline"][4])
        / statistics.median(rows["ray_pipeline"][1]),
        "same_text_as_local_batched": texts["ray_pipeline"] == texts["local_batched"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--nodes", type=int, default=1, help="Ray nodes (1: one on 127.0.0.1; N: head + N-1)"
    )
    ap.add_argument("--tokens", type=int, default=16, help="generated tokens per request")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    out: dict = {}
    if not args.model_only:
        out["measured"] = measure(args)
        lat_us = out["measured"]["latency"]["128xf32"]["median_ms"] * 1e3
        # the same model with this run's Ray round trip as the per-hop latency
        out["model_ray_local"] = model_tables(rtts_us={"10Gbit": lat_us, "100Gbit": lat_us})
    out["model"] = model_tables()
    print(json.dumps(out, indent=1))
    if not args.model_only:
        Path(__file__).with_name("SCALEOUT.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
