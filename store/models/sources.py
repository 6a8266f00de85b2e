"""Which reader opens a mount's source: safetensors checkpoint, GGUF file(s), FP8 or MXFP4
checkpoint.

Scope: dispatch only. :func:`open_checkpoint` returns an object with the
:class:`~store.models.checkpoint.Checkpoint` interface (HF names, float
dtypes) and :func:`make_source` the matching
:class:`~store.models.mount_source.MountSource` (the bytes that are stored).
A source whose format needs a conversion (a GGUF type without a native store
format, FP8 or MXFP4 weights) is converted only under the ``convert`` policy the
caller names; without one it is refused with a typed error. A store quant
policy (``--quant``) on a quantized GGUF requantizes only when the caller allows
it (``allow_requantize``, the CLI's ``--allow-requantize``); on a float GGUF that
flag changes nothing (there is nothing to requantize), on any other source it is
refused.
"""

from __future__ import annotations

import os
from typing import Any

from czyx.store.models.checkpoint import Checkpoint
from czyx.store.models.mount_source import MountSource


def open_checkpoint(path: str | os.PathLike[str], convert: str | None = None) -> Any:
    """Open ``path`` with the reader its format needs (see the module docstring)."""
    from czyx.store.models.gguf_source import GGUFCheckpoint, is_gguf

    if is_gguf(path):
        return GGUFCheckpoint(path, convert or "native")
    from czyx.store.models.fp8 import FP8Checkpoint, has_fp8

    if has_fp8(path):
        return FP8Checkpoint(path, convert)
    from czyx.store.models.mxfp4 import MXFP4Checkpoint, has_mxfp4

    if has_mxfp4(path):
        return MXFP4Checkpoint(path, convert)
    if convert not in (None, "native"):
        from czyx.store.models.gguf import ConversionPolicyError

        raise ConversionPolicyError(
            f"--convert {convert}: {path} holds no tensor that needs converting"
        )
    return Checkpoint(path)


def make_source(
    ckpt: Any,
    plan: Any,
    quant: Any = None,
    spool_dir: Any = None,
    spool: bool = True,
    allow_requantize: bool = False,
) -> MountSource:
    """The :class:`MountSource` of an opened checkpoint (``quant``: a ``QuantCodec``;
    ``spool_dir``: where a quantizing source keeps its spool file; ``spool=False``:
    keep none, the caller stores each tensor's bytes as they are made;
    ``allow_requantize``: let ``quant`` requantize a quantized GGUF's tensors)."""
    from czyx.store.models.fp8 import FP8Checkpoint, FP8MountSource
    from czyx.store.models.gguf_source import GGUFCheckpoint, GGUFMountSource

    if allow_requantize and not isinstance(ckpt, GGUFCheckpoint):
        from czyx.store.models.gguf import ConversionPolicyError

        raise ConversionPolicyError(
            "--allow-requantize is for a quantized GGUF file; this source is not one"
        )
    if isinstance(ckpt, FP8Checkpoint):
        if quant is not None:
            from czyx.store.models.gguf import ConversionPolicyError

            raise ConversionPolicyError(
                "--quant on an FP8 checkpoint: use --convert q8|q4 (the drift is then reported)"
            )
        return FP8MountSource(ckpt, plan)
    from czyx.store.models.mxfp4 import MXFP4Checkpoint, MXFP4MountSource

    if isinstance(ckpt, MXFP4Checkpoint):
        if quant is not None:
            from czyx.store.models.gguf import ConversionPolicyError

            raise ConversionPolicyError(
                "--quant on an MXFP4 checkpoint: use --convert q8|q4 (the drift is then reported)"
            )
        return MXFP4MountSource(ckpt, plan)
    if isinstance(ckpt, GGUFCheckpoint):
        if quant is None:
            return GGUFMountSource(ckpt, plan)
        if any(
            v.tensor_type.name not in ("F32", "F16", "BF16") for v, _ in ckpt.gguf_tensors.values()
        ):
            from czyx.store.models.gguf import ConversionPolicyError

            if not allow_requantize:
                raise ConversionPolicyError(
                    "--quant on a quantized GGUF would requantize its quantized tensors: "
                    "add --allow-requantize (lossy, drift recorded), or use --convert q8|q4 "
                    "(or mount the float GGUF)"
                )
            return GGUFMountSource(ckpt, plan, requant=quant)
        src = MountSource(ckpt, plan, quant, spool_dir=spool_dir, spool=spool)
        src.tokenizer = None if ckpt.tokenizer_json is None else ckpt.tokenizer_json.encode()
        return src
    return MountSource(ckpt, plan, quant, spool_dir=spool_dir, spool=spool)


def conversion_report(src: MountSource) -> list[str]:
    """Lines describing what a mount converted (empty when nothing was)."""
    conv = getattr(src, "conversion", None)
    return [] if conv is None else conv.report()
