"""Recall of the streaming cache's expert predictors, offline, on the bundled model.

Runs the trained czyx-moe-stdlib (mounted into a temporary store, all
experts resident) over stdlib text and, at every token and sparse layer,
compares the experts the router chose with three predictions:

- look-ahead: layer L's router on layer L-1's routed hidden state (what
  :meth:`inference.streaming.StreamingExpertCache.lookahead` uses);
- early routing: layer L's router on the pre-MLP norm of the residual stream
  entering L, before L's attention (:meth:`~inference.streaming.StreamingExpertCache.preroute`);
- their union.

Recall is the fraction of chosen experts predicted; "predicted per needed" is
how many distinct experts a prediction reads per chosen one (its cost).
No timing: these are properties of the model and the predictors.

    python bench/bench_predictors.py [--tokens 512] [--widths 2 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from czyx.inference.cache import ExpertCache  # noqa: E402
from czyx.inference.kernels.linear import mm_t, take_rows  # noqa: E402
from czyx.inference.models import decoder_class  # noqa: E402
from czyx.inference.models.base import rms_norm, route_topk  # noqa: E402
from czyx.store import Store  # noqa: E402
from czyx.store.models.model import open_model  # noqa: E402
from czyx.store.models.mount import mount  # noqa: E402

MODEL = ROOT / "inference" / "assets" / "czyx-moe-stdlib"


def trace(model, tokens: list[int]) -> list[dict]:
    """Per token: the residual stream entering each layer, each layer's router input
    and its chosen experts (the decoder's own loop, observed)."""
    cfg = model.cfg
    kv = model.new_kv(len(tokens) + 8)
    out = []
    for pos, tok in enumerate(tokens):
        h = take_rows(model.embed, np.array([tok]))
        rec: dict = {"pre": [], "x": [], "chosen": []}
        positions = np.arange(pos, pos + 1)
        for i, lw in enumerate(model.layers):
            rec["pre"].append(h)
            h = h + model._attention(
                i, lw, rms_norm(h, lw.input_norm, cfg.rms_eps), kv, pos, positions
            )
            x = rms_norm(h, lw.post_attn_norm, cfg.rms_eps)
            idx, _ = route_topk(mm_t(x, lw.router), cfg.top_k, cfg.renormalize)
            rec["x"].append(x)
            rec["chosen"].append(set(idx[0].tolist()))
            h = h + model._mlp(i, lw, x)
        kv.length = pos + 1
        out.append(rec)
    return out


def recall(model, records: list[dict], width: int) -> dict[str, tuple[np.ndarray, float]]:
    """Per predictor: recall per layer and distinct experts predicted per chosen one."""
    cfg = model.cfg
    n = cfg.n_layers

    def top(layer: int, v: np.ndarray) -> set[int]:
        return set(np.argsort(-mm_t(v, model.layers[layer].router)[0])[:width].tolist())

    hits = {k: np.zeros(n) for k in ("look-ahead", "early", "union")}
    reads = dict.fromkeys(hits, 0)
    total = np.zeros(n)
    for rec in records:
        for i in range(n):
            lw = model.layers[i]
            early = top(i, rms_norm(rec["pre"][i], lw.post_attn_norm, cfg.rms_eps))
            ahead = top(i, rec["x"][i - 1]) if i > 0 else set()
            for name, pred in (("look-ahead", ahead), ("early", early), ("union", ahead | early)):
                hits[name][i] += len(pred & rec["chosen"][i])
                reads[name] += len(pred)
            total[i] += cfg.top_k
    return {k: (hits[k] / total, reads[k] / total.sum()) for k in hits}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="bytes of os.py to run")
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 3], help="experts predicted")
    args = ap.parse_args()
    text = list(Path(os.__file__).read_bytes()[: args.tokens])
    with tempfile.TemporaryDirectory() as d, Store.open(Path(d) / "store") as st:
        mount(st, MODEL, "stdlib@bench")
        with open_model(st, "stdlib@bench") as consumer:
            cls = decoder_class(consumer.info.arch)
            cfg = cls.parse_config(consumer.info)
            slot = consumer.info.expert_slot_nbytes
            cache = ExpertCache(consumer, cfg.n_sparse_experts * slot, cfg.top_k)
            model = cls(consumer, cache)
            records = trace(model, text)
            print(f"czyx-moe-stdlib, {len(text)} bytes of os.py, top-{cfg.top_k} routing")
            print("| predictor | width | recall (all layers) | per layer | predicted per needed |")
            print("|---|---|---|---|---|")
            for width in args.widths:
                for name, (per_layer, cost) in recall(model, records, width).items():
                    # Look-ahead has nothing to predict the first layer from.
                    mean = per_layer[1:].mean() if name == "look-ahead" else per_layer.mean()
                    scope = " (layers 1+)" if name == "look-ahead" else ""
                    layers = " ".join(f"{r:.2f}" for r in per_layer)
                    print(f"| {name} | {width} | {mean:.3f}{scope} | {layers} | {cost:.2f} |")
            cache.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
