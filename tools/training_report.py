"""Render ``TRAINING.md`` from the ``training_log.json`` that ``tools/train_moe.py`` writes.

Usage::

    python tools/training_report.py inference/assets/czyx-moe-stdlib

Scope: formatting only; every number comes from the log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def render(log: dict) -> str:
    """The Markdown text of a training log."""
    a = log["args"]
    d = log["data"]
    b = log["baselines_bpb"]
    v = log["val_bpb"]
    lines = [
        "# czyx-moe-stdlib: training record",
        "",
        f"A byte-level Mixtral-format MoE (`MixtralForCausalLM`, vocab 256, hidden {a['hidden']}, "
        f"{a['layers']} layers, {a['experts']} experts top-{a['top_k']}, expert intermediate "
        f"{a['intermediate']}, {a['heads']} query / {a['kv_heads']} key-value heads, untied "
        f"embeddings, {log['n_params']:,} parameters) trained on the Python standard library's "
        f"own source. Stored as {a['dtype']} safetensors.",
        "",
        "## Reproduce",
        "",
        "```sh",
        "pip install '.[ref]'   # torch (CPU) + transformers",
        log["command"],
        "python tools/training_report.py " + a["out"],
        "```",
        "",
        f"Seed {a['seed']} (`torch.manual_seed`, and a separate seeded generator for the data "
        f"order); {log['threads']} torch thread(s). Wall time: training {log['train_wall_s']:.0f} "
        f"s, whole script {log['total_wall_s']:.0f} s, on a 2-vCPU machine shared with other "
        "jobs (so the wall time is an upper bound, not a benchmark). Versions: "
        + ", ".join(f"{k} {val}" for k, val in log["versions"].items())
        + ".",
        "",
        "## Data",
        "",
        f"Every `*.py` under `{d['stdlib_dir']}` (site-packages excluded), sorted by relative "
        f"path; a file is validation when {d['val_rule']}. Train: {d['train_bytes']:,} bytes in "
        f"{d['train_files']} files; validation: {d['val_bytes_total']:,} bytes in "
        f"{d['val_files']} files, of which the first {d['val_bytes_scored']:,} are scored "
        f"(sha256 `{d['val_sha256'][:16]}...`). The model saw {d['tokens_seen']:,} training "
        f"bytes ({a['steps']} steps x {a['batch']} x {a['seq_len']}). Other Python versions "
        "ship different stdlib bytes, so a retrain elsewhere gives close, not identical, numbers.",
        "",
        "## Validation bits per byte (same bytes, same run)",
        "",
        "| coder | bits/byte | vs zlib -9 |",
        "| --- | --- | --- |",
        f"| unigram entropy (oracle order-0) | {b['unigram_entropy_bpb']:.3f} | "
        f"{b['unigram_entropy_bpb'] / b['zlib9_bpb']:.2f}x |",
        f"| zlib -9 | {b['zlib9_bpb']:.3f} | 1.00x |",
        f"| xz -9e | {b['xz9e_bpb']:.3f} | {b['xz9e_bpb'] / b['zlib9_bpb']:.2f}x |",
        f"| this model (fp32, in memory) | {v:.3f} | {v / b['zlib9_bpb']:.2f}x |",
        f"| this model (reloaded from the {a['dtype']} files) | {log['val_bpb_reloaded']:.3f} | "
        f"{log['val_bpb_reloaded'] / b['zlib9_bpb']:.2f}x |",
        "",
        "The model's figure is its cross-entropy (an arithmetic coder would reach it within a "
        f"few bytes); windows of {a['seq_len']} bytes overlap by half, so each scored byte "
        f"after the first window has at least {a['seq_len'] // 2} bytes of context. The "
        "compressors see the whole validation text as one stream.",
        "",
        "## Loss curve",
        "",
        "Training cross-entropy (bits/byte, one batch, without the router auxiliary loss) and "
        f"validation on the first {a['eval_bytes']:,} scored bytes:",
        "",
        "| step | lr | train bits/byte | router aux loss | val (prefix) bits/byte |",
        "| --- | --- | --- | --- | --- |",
    ]
    curve = log["curve"]
    every = max(1, len(curve) // 24)
    for i, r in enumerate(curve):
        if i % every and "val_bpb_prefix" not in r and i != len(curve) - 1:
            continue
        vp = f"{r['val_bpb_prefix']:.3f}" if "val_bpb_prefix" in r else ""
        lines.append(
            f"| {r['step']} | {r['lr']:.2e} | {r['train_ce_bpb']:.3f} | "
            f"{r['aux_loss']:.3f} | {vp} |"
        )
    lines += [
        "",
        f"Router auxiliary (load-balancing) loss on, coefficient {a['aux_coef']}; its value is "
        f"{a['top_k']}.0 for perfectly balanced routing.",
        "",
        "## Expert usage per layer (validation, top-k selections)",
        "",
        "| layer | entropy (bits; max "
        f"{log['expert_usage'][0]['max_entropy_bits']:.0f}) | top-1 share | top-4 share | "
        "min share | counts by expert |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, u in enumerate(log["expert_usage"]):
        lines.append(
            f"| {i} | {u['entropy_bits']:.3f} | {u['top1_share']:.3f} | {u['top4_share']:.3f} | "
            f"{u['min_share']:.3f} | {' '.join(str(c) for c in u['counts'])} |"
        )
    lines += ["", "## Files", "", "| file | bytes | sha256 |", "| --- | --- | --- |"]
    for name, f in log["files"].items():
        lines.append(f"| {name} | {f['bytes']:,} | `{f['sha256'][:16]}...` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "inference/assets/czyx-moe-stdlib")
    log = json.loads((out / "training_log.json").read_text())
    (out / "TRAINING.md").write_text(render(log))
    print(f"wrote {out / 'TRAINING.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
