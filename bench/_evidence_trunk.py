"""Evidence for the dense-style trunk window (used by bench_trunk_window.py and evidence.py).

On the shipped ``czyx-moe-stdlib`` mounted into a scratch store, decode the
same teacher-forced bytes with the whole trunk resident (eager open) and
with a trunk window of 1 and 2 layers (lazy open: each layer's attention
matrices read, verified and widened per use, the next layer's read on a
background thread while one computes). Every routed expert is prewarmed
into a full-budget slot cache, so the only difference between the runs is
the trunk. Reported: median ms per decoded token and its ratio to the
resident run of the same rounds, trunk bytes resident, exposed load wait
per token, and logits parity with the resident run.

The shipped model's layers are small (96 KiB of attention matrices stored),
so per-load overhead dominates there; :func:`make_wide_checkpoint` writes a
random Mixtral whose layers are MiBs (``hidden`` wide), where the read and
the widening are large enough to overlap with a layer's compute.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from czyx.inference.engine import Engine
from czyx.inference.models.decoder import MoEDecoder
from czyx.inference.options import EngineOptions

ROOT_ASSET = Path(__file__).resolve().parent.parent / "inference" / "assets" / "czyx-moe-stdlib"
KiB = 1 << 10
TAG = "trunk@bench"


@dataclass(frozen=True)
class TrunkRun:
    """One configuration's figures over every round."""

    label: str
    window: int | None
    ms_per_token: float  # median over every decoded token of every round
    trunk_bytes: int  # trunk bytes the decoder held resident (window: at its peak)
    window_peak_bytes: int  # the window's own peak (0 when resident)
    wait_ms_per_token: float  # exposed trunk load wait per decoded token
    background_ms_per_token: float  # trunk load time on the loader thread, per token
    load_ms_per_token: float  # trunk load time on either thread, per token
    loads: int
    peak_layers: int
    identical: bool  # every step's logits equal the resident run's (np.array_equal)


def make_wide_checkpoint(path: Path, hidden: int, layers: int = 4, seed: int = 0) -> Path:
    """A random fp16 Mixtral with ``hidden``-wide attention and small experts, saved at ``path``.

    Four experts of intermediate size 64, top-2, ``hidden / 64`` heads with as
    many KV heads: each layer's q/k/v/o are ``4 * hidden**2`` fp16 values.
    """
    import torch
    import transformers as T

    heads = max(1, hidden // 64)
    cfg = T.MixtralConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = T.MixtralForCausalLM(cfg).half().eval()
    model.save_pretrained(path)
    return path


def measure(
    scratch: Path,
    io: str = "pread",
    tokens: int = 32,
    rounds: int = 3,
    windows: tuple[int, ...] = (1, 2),
    cold: bool = False,
    model_dir: Path | None = None,
) -> tuple[list[TrunkRun], dict]:
    """Resident trunk vs each window on the shipped model; ``(runs, facts)``.

    ``cold``: evict the trunk's block file from the page cache before every
    decoded token (the windowed runs then read from the device).
    ``model_dir``: another checkpoint (e.g. :func:`make_wide_checkpoint`).
    """
    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.store.io.iopaths import drop_file_cache
    from czyx.store.models.model import ModelSpace
    from czyx.store.models.mount import mount

    text = Path(os.__file__).read_bytes()
    prompt, toks = list(text[:32]), list(text[32 : 32 + tokens])
    configs: list[tuple[str, int | None]] = [("resident", None)]
    configs += [(f"window {k}", k) for k in windows]
    times: dict[str, list[float]] = {c[0]: [] for c in configs}
    waits = {c[0]: 0.0 for c in configs}
    bg = {c[0]: 0.0 for c in configs}
    load = {c[0]: 0.0 for c in configs}
    logits: dict[str, list[np.ndarray]] = {}
    with Store.open(scratch / "trunkstore") as st:
        mount(st, model_dir or ROOT_ASSET, TAG)
        space = ModelSpace(st, TAG)
        blocks = sorted({str(st.block_path(r.space)) for r in space.trunk.values()})
        engines, consumers = {}, []
        try:
            for label, k in configs:
                consumer = open_consumer(st, None, TAG, lazy_trunk=k is not None)
                consumers.append(consumer)
                info = consumer.info
                hot = [(la, e) for la in range(info.n_layers) for e in range(info.n_experts)]
                engines[label] = Engine(
                    consumer, options=EngineOptions(io=io), hot=hot, trunk_window=k
                )
            for r in range(rounds):
                for label, _ in configs:  # interleaved: load noise hits every config alike
                    eng = engines[label]
                    eng.reset()
                    out = [eng.prefill(prompt)]
                    s0 = eng.trunk_window_stats()
                    for tok in toks:
                        if cold:
                            for b in blocks:
                                drop_file_cache(b)
                        t0 = time.perf_counter()
                        out.append(eng.decode(tok))
                        times[label].append((time.perf_counter() - t0) * 1e3)
                    s1 = eng.trunk_window_stats()
                    if s1 is not None:
                        waits[label] += s1.wait_seconds - s0.wait_seconds
                        bg[label] += s1.background_seconds - s0.background_seconds
                        load[label] += s1.load_seconds - s0.load_seconds
                    if r == 0:
                        logits[label] = out
            runs = []
            n_tok = rounds * len(toks)
            for label, k in configs:
                eng = engines[label]
                s = eng.trunk_window_stats()
                same = all(
                    np.array_equal(a, b)
                    for a, b in zip(logits[label], logits["resident"], strict=True)
                )
                runs.append(
                    TrunkRun(
                        label=label,
                        window=k,
                        ms_per_token=float(np.median(times[label])),
                        trunk_bytes=eng.model.trunk_nbytes(),
                        window_peak_bytes=0 if s is None else s.peak_bytes,
                        wait_ms_per_token=waits[label] * 1e3 / n_tok,
                        background_ms_per_token=bg[label] * 1e3 / n_tok,
                        load_ms_per_token=load[label] * 1e3 / n_tok,
                        loads=0 if s is None else s.loads,
                        peak_layers=0 if s is None else s.peak_layers,
                        identical=same,
                    )
                )
            info = consumers[0].info
            facts = {
                "n_layers": info.n_layers,
                "tokens": len(toks),
                "rounds": rounds,
                "io": io,
                "cold": cold,
                "stored_layer_bytes": [
                    consumers[0].trunk_layer_nbytes(la) for la in range(info.n_layers)
                ],
                # Stored bytes a window load reads per layer (its big matrices only).
                "window_layer_bytes": [
                    sum(
                        r.record["len"]
                        for (role, la2), r in space.trunk.items()
                        if la2 == la and role in MoEDecoder.window_roles
                    )
                    for la in range(info.n_layers)
                ],
                "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
            }
        finally:
            for eng in engines.values():
                eng.close()
            for c in consumers:
                c.close()
    return runs, facts


def table(runs: list[TrunkRun]) -> str:
    """A markdown table of the runs, ratios against the resident one."""
    res = runs[0]
    lines = [
        "| trunk | ms/token (median) | vs resident | trunk resident KiB | window peak KiB "
        "| exposed wait ms/token | load ms/token (of it in background) | loads | peak layers "
        "| logits = resident |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.label} | {r.ms_per_token:.3f} | {r.ms_per_token / res.ms_per_token:.2f}x | "
            f"{r.trunk_bytes / KiB:.0f} | {r.window_peak_bytes / KiB:.0f} | "
            f"{r.wait_ms_per_token:.3f} | {r.load_ms_per_token:.3f} "
            f"({r.background_ms_per_token:.3f}) | {r.loads} | "
            f"{r.peak_layers} | {'yes' if r.identical else 'NO'} |"
        )
    return "\n".join(lines)


def _describe(runs: list[TrunkRun], facts: dict, baseline: float) -> str:
    """One model's figures for the evidence row, ratios against its resident run."""
    res = runs[0]
    parts = [f"resident {res.ms_per_token:.2f} ms/token, trunk {res.trunk_bytes / KiB:.0f} KiB"]
    for r in runs[1:]:
        parts.append(
            f"{r.label} {r.ms_per_token:.2f} ms/token ({r.ms_per_token / res.ms_per_token:.2f}x), "
            f"trunk {r.trunk_bytes / KiB:.0f} KiB (peak {r.peak_layers} layers), exposed "
            f"load wait {r.wait_ms_per_token:.2f} of {r.load_ms_per_token:.2f} ms/token loading"
        )
    w = runs[1]
    if w.load_ms_per_token and w.window is not None and w.window < facts["n_layers"]:
        # Every layer is reread per token when the window is smaller than the model.
        rate = float(np.sum(facts["window_layer_bytes"])) / (w.load_ms_per_token / 1e3)
        vs = f" = {rate / baseline:.2f}x the device baseline" if baseline else ""
        parts.append(f"{w.label} loads {rate / 1e9:.2f} GB/s of stored trunk{vs}")
    return ", ".join(parts)


def trunk_rows(scratch: Path, io: str, baseline: float) -> tuple[str, str, str, str]:
    """The evidence matrix's "Trunk window" row ``(experiment, configuration, result, status)``.

    Two models: the shipped one (small layers: per-load overhead) and a
    random 1024-wide Mixtral (8 MiB of fp16 attention matrices per layer,
    where reads can hide behind compute). ``baseline``: the device's
    measured read bandwidth (bytes/s), against which the windows' trunk load
    rate (stored bytes per second of load time: read, verify, widen) is given.
    """
    if not ROOT_ASSET.exists():
        return ("Trunk window", "-", f"not run: {ROOT_ASSET} is not in this tree", "not run")
    shipped, f1 = measure(scratch / "shipped", io=io, tokens=32, rounds=3)
    wide_ckpt = make_wide_checkpoint(scratch / "wide-ckpt", 1024, 4)
    wide, f2 = measure(scratch / "wide", io=io, tokens=16, rounds=3, model_dir=wide_ckpt)
    same = all(r.identical for r in shipped + wide)
    result = (
        f"shipped: {_describe(shipped, f1, baseline)}; 1024-wide: {_describe(wide, f2, baseline)}; "
        + ("logits bit-identical to resident in every run" if same else "LOGITS DIFFER")
    )
    conf = (
        "whole trunk resident vs window 1 and 2 layers (lazy open: read, verify, widen per "
        f"use), experts prewarmed, `{io}`, warm cache; shipped czyx-moe-stdlib (4 layers, "
        f"96 KiB fp16 attention per layer, {f1['tokens']} tokens x {f1['rounds']} rounds) and a "
        f"random 1024-wide Mixtral (4 layers, 8 MiB per layer, {f2['tokens']} tokens x "
        f"{f2['rounds']} rounds), configurations interleaved"
    )
    return ("Trunk window", conf, result, "measured" if same else "FAILED: parity")
