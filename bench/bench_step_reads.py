"""Expert reads per generated token when a step verifies several tokens, replayed.

Issue 35's real-shape question: speculative decoding verifies a pending token and its
drafts in one batched step that acquires the union of their experts once, so does a
step of ``m`` accepted tokens read fewer expert bytes per generated token than ``m``
one-token steps? Replayed on the recorded 16-layer real-shape routing
(``bench/bench_belady.py --record-rs16``: ``[T, L, k]`` expert arrays, 64 experts
top-8), every step's ``m`` consecutive tokens accepted (speculation's best case: a
rejected draft only adds its own experts):

- ``nextuse`` (the engine's default policy) inside the engine's own
  :class:`~czyx.inference.cache.ExpertCache`, acquiring each layer's union once per
  step (hits first, held slots never victims), as :func:`inference.batch.forward_batch`
  does;
- Belady's MIN with bypass on the same union stream: what any policy could reach.

Columns: experts acquired per generated token (the union's size over ``m``), reads
(misses) per generated token and their ratio to one-token steps, over the tokens
after ``--warm`` (steady decoding). Deterministic; about a minute on one core::

    python bench/bench_step_reads.py --md bench/STEP-READS.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))


def step_unions(experts: np.ndarray, m: int) -> list[list[np.ndarray]]:
    """Per step of ``m`` tokens, per layer, the distinct experts the step acquires."""
    t_, n_layers, _ = experts.shape
    return [
        [np.unique(experts[t : t + m, layer]) for layer in range(n_layers)]
        for t in range(0, t_ - m + 1, m)
    ]


def replay_steps(
    policy: str, steps: list[list[np.ndarray]], n_experts: int, n_slots: int, m: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per step: the engine cache's misses and the experts acquired, under ``policy``."""
    from czyx.inference.cache import ExpertCache
    from czyx.testing.fakes import FakeConsumer

    n_layers = len(steps[0])
    k = max(len(u) for s in steps for u in s)
    consumer = FakeConsumer(n_layers, n_experts)
    consumer.read_expert = lambda layer, e, slot: None  # the bytes are not the point here
    c = ExpertCache(consumer, consumer.info.expert_slot_nbytes * n_slots, k, policy=policy)
    misses = np.zeros(len(steps), np.int64)
    acquired = np.zeros(len(steps), np.int64)
    for i, step in enumerate(steps):
        before = c.misses
        c.advance(m)
        for layer, union in enumerate(step):
            c.acquire(layer, union)
            c.release()
        misses[i] = c.misses - before
        acquired[i] = sum(len(u) for u in step)
    c.close()
    return misses, acquired


def belady_steps(steps: list[list[np.ndarray]], n_experts: int, n_slots: int) -> np.ndarray:
    """Per step: MIN with bypass's misses on the union stream."""
    from czyx.inference.locality.replay import belady

    ids, step_of = [], []
    for i, step in enumerate(steps):
        for layer, union in enumerate(step):
            ids.append(union.astype(np.int64) + layer * n_experts)
            step_of.append(np.full(len(union), i))
    hit = belady(np.concatenate(ids), n_slots)
    return np.bincount(np.concatenate(step_of)[~hit], minlength=len(steps))


def study(experts: np.ndarray, n_experts: int, slots: list[int], sizes: list[int], warm: int):
    """Rows ``(slots, m, acquired/token, nextuse reads/token, belady reads/token)``."""
    experts = experts.astype(np.int64)
    rows = []
    for n in slots:
        for m in sizes:
            steps = step_unions(experts, m)
            first = -(-warm // m)  # the first step wholly after the warm-up
            miss, acq = replay_steps("nextuse", steps, n_experts, n, m)
            bel = belady_steps(steps, n_experts, n)
            tokens = m * (len(steps) - first)
            rows.append(
                (
                    n,
                    m,
                    acq[first:].sum() / tokens,
                    miss[first:].sum() / tokens,
                    bel[first:].sum() / tokens,
                )
            )
    return rows


def table(rows) -> list[str]:
    md = [
        "| slots | tokens a step | experts acquired / token | nextuse reads / token | "
        "vs 1-token steps | Belady reads / token | vs 1-token steps | nextuse / Belady |",
        "|---|---|---|---|---|---|---|---|",
    ]
    one = {r[0]: r for r in rows if r[1] == 1}
    for n, m, acq, nu, bel in rows:
        md.append(
            f"| {n} | {m} | {acq:.1f} | {nu:.1f} | {nu / one[n][3]:.2f}x | {bel:.1f} "
            f"| {bel / one[n][4]:.2f}x | {nu / bel:.2f}x |"
        )
    md.append("")
    for n, r1 in one.items():
        top = max((r for r in rows if r[0] == n), key=lambda r: r[1])
        md.append(
            f"- {n} slots, 1- to {top[1]}-token steps: experts acquired per generated token "
            f"{top[2] / r1[2]:.2f}x, reads per generated token {top[3] / r1[3]:.2f}x under "
            f"`nextuse` and {top[4] / r1[4]:.2f}x under Belady."
        )
    return md


def main(argv: list[str] | None = None) -> int:
    from bench_belady import add_trace_args, rs16_traces

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(
        ap,
        "164,185",
        "slot budgets (164: bench/SPECULATE-realshape-16.md's engine at the 3.6x cap; "
        "185: bench/SCALE-16.md's)",
    )
    ap.add_argument("--sizes", default="1,2,3,4,5", help="tokens verified a step")
    ap.add_argument("--warm", type=int, default=128, help="tokens before the counted span")
    ap.add_argument("--md", help="write the report here")
    a = ap.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from _machine import machine

    traces = rs16_traces(a.trace)
    if not traces:
        raise SystemExit(
            "no traces: record them first (python bench/bench_belady.py --record-rs16 STORE)"
        )
    t0, load0 = time.perf_counter(), os.getloadavg()
    slots = [int(s) for s in a.slots.split(",")]
    sizes = [int(s) for s in a.sizes.split(",")]
    if 1 not in sizes:
        sizes = [1, *sizes]
    cmd = "python bench/bench_step_reads.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        "# Expert reads per generated token, steps of several tokens (bench/bench_step_reads.py)",
        "",
        f"Machine: {machine()}. Load average {' / '.join(f'{x:.1f}' for x in load0)} before; "
        "{WALL} s. Replays are deterministic.",
        "",
        f"Command: `{cmd.strip()}`.",
        "",
        "Each step verifies `m` consecutive tokens of the recorded routing, all accepted "
        "(speculation's best case), and acquires each layer's union of their experts once. "
        f"Counted: tokens {a.warm}+ (steady decoding). `nextuse`: the engine's default policy "
        "in the engine's own slot cache; Belady: MIN with bypass on the same union stream.",
    ]
    for path in traces:
        experts = np.load(path)
        print(f"{path}: {experts.shape}", flush=True)
        md += [
            "",
            f"## `{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`",
            "",
            f"{experts.shape[0]} tokens, {experts.shape[1]} layers, top-{experts.shape[2]} of "
            f"{a.rs16_experts}.",
            "",
            *table(study(experts, a.rs16_experts, slots, sizes, a.warm)),
        ]
    text = "\n".join(md).replace("{WALL}", f"{time.perf_counter() - t0:.0f}") + "\n"
    print(text)
    if a.md:
        Path(a.md).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
