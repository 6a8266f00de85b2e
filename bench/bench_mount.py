"""Mount throughput against a plain copy of the same bytes, measured in the same run.

Builds a synthetic Qwen3-MoE-shaped bf16 checkpoint (random bytes, valid
config and safetensors, ~256 MB by default; ``--size-mb 1536`` for the issue's
1-2 GB) and times, per repetition, each on a fresh target in the same
directory:

* ``copy+fsync`` (the baseline): ``shutil.copyfile`` of every checkpoint file
  plus ``fsync`` (mount makes its block files durable before publishing, so
  both pay for durability); ``copy``: the same without ``fsync``;
* ``mount``: ``store.mount.mount`` into a fresh store (validate, BLAKE3 every
  tensor for the content selector, write the trunk and expert spaces, fsync,
  publish, tag);
* ``remount``: mounting the same checkpoint again into that store (hash only,
  nothing written).

Each figure is the median over ``--reps``, printed in GB/s of checkpoint
bytes and as a ratio to copy+fsync. ``os.sync()`` runs before each timing and
the order alternates between repetitions. The page cache is warm for all of them
(the checkpoint was just written), so the numbers compare CPU and write
paths, not cold reads. No BLAS is involved.

Usage: ``python bench/bench_mount.py [--size-mb 256] [--reps 3] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from czyx.store import Store
from czyx.store.models.checkpoint import write_safetensors
from czyx.store.models.mount import mount

HIDDEN, INTER, EXPERTS, HEADS, KV, HEAD_DIM, VOCAB = 1024, 512, 16, 8, 2, 128, 4096


def build_checkpoint(path: Path, size_mb: int, seed: int = 0) -> int:
    """Write a synthetic bf16 Qwen3-MoE checkpoint of about ``size_mb`` MB; return its bytes."""
    per_expert = 3 * INTER * HIDDEN * 2
    attn = (2 * HEADS * HEAD_DIM * HIDDEN + 2 * KV * HEAD_DIM * HIDDEN) * 2
    per_layer = EXPERTS * per_expert + attn + EXPERTS * HIDDEN * 2
    fixed = 2 * VOCAB * HIDDEN * 2
    layers = max(1, round((size_mb * 1e6 - fixed) / per_layer))
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    config = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "moe_intermediate_size": INTER,
        "intermediate_size": 4 * INTER,
        "num_experts": EXPERTS,
        "num_experts_per_tok": 2,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))

    def t(*shape: int) -> tuple[str, tuple[int, ...], np.ndarray]:
        return ("BF16", shape, rng.integers(0, 1 << 16, size=shape, dtype=np.uint16))

    tensors = {"model.embed_tokens.weight": t(VOCAB, HIDDEN), "model.norm.weight": t(HIDDEN)}
    tensors["lm_head.weight"] = t(VOCAB, HIDDEN)
    for l in range(layers):
        p = f"model.layers.{l}."
        tensors[p + "input_layernorm.weight"] = t(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = t(HIDDEN)
        tensors[p + "self_attn.q_proj.weight"] = t(HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = t(KV * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = t(KV * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = t(HIDDEN, HEADS * HEAD_DIM)
        tensors[p + "self_attn.q_norm.weight"] = t(HEAD_DIM)
        tensors[p + "self_attn.k_norm.weight"] = t(HEAD_DIM)
        tensors[p + "mlp.gate.weight"] = t(EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            tensors[q + "gate_proj.weight"] = t(INTER, HIDDEN)
            tensors[q + "up_proj.weight"] = t(INTER, HIDDEN)
            tensors[q + "down_proj.weight"] = t(HIDDEN, INTER)
    write_safetensors(path / "model.safetensors", tensors, {"format": "pt"})
    return sum(f.stat().st_size for f in path.iterdir())


def timed_copy(src: Path, dst: Path, *, durable: bool) -> float:
    """Copy every file of ``src`` into ``dst`` (then fsync them if ``durable``); seconds."""
    t0 = time.perf_counter()
    dst.mkdir()
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)
        if durable:
            fd = os.open(dst / f.name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=256, help="checkpoint size (default 256)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="czyx-bench-mount-", dir=args.dir))
    try:
        src = work / "ckpt"
        nbytes = build_checkpoint(src, args.size_mb)
        runs: dict[str, list[float]] = {"copy": [], "copy+fsync": [], "mount": [], "remount": []}
        for rep in range(args.reps):
            # Alternate the order and flush dirty pages before each timing, so no
            # method pays for another's write-back.
            order = ["copy", "copy+fsync", "mount"]
            for name in order if rep % 2 == 0 else order[::-1]:
                os.sync()
                if name.startswith("copy"):
                    dst = work / f"{name}{rep}"
                    runs[name].append(timed_copy(src, dst, durable=name == "copy+fsync"))
                    shutil.rmtree(dst)
                    continue
                with Store.open(work / f"store{rep}") as store:
                    t0 = time.perf_counter()
                    res = mount(store, src, "bench@1")
                    runs["mount"].append(time.perf_counter() - t0)
                    os.sync()
                    t0 = time.perf_counter()
                    again = mount(store, src, "bench@1")
                    runs["remount"].append(time.perf_counter() - t0)
                    assert res.created and not again.created and again.selector == res.selector
                shutil.rmtree(work / f"store{rep}")
        print(
            f"checkpoint: {nbytes / 1e6:.1f} MB, bf16, {res.tensors} tensors "
            f"({args.reps} reps, medians; page cache warm; cpus={os.cpu_count()})"
        )
        print(f"last mount: {res.summary()}")
        base = statistics.median(runs["copy+fsync"])
        for name, times in runs.items():
            med = statistics.median(times)
            print(
                f"{name:>11}: {med:7.3f} s  {nbytes / med / 1e9:6.2f} GB/s  "
                f"{base / med:5.2f}x copy+fsync throughput"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
