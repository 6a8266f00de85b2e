"""Group-wise asymmetric quantized formats on disk: q2, q3, q4, q8.

Scope: the byte layout of a packed matrix, packing and unpacking of codes, and
``quantize`` / ``dequantize`` of whole matrices. The choice of each group's
scale and offset lives in :mod:`store.quant.quantizer`; which tensor gets which
format lives in :mod:`store.quant.policy`.

The format
----------
A float matrix ``W [R, C]`` (rows = outputs, columns = inputs, the row-major
layout of a ``Linear`` weight) is cut along the input dimension into groups of
``group_size`` consecutive columns. Each group of each row stores an fp16
scale ``d`` and an fp16 offset ``m`` (the group's "min"), and one unsigned
``bits``-bit code ``q`` in ``[0, 2**bits - 1]`` per weight; the weight is
reconstructed as ``w = d * q + m`` (computed in float32). Asymmetric groups
fit the skewed weight groups of small models better than symmetric ones, at
the cost of one fp16 per group.

Default group sizes (``FORMATS``)::

    q2  group 64  -> 2 + 32/64 = 2.5 bits per weight
    q3  group 64  -> 3.5 bits per weight
    q4  group 32  -> 5.0 bits per weight   (as llama.cpp's Q4_1)
    q8  group 32  -> 9.0 bits per weight   (as llama.cpp's Q8_1)

q2 and q3 use 64 so that "about 2 bits" stays about 2 bits; q4 and q8 use 32
because at those widths the scale overhead is cheap and smaller groups buy
accuracy. Other group sizes are spelled ``q4g64``, ``q2g128`` and so on; a
group size must be a multiple of 32 (the C kernels process 32 weights per
step) and the matrix's column count a multiple of the group size
(:class:`~store.quant.errors.ShapeError` otherwise). Rows are unrestricted.

Packed buffer layout (planar, one contiguous ``uint8`` buffer)::

    codes   uint8 [R, C * bits / 8]    row-major; each row is a little-endian
                                       bit stream: code i occupies bits
                                       [bits*i, bits*i + bits) where bit k is
                                       bit (k % 8) of byte (k // 8)
    scales  fp16  [R, C / group_size]  little-endian IEEE half
    mins    fp16  [R, C / group_size]

Planar (codes, then scales, then mins) rather than interleaved per group:
a row's codes are contiguous for the kernels' streaming loads, and every part
is a zero-copy numpy view (:func:`views`). ``C * bits / 8`` is a multiple of 4
bytes (C is a multiple of 32), so the fp16 parts are always 2-byte aligned
and ``nbytes`` is a multiple of 4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from czyx.store.quant.errors import FormatError, PackedBufferError, ShapeError

#: Bit widths the formats (and the C kernels) support.
SUPPORTED_BITS = (2, 3, 4, 8)
#: Every group size must be a multiple of this (the kernels' step).
GROUP_QUANTUM = 32
_DEFAULT_GROUP = {2: 64, 3: 64, 4: 32, 8: 32}
_NAME_RE = re.compile(r"^q(\d)(?:g(\d+))?$")
#: Added to importance, relative to its mean, so that a column the calibration
#: text never exercised (importance 0) still counts a little instead of being
#: free to take any value; costs < 0.5% of the weighted gain in our measurement.
IMPORTANCE_FLOOR = 1e-3


@dataclass(frozen=True)
class QuantFormat:
    """One group-wise asymmetric format: ``bits`` per code, ``group_size`` columns per group.

    Parameters
    ----------
    name : str
        The canonical name (``"q4"`` for a default group size, else ``"q4g64"``).
    bits : int
        Bits per code, one of :data:`SUPPORTED_BITS`.
    group_size : int
        Columns per (scale, offset) pair, a positive multiple of :data:`GROUP_QUANTUM`.
    """

    name: str
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise FormatError(f"format {self.name!r}: bits={self.bits} not in {SUPPORTED_BITS}")
        if self.group_size <= 0 or self.group_size % GROUP_QUANTUM:
            raise FormatError(
                f"format {self.name!r}: group_size={self.group_size} is not a positive "
                f"multiple of {GROUP_QUANTUM}"
            )

    @property
    def qmax(self) -> int:
        """The largest code, ``2**bits - 1``."""
        return (1 << self.bits) - 1

    @property
    def bits_per_weight(self) -> float:
        """Storage cost per weight including the two fp16 per group."""
        return self.bits + 32.0 / self.group_size

    def check_shape(self, rows: int, cols: int) -> None:
        """Raise :class:`ShapeError` unless ``[rows, cols]`` can be packed in this format."""
        if rows < 0 or cols <= 0:
            raise ShapeError(f"format {self.name}: bad shape [{rows}, {cols}]")
        if cols % self.group_size:
            raise ShapeError(
                f"format {self.name}: columns={cols} is not a multiple of the group size "
                f"{self.group_size} (groups run along the input dimension)"
            )

    def row_code_bytes(self, cols: int) -> int:
        """Bytes of packed codes in one row of ``cols`` columns."""
        return cols * self.bits // 8

    def n_groups(self, cols: int) -> int:
        """Groups per row."""
        return cols // self.group_size

    def offsets(self, rows: int, cols: int) -> tuple[int, int, int, int]:
        """``(codes, scales, mins, end)`` byte offsets of the planar parts.

        Raises
        ------
        ShapeError
            If the shape cannot be packed in this format.
        """
        self.check_shape(rows, cols)
        codes = rows * self.row_code_bytes(cols)
        per = rows * self.n_groups(cols) * 2
        return 0, codes, codes + per, codes + 2 * per

    def nbytes(self, rows: int, cols: int) -> int:
        """Size in bytes of a packed ``[rows, cols]`` matrix (a multiple of 4)."""
        return self.offsets(rows, cols)[3]


def _canonical(bits: int, group: int) -> str:
    return f"q{bits}" if _DEFAULT_GROUP[bits] == group else f"q{bits}g{group}"


#: The named formats with their default group sizes.
FORMATS: dict[str, QuantFormat] = {
    f"q{b}": QuantFormat(f"q{b}", b, _DEFAULT_GROUP[b]) for b in SUPPORTED_BITS
}


def get_format(name: str | QuantFormat) -> QuantFormat:
    """The format named ``name`` (``"q4"``, ``"q2g128"``...); a format passes through.

    Raises
    ------
    FormatError
        If the name is not a quantized format (``"f32"`` is not one).
    """
    if isinstance(name, QuantFormat):
        return name
    m = _NAME_RE.match(str(name))
    if not m:
        raise FormatError(
            f"unknown quantized format {name!r} (expected q2, q3, q4, q8, optionally with "
            f"gN for a group size N, e.g. q4g64)"
        )
    bits = int(m.group(1))
    if bits not in SUPPORTED_BITS:
        raise FormatError(f"format {name!r}: bits={bits} not in {SUPPORTED_BITS}")
    group = int(m.group(2)) if m.group(2) else _DEFAULT_GROUP[bits]
    return QuantFormat(_canonical(bits, group), bits, group)


def is_quant_format(name: str) -> bool:
    """Whether ``name`` names a quantized format (as opposed to f32/f16/bf16)."""
    try:
        get_format(name)
    except FormatError:
        return False
    return True


# --------------------------------------------------------------------- codes


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes ``[R, C]`` (C a multiple of 8) into little-endian bit streams.

    Eight codes of ``bits`` bits make exactly ``bits`` bytes, so rows are packed
    eight codes at a time through a 64-bit word (exact for every width <= 8).

    Returns
    -------
    numpy.ndarray
        ``uint8 [R, C * bits / 8]``.
    """
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] % 8:
        raise ShapeError(f"pack_codes: need [R, C] with C a multiple of 8, got {codes.shape}")
    if bits not in SUPPORTED_BITS:
        raise FormatError(f"pack_codes: bits={bits} not in {SUPPORTED_BITS}")
    r, c = codes.shape
    if codes.size and int(codes.max()) >= (1 << bits):
        raise FormatError(f"pack_codes: a code exceeds {(1 << bits) - 1} for {bits} bits")
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8)
    if bits == 4:  # the 64-bit word's bytes are code pairs, low nibble first
        u8 = codes.astype(np.uint8, copy=False)
        return u8[:, 0::2] | (u8[:, 1::2] << np.uint8(4))
    octets = codes.reshape(r, c // 8, 8).astype("<u8")
    shifts = (np.arange(8, dtype="<u8") * np.uint64(bits)).astype("<u8")
    words = np.bitwise_or.reduce(octets << shifts, axis=2).astype("<u8")
    out = words.view(np.uint8).reshape(r, c // 8, 8)[:, :, :bits]
    return np.ascontiguousarray(out).reshape(r, c * bits // 8)


def unpack_codes(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: ``uint8 [R, cols*bits/8]`` -> ``uint8 [R, cols]``."""
    packed = np.asarray(packed, dtype=np.uint8)
    if bits not in SUPPORTED_BITS:
        raise FormatError(f"unpack_codes: bits={bits} not in {SUPPORTED_BITS}")
    if cols % 8 or packed.ndim != 2 or packed.shape[1] != cols * bits // 8:
        raise ShapeError(
            f"unpack_codes: packed shape {packed.shape} does not hold {cols} codes of {bits} bits"
        )
    r = packed.shape[0]
    if bits == 8:
        return packed.copy()
    octets = np.zeros((r, cols // 8, 8), dtype=np.uint8)
    octets[:, :, :bits] = packed.reshape(r, cols // 8, bits)
    words = octets.view("<u8")  # [r, cols // 8, 1]
    shifts = (np.arange(8, dtype="<u8") * np.uint64(bits)).astype("<u8")
    codes = (words >> shifts) & np.uint64((1 << bits) - 1)
    return codes.astype(np.uint8).reshape(r, cols)


# ------------------------------------------------------------------- buffers


def views(
    buf: np.ndarray | bytes | bytearray | memoryview, fmt: str | QuantFormat, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zero-copy ``(codes uint8 [R, C*bits/8], scales f16 [R, G], mins f16 [R, G])`` of a buffer.

    Raises
    ------
    PackedBufferError
        If the buffer's size is not ``fmt.nbytes(*shape)``.
    """
    fmt = get_format(fmt)
    rows, cols = (int(s) for s in shape)
    o_codes, o_scales, o_mins, end = fmt.offsets(rows, cols)
    raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raw = raw.reshape(-1).view(np.uint8)
    if raw.size != end:
        raise PackedBufferError(
            f"packed {fmt.name} [{rows}, {cols}] needs {end} bytes, buffer has {raw.size}"
        )
    g = fmt.n_groups(cols)
    codes = raw[o_codes:o_scales].reshape(rows, fmt.row_code_bytes(cols))
    scales = raw[o_scales:o_mins].view("<f2").reshape(rows, g)
    mins = raw[o_mins:end].view("<f2").reshape(rows, g)
    return codes, scales, mins


def assemble(
    codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, fmt: QuantFormat
) -> np.ndarray:
    """Concatenate packed codes, fp16 scales and fp16 mins into one planar ``uint8`` buffer."""
    parts = [
        np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1),
        np.ascontiguousarray(scales, dtype="<f2").reshape(-1).view(np.uint8),
        np.ascontiguousarray(mins, dtype="<f2").reshape(-1).view(np.uint8),
    ]
    return np.concatenate(parts)


def _column_weights(importance: np.ndarray | None, cols: int) -> np.ndarray | None:
    """Per-column error weights of :func:`quantize`: importance plus its floor, or ``None``."""
    if importance is None:
        return None
    imp = np.asarray(importance, dtype=np.float32)
    if imp.shape != (cols,):
        raise ShapeError(f"quantize: importance shape {imp.shape} != ({cols},)")
    if not (np.isfinite(imp).all() and (imp >= 0).all()):
        raise FormatError("quantize: importance must be finite and non-negative")
    mean = float(imp.mean())
    return imp + np.float32(IMPORTANCE_FLOOR * mean) if mean > 0 else None


def _checked_matrix(
    w: np.ndarray, fmt: str | QuantFormat
) -> tuple[QuantFormat, np.ndarray, int, int]:
    """``(format, w as an array, rows, cols)``, once ``w`` is a 2-D matrix ``fmt`` can hold."""
    fmt = get_format(fmt)
    w = np.asarray(w)
    if w.ndim != 2:
        raise ShapeError(f"quantize: need a 2-D matrix, got shape {w.shape}")
    rows, cols = w.shape
    fmt.check_shape(rows, cols)
    return fmt, w, rows, cols


def quantize(
    w: np.ndarray,
    fmt: str | QuantFormat,
    importance: np.ndarray | None = None,
    *,
    method: str = "search",
    dtype: str | None = None,
    threads: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Quantize a float matrix into the planar packed buffer of ``fmt``.

    Runs the C quantizer (:mod:`czyx.store.quant.native`: threaded, the source
    read in its own dtype); its bytes are those of the numpy reference
    :func:`quantize_reference`, which runs instead (with a warning) only when
    the extension is not built.

    Parameters
    ----------
    w : numpy.ndarray
        ``float32 [R, C]`` (or float16; or raw safetensors elements with
        ``dtype``); C must be a multiple of the format's group size.
    fmt : str or QuantFormat
        The format (``"q4"``, ``"q2g128"``, ...).
    importance : numpy.ndarray or None
        ``float32 [C]``, non-negative per-column weights of the squared error
        (the calibration's mean squared activation), plus
        :data:`IMPORTANCE_FLOOR` times its mean. ``None`` (or all zeros) means
        plain least squares (all ones).
    method : {"search", "minmax"}
        ``"search"``: the importance-weighted grid search with least-squares
        refinement (:func:`store.quant.quantizer.fit_groups`); ``"minmax"``:
        plain min-max groups, every weight within half a step.
    dtype : {"F32", "F16", "BF16"} or None
        Read ``w``'s elements as this safetensors dtype (bf16 as ``uint16`` bit
        patterns); ``None``: ``w``'s own numpy dtype.
    threads : int or None
        Threads of the C quantizer (default: the cores the process may use);
        the bytes do not depend on it.
    out : numpy.ndarray or None
        A contiguous ``uint8 [fmt.nbytes(R, C)]`` buffer to fill and return
        (an expert's part of its extent, so that no copy is made); else a new one.

    Returns
    -------
    numpy.ndarray
        ``uint8 [fmt.nbytes(R, C)]``.
    """
    from czyx.store.quant import native

    if method not in ("search", "minmax"):
        raise FormatError(f"fit_groups: unknown method {method!r} (search or minmax)")
    fmt, w, rows, cols = _checked_matrix(w, fmt)
    if not native.available():
        import warnings

        warnings.warn("czyx: C quantizer not built; using the numpy reference", stacklevel=2)
        if dtype not in (None, "F32", "F16"):
            from czyx.store.models.checkpoint import to_float32

            w = to_float32(w, dtype)
        ref = quantize_reference(w, fmt, importance, method=method)
        if out is None:
            return ref
        if out.dtype != np.uint8 or out.shape != ref.shape:
            raise ShapeError(f"quantize: out must be uint8 x {ref.size}")
        out[:] = ref
        return out
    weights = _column_weights(importance, cols)
    return native.quantize_native(
        w,
        (rows, cols),
        fmt.bits,
        fmt.group_size,
        weights,
        search=method == "search",
        dtype=dtype,
        threads=threads,
        out=out,
    )


def quantize_reference(
    w: np.ndarray,
    fmt: str | QuantFormat,
    importance: np.ndarray | None = None,
    *,
    method: str = "search",
) -> np.ndarray:
    """:func:`quantize` in numpy: the reference the C quantizer's bytes are checked against.

    Same parameters and result as :func:`quantize` (float input only).
    """
    from czyx.store.quant.quantizer import fit_groups

    fmt, w, rows, cols = _checked_matrix(w, fmt)
    g = fmt.group_size
    imp = _column_weights(importance, cols)
    if imp is not None:
        imp = np.broadcast_to(imp.reshape(1, cols // g, g), (rows, cols // g, g)).reshape(-1, g)
    groups = np.asarray(w, dtype=np.float32).reshape(rows * (cols // g), g)
    codes, scales, mins = fit_groups(groups, fmt.bits, imp, method=method)
    packed = pack_codes(codes.reshape(rows, cols), fmt.bits)
    n_groups = cols // g
    return assemble(packed, scales.reshape(rows, n_groups), mins.reshape(rows, n_groups), fmt)


def dequantize(
    buf: np.ndarray | bytes | bytearray | memoryview,
    fmt: str | QuantFormat,
    shape: tuple[int, int],
    rows: np.ndarray | slice | None = None,
) -> np.ndarray:
    """Reconstruct ``float32`` weights ``d * q + m`` from a packed buffer.

    Parameters
    ----------
    buf, fmt, shape
        The packed buffer, its format and its logical ``[R, C]`` shape.
    rows : array of int or slice, optional
        Only these rows (an embedding lookup dequantizes a few rows, not the table).

    Returns
    -------
    numpy.ndarray
        ``float32 [len(rows) or R, C]``.
    """
    fmt = get_format(fmt)
    codes, scales, mins = views(buf, fmt, shape)
    if rows is not None:
        codes, scales, mins = codes[rows], scales[rows], mins[rows]
    cols = int(shape[1])
    q = unpack_codes(codes, fmt.bits, cols).astype(np.float32)
    q = q.reshape(q.shape[0], -1, fmt.group_size)
    out = q * scales.astype(np.float32)[:, :, None] + mins.astype(np.float32)[:, :, None]
    return out.reshape(q.shape[0], cols)
