"""Quality of a quantized model against its float reference, on held-out text.

Scope: the three measurements of the quantization issue, computed from the
all-position logits of two engines over the same token windows: mean
per-token negative log-likelihood (and its drift from the reference), mean KL
divergence ``KL(ref || quant)`` of the next-token distribution, and top-1
agreement. Building the engines (policy, calibration) is the caller's.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: The shipped model's validation rule (``tools/train_moe.py``, ``--val-fraction 0.05``):
#: a stdlib file is validation when ``sha256(relative path)[0] < 13``.
VAL_THRESHOLD = round(256 * 0.05)


@dataclass(frozen=True)
class Quality:
    """Per-token averages over every predicted position of the evaluated windows."""

    n_tokens: int
    nll_ref: float
    nll: float
    kl: float
    top1: float

    @property
    def nll_drift(self) -> float:
        """Mean NLL of the quantized model minus that of the reference (nats/token)."""
        return self.nll - self.nll_ref


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare_logits(ref: np.ndarray, test: np.ndarray, targets: np.ndarray) -> Quality:
    """Quality of ``test`` against ``ref`` logits ``[T, V]`` predicting ``targets [T]``."""
    lr, lt = _log_softmax(ref), _log_softmax(test)
    idx = np.arange(targets.size)
    pr = np.exp(lr)
    return Quality(
        n_tokens=int(targets.size),
        nll_ref=float(-lr[idx, targets].mean()),
        nll=float(-lt[idx, targets].mean()),
        kl=float((pr * (lr - lt)).sum(axis=-1).mean()),
        top1=float((lr.argmax(-1) == lt.argmax(-1)).mean()),
    )


def stdlib_split() -> tuple[list[Path], list[Path]]:
    """``(training files, validation files)`` of this interpreter's standard library,
    split as the shipped model was trained (so held-out text is text it never saw)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )
    train, val = [], []
    for f in files:
        (val if hashlib.sha256(f.encode()).digest()[0] < VAL_THRESHOLD else train).append(root / f)
    return train, val


def text_windows(
    encode: object, files: Sequence[str | Path], length: int, limit: int
) -> list[np.ndarray]:
    """Non-overlapping windows of ``length`` token ids from the files, at most ``limit``.

    ``encode`` is a tokenizer's ``encode(str) -> list[int]``.
    """
    out: list[np.ndarray] = []
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        ids = np.asarray(encode(text), np.int64)  # type: ignore[operator]
        for s in range(0, ids.size - length + 1, length):
            out.append(ids[s : s + length])
            if len(out) == limit:
                return out
    return out


def window_logits(engine: object, windows: Sequence[np.ndarray]) -> list[np.ndarray]:
    """All-position logits ``[T, V]`` of ``engine`` on each window, each from an empty cache."""
    out = []
    for w in windows:
        engine.reset()  # type: ignore[attr-defined]
        out.append(np.asarray(engine.prefill(np.asarray(w, np.int64), all_logits=True)))  # type: ignore[attr-defined]
    engine.reset()  # type: ignore[attr-defined]
    return out


def evaluate(
    ref_logits: Sequence[np.ndarray], engine: object, windows: Sequence[np.ndarray]
) -> Quality:
    """Quality of ``engine`` on ``windows`` against precomputed reference logits.

    Position ``t`` of a window predicts token ``t + 1``; the last position of
    each window has no target and is skipped.
    """
    test = window_logits(engine, windows)
    r = np.concatenate([a[:-1] for a in ref_logits])
    q = np.concatenate([a[:-1] for a in test])
    tg = np.concatenate([np.asarray(w, np.int64)[1:] for w in windows])
    return compare_logits(r, q, tg)
