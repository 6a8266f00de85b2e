"""FP8 block-scaled checkpoints (``F8_E4M3`` weights with ``weight_scale_inv``), converted at mount.

Scope: DeepSeek-V3's published layout: a weight ``W [R, C]`` stored as
``F8_E4M3`` codes and a ``W_scale_inv [ceil(R/b0), ceil(C/b1)]`` float32 per
block (``quantization_config.weight_block_size``, 128 x 128 by default); its
value is ``float(code) * scale_inv[i // b0, j // b1]`` computed in float32 (the
reference dequantization, as DeepSeek's own ``weight_dequant`` does).

The store has no FP8 format with a kernel, so a mount converts, and only
under a named policy (:data:`POLICIES`): ``f32`` keeps the reference values
exactly; ``bf16``/``f16`` round them; ``q8``/``q4`` requantize them with the
store's quantizer (group 32; a matrix whose column count is not a multiple of
32 is refused under those). Every converted tensor's drift against the
reference (relative RMS error, max abs error) is measured and recorded in the
manifest's ``quant.converted`` (experts aggregated per layer and part), and
printed by the CLI. Without a policy an FP8 checkpoint is refused.

:class:`FP8Checkpoint` presents the checkpoint as the float one (``*_scale_inv``
tensors absorbed, ``quantization_config`` moved into the source manifest);
:class:`FP8MountSource` writes the stored bytes.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

from czyx.store.models.checkpoint import DTYPES, TensorInfo, to_float32
from czyx.store.models.converted import ConvertedCheckpoint
from czyx.store.models.gguf_source import Drift, DriftConversion, _to_bf16
from czyx.store.models.mount_errors import (
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
)
from czyx.store.models.mount_source import MountSource, side_file_bytes
from czyx.store.quant.extent import ExpertLayout
from czyx.store.quant.formats import dequantize, get_format, quantize

FP8_DTYPES = ("F8_E4M3",)
POLICIES = ("f32", "bf16", "f16", "q8", "q4")
_FLOAT = {"f32": "F32", "bf16": "BF16", "f16": "F16"}
_SCALE = ".weight_scale_inv"
_EXPERT = re.compile(r"model\.layers\.(\d+)\..*experts\.\d+\.(\w+)\.weight")


def e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 ``float8_e4m3fn`` bit patterns (0x7F/0xFF are NaN)."""
    b = np.arange(256, dtype=np.uint32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(np.float64)
    val = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    out = (sign * val).astype(np.float32)
    out[(exp == 15) & (man == 7)] = np.nan
    return out


_E4M3 = e4m3_table()


def dequantize_fp8(codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The reference float32 values of block-scaled FP8 ``codes [R, C]`` (uint8 bits)."""
    r, c = codes.shape
    b0, b1 = block
    want = (-(-r // b0), -(-c // b1))
    if scale_inv.shape != want:
        raise ShapeMismatchError(
            f"scale_inv shape {list(scale_inv.shape)}, blocks need {list(want)}"
        )
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, axis=0), b1, axis=1)[:r, :c]
    return _E4M3[codes] * scale


def has_fp8(path: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint directory holds ``F8_E4M3`` tensors (read from the headers only)."""
    p = Path(path)
    if not p.is_dir():
        return False
    for f in sorted(p.glob("*.safetensors")):
        # Only regular files (a FIFO would block); anything odd is for the
        # checkpoint reader to refuse with its typed error.
        if not stat.S_ISREG(os.stat(f).st_mode):
            return False
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                return False
            try:
                header = json.loads(fh.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                return False  # the checkpoint reader reports it properly
        if isinstance(header, dict) and any(
            isinstance(e, dict) and e.get("dtype") in FP8_DTYPES for e in header.values()
        ):
            return True
    return False


class FP8Checkpoint(ConvertedCheckpoint):
    """An FP8 block-scaled checkpoint seen as its float checkpoint (module docstring).

    Raises
    ------
    ConversionPolicyError
        No (or an unknown) conversion policy.
    MissingTensorError, UnexpectedTensorError, ShapeMismatchError
        A weight without its scale, a scale without its weight, wrong block shapes.
    """

    def __init__(self, path: str | os.PathLike[str], policy: str | None) -> None:
        self._open_inner(path, policy, POLICIES, "F8_E4M3 weights")
        block = self.quantization_config.get("weight_block_size") or [128, 128]
        self.block = (int(block[0]), int(block[1]))
        names = set(self.inner.names())
        self.fp8: dict[str, str] = {}
        for n in names:
            info = self.inner.info(n)
            if n.endswith(_SCALE):
                w = n[: -len(_SCALE)] + ".weight"
                if w not in names or self.inner.info(w).dtype not in FP8_DTYPES:
                    raise UnexpectedTensorError(
                        "a scale without an F8 weight", file=str(info.file), tensor=n
                    )
            elif info.dtype in FP8_DTYPES:
                scale = n[: -len(".weight")] + _SCALE
                if len(info.shape) != 2 or scale not in names:
                    raise MissingTensorError(
                        "F8 weight without a 2-D shape and a weight_scale_inv",
                        file=str(info.file),
                        tensor=n,
                    )
                self.fp8[n] = scale
        self._names = [n for n in self.inner.names() if not n.endswith(_SCALE)]

    def dtype_of(self, name: str) -> str:
        """The dtype readers see for ``name``."""
        if name not in self.fp8:
            return self.inner.info(name).dtype
        return _FLOAT.get(self.policy, "F32")

    def reference(self, name: str) -> np.ndarray:
        """The reference float32 values of F8 weight ``name``."""
        scale = to_float32(self.inner.array(self.fp8[name]), self.inner.info(self.fp8[name]).dtype)
        return dequantize_fp8(np.asarray(self.inner.array(name)), scale, self.block)

    def names(self) -> list[str]:
        """Tensor names (scales absorbed), in file order."""
        return list(self._names)

    def info(self, name: str) -> TensorInfo:
        """:class:`TensorInfo` with the dtype readers see."""
        info = self.inner.info(name)
        if name not in self.fp8:
            return info
        n = int(np.prod(info.shape)) * DTYPES[self.dtype_of(name)][1]
        return TensorInfo(
            name,
            info.file,
            self.dtype_of(name),
            info.shape,
            info.offset,
            n,
            info.begin,
            info.begin + n,
        )

    def array(self, name: str) -> np.ndarray:
        """``name`` in :meth:`dtype_of` (bf16 as uint16 bits)."""
        if name not in self.fp8:
            return self.inner.array(name)
        ref = self.reference(name)
        dt = self.dtype_of(name)
        return ref if dt == "F32" else ref.astype(np.float16) if dt == "F16" else _to_bf16(ref)

    def raw(self, name: str) -> memoryview:
        """Bytes of :meth:`array`."""
        return memoryview(np.ascontiguousarray(self.array(name)).reshape(-1).view(np.uint8))

    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        """Copy bytes of :meth:`raw` from ``start`` into ``out``."""
        if name not in self.fp8:
            self.inner.read_into(name, start, out)
            return
        data = np.ascontiguousarray(self.array(name)).reshape(-1).view(np.uint8)
        out.reshape(-1).view(np.uint8)[:] = data[start : start + out.nbytes]

    def conversion_facts(self) -> dict[str, Any]:
        """The source format: F8_E4M3 block-scaled."""
        return {"from": "F8_E4M3 block-scaled", "block": list(self.block)}


class FP8Conversion(DriftConversion):
    """The manifest's ``quant`` section of an FP8 mount (drift: experts per layer and part)."""

    def __init__(self, policy: str, expert_fmt: str) -> None:
        super().__init__(expert_fmt)
        self.policy = policy

    @property
    def policy_label(self) -> str:
        """``fp8:<policy>``."""
        return f"fp8:{self.policy}"


def _as_f32(arr: np.ndarray, dtype: str) -> np.ndarray:
    return to_float32(arr, dtype)


class FP8MountSource(MountSource):
    """Stored bytes of an FP8 checkpoint's tensors under its policy."""

    def __init__(self, ckpt: FP8Checkpoint, plan: Any) -> None:
        self.ckpt, self.plan = ckpt, plan
        tok = ckpt.path / "tokenizer.json"
        self.tokenizer = tok.read_bytes() if tok.is_file() else None
        self.side_files = side_file_bytes(ckpt)
        self.fmt = None if ckpt.policy in _FLOAT else ckpt.policy
        self.qlayout = (
            None
            if self.fmt is None
            else ExpertLayout(get_format(self.fmt), plan.inter, plan.hidden)
        )
        self.expert_nbytes = plan.expert_nbytes if self.qlayout is None else self.qlayout.nbytes
        self.buf = np.empty(self.expert_nbytes, np.uint8)
        self._scratch = np.empty(0, np.uint8)
        self.conversion = FP8Conversion(ckpt.policy, self.fmt or plan.expert_format)
        self.codec = self.conversion
        self._seen: set[tuple[int, int]] = set()

    def _bytes(self, name: str, fmt: str | None, key: str | None) -> np.ndarray:
        ck = self.ckpt
        if name not in ck.fp8:
            if fmt is None:
                return np.ascontiguousarray(ck.array(name)).reshape(-1).view(np.uint8)
            ref = _as_f32(ck.array(name), ck.dtype_of(name))
        else:
            ref = ck.reference(name)
        if fmt is None:
            data = ck.array(name)
            if key is not None:
                got = _as_f32(data, ck.dtype_of(name))
                self._drift(key, ck.policy).add(got, ref)
            return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        packed = quantize(ref, fmt)
        if key is not None:
            self._drift(key, fmt).add(dequantize(packed, fmt, ref.shape), ref)
        return packed

    def _drift(self, key: str, target: str) -> Drift:
        return self.conversion.drift.setdefault(key, Drift("F8_E4M3", target))

    def assemble(self, key: tuple[int, int], out: np.ndarray) -> None:
        """Expert ``key``'s extent as stored."""
        first = key not in self._seen
        self._seen.add(key)
        pos = 0
        for p, part in zip(self.plan.experts[key], ("gate", "up", "down"), strict=True):
            if p.start or p.nbytes != int(np.prod(p.shape)) * DTYPES[self.plan.dtype][1]:
                raise ShapeMismatchError("fused FP8 experts are not supported", tensor=p.tensor)
            dkey = f"model.layers.{key[0]}.experts.*.{part}" if first else None
            data = self._bytes(p.tensor, self.fmt, dkey if p.tensor in self.ckpt.fp8 else None)
            out[pos : pos + data.size] = data
            pos += data.size

    def stored_tensor(self, t: Any) -> tuple[np.ndarray, str | None]:
        """``(bytes, quantized format or None)``: F8 matrices converted, others as stored."""
        if t.tensor not in self.ckpt.fp8:
            return self.tensor(t.tensor), None
        data = self._bytes(t.tensor, self.fmt, t.tensor)
        if self.fmt is not None:
            self.conversion.trunk_formats[t.role] = self.fmt
        return data, self.fmt
