"""Speculation on the real-shape model under a memory cap, drafts replayed (bench-only).

Used by ``python bench/bench_speculate.py --realshape DIR`` (a directory written by
``bench/realshape.py gen``: ``shape.json``, ``store/``, ``gguf/model-q8_0.gguf``).
The engine runs in a child process (this file run as a script) inside a cgroup v1
memory group capped at the GGUF file's size / ``--rs-ratio`` (3.6: the stored model is
3.6 times the cap; ``bench/bench_scale.py``'s helpers, the model's files evicted from
the page cache first), with no slot budget given: the engine sizes its slots to the
group's room, as a user runs it. Where no memory group can be made, the section is
skipped with the reason.

Random weights give no real acceptance and a random model's greedy continuation soon
repeats itself (which would make the expert cache look better than on real text), so
the sequence is teacher-forced, as ``bench/_rs_run.py`` runs this model: the "model's
choice" at every position is the next token of a text (:class:`Teacher`, a sampler
that speculative decoding asks as it asks the greedy one), and the drafts replay that
text, each token kept with a probability ``p`` chosen so that the drafts' acceptance
(accepted over drafted, at the fixed draft length) is a set value
(:func:`replay_keep`): the bundled trained model's measured ones (read from the
reports that measured them, :func:`measured_acceptance`) and fixed ones. Speculation
off and on run in the same process and the same rounds, configurations rotated
round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from czyx.inference.options import EngineOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TEXT = ROOT / "store" / "models" / "mount.py"  # the text bench_scale.py feeds this model
DEFAULT_POLICY = EngineOptions().policy  # the eviction policy when none is given


def replay_keep(acceptance: float, k: int) -> float:
    """The keep probability ``p`` whose replayed drafts of ``k`` tokens are accepted at
    ``acceptance`` (accepted over drafted: a draft counts only after every earlier one
    of its step was accepted, so ``(p + p**2 + ... + p**k) / k = acceptance``)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance {acceptance} is not in [0, 1]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        if sum(p**i for i in range(1, k + 1)) / k < acceptance:
            lo = p
        else:
            hi = p
    return (lo + hi) / 2


_COUNTS = re.compile(r"\((\d+)/(\d+)\)")


def measured_acceptance(report: Path, config: str) -> tuple[int, int] | None:
    """``(accepted, drafted)`` summed over a ``bench/SPECULATE*.md`` report's rows of
    ``config`` (its second column: ``| prompt | config | ... | 0.32 (265/825) | ...``),
    or None when the report or such rows are missing."""
    try:
        lines = report.read_text().splitlines()
    except OSError:
        return None
    acc = drafted = 0
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[1] == config:
            m = _COUNTS.search(cells[4])
            if m:
                acc += int(m.group(1))
                drafted += int(m.group(2))
    return (acc, drafted) if drafted else None


class Teacher:
    """A sampler choosing the text's next token at every position (teacher forcing), asked
    as :func:`~czyx.inference.speculative.speculative_decode` asks the greedy one: each
    call chooses the next position's token."""

    def __init__(self, feed: Sequence[int]) -> None:
        self.feed = list(feed)
        self.at = 0

    def __call__(self, logits: object) -> int:
        tok = self.feed[self.at]
        self.at += 1
        return tok

    def verify(self, logits: object, draft: int) -> tuple[int, bool]:
        """The text's token, and whether it is the draft."""
        tok = self(logits)
        return tok, tok == draft


def timed_run(eng, prompt: list[int], warm: list[int], feed: list[int], spec) -> dict:
    """One run: prefill ``prompt``, decode ``warm`` (untimed), then the timed
    teacher-forced decode of ``feed``, speculating with ``spec`` (None: plain decode)."""
    from bench._rs_run import read_bytes
    from czyx.inference.speculative import speculative_decode

    eng.reset()
    logits = eng.prefill(prompt)
    for tok in warm:  # not timed: the same warm-up for every configuration
        logits = eng.decode(tok)
    teacher = Teacher(feed)
    s0, r0, t0 = eng.stats(), read_bytes(), time.perf_counter()
    if spec is None:
        out = [teacher(logits)]
        while len(out) < len(feed):
            out.append(teacher(eng.decode(out[-1])))
    else:
        history = [*prompt, *warm]
        out, _ = speculative_decode(eng, logits, history, len(feed), teacher, set(), spec)
    dt = time.perf_counter() - t0
    st, storage = eng.stats().minus(s0), read_bytes() - r0
    if out != feed:
        raise SystemExit("the tokens are not the text's")
    return {
        "tok_s": (len(out) - 1) / dt,
        "decoded": len(out) - 1,
        "passes": len(spec.steps) if spec else len(out) - 1,
        "drafted": spec.drafted if spec else 0,
        "accepted": spec.accepted if spec else 0,
        "bytes_read": st.bytes_read,
        "hits": st.hits,
        "misses": st.misses,
        "storage_bytes": storage,
        "wait_s": st.read_seconds,
    }


def run_child(a: argparse.Namespace) -> dict:
    """Every round's runs, in this process (the child, inside the memory group)."""
    from bench.bench_speculate import Replay
    from bench.realshape import text_ids
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.speculative import DraftLength, Speculator

    ids = text_ids(Path(a.text).read_bytes(), a.vocab, a.prompt + a.warmup + a.tokens)
    prompt, warm = ids[: a.prompt], ids[a.prompt : a.prompt + a.warmup]
    feed = ids[a.prompt + a.warmup :]
    import czyx.inference.batch as batch

    parts = [None if x == "topk" else int(x) for x in a.parts]
    configs = [("off", None, None)] + [
        (f"replay p={p:.3f}" + ("" if len(parts) == 1 else f", parts {x or 'top-k'}"), p, x)
        for p in a.keep
        for x in parts
    ]
    runs = []
    with OpenedModel(a.store, a.tag, None) as model:
        options = EngineOptions(
            io=a.io, readers=2, prefetch=a.prefetch == "on", policy=a.policy or DEFAULT_POLICY
        )
        eng = Engine(model.consumer, options=options, threads=a.threads)
        info = {
            "budget_bytes": eng.budget_bytes,
            "expert_bytes": eng.expert_bytes,
            "slots": eng.cache.n_slots,
            "verifies_in_one_step": eng.verifies_in_one_step,
        }
        try:
            for r in range(a.rounds):
                k = r % len(configs)
                for label, p, part in configs[k:] + configs[:k]:
                    batch.MISSES_PER_PART = part
                    spec = None
                    if p is not None:
                        drafter = Replay(ids, p, a.vocab, seed=r)
                        spec = Speculator(drafter, DraftLength(a.draft_tokens, adaptive=False))
                    run = timed_run(eng, prompt, warm, feed, spec)
                    runs.append({"config": label, "keep": p, "round": r, **run})
                    print(f"round {r + 1} {label}: {run['tok_s']:.2f} tok/s", flush=True)
        finally:
            eng.close()
    return {**info, "runs": runs}


def run_capped(a: argparse.Namespace, rs_dir: Path, keep: list[float]) -> dict:
    """The child run in a fresh memory group capped at the GGUF file's size / ratio:
    its results, the cap, the group's peak and OOM kills; ``{"skipped": why}`` where
    no memory group can be made here."""
    from bench.bench_scale import cgroups_writable, close_group, evict, in_group, open_group

    why = cgroups_writable()
    if why is not None:
        return {"skipped": why}
    shape = json.loads((rs_dir / "shape.json").read_text())
    gguf = rs_dir / "gguf" / "model-q8_0.gguf"
    store = rs_dir / "store"
    cap = int(gguf.stat().st_size / a.rs_ratio)
    out = Path(f"/tmp/czyx-spec-rs-{os.getpid()}.json")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        *("--store", str(store), "--tag", a.rs_tag, "--vocab", str(shape["vocab"])),
        *("--text", str(TEXT), "--prompt", str(a.rs_prompt), "--warmup", str(a.rs_warmup)),
        *("--tokens", str(a.rs_tokens), "--threads", str(a.rs_threads)),
        *("--rounds", str(a.rs_rounds), "--draft-tokens", str(a.draft_tokens)),
        *("--prefetch", a.rs_prefetch, "--policy", a.rs_policy or DEFAULT_POLICY),
        *("--json", str(out), "--keep", *map(str, keep), "--parts", *a.rs_parts),
    ]
    evict([gguf, *sorted(p for p in store.rglob("*.blk"))])
    group = open_group("spec-rs", cap)
    res: dict = {"cap": cap, "shape": shape, "gguf_bytes": gguf.stat().st_size}
    try:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        proc = subprocess.run(in_group(group, cmd), env=env, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"the capped child failed (exit {proc.returncode})")
        res.update(json.loads(out.read_text()))
    finally:
        res.update(close_group(group))
        out.unlink(missing_ok=True)
    return res


#: The bundled model's measured acceptances a target may name: (report, config rows).
MEASURED = {
    "q2": (ROOT / "bench" / "SPECULATE-q2.md", "draft:stdlib@draft"),
    "lookup": (ROOT / "bench" / "SPECULATE.md", "lookup"),
}


def targets(names: Sequence[str], k: int) -> list[tuple[str, float, float]]:
    """``(label, acceptance, keep probability)`` of each target: a number, or a name of
    :data:`MEASURED` (the pooled acceptance of that report's rows)."""
    out = []
    for name in names:
        if name in MEASURED:
            report, config = MEASURED[name]
            got = measured_acceptance(report, config)
            if got is None:
                raise SystemExit(f"no {config} rows with counts in {report}")
            acc = got[0] / got[1]
            label = (
                f"{name}: `{config}` measured in `{report.relative_to(ROOT)}` "
                f"({got[0]}/{got[1]} = {acc:.2f})"
            )
        else:
            acc = float(name)
            label = f"{acc:.2f}"
        out.append((label, acc, replay_keep(acc, k)))
    return out


def report(res: dict, tgts: list[tuple[str, float, float]], a: argparse.Namespace) -> list[str]:
    """The section's Markdown lines (from :func:`run_capped`'s result)."""
    import statistics

    where = (
        f"under a {a.rs_ratio}x cap"
        if a.rs_ratio > 1
        else f"in a group larger than the model (stored {a.rs_ratio}x the cap: near-resident)"
    )
    title = f"## The real-shape model {where}, drafts replayed at set acceptances"
    if "skipped" in res:
        return [title, "", f"Skipped: {res['skipped']}."]
    shape, runs = res["shape"], res["runs"]
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["config"], []).append(r)
    off = {r["round"]: r for r in by["off"]}
    base = statistics.median(r["tok_s"] for r in by["off"])
    base_bytes = sum(r["bytes_read"] for r in by["off"]) / sum(r["decoded"] for r in by["off"])
    label_of = {f"replay p={p:.3f}": (lab, acc) for lab, acc, p in tgts}
    lines = [
        title,
        "",
        f"`bench/realshape.py`'s {shape['arch']} shape, {shape['layers']} layers, "
        f"{shape['experts']} experts top-{shape['top_k']}, hidden {shape['hidden']}, expert "
        f"intermediate {shape['inter']}, vocab {shape['vocab']}; czyx `{a.rs_tag}` (q8) read "
        f"O_DIRECT, prefetch {a.rs_prefetch}, eviction policy `{a.rs_policy or DEFAULT_POLICY}`, "
        f"{a.rs_threads} kernel threads. The engine ran in "
        f"a cgroup v1 memory group capped at {res['cap'] / 2**20:.0f} MiB (the GGUF file's "
        f"{res['gguf_bytes'] / 2**20:.0f} MiB / {a.rs_ratio}; model files evicted from the "
        "page cache first) with no slot budget given: the engine chose "
        f"{res['budget_bytes'] / 2**20:.0f} MiB, {res['slots']} slots, of "
        f"{res['expert_bytes'] / 2**20:.0f} MiB of experts. Group peak "
        f"{res['group_peak'] / 2**20:.0f} MiB, OOM kills {res['oom_kills']}. Verification in "
        f"one batched step: {'yes' if res['verifies_in_one_step'] else 'no'}.",
        "",
        f"Teacher-forced (`bench/_rs_run.py`'s protocol): the tokens are the text "
        f"`{TEXT.relative_to(ROOT)}`'s (byte bigrams hashed into the vocabulary), every "
        f"position's choice the text's next token; {a.rs_prompt}-token prompt, {a.rs_warmup} "
        f"untimed decode tokens, then {a.rs_tokens} timed. Random weights give no real "
        "acceptance: the drafts replay the text, each token kept with probability p (else a "
        "wrong token; seeded per round), p chosen so that accepted over drafted at the fixed "
        f"draft length {a.draft_tokens} is the target ((p + ... + p^k) / k). {a.rs_rounds} "
        "rounds, configurations rotated round by round in one process; tok/s the median "
        "over rounds (vs off: ratio of medians; per round: each round's own ratio), counts "
        "summed over rounds. Expert bytes: the slot cache's reads per decoded token; "
        "storage: the process's `/proc/self/io` read_bytes per decoded token (the trunk's "
        "page faults under the cap included); exposed read wait: the time the engine was "
        "blocked on expert reads, per decoded token; experts acquired: the slot cache's hits and "
        "misses per decoded token (a step acquires each expert its rows chose once: "
        f"{shape['layers'] * shape['top_k']} a token without drafts).",
        "",
        "| config | target acceptance | p | decode tok/s | vs off | per round | acceptance "
        "achieved | tokens per forward pass | expert MiB per token | vs off | storage MiB per "
        "token | hit rate | experts acquired per token | exposed read wait ms per token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cfg, rs in by.items():
        med = statistics.median(r["tok_s"] for r in rs)
        per_round = ", ".join(f"{r['tok_s'] / off[r['round']]['tok_s']:.2f}" for r in rs)
        dec = sum(r["decoded"] for r in rs)
        drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        got = f"{accepted / drafted:.2f} ({accepted}/{drafted})" if drafted else "-"
        hits, misses = sum(r["hits"] for r in rs), sum(r["misses"] for r in rs)
        per_tok = sum(r["bytes_read"] for r in rs) / dec
        replay = cfg.split(",")[0]  # "replay p=..." (", parts N": a parts configuration)
        label, acc = label_of.get(replay, ("-", None))
        p = "-" if acc is None else replay.split("=")[1]
        lines.append(
            f"| {cfg} | {label} | {p} | {med:.2f} | {med / base:.2f}x | {per_round} | {got} | "
            f"{dec / sum(r['passes'] for r in rs):.2f} | {per_tok / 2**20:.1f} | "
            f"{per_tok / base_bytes:.2f}x | "
            f"{sum(r['storage_bytes'] for r in rs) / dec / 2**20:.1f} | "
            f"{hits / max(hits + misses, 1):.3f} | {(hits + misses) / dec:.1f} | "
            f"{sum(r['wait_s'] for r in rs) / dec * 1e3:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    """The child: every round's runs, written as JSON."""
    ap = argparse.ArgumentParser(description="bench_speculate --realshape's capped child")
    ap.add_argument("--store", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--keep", type=float, nargs="+", required=True)
    ap.add_argument("--io", default="direct")
    ap.add_argument("--prefetch", choices=["on", "off"], default="on")
    ap.add_argument("--policy", default=None, help="eviction policy (default: the engine's)")
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["topk"],
        help="misses a verification step acquires together past its hits (topk, or a count)",
    )
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    Path(a.json).write_text(json.dumps(run_child(a)))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
