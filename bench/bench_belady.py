"""Expert-cache policies against Belady's offline optimum, replayed on recorded routing.

Issue 34's measure: expert bytes read per decode token over what Belady's MIN
would read on the same routing with the same slots (goal: within 1.3x at each
budget). Every miss reads one slot, so bytes are misses times the slot size and
the ratio is the ratio of misses.

Run from the repository root::

    # the real-shape traces (once; a resident run of the 16-layer model, ~7.5 GB RAM,
    # about 4 minutes a text at 1 thread), written to .traces/ (git-ignored)
    python bench/bench_belady.py --record-rs16 /work/data/rs16/store
    # the study (about 2 minutes on one core)
    python bench/bench_belady.py --md bench/BELADY.md

Traces: the bundled model's (``inference/assets/czyx-moe-stdlib``: 4 layers x 16
experts, top-2), recorded here by a resident run on held-out standard-library
text as ``bench/bench_policies.py --full`` does (4 files x 2048 B, 8192 tokens,
each file from an empty context); and the ``--trace`` files, ``[T, L, k]``
expert arrays that ``--record-rs16`` writes: the 16-layer OLMoE-shape model
(``bench/realshape.py``, ``rs@q8``, 64 experts top-8), teacher-forced decode of
``--rs16-tokens`` tokens of each text (``realshape.text_ids``, as
``bench/bench_scale.py`` feeds it) from an empty context.

Replay: every policy of the engine runs inside the engine's own
:class:`~czyx.inference.cache.ExpertCache` (a consumer whose reads do nothing),
so its hits are the engine's, access for access: a layer's resident experts
are held before its misses are filled, and a slot the layer holds is never a
victim. Bounds: ``belady`` is :func:`czyx.inference.locality.replay.belady`, MIN
with bypass on the request stream (the bound ``bench/_rs_run.py`` reports);
``belady, no bypass`` is MIN inside the same cache (every miss takes a slot,
the victim is the unheld expert whose next use is farthest): what the engine's
constraint leaves of the optimum; ``hindsight frequency`` keeps the trace's
``slots - k`` most used experts (counted over the whole trace, in hindsight)
and turns the other slots over LRU: what exact knowledge of each expert's
frequency, without its timing, is worth; ``nextuse, next token's routing
known`` never evicts an expert the next ``L`` layer visits route to (a
perfect one-token look-ahead): what a prediction of the next token's routing
would be worth. Study-only candidates (not engine policies):
``nextuse`` with a fixed 32-token half-life (no warm-up), decay with
TinyLFU-style admission (a newcomer whose score is below its
victim's is inserted cold: the next victim until it is used again), decay
with per-layer quotas (victims from the layers over ``slots / L`` first), and
decay with other half-lives.

Columns: reads per token and their ratio to Belady's over the same tokens, for
the whole trace from a cold start, for the tokens after ``--warm`` (the cache
carried over: steady decoding), and for the first 32 tokens (a cold start, as a
short bench run measures).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
TRACES = ROOT / ".traces"
RS16_TEXTS = ("store/models/mount.py", "inference/cache.py")
COLD = 32  # tokens of the cold-start column


def add_trace_args(ap: argparse.ArgumentParser, slots: str, slots_help: str) -> None:
    """The arguments of a study of the recorded real-shape routing (``--trace``,
    ``--rs16-experts``, ``--slots``), shared by this script and ``bench_step_reads.py``."""
    ap.add_argument(
        "--trace",
        action="append",
        help="[T, L, k] experts .npy of the 16-layer real shape (default: .traces/rs16-*, "
        "bench_belady.py --record-rs16)",
    )
    ap.add_argument("--rs16-experts", type=int, default=64, help="experts per layer of --trace")
    ap.add_argument("--slots", default=slots, help=slots_help)


def rs16_traces(given: list[str] | None) -> list[Path]:
    """The ``--trace`` files, else the ones ``--record-rs16`` wrote (``.traces/rs16-*``)."""
    return [Path(p) for p in given] if given else sorted(TRACES.glob("rs16-*.experts.npy"))


# ----------------------------------------------------------------------------- traces


def record_rs16(store: str, tag: str, n_tokens: int, texts: list[str]) -> list[Path]:
    """Record the decode routing of the real-shape model on ``texts`` (resident run)."""
    import json

    from realshape import text_ids
    from threadpoolctl import threadpool_limits

    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.profile import RouteRecorder

    vocab = json.loads((Path(store).parent / "shape.json").read_text())["vocab"]
    threadpool_limits(1)
    TRACES.mkdir(exist_ok=True)
    out = []
    with OpenedModel(store, tag, None) as model:
        eng = Engine(model.consumer, cache_fraction=1.0, threads=1)
        cfg = eng.model.cfg
        try:
            for text in texts:
                ids = text_ids((ROOT / text).read_bytes(), vocab, n_tokens)
                rec = RouteRecorder(cfg.sparse_layers, cfg.n_experts, cfg.top_k)
                rec.new_segment(n_tokens)
                eng.model.recorder = rec
                eng.reset()
                t0 = time.perf_counter()
                for t in ids:
                    eng.decode(t)
                path = TRACES / f"rs16-{Path(text).stem}.experts.npy"
                np.save(path, rec.trace(tag, "", "router").experts)
                print(f"{path}: {n_tokens} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
                out.append(path)
        finally:
            eng.cache.close()
    return out


def bundled_trace(n_files: int, n_bytes: int) -> tuple[np.ndarray, int, str]:
    """``(experts [T, L, k], n_experts, description)`` of the bundled model (resident run)."""
    from bench_policies import ASSET, TAG, decode_texts, held_out_texts

    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.profile import RouteRecorder
    from czyx.store import Store
    from czyx.store.models.mount import mount

    files = held_out_texts(n_files, n_bytes)
    workdir = tempfile.mkdtemp(prefix="czyx-belady-", dir="/var/tmp")
    try:
        with Store.open(os.path.join(workdir, "store")) as st:
            mount(st, ASSET, TAG)
        opened = OpenedModel(os.path.join(workdir, "store"), TAG, None)
        try:
            full = Engine(opened.consumer, cache_fraction=1.0)
            cfg = full.cfg
            rec = RouteRecorder(cfg.sparse_layers, cfg.n_experts, cfg.top_k)
            full.model.recorder = rec
            decode_texts(full, [d for _, d in files], rec)
            full.close()
            experts = rec.trace(TAG, "", "softmax").experts
        finally:
            opened.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    desc = (
        f"bundled czyx-moe-stdlib ({cfg.n_layers} layers x {cfg.n_experts} experts, "
        f"top-{cfg.top_k}): first {n_bytes} B of {len(files)} held-out stdlib files "
        f"({', '.join(r for r, _ in files)}), each from an empty context, "
        f"{experts.shape[0]} tokens"
    )
    return experts, int(cfg.n_experts), desc


# ----------------------------------------------------------------------------- policies


class BeladyNoBypass:
    """MIN inside the engine's cache: the victim is the unheld expert used farthest ahead.

    An offline policy for the replay only: it is given the routing, and the cache
    tells it the token (:meth:`set_token`) and layer (:meth:`set_layer`) of each
    use, from which the next use of the expert is read off a precomputed table.
    """

    name = "belady-nobypass"

    def __init__(self, n_slots: int, experts: np.ndarray, n_experts: int) -> None:
        t_, n_layers, _ = experts.shape
        self.n_layers, self.n_experts = n_layers, n_experts
        # nxt[t, l, e]: the next token after t at which layer l routes to e (t_ if none)
        self.nxt = np.full((t_, n_layers, n_experts), t_, np.int64)
        ahead = np.full((n_layers, n_experts), t_, np.int64)
        rows = np.arange(n_layers)[:, None]
        for t in range(t_ - 1, -1, -1):
            self.nxt[t] = ahead
            ahead[rows, experts[t]] = t
        self.key = np.zeros(n_slots, np.int64)
        self.next_use = np.zeros(n_slots, np.int64)  # request order: token * L + layer
        self.token = 0
        self._scratch = np.empty(n_slots, np.int64)

    def set_token(self, token: int) -> None:
        self.token = token

    def filled(self, slot: int, key: int) -> None:
        self.key[slot] = key

    def touch(self, slot: int) -> None:
        layer, e = divmod(int(self.key[slot]), self.n_experts)
        self.next_use[slot] = int(self.nxt[self.token, layer, e]) * self.n_layers + layer

    def victim(self, blocked: np.ndarray) -> int:
        np.copyto(self._scratch, self.next_use)
        np.putmask(self._scratch, blocked, -1)
        s = int(self._scratch.argmax())
        return -1 if blocked[s] else s


class HindsightFrequency:
    """The most used experts of the whole trace (known in hindsight) kept, LRU for the rest.

    An offline policy for the replay only: the ``n_slots - k`` experts the trace
    routes to most often are never victims once loaded while another slot is
    evictable; the other slots turn over least recently used first. The best a
    policy that knows each expert's frequency exactly (and nothing of when it
    comes) can do with a fixed hot set.
    """

    name = "hindsight-frequency"

    def __init__(self, n_slots: int, experts: np.ndarray, n_experts: int) -> None:
        _, n_layers, k = experts.shape
        keys = experts.astype(np.int64) + np.arange(n_layers)[:, None] * n_experts
        counts = np.bincount(keys.ravel(), minlength=n_layers * n_experts)
        self.hot = np.zeros(n_layers * n_experts, bool)
        self.hot[np.argsort(-counts, kind="stable")[: max(n_slots - k, 0)]] = True
        self.key = np.zeros(n_slots, np.int64)
        self.last_use = np.zeros(n_slots, np.int64)
        self.clock = 0
        self._scratch = np.empty(n_slots, np.int64)

    def filled(self, slot: int, key: int) -> None:
        self.key[slot] = key

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.last_use[slot] = self.clock

    def victim(self, blocked: np.ndarray) -> int:
        sc = self._scratch
        np.copyto(sc, self.last_use)
        sc[self.hot[self.key]] += 1 << 40  # a hot expert only when nothing else is left
        np.putmask(sc, blocked, np.iinfo(np.int64).max)
        s = int(sc.argmin())
        return -1 if blocked[s] else s


def nextuse_seeing_ahead(n_slots: int, experts: np.ndarray, n_experts: int):
    """``nextuse`` told the routing of the next ``n_layers`` layer visits (one token ahead):
    an expert routed there is never a victim while another slot is evictable. An offline
    variant for the replay only: what a perfect prediction of the next token's routing
    would be worth to the engine's policy."""
    from czyx.inference.eviction import NextUsePolicy

    t_, n_layers, _ = experts.shape

    class SeeingAhead(NextUsePolicy):
        def __init__(self) -> None:
            super().__init__(n_slots, n_layers * n_experts)
            self.soon = np.zeros(n_layers * n_experts, bool)
            self._held = np.empty(n_slots, bool)

        def set_layer(self, layer: int) -> None:
            super().set_layer(layer)
            self.soon[:] = False
            for d in range(1, n_layers + 1):  # the next n_layers layer visits
                t, la = self._token + (layer + d) // n_layers, (layer + d) % n_layers
                if t < t_:
                    self.soon[la * n_experts + experts[t, la]] = True

        def victim(self, blocked: np.ndarray) -> int:
            np.take(self.soon, self.key, out=self._held)
            self._held |= blocked
            s = super().victim(self._held)
            return s if s >= 0 else super().victim(blocked)

    return SeeingAhead()


def study_policies():
    """Candidates replayed here only: ``{name: (factory(n_slots, n_keys), description)}``."""
    from czyx.inference.eviction import DecayPolicy

    class DecayAdmit(DecayPolicy):
        """Decay with admission: a newcomer scoring below its victim goes in cold."""

        def __init__(self, n_slots: int, n_keys: int) -> None:
            super().__init__(n_slots, n_keys)
            self.cold = np.zeros(n_slots, bool)
            self.fresh = np.zeros(n_slots, bool)
            self.victim_lv = -np.inf

        def filled(self, slot: int, key: int) -> None:
            self.key[slot] = key
            self.fresh[slot] = True
            self.cold[slot] = self.lv[key] < self.victim_lv  # its history against the victim's
            self.victim_lv = -np.inf

        def touch(self, slot: int) -> None:
            if self.fresh[slot]:
                self.fresh[slot] = False
            else:
                self.cold[slot] = False  # used again: admitted
            super().touch(slot)

        def victim(self, blocked: np.ndarray) -> int:
            score = self._score
            np.take(self.lv, self.key, out=score)
            np.putmask(score, self.cold, -np.inf)
            np.putmask(score, blocked, np.inf)
            s = int(score.argmin())
            if blocked[s]:
                return -1
            self.victim_lv = -np.inf if self.cold[s] else self.lv[self.key[s]]
            return s

    class DecayQuota(DecayPolicy):
        """Decay with per-layer partitions: victims from layers over slots / L first."""

        def __init__(self, n_slots: int, n_keys: int) -> None:
            super().__init__(n_slots, n_keys)
            self.slot_layer = np.full(n_slots, -1, np.int64)
            self.n_slots, self.n_experts = n_slots, 1
            self.count = np.zeros(1, np.int64)
            self.quota = float(n_slots)
            self._over = np.empty(n_slots, bool)

        def set_layout(self, n_layers: int, n_experts: int) -> None:
            self.n_experts = n_experts
            self.count = np.zeros(n_layers, np.int64)
            self.quota = self.n_slots / n_layers

        def filled(self, slot: int, key: int) -> None:
            if self.slot_layer[slot] >= 0:
                self.count[self.slot_layer[slot]] -= 1
            self.key[slot] = key
            self.slot_layer[slot] = key // self.n_experts
            self.count[self.slot_layer[slot]] += 1

        def victim(self, blocked: np.ndarray) -> int:
            score = self._score
            np.take(self.lv, self.key, out=score)
            np.take(self.count > self.quota, self.slot_layer, out=self._over)
            self._over &= ~blocked
            if self._over.any():
                score[~self._over] = np.inf
            np.putmask(score, blocked, np.inf)
            s = int(score.argmin())
            return -1 if blocked[s] else s

    from czyx.inference.eviction import NextUsePolicy

    return {
        "nextuse, fixed half-life 32": (
            lambda n, k: NextUsePolicy(n, k, start_half_life=32.0),
            "nextuse without its warm-up",
        ),
        "decay, admission": (DecayAdmit, "TinyLFU-style cold insertion"),
        "decay, layer quotas": (DecayQuota, "per-layer partitions of slots / L"),
        "decay, half-life 16": (lambda n, k: DecayPolicy(n, k, 16.0), "shorter memory"),
        "decay, half-life 128": (lambda n, k: DecayPolicy(n, k, 128.0), "longer memory"),
    }


ENGINE_POLICIES = ("lru", "lfu", "decay", "slru", "cyclic", "nextuse")


def replay_engine(policy, experts: np.ndarray, n_experts: int, n_slots: int) -> np.ndarray:
    """Misses per token of ``policy`` (a name or an instance) in the engine's cache."""
    from czyx.inference.cache import ExpertCache
    from czyx.testing.fakes import FakeConsumer

    t_, n_layers, k = experts.shape
    consumer = FakeConsumer(n_layers, n_experts)
    consumer.read_expert = lambda layer, e, slot: None  # the bytes are not the point here
    c = ExpertCache(consumer, consumer.info.expert_slot_nbytes * n_slots, k, policy=policy)
    out = np.zeros(t_, np.int64)
    for t in range(t_):
        before = c.misses
        c.advance(1)
        for layer in range(n_layers):
            c.acquire(layer, experts[t, layer])
            c.release()
        out[t] = c.misses - before
    c.close()
    return out


def belady_per_token(experts: np.ndarray, n_experts: int, n_slots: int) -> np.ndarray:
    """Misses per token of MIN with bypass on the request stream."""
    from czyx.inference.locality.replay import belady

    t_, n_layers, _ = experts.shape
    ids = (experts.astype(np.int64) + (np.arange(n_layers) * n_experts)[None, :, None]).ravel()
    return (~belady(ids, n_slots)).reshape(t_, -1).sum(axis=1)


def study(experts: np.ndarray, n_experts: int, slots: list[int], warm: int) -> list[dict]:
    """Every policy at every budget: rows of reads per token over the three spans."""
    experts = experts.astype(np.int64)
    t_, n_layers, _ = experts.shape
    spans = {"all": slice(0, t_), "warm": slice(warm, t_), "cold": slice(0, min(COLD, t_))}
    rows = []
    study_pols = study_policies()
    for n in slots:
        t0 = time.perf_counter()
        base = belady_per_token(experts, n_experts, n)
        runs = {"belady": base}
        runs["belady, no bypass"] = replay_engine(
            BeladyNoBypass(n, experts, n_experts), experts, n_experts, n
        )
        runs["hindsight frequency"] = replay_engine(
            HindsightFrequency(n, experts, n_experts), experts, n_experts, n
        )
        for pol in ENGINE_POLICIES:
            runs[pol] = replay_engine(pol, experts, n_experts, n)
        runs["nextuse, next token's routing known"] = replay_engine(
            nextuse_seeing_ahead(n, experts, n_experts), experts, n_experts, n
        )
        for name, (make, _) in study_pols.items():
            runs[name] = replay_engine(make(n, n_layers * n_experts), experts, n_experts, n)
        for name, m in runs.items():
            row = {"slots": n, "policy": name}
            for span, sl in spans.items():
                row[span] = float(m[sl].mean())
                row[span + "_ratio"] = float(m[sl].sum() / max(base[sl].sum(), 1))
            rows.append(row)
        print(f"  {n} slots: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


# ----------------------------------------------------------------------------- report


def table(rows: list[dict], n_keys: int, names: dict[int, str], warm: int) -> list[str]:
    head = (
        f"| slots | policy | reads/token | / Belady | reads/token, tokens {warm}+ | / Belady "
        f"| reads/token, first {COLD} | / Belady |"
    )
    md = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        label = f"{r['slots']} ({r['slots'] / n_keys:.1%}{names.get(r['slots'], '')})"
        md.append(
            f"| {label} | {r['policy']} | {r['all']:.2f} | {r['all_ratio']:.2f}x "
            f"| {r['warm']:.2f} | {r['warm_ratio']:.2f}x "
            f"| {r['cold']:.2f} | {r['cold_ratio']:.2f}x |"
        )
    return md


def keep_reading(text: str, path: Path) -> str:
    """``text`` with the hand-written sections of the report at ``path`` kept: everything
    from its first ``## `` heading to the first trace's table heading (``## `"``)."""
    if not path.exists():
        return text
    old = path.read_text()
    start = old.find("\n## ")
    end = old.find("\n## `", start)
    if start < 0 or end < 0 or start == end:
        return text
    at = text.find("\n## `")
    return text[:at] + old[start:end] + text[at:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record-rs16", metavar="STORE", help="record the real-shape traces and stop")
    ap.add_argument("--tag", default="rs@q8", help="version --record-rs16 opens")
    ap.add_argument("--rs16-tokens", type=int, default=512, help="decode tokens per text")
    add_trace_args(
        ap,
        "128,185,256,460",
        "slot budgets of --trace (185 and 460: the engine's slots at bench/SCALE-16.md's "
        "3.6x and 1.8x caps)",
    )
    ap.add_argument("--bundled-files", type=int, default=4)
    ap.add_argument("--bundled-bytes", type=int, default=2048)
    ap.add_argument("--warm", type=int, default=128, help="tokens before the warm column")
    ap.add_argument("--md", help="write the report here")
    a = ap.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if a.record_rs16:
        record_rs16(a.record_rs16, a.tag, a.rs16_tokens, list(RS16_TEXTS))
        return 0
    from _machine import machine

    t_start = time.perf_counter()
    load0 = os.getloadavg()
    traces = rs16_traces(a.trace)
    cmd = "python bench/bench_belady.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        "# Expert-cache policies against Belady (generated by bench/bench_belady.py)",
        "",
        f"Machine: {machine()}. Load average {' / '.join(f'{x:.1f}' for x in load0)} before, "
        "{LOAD1} after; {WALL} s. Replays are deterministic: the load only changes the wall time.",
        "",
        f"Command: `{cmd.strip()}` (the real-shape traces first: "
        "`python bench/bench_belady.py --record-rs16 /work/data/rs16/store`).",
        "",
        "Reads per token are expert reads (misses) per decode token: times the slot size, "
        "bytes per token (a miss reads one slot). `/ Belady`: over Belady's MIN with bypass "
        "on the same tokens of the same trace with the same slots. Every engine policy is "
        "replayed inside the engine's own slot cache (hits first, held slots never victims), "
        "so its reads are the engine's without prefetch; see the script's docstring.",
    ]
    slots = [int(s) for s in a.slots.split(",")]
    names = {185: ", SCALE-16's 3.6x cap", 460: ", SCALE-16's 1.8x cap"}
    md += [
        "",
        f"Budgets: for the real shape {', '.join(map(str, slots))} slots (185 and 460: the "
        "slots the engine chose under `bench/SCALE-16.md`'s caps, 1255 MiB of slots at the "
        "3.6x cap and 3107 MiB at the 1.8x cap, of 7,077,888 B each); for the bundled model "
        "12.5, 25 and 50 % of its experts.",
    ]
    for path in traces:
        experts = np.load(path)
        t_, n_layers, k = experts.shape
        print(f"{path}: {experts.shape}", flush=True)
        n_keys = n_layers * a.rs16_experts
        keys = experts.astype(np.int64) + np.arange(n_layers)[:, None] * a.rs16_experts
        md += [
            "",
            f"## `{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`",
            "",
            f"16-layer OLMoE real shape (`rs@q8`, {a.rs16_experts} experts top-{k}, "
            f"{n_keys} experts in all): {t_} decode tokens, teacher-forced from an empty "
            f"context, resident run (`--record-rs16`). Distinct experts routed: "
            f"{len(np.unique(keys))}.",
            "",
            *table(study(experts, a.rs16_experts, slots, a.warm), n_keys, names, a.warm),
        ]
    experts, n_exp, desc = bundled_trace(a.bundled_files, a.bundled_bytes)
    print(desc, flush=True)
    n_keys = experts.shape[1] * n_exp
    b_slots = [n_keys // 8, n_keys // 4, n_keys // 2]
    md += ["", f"## {desc}", ""]
    md += table(study(experts, n_exp, b_slots, a.warm), n_keys, {}, a.warm)
    wall = time.perf_counter() - t_start
    load1 = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    text = "\n".join(md).replace("{LOAD1}", load1).replace("{WALL}", f"{wall:.0f}") + "\n"
    print(text)
    if a.md:
        Path(a.md).write_text(keep_reading(text, Path(a.md)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
