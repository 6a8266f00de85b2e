"""Record a routing trace of any transformers MoE checkpoint on a text file.

Usage::

    python tools/trace_hf.py MODEL_DIR --text FILE --out TRACE.npz [--window 256]

Scope: the transformers-side producer of :mod:`inference.trace` files (the
engine's own ``czyx profile`` writes the same format). Tokenises with the
checkpoint's tokenizer when it has one, else as bytes (vocab 256, like the
bundled model); the text is cut into ``--window``-token windows, each run from
an empty context and recorded as one segment.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", help="a local transformers checkpoint directory")
    ap.add_argument("--text", required=True, help="text file to run")
    ap.add_argument("--out", required=True, help="trace file to write (.npz)")
    ap.add_argument("--window", type=int, default=256, help="tokens per window")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from czyx.inference.trace import text_sha256, trace_hf_model

    torch.set_num_threads(args.threads)
    data = Path(args.text).read_bytes()
    model_dir = Path(args.model)
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_dir)(data.decode("utf-8"))["input_ids"]
    else:
        ids = list(data)
    w = args.window
    windows = [ids[i : i + w] for i in range(0, len(ids), w)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trace = trace_hf_model(
        model, windows, model_id=model_dir.name, text_sha256=text_sha256(data), batch_size=8
    )
    trace.save(args.out)
    print(f"{args.out}: {trace.n_tokens} tokens x {trace.n_layers} layers, top-{trace.top_k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
