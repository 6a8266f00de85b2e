"""Train the small byte-level Mixtral-format MoE that czyx ships as package data.

Scope: one self-contained, seeded training run of ``transformers``'
``MixtralForCausalLM`` (vocab 256: one token per byte) on the Python standard
library's own ``.py`` source, plus the reference compressors measured on the
same validation bytes, the save (fp16 safetensors + config.json), a reload
check and the training log. Nothing here is imported by the ``czyx`` packages;
torch and transformers come from the ``ref`` extra.

Data: every ``*.py`` under the running interpreter's stdlib directory
(``sysconfig.get_paths()["stdlib"]``), ``site-packages`` excluded, sorted by
path relative to that directory. A file is validation when the first byte of
``sha256(relative_path)`` is below ``256 * val_fraction`` (a split by path hash,
stable across machines and file-system orders), train otherwise. Training
windows start at offsets drawn from a seeded ``torch.Generator`` over the
concatenated training bytes; validation is the first ``--val-bytes`` bytes of
the concatenated validation files, scored with overlapping windows so every
scored byte sees at least ``seq_len / 2`` bytes of context.

Usage (the shipped checkpoint)::

    python tools/train_moe.py --steps N --out inference/assets/czyx-moe-stdlib

``--probe K`` times K steps and exits (used to size ``--steps`` to a budget).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import os
import platform
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Corpus:
    """Train and validation bytes of the stdlib corpus, with the split's provenance."""

    train: np.ndarray  # uint8, concatenated training files
    val: np.ndarray  # uint8, concatenated validation files (whole, before --val-bytes)
    n_train_files: int
    n_val_files: int
    stdlib_dir: str
    val_rule: str


def load_corpus(val_fraction: float) -> Corpus:
    """Read the stdlib ``.py`` files, sorted, and split them by a hash of the path.

    Parameters
    ----------
    val_fraction : float
        Approximate fraction of files routed to validation (in 1/256 steps).

    Returns
    -------
    Corpus
        The two byte streams and how they were made.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    threshold = round(256 * val_fraction)
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for rel in files:
        data = (root / rel).read_bytes()
        if hashlib.sha256(rel.encode()).digest()[0] < threshold:
            val_parts.append(data)
        else:
            train_parts.append(data)
    return Corpus(
        train=np.frombuffer(b"".join(train_parts), dtype=np.uint8),
        val=np.frombuffer(b"".join(val_parts), dtype=np.uint8),
        n_train_files=len(train_parts),
        n_val_files=len(val_parts),
        stdlib_dir=str(root),
        val_rule=f"sha256(relpath)[0] < {threshold} (of 256)",
    )


def baselines(val: bytes) -> dict[str, float]:
    """Bits per byte of the reference coders on exactly the validation bytes.

    The unigram figure is the empirical byte entropy of ``val`` itself (an
    oracle order-0 model: it is told the validation histogram), so it is a
    lower bound for any order-0 coder, not a fair compressor.
    """
    counts = np.bincount(np.frombuffer(val, dtype=np.uint8), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    n = len(val)
    return {
        "unigram_entropy_bpb": float(-(p * np.log2(p)).sum()),
        "zlib9_bpb": 8.0 * len(zlib.compress(val, 9)) / n,
        "xz9e_bpb": 8.0 * len(lzma.compress(val, preset=9 | lzma.PRESET_EXTREME)) / n,
    }


def make_config(args: argparse.Namespace):  # -> MixtralConfig
    """The model's architecture; everything the engine must reproduce is here."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=args.seq_len * 4,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def evaluate(model, val: np.ndarray, seq_len: int, batch: int, top_k: int, n_experts: int):
    """Validation bits/byte with half-overlapping windows, and expert usage per layer.

    Every byte after the first is scored exactly once; bytes past the first
    window are scored with at least ``seq_len // 2`` bytes of context.

    Returns
    -------
    tuple
        ``(bits_per_byte, usage)`` where ``usage`` is an ``[L, E]`` int array of
        top-k selections counted over the scored positions.
    """
    import torch

    stride = seq_len // 2
    n = len(val)
    starts = list(range(0, max(n - seq_len, 0) + 1, stride))
    if starts[-1] + seq_len < n:
        starts.append(n - seq_len)
    total_nll = 0.0
    total_count = 0
    usage = np.zeros((model.config.num_hidden_layers, n_experts), dtype=np.int64)
    prev_end = 0  # bytes [0, prev_end) are already scored (as targets)
    data = torch.from_numpy(val.astype(np.int64))
    model.eval()
    with torch.no_grad():
        for b0 in range(0, len(starts), batch):
            chunk = starts[b0 : b0 + batch]
            x = torch.stack([data[s : s + seq_len] for s in chunk])
            out = model(input_ids=x, output_router_logits=True)
            logp = torch.log_softmax(out.logits.float(), dim=-1)
            nll = -logp[:, :-1].gather(-1, x[:, 1:, None])[..., 0]  # predicts x[:, 1:]
            for row, s in enumerate(chunk):
                first_target = max(prev_end, s + 1)  # absolute index of first new target
                lo = first_target - s - 1
                if lo >= seq_len - 1:
                    continue
                total_nll += float(nll[row, lo:].sum())
                total_count += seq_len - 1 - lo
                for layer, logits in enumerate(out.router_logits):
                    sel = logits.view(len(chunk), seq_len, -1)[row, lo + 1 :].topk(top_k, -1)
                    usage[layer] += np.bincount(
                        sel.indices.reshape(-1).numpy(), minlength=n_experts
                    )
                prev_end = s + seq_len
    model.train()
    return total_nll / total_count / math.log(2), usage


def usage_summary(usage: np.ndarray) -> list[dict[str, float]]:
    """Per layer: routing entropy (bits, of the selection histogram) and top shares."""
    rows = []
    for counts in usage:
        p = counts / counts.sum()
        nz = p[p > 0]
        srt = np.sort(p)[::-1]
        rows.append(
            {
                "entropy_bits": float(-(nz * np.log2(nz)).sum()),
                "max_entropy_bits": float(np.log2(len(p))),
                "top1_share": float(srt[0]),
                "top4_share": float(srt[:4].sum()),
                "min_share": float(srt[-1]),
                "counts": counts.astype(int).tolist(),
            }
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="inference/assets/czyx-moe-stdlib")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--val-bytes", type=int, default=131072)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-bytes", type=int, default=16384, help="bytes for mid-run evals")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--probe", type=int, default=0, help="time this many steps and exit")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import MixtralForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    t_start = time.time()

    corpus = load_corpus(args.val_fraction)
    val = corpus.val[: args.val_bytes]
    ref = baselines(val.tobytes())
    print(
        f"corpus: train {len(corpus.train):,} B / {corpus.n_train_files} files, "
        f"val {len(corpus.val):,} B / {corpus.n_val_files} files; scoring {len(val):,} B",
        flush=True,
    )
    print("baselines (bits/byte): " + json.dumps({k: round(v, 4) for k, v in ref.items()}))

    config = make_config(args)
    model = MixtralForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        cos = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * cos)

    gen = torch.Generator().manual_seed(args.seed)  # the data order, independent of init
    train = torch.from_numpy(corpus.train.astype(np.int64))
    hi = len(train) - args.seq_len
    offs = torch.arange(args.seq_len)
    curve: list[dict[str, float]] = []
    n_steps = args.probe or args.steps
    t_train = time.time()
    for step in range(n_steps):
        starts = torch.randint(0, hi, (args.batch,), generator=gen)
        x = train[starts[:, None] + offs]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=x, labels=x, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        ce = float(out.loss.detach()) - args.aux_coef * float(out.aux_loss.detach())
        if step % 10 == 0 or step == n_steps - 1:
            rec = {
                "step": step,
                "lr": lr_at(step),
                "train_ce_bpb": ce / math.log(2),
                "aux_loss": float(out.aux_loss.detach()),
                "grad_norm": gnorm,
                "elapsed_s": time.time() - t_train,
            }
            if args.eval_every and step > 0 and (step % args.eval_every == 0):
                vb, _ = evaluate(
                    model, val[: args.eval_bytes], args.seq_len, 32, args.top_k, args.experts
                )
                rec["val_bpb_prefix"] = vb
            curve.append(rec)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}),
                flush=True,
            )
    train_s = time.time() - t_train
    if args.probe:
        print(f"probe: {train_s / n_steps:.3f} s/step", flush=True)
        return 0

    val_bpb, usage = evaluate(model, val, args.seq_len, 32, args.top_k, args.experts)
    print(f"final val bpb (fp32 in memory): {val_bpb:.4f}", flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    reloaded = MixtralForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    reload_bpb, _ = evaluate(reloaded, val, args.seq_len, 32, args.top_k, args.experts)
    print(f"reloaded ({args.dtype} on disk, fp32 compute) val bpb: {reload_bpb:.4f}", flush=True)

    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(out_dir.iterdir())
        if p.suffix in (".json", ".safetensors") and p.name != "training_log.json"
    }
    log = {
        "command": "python tools/train_moe.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": np.__version__,
        },
        "threads": args.threads,
        "machine": platform.machine(),
        "n_params": n_params,
        "data": {
            "stdlib_dir": corpus.stdlib_dir,
            "train_bytes": len(corpus.train),
            "train_files": corpus.n_train_files,
            "val_bytes_total": len(corpus.val),
            "val_files": corpus.n_val_files,
            "val_bytes_scored": len(val),
            "val_sha256": hashlib.sha256(val.tobytes()).hexdigest(),
            "val_rule": corpus.val_rule,
            "tokens_seen": n_steps * args.batch * args.seq_len,
        },
        "baselines_bpb": ref,
        "val_bpb": val_bpb,
        "val_bpb_reloaded": reload_bpb,
        "expert_usage": usage_summary(usage),
        "curve": curve,
        "train_wall_s": train_s,
        "total_wall_s": time.time() - t_start,
        "files": files,
    }
    (out_dir / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    from training_report import render  # tools/ is on sys.path when run as a script

    (out_dir / "TRAINING.md").write_text(render(log))
    print(f"wrote {out_dir} in {time.time() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
