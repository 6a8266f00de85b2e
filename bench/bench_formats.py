"""Quality of each stored policy for GGUF-quantized and FP8 sources, against the source's own
dequantized reference, on held-out text (writes bench/FORMATS.md).

For every source (a GGUF file of some quant type, an FP8 block-scaled
checkpoint), the reference is the source's own values dequantized to float32:
the mount under ``--convert f32`` (exact by construction: the ``gguf``
package's dequantizers, FP8 codes times their block scales). Every other
policy the store offers for that source (``native`` where the type has a
native format, ``bf16``, ``q8``, ``q4``) is mounted and compared with it on
the same token windows: NLL drift (nats/token), KL(ref || policy), top-1
agreement, stored bytes, and the largest per-tensor relative RMS drift the
mount recorded. A context row gives the source itself against the original
float model.

Sources. The bundled model (``inference/assets/czyx-moe-stdlib``, fp16,
128-wide rows) as GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 (written the converter's way)
and as FP8 with 128 x 128 blocks; K-quants need rows of 256, which the bundled
model does not have (llama-quantize falls back to Q8_0/Q5_0 for every tensor),
so the K-quant rows use a random 256-wide Mixtral quantized by llama.cpp's own
``llama_model_quantize`` (Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K), evaluated on
the same text (its NLL is meaningless; drift, KL and top-1 against its
reference are what is measured).

    OPENBLAS_NUM_THREADS=1 python bench/bench_formats.py --windows 16 --window 256
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "inference" / "assets" / "czyx-moe-stdlib"
K_QUANTS = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")


def _engine_logits(store, tag: str, windows: list) -> list[np.ndarray]:
    from czyx.inference.engine import Engine
    from czyx.inference.quant_eval import window_logits
    from czyx.portals import open_consumer

    with open_consumer(store, None, tag) as model:
        return window_logits(Engine(model), windows)


def _compare(ref: list[np.ndarray], test: list[np.ndarray], windows: list) -> object:
    from czyx.inference.quant_eval import compare_logits

    r = np.concatenate([a[:-1] for a in ref])
    q = np.concatenate([a[:-1] for a in test])
    tg = np.concatenate([np.asarray(w, np.int64)[1:] for w in windows])
    return compare_logits(r, q, tg)


def _float_logits(model, windows: list) -> list[np.ndarray]:
    import torch

    out = []
    with torch.no_grad():
        for w in windows:
            out.append(model(torch.tensor(np.asarray(w))[None]).logits[0].float().numpy())
    return out


def _llama_quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {ftype} failed ({rc})")


def _types(path: Path) -> str:
    from collections import Counter

    import gguf

    c = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items()))


def _source_rows(name, path, policies, orig_logits, windows, store):
    """Mount ``path`` under f32 (reference) and each policy; one row per policy."""
    from czyx.store.models.mount import mount

    rows = []
    ref = mount(store, path, f"{name}@f32", convert="f32")
    ref_logits = _engine_logits(store, f"{name}@f32", windows)
    if orig_logits is not None:
        q = _compare(orig_logits, ref_logits, windows)
        rows.append((name, "source vs original", ref.bytes_total, q, None))
    for pol in policies:
        convert = None if pol == "native" else pol
        try:
            res = mount(store, path, f"{name}@{pol}", convert=convert)
        except Exception as exc:  # a policy that does not apply is reported, not hidden
            rows.append((name, pol, None, None, f"refused: {type(exc).__name__}"))
            continue
        m = store.manifest(res.selector)
        drift = [v[2] for v in (m.get("quant") or {}).get("converted", {}).values()]
        test = _engine_logits(store, f"{name}@{pol}", windows)
        q = _compare(ref_logits, test, windows)
        rows.append((name, pol, res.bytes_total, q, max(drift) if drift else 0.0))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "bench" / "FORMATS.md"))
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from czyx.inference.quant_eval import stdlib_split, text_windows
    from czyx.store import Store
    from czyx.testing.fp8_writer import write_fp8_checkpoint
    from czyx.testing.gguf_writer import write_gguf
    from czyx.testing.refmodels import tiny_model

    torch.set_num_threads(1)
    t0 = time.time()
    load0 = os.getloadavg()
    _, val = stdlib_split()
    windows = text_windows(lambda s: list(s.encode("utf-8")), val, args.window, args.windows)
    bundled = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    orig = _float_logits(bundled, windows)
    wide = tiny_model(
        "mixtral",
        seed=1,
        hidden_size=256,
        intermediate_size=256,
        sliding_window=None,
        initializer_range=0.02,
    )
    wide_orig = _float_logits(wide, windows)
    rows = []
    types_of: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        store = Store.open(work / "s")
        for qtype in ("q8_0", "q4_0", "q4_1", "q5_0"):
            path = work / f"bundled-{qtype}.gguf"
            write_gguf(bundled, path, qtype)
            name = f"bundled-gguf-{qtype.upper()}"
            types_of[name] = _types(path)
            rows += _source_rows(name, path, ("native", "bf16", "q8", "q4"), orig, windows, store)
            print(f"{name}: done ({time.time() - t0:.0f} s)", file=sys.stderr)
        write_gguf(wide, work / "wide-f16.gguf", "f16")
        for ft in K_QUANTS:
            path = work / f"wide-{ft}.gguf"
            _llama_quantize(work / "wide-f16.gguf", path, ft)
            name = f"wide-gguf-{ft}"
            types_of[name] = _types(path)
            rows += _source_rows(
                name, path, ("native", "bf16", "q8", "q4"), wide_orig, windows, store
            )
            print(f"{name}: done ({time.time() - t0:.0f} s)", file=sys.stderr)
        fp8 = write_fp8_checkpoint(bundled, work / "bundled-fp8", (128, 128))
        types_of["bundled-fp8"] = "F8_E4M3 (128 x 128 blocks) + F32 norms/router/embed/head"
        rows += _source_rows("bundled-fp8", fp8, ("bf16", "f16", "q8", "q4"), orig, windows, store)
        store.close()
    load1 = os.getloadavg()
    n_tok = sum(len(w) - 1 for w in windows)
    lines = [
        "# Stored policies of quantized sources vs the source's own dequantized reference",
        "",
        "Generated by `OPENBLAS_NUM_THREADS=1 python bench/bench_formats.py "
        f"--windows {args.windows} --window {args.window}` on {time.strftime('%Y-%m-%d')} "
        f"({time.time() - t0:.0f} s; load average {load0[0]:.1f} before, {load1[0]:.1f} after). "
        f"Text: {len(windows)} windows x {args.window} bytes ({n_tok} predicted tokens) of the "
        "bundled model's held-out stdlib split (`inference.quant_eval.stdlib_split`).",
        "",
        "Reference for every row: the source mounted with `--convert f32` (its own values "
        "dequantized, exactly). `native`: the GGUF type repacked without loss (Q8_0 -> q8, "
        "Q4_0/Q4_1 -> q4); `--convert` policies apply only to tensors whose type has no native "
        "format (a native type stays native under `q8`/`q4`, so those rows equal `native`; the "
        "float policies convert every quantized tensor). `stored MiB` of a `source vs original` "
        "row is the f32 reference mount. `max rel RMS` is the largest per-tensor "
        "relative RMS error the mount recorded in the manifest (`quant.converted`). The "
        "`source vs original` rows compare the reference with the original float model (what "
        "the source format itself costs). `wide-*` sources are a random 256-wide Mixtral "
        "(K-quants need rows of 256; the bundled model's are 128), quantized by llama.cpp's "
        "`llama_model_quantize`; their NLL is not meaningful, their drift/KL/top-1 are.",
        "",
        "| source | policy | stored MiB | NLL drift (nats/token) | KL | top-1 agree | "
        "max rel RMS |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, pol, nbytes, q, extra in rows:
        if q is None:
            lines.append(f"| {name} | {pol} | - | - | - | - | {extra} |")
            continue
        mib = f"{nbytes / 2**20:.2f}" if nbytes else "-"
        rel = "-" if extra is None else f"{extra:.2e}"
        lines.append(
            f"| {name} | {pol} | {mib} | {q.nll_drift:+.4f} | {q.kl:.5f} | {q.top1:.3f} | {rel} |"
        )
    lines += ["", "Tensor types of each source file:", ""]
    lines += [f"- {k}: {v}" for k, v in types_of.items()]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
