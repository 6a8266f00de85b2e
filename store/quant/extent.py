"""Quantized expert extents and per-tensor format records.

Scope: the byte layout of one routed expert's extent when its matrices are
quantized, the choice of one format valid for all three of them, and the
small msgpack-friendly record that states a tensor's format next to its bytes
(at the same coordinate). The mount writes these; the engine reads them.

Extent layout (quantized), following the contract's float layout literally,
each matrix in the planar packed format of :mod:`store.quant.formats`::

    packed(gate [I, H]) | packed(up [I, H]) | packed(down [H, I])

Each part's size is a multiple of 4 bytes, so every part starts 4-byte
aligned when the extent does. gate and up read H columns and down reads I,
so one format must divide both (see :func:`expert_format`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from czyx.store.quant.errors import FormatError, PackedBufferError, ShapeError
from czyx.store.quant.formats import GROUP_QUANTUM, QuantFormat, get_format, quantize
from czyx.store.quant.policy import Policy

#: Version tag of :func:`format_record`.
RECORD_TAG = "czyx-qformat/1"


@dataclass(frozen=True)
class ExpertLayout:
    """Byte offsets of gate, up and down inside one quantized expert extent."""

    fmt: QuantFormat
    inter: int
    hidden: int

    @property
    def part_nbytes(self) -> tuple[int, int, int]:
        """Bytes of gate, up and down."""
        gu = self.fmt.nbytes(self.inter, self.hidden)
        return gu, gu, self.fmt.nbytes(self.hidden, self.inter)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole extent."""
        return sum(self.part_nbytes)

    @property
    def shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """Logical shapes of gate, up and down."""
        return (self.inter, self.hidden), (self.inter, self.hidden), (self.hidden, self.inter)

    def split(self, extent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Zero-copy uint8 views of the three packed parts of ``extent`` (extra tail ignored).

        Raises
        ------
        PackedBufferError
            If ``extent`` is shorter than :attr:`nbytes` or not uint8.
        """
        if extent.dtype != np.uint8 or extent.ndim != 1 or extent.size < self.nbytes:
            raise PackedBufferError(
                f"expert extent {self.fmt.name} [I={self.inter}, H={self.hidden}] needs "
                f"{self.nbytes} uint8 bytes, got {extent.dtype} x {extent.size}"
            )
        a, b, _ = self.part_nbytes
        return extent[:a], extent[a : a + b], extent[a + b : self.nbytes]


def expert_format(policy: Policy, inter: int, hidden: int) -> QuantFormat | None:
    """The one format of a routed expert's extent under ``policy`` (``None``: float).

    The policy's expert format if its group divides both H and I; else the
    same width with groups of 32 if that divides both; else float.
    """
    name = policy.format_for("expert")
    if name is None:
        return None
    fmt = get_format(name)
    if hidden % fmt.group_size == 0 and inter % fmt.group_size == 0:
        return fmt
    if hidden % GROUP_QUANTUM == 0 and inter % GROUP_QUANTUM == 0:
        return get_format(f"q{fmt.bits}g{GROUP_QUANTUM}")
    return None


def pack_expert(
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    fmt: str | QuantFormat,
    importance_in: np.ndarray | None = None,
    importance_down: np.ndarray | None = None,
    *,
    dtype: str | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Quantize one expert into its extent bytes (``uint8 [ExpertLayout.nbytes]``).

    Parameters
    ----------
    gate, up, down : numpy.ndarray
        ``[I, H]``, ``[I, H]``, ``[H, I]`` float weights.
    fmt : str or QuantFormat
        The extent's format.
    importance_in, importance_down : numpy.ndarray or None
        Calibration importance of the expert's input (``[H]``, for gate and up)
        and of its down projection's input (``[I]``).
    dtype : {"F32", "F16", "BF16"} or None
        Read the matrices' elements as this safetensors dtype (see
        :func:`~czyx.store.quant.formats.quantize`); ``None``: their numpy dtype.
    out : numpy.ndarray or None
        A contiguous ``uint8 [ExpertLayout.nbytes]`` buffer to fill and return
        (each part is quantized in place); else a new one.
    """
    fmt = get_format(fmt)
    inter, hidden = np.shape(gate)
    if np.shape(up) != (inter, hidden) or np.shape(down) != (hidden, inter):
        raise ShapeError(
            f"expert shapes gate {np.shape(gate)}, up {np.shape(up)}, down {np.shape(down)} "
            f"are not [I, H], [I, H], [H, I]"
        )
    lay = ExpertLayout(fmt, inter, hidden)
    if out is None:
        out = np.empty(lay.nbytes, np.uint8)
    elif out.dtype != np.uint8 or out.shape != (lay.nbytes,) or not out.flags.c_contiguous:
        raise ShapeError(f"pack_expert: out must be contiguous uint8 x {lay.nbytes}")
    parts = lay.split(out)
    for mat, imp, dst in zip(
        (gate, up, down), (importance_in, importance_in, importance_down), parts
    ):
        quantize(mat, fmt, imp, dtype=dtype, out=dst)
    return out


def format_record(fmt: QuantFormat | None, shape: tuple[int, ...]) -> dict[str, object]:
    """The record stored beside a tensor's bytes: its format and logical shape."""
    if fmt is None:
        return {"tag": RECORD_TAG, "format": "f32", "shape": [int(s) for s in shape]}
    return {
        "tag": RECORD_TAG,
        "format": fmt.name,
        "bits": fmt.bits,
        "group_size": fmt.group_size,
        "shape": [int(s) for s in shape],
        "nbytes": fmt.nbytes(*(int(s) for s in shape)),
    }


def parse_format_record(rec: dict[str, object]) -> tuple[QuantFormat | None, tuple[int, ...]]:
    """Inverse of :func:`format_record`; checks that the fields agree.

    Raises
    ------
    FormatError
        On a wrong tag, an unknown format or fields that contradict the name.
    """
    if not isinstance(rec, dict) or rec.get("tag") != RECORD_TAG:
        raise FormatError(f"not a format record (expected tag {RECORD_TAG!r})")
    try:
        shape = tuple(int(s) for s in rec["shape"])  # type: ignore[union-attr]
        name = str(rec["format"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"format record: malformed ({exc})") from None
    if name == "f32":
        return None, shape
    fmt = get_format(name)
    if (rec.get("bits"), rec.get("group_size")) != (fmt.bits, fmt.group_size):
        raise FormatError(f"format record: bits/group_size contradict format {name!r}")
    if len(shape) != 2 or rec.get("nbytes") != fmt.nbytes(*shape):
        raise FormatError(f"format record: nbytes {rec.get('nbytes')} wrong for {name} {shape}")
    return fmt, shape
