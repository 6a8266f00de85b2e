"""Per-expert precision tiers on the real-shape model under a memory cap: q4/q2 tiers
against pure q4 (and pure q2), the same cap, the same rounds.

Runs on a directory written by ``bench/realshape.py gen`` whose store also holds the
model's q4 and q2 versions, requantized from its q8 GGUF with the trunk kept as
stored (so the two are tiers of one model)::

    czyx mount DIR/gguf/model-q8_0.gguf --as rs@q4 --quant none,expert=q4 \\
        --allow-requantize --store DIR/store      (and rs@q2 with expert=q2)

1. The hot list: an uncapped run of ``rs@q4`` over another text
   (``store/models/gguf_source.py``, not the timed one) saves its routing profile:
   what ``czyx profile`` would measure before a user turns tiers on.
2. Capped rounds: every configuration in its own cgroup v1 memory group capped at
   the q4 model's stored bytes / ``--ratio`` (its experts in the store plus the
   trunk, the q8 GGUF's other tensors), the model's files evicted from the page
   cache first, the engine sizing its slots to the group (no budget given), every
   run given the same hot list (prewarmed; for tiers also the high-precision
   choice). Configurations rotated round by round: pure q4, tiers
   ``q4,q2:FRACTION`` for each ``--fractions``, pure q2. Teacher-forced decode
   (``bench/_rs_run.py``) of ``store/models/mount.py``, as ``bench/bench_scale.py``.

Reported: decode tok/s (median over rounds, and each round's ratio against pure q4
in the same round), expert MiB read per token, hit rate, the time per token the
decoding thread was blocked on reads (exposed wait) and the time the same bytes take
to read without compute (the read half of the overlap bound), slots, the group's
peak and OOM kills, load averages; beside them, in the same rounds, pure q4 and pure
q2 resident (uncapped, every expert read first): their compute alone, the other half
of the bound. The tiers' quality cost is measured on the trained
bundled model (``bench/TIERS.md``: random real-shape weights have no quality).

Run: ``python bench/bench_tiers_realshape.py --out DIR`` (writes ``--md``,
default ``bench/TIERS-realshape.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from _report import write_report  # noqa: E402
from bench_scale import TEXT, cgroups_writable, evict, run  # noqa: E402

PROFILE_TEXT = HERE.parent / "store" / "models" / "gguf_source.py"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def trunk_bytes(gguf: Path) -> int:
    """Bytes of the GGUF's tensors other than the routed expert stacks (the trunk every
    version of the model shares)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors if "_exps" not in t.name)


def expert_bytes(store: Path, tag: str) -> int:
    """Bytes of a stored version's routed experts (every extent, no slot padding)."""
    from czyx.inference.opened import OpenedModel

    with OpenedModel(str(store), tag, None) as m:
        info = m.consumer.info
        return int(info.expert_nbytes) * int(info.n_layers) * int(info.n_experts)


def row(label: str, runs: list[dict], base: list[dict]) -> str:
    ok = [r for r in runs if r.get("rc") == 0]
    if not ok:
        why = runs[0].get("stderr", "").strip().splitlines()[-1:] if runs else ["not run"]
        return f"| {label} | failed: {why[0] if why else '?'} |" + " |" * 12
    rate = statistics.median(r["decode_tok_s"] for r in ok)
    per = [
        r["decode_tok_s"] / b["decode_tok_s"]
        for r, b in zip(runs, base, strict=True)
        if r.get("rc") == 0 and b.get("rc") == 0
    ]
    base_rate = statistics.median(b["decode_tok_s"] for b in base if b.get("rc") == 0)
    mib = statistics.median(r["bytes_read"] / r["n_decode"] / 2**20 for r in ok)
    hit = statistics.median(r["hit_rate"] for r in ok)
    peak = max(r.get("group_peak", 0) for r in ok) / 2**20
    kills = sum(r.get("oom_kills", 0) for r in runs)

    def per_token_ms(key: str) -> str:
        if not all(key in r for r in ok):
            return "-"
        return f"{statistics.median(1e3 * r[key] / r['n_decode'] for r in ok):.1f}"

    return (
        f"| {label} | {rate:.2f} | {rate / base_rate:.2f}x | "
        f"{', '.join(f'{p:.2f}' for p in per)} | "
        f"{statistics.median(1e3 * r['decode_s'] / r['n_decode'] for r in ok):.1f} | "
        f"{per_token_ms('exposed_wait_s')} | {per_token_ms('raw_read_s')} | "
        f"{mib:.1f} | {hit:.3f} | {ok[0]['slots']} | "
        f"{ok[0]['budget_bytes'] / 2**20:.0f} | {peak:.0f} | {kills} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="realshape directory (bench/realshape.py gen)")
    ap.add_argument("--high", default="rs@q4", help="the high-precision version")
    ap.add_argument("--low", default="rs@q2", help="the low-precision version")
    ap.add_argument("--ratio", type=float, default=3.6, help="q4 stored bytes / cap")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--profile-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policy", default=None, help="eviction policy (default: the engine's)")
    ap.add_argument("--md", default=str(HERE / "TIERS-realshape.md"))
    a = ap.parse_args(argv)
    command = "python bench/bench_tiers_realshape.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    why = cgroups_writable()
    if why is not None:
        print(f"skipped: {why}")
        return 0
    out = Path(a.out)
    store = out / "store"
    shape = json.loads((out / "shape.json").read_text())
    gguf = out / "gguf" / "model-q8_0.gguf"
    files = [gguf, *sorted((store / "blocks").rglob("*"))]
    files = [f for f in files if f.is_file()]
    high_ver, low_ver = a.high.split("@")[1], a.low.split("@")[1]
    stored = trunk_bytes(gguf) + expert_bytes(store, a.high)
    cap = int(stored / a.ratio)
    load0, t0 = load(), time.perf_counter()
    common = [
        "--engine", "czyx", "--store", str(store), "--vocab", str(shape["vocab"]),
        "--threads", str(a.threads), *(["--policy", a.policy] if a.policy else []),
        "--default-budget",
    ]  # fmt: skip
    profile = Path(f"/tmp/czyx-tiers-profile-{os.getpid()}.json")
    prof = run(
        [*common[:-1], "--tag", a.high, "--text", str(PROFILE_TEXT), "--prompt", "8",
         "--tokens", str(a.profile_tokens), "--save-profile", str(profile)],
        None, "tiers-profile",
    )  # fmt: skip
    if prof.get("rc") != 0:
        raise SystemExit(f"profile run failed: {prof.get('stderr', '')[-500:]}")
    timed = [
        "--text", str(TEXT), "--prompt", str(a.prompt), "--warmup", str(a.warmup),
        "--tokens", str(a.tokens), "--hot", str(profile),
    ]  # fmt: skip
    capped = [*common, *timed, "--bound"]
    configs = [("pure q4", [*capped, "--tag", a.high])]
    configs += [
        (
            f"tiers {high_ver},{low_ver}:{f:g}",
            [*capped, "--tag", a.high, "--tiers", f"{high_ver},{low_ver}:{f:g}"],
        )
        for f in a.fractions
    ]
    configs.append(("pure q2", [*capped, "--tag", a.low]))
    # Compute alone: every expert read before the first token, no cap (cache_fraction 1).
    resident = [*common[:-1], *timed, "--prewarm"]
    configs += [(f"pure {v}, resident", [*resident, "--tag", t]) for v, t in
                ((high_ver, a.high), (low_ver, a.low))]  # fmt: skip
    results: dict[str, list[dict]] = {label: [] for label, _ in configs}
    for rnd in range(a.rounds):
        k = rnd % len(configs)
        for label, args in configs[k:] + configs[:k]:
            evict(files)
            group = None if label.endswith("resident") else cap
            res = run(args, group, label.replace(" ", "-").replace(",", ""))
            results[label].append(res)
            rate = res.get("decode_tok_s", float("nan"))
            print(f"round {rnd + 1} {label}: rc {res.get('rc')} {rate:.2f} tok/s", flush=True)
    wall = time.perf_counter() - t0
    profile.unlink(missing_ok=True)
    base = results["pure q4"]
    md = [
        "# Precision tiers on the real-shape model under a memory cap",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); {machine()}.",
        "",
        f"Load average {load0} before, {load()} after ({wall:.0f} s in all).",
        "",
        f"`bench/realshape.py`'s {shape['arch']} shape, {shape['layers']} layers, "
        f"{shape['experts']} experts top-{shape['top_k']}, hidden {shape['hidden']}, expert "
        f"intermediate {shape['inter']}. `{a.high}` and `{a.low}`: the q8 GGUF's experts "
        "requantized (`czyx mount --quant none,expert=FMT --allow-requantize`), the trunk "
        f"as stored (q8). Stored bytes of `{a.high}`: {stored / 2**20:.0f} MiB (its experts "
        f"and the trunk); cap {cap / 2**20:.0f} MiB ({a.ratio}x below), cgroup v1, the "
        "model's files evicted from the page cache before every run, the engine sizing its "
        "slots to the group (no budget given), O_DIRECT reads, prefetch on, "
        f"{a.threads} kernel threads.",
        "",
        f"Hot list: the routing profile of an uncapped `{a.high}` run over "
        f"{a.profile_tokens} tokens of `{PROFILE_TEXT.relative_to(HERE.parent)}` (a text "
        "the timed runs do not decode); every run prewarms it, and tiers take its first "
        "experts at q4 until they fill FRACTION of the slots, every other expert read at "
        f"q2. Timed: teacher-forced decode of `{TEXT.relative_to(HERE.parent)}`, "
        f"{a.prompt}-token prompt, {a.warmup} untimed tokens, then {a.tokens} timed; "
        f"{a.rounds} rounds, configurations rotated round by round; tok/s the median over "
        'rounds, "per round" each round\'s ratio against pure q4 in the same round. '
        "Quality (KL, top-1 agreement, NLL on the trained bundled model): `bench/TIERS.md`.",
        "",
        "Per token: ms of decode; ms the decoding thread waited on expert reads (exposed "
        "wait); ms the run's own reads take alone (`bench/_rs_run.py --bound`: the same "
        "extents read O_DIRECT in a row after the run, no compute). The resident rows run "
        "uncapped with every expert read first: the compute half of the overlap bound "
        "max(read, compute).",
        "",
        "| config | decode tok/s | vs pure q4 | per round | ms per token | exposed read "
        "wait ms | read alone ms | expert MiB per token | hit rate | slots | slot MiB | group "
        "peak MiB | OOM kills |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(row(label, results[label], base) for label, _ in configs),
        "",
    ]
    return write_report(md, a.md)


if __name__ == "__main__":
    raise SystemExit(main())
