"""FP8 block-scaled checkpoints (``F8_E4M3`` weights with ``weight_scale_inv``), converted at mount.

Placeholder until the converter lands: :func:`has_fp8` detects such a checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

FP8_DTYPES = ("F8_E4M3",)


def has_fp8(path: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint directory holds ``F8_E4M3`` tensors (read from the headers only)."""
    p = Path(path)
    if not p.is_dir():
        return False
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                return False
            try:
                header = json.loads(fh.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError):
                return False  # the checkpoint reader reports it properly
        if isinstance(header, dict) and any(
            isinstance(e, dict) and e.get("dtype") in FP8_DTYPES for e in header.values()
        ):
            return True
    return False


class FP8Checkpoint:  # replaced by the converter
    def __init__(self, path: str | os.PathLike[str], convert: str | None) -> None:
        from czyx.store.models.gguf import ConversionPolicyError

        raise ConversionPolicyError(f"{path}: FP8 weights are not supported yet")
