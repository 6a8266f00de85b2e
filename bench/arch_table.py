"""The architecture table: every MoE class, mounted, run and exported against transformers.

For each supported architecture and each expert layout transformers uses
(the per-expert tensors ``save_pretrained`` writes, and the stacked
``experts.gate_up_proj`` form it holds in memory), a tiny random model is
built, written, mounted into a fresh store, run through a portal and exported
(:func:`czyx.testing.archparity.run_parity`): the largest logit difference
from transformers, whether greedy tokens equal transformers' with all experts
resident and with a quarter of them cached, and whether the export is
byte-identical. Every other MoE ``model_type`` transformers knows is mounted
from its default config and its refusal (the one-line message mount prints)
recorded (every model type in ``store.models.archs.REFUSED_MOE``). Writes ``bench/ARCHS.md``.

    .venv/bin/python bench/arch_table.py            # writes bench/ARCHS.md
    .venv/bin/python bench/arch_table.py --no-write # prints only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (arch, overrides): a few layers, weights large enough for decisive logits.
SUPPORTED = [
    ("mixtral", dict(initializer_range=0.2, sliding_window=6)),
    ("qwen2_moe", dict(initializer_range=0.2, num_hidden_layers=3, mlp_only_layers=[1])),
    ("qwen3_moe", dict(initializer_range=0.2)),
    ("qwen3_moe", dict(initializer_range=0.2, attention_bias=True)),
    ("olmoe", dict(initializer_range=0.2, clip_qkv=3.0)),
    ("deepseek_v2", dict(initializer_range=0.2, num_hidden_layers=3)),
    (
        "deepseek_v2",
        dict(initializer_range=0.2, num_hidden_layers=3, topk_method="group_limited_greedy"),
    ),
    ("deepseek_v3", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("glm4_moe", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("gpt_oss", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("ernie4_5_moe", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("granitemoe", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("hunyuan_v1_moe", dict(initializer_range=0.2)),
    ("qwen3_next", dict(initializer_range=0.2)),
    ("qwen3_next", dict(initializer_range=0.2, mlp_only_layers=[1])),
    ("jamba", dict(initializer_range=0.2)),
    ("jamba", dict(initializer_range=0.2, attn_layer_offset=1, mamba_conv_bias=False)),
    ("phimoe", dict(initializer_range=0.2)),
    ("llama4_text", dict(initializer_range=0.2)),
    ("dots1", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("solar_open", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("sarvam_mla", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("glm4_moe_lite", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("granitemoeshared", dict(initializer_range=0.2, num_hidden_layers=3)),
    ("minimax_m2", dict(initializer_range=0.2)),
    ("hy_v3", dict(initializer_range=0.2)),
    ("exaone_moe", dict(initializer_range=0.2)),
]
# GPT-OSS and Llama 4 experts exist in one form only (save_pretrained writes the
# stacked, transposed tensors transformers holds), so each has one row.
ONE_LAYOUT = {"gpt_oss", "llama4_text"}


def _label(arch: str, overrides: dict) -> str:
    extra = [k for k in overrides if k not in ("initializer_range", "num_hidden_layers")]
    return arch + (f" ({', '.join(f'{k}={overrides[k]}' for k in extra)})" if extra else "")


def refusal(model_type: str, workdir: Path) -> str:
    """Mount a checkpoint with ``model_type``'s default config; the refusal's one line."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from czyx.errors import CzyxError
    from czyx.store import Store
    from czyx.store.models.mount import mount

    ckpt = workdir / model_type
    ckpt.mkdir(parents=True)
    try:
        config = AutoConfig.for_model(model_type).to_dict()
    except Exception:  # a config class whose own defaults do not validate
        config = {"model_type": model_type}
    (ckpt / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(ckpt / "model.safetensors"))
    store = Store.open(workdir / f"store-{model_type}")
    try:
        mount(store, ckpt, "x@1")
    except CzyxError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        store.close()
    return "mounted (unexpected)"


def main(argv: list[str] | None = None) -> int:
    """Run every row; print the table and (unless ``--no-write``) write bench/ARCHS.md."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).with_name("ARCHS.md")))
    args = ap.parse_args(argv)

    import torch

    from czyx.testing.archparity import run_parity

    torch.set_num_threads(1)
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for n, (arch, ov) in enumerate(SUPPORTED):
            for fused in (False,) if arch in ONE_LAYOUT else (False, True):
                work = Path(tmp) / f"{n}-{int(fused)}"
                r = run_parity(arch, work, fused=fused, prompt_len=14, **ov)
                rows.append((_label(arch, ov), r))
        from czyx.store.models.archs import REFUSED_MOE

        refused = [(mt, refusal(mt, Path(tmp) / "refused")) for mt in sorted(REFUSED_MOE)]
    seconds = time.perf_counter() - t0

    head = [
        "| architecture | written by | expert tensors in the file | mount "
        "| export (bytes; transformers reload diff) "
        "| logits max abs diff (logit range) | greedy = transformers, full cache "
        "| greedy = transformers, 25 % cache (misses) | row |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines = []
    for label, r in rows:
        by = "state dict as held" if r.layout == "fused" else "save_pretrained"
        form = {"fused": "stacked", "per_expert": "per expert"}.get(r.source_layout, "")
        if r.refused:
            lines.append(f"| {label} | {by} | {form} | refused: {r.refused} | | | | | refused |")
            continue
        export = ("identical" if r.export_identical else "DIFFERS") + f"; {r.export_max_diff:.1e}"
        lines.append(
            f"| {label} | {by} | {form} | ok | {export} | {r.max_diff:.2e} ({r.logit_range:.2f}) "
            f"| {'yes' if r.greedy_full else 'NO'} ({r.tokens} tokens) "
            f"| {'yes' if r.greedy_quarter else 'NO'} ({r.quarter_misses}) "
            f"| {'green' if r.green else 'RED'} |"
        )
    for mt, msg in refused:
        lines.append(f"| {mt} | | | refused: {msg} | | | | | refused |")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    import transformers

    report = "\n".join(
        [
            "# Architectures: czyx against transformers",
            "",
            f"Generated by `bench/arch_table.py` at commit {commit or '?'} with transformers "
            f"{transformers.__version__}, in {seconds:.0f} s (load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs).",
            "",
            "Each supported row: a tiny random transformers model (float32) written by "
            "`save_pretrained` or as the state dict transformers holds in memory (the column "
            "after it says whether the file then has per-expert or stacked expert tensors; "
            "GPT-OSS and Llama 4 write the same stacked file both ways, so each has one row), "
            "mounted "
            "into a fresh store, opened through a portal and run by the numpy engine; logits "
            "over a 14-token prompt against transformers'; 16 greedy "
            "tokens against transformers' own argmax loop over its KV cache, with every expert "
            "resident and with a quarter of the experts' bytes as cache; `czyx export` "
            "compared byte for byte with the source files and reloaded by transformers. "
            "Green: logits within 1e-5 of the logit range, both greedy runs equal, export "
            "identical. Refused rows: a checkpoint with that model_type's default config, "
            "mounted; the message is mount's own one line.",
            "",
            *head,
            *lines,
            "",
        ]
    )
    print(report)
    if not args.no_write:
        Path(args.out).write_text(report)
    return 0 if all(r.green for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
