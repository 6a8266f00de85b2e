"""MXFP4 safetensors checkpoints (GPT-OSS's ``*_blocks`` / ``*_scales`` experts), converted.

Scope: the layout GPT-OSS publishes and transformers' ``integrations/mxfp4.py``
reads. A stacked expert tensor ``P`` (``gate_up_proj``, ``down_proj``) is
stored as ``P_blocks [E, R, G, 16]`` uint8 (two FP4 E2M1 codes per byte, the
low nibble first, 32 values per block) and ``P_scales [E, R, G]`` uint8 (E8M0
exponents, bias 127). The reference value of row ``r``, column ``32 g + j``
is ``E2M1[code] * 2**(scale - 127)`` in float32, and the float tensor is that
``[E, R, 32 G]`` array transposed to ``[E, 32 G, R]``: exactly transformers'
``convert_moe_packed_tensors`` (the in-memory ``gate_up_proj [E, H, 2I]`` and
``down_proj [E, I, H]``), after which GPT-OSS's usual expert transform
(:mod:`store.models.expert_transform`) applies.

The E2M1 table is the ``gguf`` package's MXFP4 ``kvalues`` halved (GGUF keeps
them doubled with a halved E8M0 scale, so the values are the same); the
nibble order differs (GGUF: low nibbles are the block's first 16 values), so
GGUF's dequantizer is not reused, only its table is checked against in tests.

The store has no MXFP4 format with a kernel, so a mount converts, and only
under a named policy (:data:`POLICIES`), as for FP8 (:mod:`store.models.fp8`):
``f32`` keeps the reference values exactly; ``bf16`` also does for every
scale in bf16's normal range (an E2M1 value has at most 2 significant bits),
``f16`` rounds what falls outside f16's range; ``q8``/``q4`` requantize with
the store's quantizer (group 32). Every converted expert part's drift
(relative RMS error, max abs error, aggregated per layer and part) is
recorded in the manifest's ``quant.converted`` and printed by the CLI.
Without a policy an MXFP4 checkpoint is refused.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

from czyx.store.models.checkpoint import DTYPES, TensorInfo
from czyx.store.models.converted import ConvertedCheckpoint
from czyx.store.models.expert_transform import to_contract
from czyx.store.models.gguf_source import Drift, DriftConversion, _to_bf16
from czyx.store.models.mount_errors import (
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
)
from czyx.store.models.mount_source import MountSource
from czyx.store.quant.extent import ExpertLayout
from czyx.store.quant.formats import dequantize, get_format, quantize

POLICIES = ("f32", "bf16", "f16", "q8", "q4")
_FLOAT = {"f32": "F32", "bf16": "BF16", "f16": "F16"}
_BLOCKS, _SCALES = "_blocks", "_scales"

#: FP4 E2M1 values of the 16 codes (sign bit 3), as transformers' ``FP4_VALUES``.
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
# 2**(s - 127) for every E8M0 byte, in float32 (2**128 overflows to inf, as torch.ldexp does).
with np.errstate(over="ignore"):
    _POW2 = np.float32(2.0) ** (np.arange(256, dtype=np.float32) - np.float32(127))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 tensor of ``blocks [*P, R, G, 16]`` and ``scales [*P, R, G]`` (uint8).

    Returns ``[*P, 32 G, R]`` (the last two axes transposed), as transformers does.

    Raises
    ------
    ShapeMismatchError
        ``scales`` does not match ``blocks``' leading axes, or a block is not 16 bytes.
    """
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ShapeMismatchError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match"
        )
    *prefix, r, g, _ = blocks.shape
    b = np.asarray(blocks, np.uint8)
    vals = np.empty((*prefix, r, g, 32), np.float32)
    vals[..., 0::2] = E2M1[b & 0x0F]
    vals[..., 1::2] = E2M1[b >> 4]
    with np.errstate(over="ignore"):  # as torch: a value past float32's range is inf
        vals *= _POW2[np.asarray(scales, np.uint8)][..., None]
    return np.ascontiguousarray(vals.reshape(*prefix, r, g * 32).swapaxes(-1, -2))


def _header(f: Path) -> dict | None:
    if not stat.S_ISREG(os.stat(f).st_mode):
        return None
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return None
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            return None
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return None  # the checkpoint reader reports it properly
    return header if isinstance(header, dict) else None


def has_mxfp4(path: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint directory holds a ``*_blocks`` / ``*_scales`` uint8 pair
    (read from the safetensors headers only)."""
    p = Path(path)
    if not p.is_dir():
        return False
    names: dict[str, Any] = {}
    for f in sorted(p.glob("*.safetensors")):
        header = _header(f)
        if header is None:
            return False
        names.update(header)
    return any(
        n.endswith(_BLOCKS)
        and isinstance(e, dict)
        and e.get("dtype") == "U8"
        and n[: -len(_BLOCKS)] + _SCALES in names
        for n, e in names.items()
    )


class MXFP4Checkpoint(ConvertedCheckpoint):
    """An MXFP4 checkpoint seen as its float checkpoint (module docstring).

    Raises
    ------
    ConversionPolicyError
        No (or an unknown) conversion policy.
    MissingTensorError, UnexpectedTensorError, ShapeMismatchError
        Blocks without scales (or the reverse), blocks that are not 4-D uint8.
    """

    def __init__(self, path: str | os.PathLike[str], policy: str | None) -> None:
        self._open_inner(path, policy, POLICIES, "MXFP4 weights (*_blocks/*_scales)")
        names = set(self.inner.names())
        #: float name -> (blocks name, scales name)
        self.mx: dict[str, tuple[str, str]] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for n in self.inner.names():
            info = self.inner.info(n)
            if n.endswith(_SCALES) and n[: -len(_SCALES)] + _BLOCKS not in names:
                raise UnexpectedTensorError(
                    "MXFP4 scales without their blocks", file=str(info.file), tensor=n
                )
            if not n.endswith(_BLOCKS):
                continue
            base = n[: -len(_BLOCKS)]
            if base + _SCALES not in names:
                raise MissingTensorError(
                    "MXFP4 blocks without their scales", file=str(info.file), tensor=n
                )
            sinfo = self.inner.info(base + _SCALES)
            if (
                info.dtype != "U8"
                or sinfo.dtype != "U8"
                or len(info.shape) != 4
                or info.shape[-1] != 16
                or tuple(sinfo.shape) != tuple(info.shape[:-1])
            ):
                raise ShapeMismatchError(
                    f"MXFP4 blocks {info.dtype}{list(info.shape)} and scales "
                    f"{sinfo.dtype}{list(sinfo.shape)}: expected U8 [E, R, G, 16] and [E, R, G]",
                    file=str(info.file),
                    tensor=n,
                )
            if base in names:
                raise UnexpectedTensorError(
                    "both a float tensor and its MXFP4 blocks", file=str(info.file), tensor=base
                )
            e, r, g, _ = info.shape
            self.mx[base] = (n, base + _SCALES)
            self._shape[base] = (e, 32 * g, r)
        self._names = []
        for n in self.inner.names():
            if n.endswith(_BLOCKS) and n[: -len(_BLOCKS)] in self.mx:
                self._names.append(n[: -len(_BLOCKS)])
            elif not (n.endswith(_SCALES) and n[: -len(_SCALES)] in self.mx):
                self._names.append(n)

    def dtype_of(self, name: str) -> str:
        """The dtype readers see for ``name``."""
        if name not in self.mx:
            return self.inner.info(name).dtype
        return _FLOAT.get(self.policy, "F32")

    def reference_experts(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Reference float32 values of experts ``lo:hi`` of MXFP4 tensor ``name``."""
        b, s = self.mx[name]
        return dequantize_mxfp4(self.inner.array(b)[lo:hi], self.inner.array(s)[lo:hi])

    def reference_range(self, name: str, first: int, count: int) -> np.ndarray:
        """Reference float32 elements ``first:first+count`` of the flattened tensor ``name``."""
        per = int(np.prod(self._shape[name][1:]))
        lo, hi = first // per, -(-(first + count) // per)
        flat = self.reference_experts(name, lo, hi).reshape(-1)
        return flat[first - lo * per : first - lo * per + count]

    def reference(self, name: str) -> np.ndarray:
        """The reference float32 tensor ``name``."""
        return self.reference_experts(name, 0, self._shape[name][0])

    def names(self) -> list[str]:
        """Tensor names (blocks and scales as their float tensor), in file order."""
        return list(self._names)

    def info(self, name: str) -> TensorInfo:
        """:class:`TensorInfo` with the dtype and shape readers see."""
        if name not in self.mx:
            return self.inner.info(name)
        info = self.inner.info(self.mx[name][0])
        dt = self.dtype_of(name)
        n = int(np.prod(self._shape[name])) * DTYPES[dt][1]
        return TensorInfo(
            name, info.file, dt, self._shape[name], info.offset, n, info.begin, info.begin + n
        )

    def _cast(self, ref: np.ndarray) -> np.ndarray:
        dt = _FLOAT.get(self.policy, "F32")
        return ref if dt == "F32" else ref.astype(np.float16) if dt == "F16" else _to_bf16(ref)

    def array(self, name: str) -> np.ndarray:
        """``name`` in :meth:`dtype_of` (bf16 as uint16 bits)."""
        if name not in self.mx:
            return self.inner.array(name)
        return self._cast(self.reference(name))

    def raw(self, name: str) -> memoryview:
        """Bytes of :meth:`array`."""
        return memoryview(np.ascontiguousarray(self.array(name)).reshape(-1).view(np.uint8))

    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        """Copy bytes of :meth:`raw` from ``start`` into ``out`` (only the experts it spans
        are dequantized)."""
        if name not in self.mx:
            self.inner.read_into(name, start, out)
            return
        item = DTYPES[self.dtype_of(name)][1]
        first, end = start // item, -(-(start + out.nbytes) // item)
        data = self._cast(self.reference_range(name, first, end - first)).view(np.uint8)
        skip = start - first * item
        out.reshape(-1).view(np.uint8)[:] = data[skip : skip + out.nbytes]

    def conversion_facts(self) -> dict[str, Any]:
        """The source format: MXFP4 (E2M1 blocks of 32, E8M0 scales)."""
        return {"from": "MXFP4 (E2M1 blocks of 32, E8M0 scales)", "block": 32}


class MXFP4Conversion(DriftConversion):
    """The manifest's ``quant`` section of an MXFP4 mount (drift: experts per layer and part)."""

    def __init__(self, policy: str, expert_fmt: str) -> None:
        super().__init__(expert_fmt)
        self.policy = policy

    @property
    def policy_label(self) -> str:
        """``mxfp4:<policy>``."""
        return f"mxfp4:{self.policy}"


class MXFP4MountSource(MountSource):
    """Stored bytes of an MXFP4 checkpoint under its policy (experts converted, the
    rest as stored)."""

    def __init__(self, ckpt: MXFP4Checkpoint, plan: Any) -> None:
        super().__init__(ckpt, plan)  # type: ignore[arg-type]
        self.fmt = None if ckpt.policy in _FLOAT else ckpt.policy
        if self.fmt is not None:
            self.qlayout = ExpertLayout(get_format(self.fmt), plan.inter, plan.hidden)
            self.expert_nbytes = self.qlayout.nbytes
            self.buf = np.empty(self.expert_nbytes, np.uint8)
        self.conversion = MXFP4Conversion(ckpt.policy, self.fmt or plan.expert_format)
        self.codec = self.conversion
        self._seen: set[tuple[int, int]] = set()

    def _reference(self, key: tuple[int, int]) -> np.ndarray:
        """Expert ``key``'s reference float32 values, gate | up | down (the contract)."""
        plan, ck = self.plan, self.ckpt
        item = DTYPES[plan.dtype][1]
        parts = []
        for p in plan.experts[key]:
            n = p.nbytes // item
            if p.tensor in ck.mx:
                parts.append(ck.reference_range(p.tensor, p.start // item, n))
            else:
                raise UnexpectedTensorError(
                    "float experts beside MXFP4 experts in one checkpoint", tensor=p.tensor
                )
        ref = np.concatenate(parts)
        if plan.expert_transform is not None:
            ref = to_contract(
                ref.view(np.uint8), plan.inter, plan.hidden, 4, plan.expert_transform
            ).view(np.float32)
        return ref

    def stored_tensor(self, t: Any) -> tuple[np.ndarray, str | None]:
        """Trunk tensors as stored (only the routed experts are MXFP4)."""
        return self.tensor(t.tensor), None

    def assemble(self, key: tuple[int, int], out: np.ndarray) -> None:
        """Expert ``key``'s extent as stored (drift recorded on its first read)."""
        first = key not in self._seen
        self._seen.add(key)
        inter, hidden = self.plan.inter, self.plan.hidden
        ref = self._reference(key)
        n = inter * hidden
        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
        pos = 0
        for i, (part, shape) in enumerate(zip(("gate", "up", "down"), shapes, strict=True)):
            r = ref[i * n : (i + 1) * n].reshape(shape)
            if self.fmt is None:
                stored = self.ckpt._cast(r)
                data = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
                got = _as_f32(stored, self.plan.dtype)
            else:
                data = quantize(r, self.fmt)
                got = dequantize(data, self.fmt, shape) if first else None
            if first:
                d = self.conversion.drift.setdefault(
                    f"model.layers.{key[0]}.experts.*.{part}",
                    Drift("MXFP4", self.fmt or self.plan.dtype.lower()),
                )
                d.add(got, r)
            out[pos : pos + data.size] = data
            pos += data.size
        if pos != out.size:
            raise ShapeMismatchError(f"expert {key}: {pos} bytes assembled, extent has {out.size}")


def _as_f32(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return arr
    if dtype == "F16":
        return arr.astype(np.float32)
    return (arr.astype(np.uint32) << 16).view(np.float32)
