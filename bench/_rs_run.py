"""One engine on the real-shape model, as a subprocess: prefill, decode, report JSON.

Used by ``bench/bench_scale.py`` (each run in its own memory cgroup) and by
``python bench/realshape.py``'s greedy check. Token ids come from
``realshape.text_ids`` so both engines see the same sequence.

Decode is teacher-forced by default (the next token of the text is fed, not the
argmax): a random-weight model's greedy continuation soon repeats itself, which
would make the expert cache look better than on real text. ``--greedy`` feeds
the argmax instead (the cross-engine token check).

Reported: prefill and decode tokens/s (wall), the greedy or fed tokens, and for
czyx the expert cache's hits, misses and bytes read; the process's own peak RSS
(``VmHWM``); the caller reads the group's peak itself.

``--bound`` (czyx): the timed decode also records every expert transfer (X-Ray),
and afterwards, in the same process and memory group, reads exactly the extents
those transfers read, in the order they were requested, with the store's
O_DIRECT reader into one huge-page buffer and no compute (``raw_read_s``): the
read half of the overlap bound. Also reported: the exposed I/O wait (the time
the engine was blocked on a completion) and how long before its first use each
read was requested (``lead_us``: median and 10th percentile). The run's routing
is recorded too, and Belady's offline optimum (MIN with bypass,
:func:`czyx.inference.locality.replay.belady`) replayed on it with the run's
slot count, from the same cold start, gives the fewest expert bytes any policy
could have read over the timed tokens (``belady_read_bytes``), beside the
engine's own (``bytes_read``, prefetches included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import without_extra_bufts
from realshape import text_ids


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def read_bytes(pid: int | str = "self") -> int:
    """Bytes process ``pid`` has caused to be read from storage (``/proc/PID/io``):
    O_DIRECT reads and page-cache misses (mmap faults, readahead) alike."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return -1


def run_llama(a: argparse.Namespace, prompt: list[int], warm: list[int], feed: list[int]) -> dict:
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    t0 = time.perf_counter()
    with without_extra_bufts():
        llm = llama_cpp.Llama(
            model_path=a.model,
            n_ctx=len(prompt) + len(feed) + 8,
            n_batch=max(32, len(prompt)),
            n_threads=a.threads,
            n_threads_batch=a.threads,
            use_mmap=True,
            verbose=False,
        )
    load = time.perf_counter() - t0
    if a.warm_prefill:  # not timed: the same prompt once (mmap faults, first-call costs)
        llm.eval(prompt)
        llm.reset()
    t0 = time.perf_counter()

    def last_logits() -> np.ndarray:  # llama-cpp-python keeps no scores without logits_all
        ptr = lc.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))

    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    if a.logits:
        np.save(a.logits, last_logits())
    for tok in warm:  # not timed: fills llama.cpp's page cache / czyx's slots
        llm.eval([tok])
    toks = []
    nxt = int(np.argmax(last_logits()))
    r0 = read_bytes()
    t0 = time.perf_counter()
    for i in range(len(feed)):
        tok = nxt if a.greedy else feed[i]
        toks.append(tok)
        llm.eval([tok])
        nxt = int(np.argmax(last_logits()))
    decode = time.perf_counter() - t0
    return {
        "load_s": load,
        "prefill_s": prefill,
        "decode_s": decode,
        "tokens": toks,
        "decode_read_bytes": read_bytes() - r0,
    }


def run_czyx(a: argparse.Namespace, prompt: list[int], warm: list[int], feed: list[int]) -> dict:
    from threadpoolctl import threadpool_limits

    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import EngineOptions

    threadpool_limits(a.threads)
    if a.consumer_hash:  # the checksum on the decoding thread at first use (as before)
        from czyx.store.io.experts import ExpertReads

        ExpertReads.hash_in_readers = False
    t0 = time.perf_counter()
    if a.tiers and not a.hot:
        raise SystemExit("--tiers needs --hot PROFILE (the usage that picks the high experts)")
    with OpenedModel(a.store, a.tag, None, tiers=a.tiers) as model:
        opts = EngineOptions(
            io=a.io,
            prefetch=not a.no_prefetch,
            prefetch_evicts=a.prefetch_evicts,
            prefetch_slots=a.prefetch_slots,
            tiers=a.tiers,
            **({"policy": a.policy} if a.policy else {}),
            **({"lookahead": a.lookahead} if a.lookahead is not None else {}),
            **({"width": a.width} if a.width is not None else {}),
            **({"readers": a.readers} if a.readers is not None else {}),
        )
        kw = {"cache_bytes": a.cache_mb << 20} if a.cache_mb else {"cache_fraction": 1.0}
        if a.default_budget:  # the engine's own choice: what fits this process's memory
            kw = {}
        hot = None
        info = model.consumer.info
        if a.hot:  # a routing profile's hot list (czyx profile): prewarmed, and the tiers'
            from czyx.inference.profile import RoutingProfile

            hot = RoutingProfile.load(a.hot, info.n_layers, info.n_experts).hot_list()
        if a.prewarm:  # every expert read before the first token (a resident run)
            every = [(i, e) for i in range(info.n_layers) for e in range(info.n_experts)]
            seen = set(hot or [])
            hot = (hot or []) + [p for p in every if p not in seen]
        xray = None
        if a.bound:
            from czyx.inference.xray import XRay

            xray = XRay()
        eng = Engine(model.consumer, options=opts, hot=hot, threads=a.threads, xray=xray, **kw)
        rec = None
        try:
            load = time.perf_counter() - t0
            if a.warm_prefill:  # not timed, as for llama.cpp
                eng.prefill(prompt)
                eng.reset()
            if a.bound:
                from czyx.inference.profile import RouteRecorder

                cfg = eng.model.cfg
                rec = RouteRecorder(cfg.sparse_layers, cfg.n_experts, cfg.top_k)
                rec.new_segment(len(prompt) + len(warm) + len(feed))
                eng.model.recorder = rec
            t0 = time.perf_counter()
            logits = eng.prefill(prompt)
            prefill = time.perf_counter() - t0
            if a.logits:
                np.save(a.logits, np.asarray(logits, dtype=np.float32))
            for tok in warm:  # not timed
                logits = eng.decode(tok)
            s0 = eng.stats()
            c = eng.cache  # prefetch counters (a streaming cache has them)
            p0 = (getattr(c, "prefetches", 0), getattr(c, "prefetch_hits", 0))
            toks = []
            r0 = read_bytes()
            t0_ns = time.monotonic_ns()
            t0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
            for i in range(len(feed)):
                tok = int(np.argmax(logits)) if a.greedy else feed[i]
                toks.append(tok)
                logits = eng.decode(tok)
            decode = time.perf_counter() - t0
            cpu = (time.process_time() - cpu0, time.thread_time() - main0)
            r1 = read_bytes()
            st = eng.stats().minus(s0)
            out = {
                "load_s": load,
                "prefill_s": prefill,
                "decode_s": decode,
                "tokens": toks,
                "budget_bytes": eng.budget_bytes,
                "expert_bytes": eng.expert_bytes,
                "slots": st.n_slots,
                "hits": st.hits,
                "misses": st.misses,
                "bytes_read": st.bytes_read,
                "hit_rate": st.hit_rate,
                "decode_read_bytes": r1 - r0,
                "decode_in_c": bool(eng.model.decode_in_c()),
                # CPU seconds over the timed tokens: the whole process, and the decoding
                # thread alone (the rest: the kernel pool's workers and the readers)
                "decode_cpu_s": cpu[0],
                "decode_main_cpu_s": cpu[1],
                # prefetched experts over the timed tokens, and those later used
                "prefetches": getattr(c, "prefetches", 0) - p0[0],
                "prefetches_used": getattr(c, "prefetch_hits", 0) - p0[1],
            }
            if a.save_profile:
                eng.routing_profile().save(a.save_profile)
            if xray is not None:
                out.update(bound_figures(model.consumer, xray.transfers, t0_ns))
                out["belady_read_bytes"] = belady_bytes(rec, len(feed), st.n_slots, eng)
        finally:
            eng.cache.close()
    return out


def belady_bytes(rec, n_timed: int, n_slots: int, eng) -> int:
    """Bytes Belady's MIN would read over the last ``n_timed`` tokens of the recorded routing."""
    from czyx.inference.locality.replay import belady, request_stream

    trace = rec.trace("realshape", "", "router")
    ids, _ = request_stream(trace)
    per_token = trace.n_layers * trace.top_k
    hits = belady(ids, n_slots)
    misses = int((~hits[len(ids) - n_timed * per_token :]).sum())
    return misses * int(eng.cache.slot_nbytes)


def device_busy(spans: list[tuple[int | None, int | None]]) -> tuple[float, float]:
    """Seconds during which at least one read of ``spans`` (start, end ns) was in flight,
    and the mean number in flight over them."""
    done = [(a, b) for a, b in spans if a is not None and b is not None]
    events = sorted([(a, 1) for a, _ in done] + [(b, -1) for _, b in done])
    busy = area = depth = 0
    last = None
    for t, d in events:
        if last is not None and depth > 0:
            busy += t - last
            area += depth * (t - last)
        depth += d
        last = t
    return busy / 1e9, area / busy if busy else 0.0


def bound_figures(consumer, transfers, t0_ns: int) -> dict:
    """The read half of the overlap bound, timed on the run's own extents (see the docstring)."""
    from czyx.store.io.reader import RawReader, aligned_empty

    window = [t for t in transfers if t.t_request >= t0_ns and t.error is None]
    exts = [consumer.expert_extent(t.layer, t.expert) for t in window]
    exposed = sum(t.exposed_ns for t in window) / 1e9
    busy, in_flight = device_busy(
        [(t.read.t_start, t.read.t_complete) for t in window if t.read is not None]
    )
    leads = [(t.t_first_use - t.t_request) / 1e3 for t in window if t.t_first_use is not None]
    raw = raw_cpu = 0.0
    if exts:
        buf = aligned_empty(max(x.length for x in exts), hugepage=True)
        paths = consumer.expert_block_paths()
        readers = {}
        try:
            for x in exts:
                if x.block not in readers:
                    readers[x.block] = RawReader(paths[x.block], direct=True)
            t0, c0 = time.perf_counter(), time.thread_time()
            for x in exts:
                readers[x.block].read_into(x.offset, buf[: x.length])
            raw = time.perf_counter() - t0
            raw_cpu = time.thread_time() - c0
        finally:
            for r in readers.values():
                r.close()
    return {
        "raw_reads": len(exts),
        "raw_read_bytes": int(sum(x.length for x in exts)),
        "raw_read_s": raw,
        "raw_read_cpu_s": raw_cpu,  # the reading thread's CPU: what a read costs a core
        "exposed_wait_s": exposed,
        "device_busy_s": busy,  # the run's own reads as they ran: time any was in flight
        "reads_in_flight": in_flight,  # ... and how many were, on average over that time
        "lead_us_median": float(np.median(leads)) if leads else float("nan"),
        "lead_us_p10": float(np.percentile(leads, 10)) if leads else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["llama", "czyx"], required=True)
    ap.add_argument("--model", help="GGUF file (llama)")
    ap.add_argument("--store", help="czyx store directory")
    ap.add_argument("--tag", help="czyx NAME@VERSION")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-mb", type=int, default=0, help="czyx slot budget (0: all)")
    ap.add_argument(
        "--default-budget", action="store_true", help="czyx: no budget given (the engine's default)"
    )
    ap.add_argument("--io", default="direct")
    ap.add_argument("--readers", type=int, default=None, help="czyx: reader threads (the default)")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument(
        "--consumer-hash", action="store_true", help="czyx: hash extents on the decoding thread"
    )
    ap.add_argument("--width", type=int, default=None, help="czyx: predicted experts a token")
    ap.add_argument(
        "--prefetch-slots", type=int, default=0, help="czyx: slots set aside for predictions"
    )
    ap.add_argument("--prefetch-evicts", action="store_true", help="czyx: predictions may evict")
    ap.add_argument("--policy", default=None, help="czyx: eviction policy (default: the engine's)")
    ap.add_argument(
        "--lookahead",
        type=int,
        default=None,
        help="czyx: layers predicted ahead (0: early only)",
    )
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--warmup", type=int, default=0, help="untimed decode tokens first")
    ap.add_argument("--prewarm", action="store_true", help="czyx: read every expert first")
    ap.add_argument("--hot", default=None, help="czyx: routing profile whose hot list to prewarm")
    ap.add_argument(
        "--tiers",
        default=None,
        metavar="HIGH,LOW[:FRACTION]",
        help="czyx: per-expert precision tiers (--tag must be NAME@HIGH; needs --hot)",
    )
    ap.add_argument(
        "--warm-prefill", action="store_true", help="an untimed prefill of the prompt first"
    )
    ap.add_argument("--logits", default=None, help="save the prompt's last logits (.npy)")
    ap.add_argument(
        "--save-profile", default=None, help="czyx: save the run's routing profile (JSON)"
    )
    ap.add_argument(
        "--bound", action="store_true", help="czyx: time the run's own reads without compute"
    )
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if a.default_budget and a.cache_mb:
        ap.error("--default-budget and --cache-mb are two budgets: give one")
    ids = text_ids(Path(a.text).read_bytes(), a.vocab, a.prompt + a.warmup + a.tokens)
    prompt, warm, feed = ids[: a.prompt], ids[a.prompt : a.prompt + a.warmup], ids[-a.tokens :]
    res = (run_llama if a.engine == "llama" else run_czyx)(a, prompt, warm, feed)
    res.update(
        engine=a.engine,
        prompt=a.prompt,
        n_decode=a.tokens,
        warmup=a.warmup,
        threads=a.threads,
        vm_hwm=_vm_hwm(),
        prefill_tok_s=a.prompt / res["prefill_s"],
        decode_tok_s=a.tokens / res["decode_s"] if a.tokens else float("nan"),
    )
    Path(a.json).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
