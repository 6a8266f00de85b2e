"""Speculative decoding on the shipped model: ``python bench/bench_speculate.py``.

Greedy decode of ``czyx-moe-stdlib`` (mounted into a scratch store, every expert
resident and warm) without drafts and with prompt lookup (``--speculate lookup``),
on code prompts written for this benchmark (not files of the model's training set:
they are new code) and on an English prose prompt; optionally (``--self``) with the
model's own quantized version as the draft (``draft:stdlib@q4``). Configurations
are interleaved round by round; each figure is the median over the rounds of
decode tokens/s, with the ratio to the non-speculative run of the same rounds. The
tokens of every speculative run are checked identical to the non-speculative ones.
Writes ``bench/SPECULATE.md``.

Usage::

    python bench/bench_speculate.py                 # 96 tokens x 5 rounds (~1-2 min)
    python bench/bench_speculate.py --self          # also the q4 version as the draft
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._machine import machine  # noqa: E402

# Code the model never saw: written for this benchmark (its training set is CPython's
# own standard library; see inference/assets/czyx-moe-stdlib/TRAINING.md).
PROMPTS = {
    "code: ring buffer": '''class RingBuffer:
    """A fixed-size buffer that overwrites its oldest item."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.items = [None] * capacity
        self.start = 0
        self.size = 0

    def push(self, item):
        end = (self.start + self.size) % self.capacity
        self.items[end] = item
        if self.size < self.capacity:
            self.size += 1
        else:
            self.start = (self.start + 1) % self.capacity

    def pop(self):
        if self.size == 0:
            raise IndexError("pop from an empty ring buffer")
        item = self.items[self.start]
        self.items[self.start] = None
        self.start = (self.start + 1) % self.capacity
        self.size -= 1
        return item

    def peek(self):
        if self.size == 0:
            raise IndexError("peek at an empty ring buffer")
''',
    "code: config parser": """def parse_settings(lines):
    settings = {}
    section = None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            settings.setdefault(section, {})
            continue
        if "=" not in line:
            raise ValueError("line %d: expected key = value" % number)
        key, value = line.split("=", 1)
        key = key.strip()
        value = value.strip()
        if section is None:
            raise ValueError("line %d: key outside a section" % number)
        settings[section][key] = value
    return settings


def format_settings(settings):
    out = []
    for section, values in settings.items():
        out.append("[%s]" % section)
""",
    "code: vector": """class Vector:
    def __init__(self, x, y, z):
        self.x = x
        self.y = y
        self.z = z

    def __add__(self, other):
        return Vector(self.x + other.x, self.y + other.y, self.z + other.z)

    def __sub__(self, other):
        return Vector(self.x - other.x, self.y - other.y, self.z - other.z)

    def __mul__(self, k):
        return Vector(self.x * k, self.y * k, self.z * k)

    def dot(self, other):
        return self.x * other.x + self.y * other.y + self.z * other.z

    def cross(self, other):
""",
    "prose": (
        "The harbour town woke slowly that autumn. Fishermen mended their nets on the "
        "quay while the baker's daughter carried warm bread up the hill to the old "
        "lighthouse keeper, who had not spoken to anyone since the storm. She left the "
        "basket by his door, knocked twice, and waited. The wind smelled of rain and "
        "seaweed, and somewhere below a gull complained about"
    ),
}


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (configurations interleaved)")
    ap.add_argument("--draft-tokens", type=int, default=None, help="draft length at most")
    ap.add_argument("--self", action="store_true", help="also the q4 version as the draft")
    ap.add_argument("--out", default=str(ROOT / "bench" / "SPECULATE.md"))
    args = ap.parse_args(argv)

    from czyx.inference.assets import bundled_model_dir
    from czyx.inference.engine import Engine
    from czyx.inference.generate import generate_ids
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import SpeculateOptions
    from czyx.inference.speculative import Speculator
    from czyx.store import Store
    from czyx.store.models.mount import mount

    spec_opts = SpeculateOptions("lookup")
    if args.draft_tokens is not None:
        spec_opts = SpeculateOptions("lookup", draft_tokens=args.draft_tokens)
    load0 = load()
    tmp = tempfile.TemporaryDirectory(prefix="czyx-spec-")
    store_dir = str(Path(tmp.name) / "store")
    with Store.open(store_dir) as st:
        mount(st, bundled_model_dir(), "stdlib@1")
        if args.self:
            from czyx.store.quant.codec import QuantCodec
            from czyx.store.quant.policy import parse_policy

            mount(st, bundled_model_dir(), "stdlib@q4", quant=QuantCodec(parse_policy("q4-all")))
    opened = OpenedModel(store_dir, "stdlib@1", None)
    engine = Engine(opened.consumer)
    configs = ["off", "lookup"] + (["draft:stdlib@q4"] if args.self else [])
    speculators = {
        "off": None,
        "lookup": Speculator.open(spec_opts, engine),
    }
    if args.self:
        speculators["draft:stdlib@q4"] = Speculator.open(
            SpeculateOptions("draft:stdlib@q4", draft_tokens=spec_opts.draft_tokens),
            engine,
            opened.store,
        )
    prompts = {name: list(text.encode()) for name, text in PROMPTS.items()}
    # rate[prompt][config] = tok/s per round; acc = (accepted, drafted, passes, tokens)
    rate = {p: {c: [] for c in configs} for p in prompts}
    acc = {p: {c: [0, 0, 0, 0] for c in configs} for p in prompts}
    want: dict[str, list[int]] = {}
    for name, ids in prompts.items():  # warm-up (caches, kernels) and the reference tokens
        want[name], _ = generate_ids(engine, ids, args.tokens)
    t_start = time.perf_counter()
    for _ in range(args.rounds):
        for name, ids in prompts.items():
            for cfg in configs:
                spec = speculators[cfg]
                if spec is not None:
                    spec.length = type(spec.length)(spec_opts.draft_tokens, spec_opts.adaptive)
                out, st = generate_ids(engine, ids, args.tokens, speculate=spec)
                if out != want[name]:
                    raise SystemExit(f"{cfg} on {name!r}: tokens differ from non-speculative")
                rate[name][cfg].append(st.decode_tokens_per_s)
                a = acc[name][cfg]
                a[0] += st.accepted
                a[1] += st.drafted
                a[2] += len(st.draft_steps) if st.draft_steps else st.decode_steps
                a[3] += st.decode_steps
    wall = time.perf_counter() - t_start
    load1 = load()
    for spec in speculators.values():
        if spec is not None:
            spec.close()
    engine.close()
    opened.close()
    tmp.cleanup()

    lines = [
        "# Speculative decoding on czyx-moe-stdlib",
        "",
        f"`python bench/bench_speculate.py{' --self' if args.self else ''}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); {machine()}.",
        "",
        f"Greedy, {args.tokens} tokens per run, {args.rounds} rounds with the configurations "
        f"interleaved, medians; load average {load0} before, {load1} after ({wall:.0f} s). "
        f"Engine threads: {engine.threads}, every expert resident and warm. Draft length at "
        f"most {spec_opts.draft_tokens}, adaptive. The tokens of every speculative run were "
        "identical to the non-speculative run's (checked).",
        "",
        "| prompt | config | decode tok/s | vs off | acceptance | tokens per forward pass |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in prompts:
        base = statistics.median(rate[name]["off"])
        for cfg in configs:
            med = statistics.median(rate[name][cfg])
            a = acc[name][cfg]
            accept = f"{a[0] / a[1]:.2f} ({a[0]}/{a[1]})" if a[1] else "-"
            per_pass = a[3] / a[2] if a[2] else 0.0
            lines.append(
                f"| {name} | {cfg} | {med:.1f} | {med / base:.2f}x | {accept} | {per_pass:.2f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
