"""Products with a weight that is either a float array or a packed quantized matrix.

Scope: the few operations the engine performs on weights, dispatched on the
weight's type so that the decoder code reads the same for float and quantized
models: ``x @ W.T`` (:func:`mm_t`), an embedding gather (:func:`take_rows`)
and wrapping a packed buffer, or a quantized expert's three packed parts,
into kernel-ready :class:`~inference.kernels.ops.PackedMatrix` objects.

Up to :data:`INT8_MAX_TOKENS` tokens (decode, a short prompt, an expert's
share of a prompt) run the decode kernels' int8-input product, each token
exactly as a decode step computes it; more run the float small-matmul kernel,
which decodes each group once for every token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from czyx.inference.kernels import fused
from czyx.inference.kernels.ops import PackedMatrix, prepare
from czyx.store.quant.errors import QuantError
from czyx.store.quant.extent import ExpertLayout
from czyx.store.quant.formats import dequantize, get_format

#: A weight as the engine holds it.
Weight = np.ndarray | PackedMatrix


@dataclass(frozen=True)
class GateUp:
    """A quantized expert's gate and up, used as the stacked ``[2I, H]`` matrix."""

    gate: PackedMatrix
    up: PackedMatrix

    @property
    def shape(self) -> tuple[int, int]:
        """``(2I, H)``, as the stacked float matrix."""
        return 2 * self.gate.shape[0], self.gate.shape[1]


def mm_t(x: np.ndarray, w: Weight | GateUp) -> np.ndarray:
    """``x @ w.T`` for ``x float32 [T, C]``; returns ``float32 [T, R]``."""
    if isinstance(w, np.ndarray):
        return x @ w.T
    x = np.ascontiguousarray(x, dtype=np.float32)
    if isinstance(w, GateUp):
        inter = w.gate.shape[0]
        out = np.empty((x.shape[0], 2 * inter), np.float32)
        if _int8_inputs(w.gate, x):
            out[:, :inter] = fused.quant_matmul(w.gate, x)
            out[:, inter:] = fused.quant_matmul(w.up, x)
        elif x.shape[0] == 1:  # row slices of a single row are contiguous: no copy
            w.gate.matvec(x[0], out=out[0, :inter])
            w.up.matvec(x[0], out=out[0, inter:])
        else:
            out[:, :inter] = w.gate.matmul(x)
            out[:, inter:] = w.up.matmul(x)
        return out
    if _int8_inputs(w, x):
        return fused.quant_matmul(w, x)
    if x.shape[0] == 1:
        out = np.empty((1, w.shape[0]), np.float32)
        w.matvec(x.reshape(-1), out=out.reshape(-1))
        return out
    return w.matmul(x)


#: Tokens up to which a quantized product runs the decode kernels' int8-input
#: path (:func:`~czyx.inference.kernels.fused.quant_matmul`: integer dot
#: products, the codes loaded once per four tokens). It measured faster than the
#: float small matmul at every token count tried (bench/RESIDENT.md); the bound
#: caps its per-call scratch (three bytes per input value).
INT8_MAX_TOKENS = 256


@contextmanager
def float_inputs() -> Iterator[None]:
    """Within the block, quantized products take float inputs at every token count.

    For checks of a stored version's weight values against a float reference
    (conversion and export fidelity): the 8-bit inputs of the short-prompt
    kernels would add their own rounding to what is being compared. Not thread
    safe (it sets :data:`INT8_MAX_TOKENS` for the process); tests only.
    """
    global INT8_MAX_TOKENS
    saved, INT8_MAX_TOKENS = INT8_MAX_TOKENS, 0
    try:
        yield
    finally:
        INT8_MAX_TOKENS = saved


#: Columns from which the int8-input path is taken: on narrow matrices its fixed
#: per-token costs (quantizing the input, the call) outweigh the faster dot
#: products and the float small matmul measured faster; Qwen3-MoE's 768-column
#: expert down projections are above it (bench/RESIDENT-qwen3.md).
INT8_MIN_COLS = 512


def _int8_inputs(w: PackedMatrix, x: np.ndarray) -> bool:
    # groups of a power-of-two number of 32-column blocks: the kernels' SIMD paths
    blocks = w.fmt.group_size // 32
    return (
        x.shape[0] <= INT8_MAX_TOKENS
        and w.shape[1] >= INT8_MIN_COLS
        and fused.have_czk()
        and blocks & (blocks - 1) == 0
    )


def take_rows(w: Weight, idx: np.ndarray) -> np.ndarray:
    """Rows ``idx`` of ``w`` as float32 (an embedding lookup dequantizes only those rows)."""
    if isinstance(w, np.ndarray):
        return w[idx]
    return dequantize(w.buf, w.fmt, w.shape, rows=np.asarray(idx))


def packed_expert(layout: ExpertLayout, slot: np.ndarray) -> tuple[GateUp, PackedMatrix]:
    """Kernel-ready ``(gate_up, down)`` over a slot holding a quantized extent (zero-copy).

    Made once per slot: the views follow whatever extent is later read into it.
    """
    g, u, d = layout.split(slot)
    sg, su, sd = layout.shapes
    fmt = layout.fmt
    return GateUp(prepare(g, fmt, sg), prepare(u, fmt, su)), prepare(d, fmt, sd)


def packed_expert_from_views(
    fmt_name: str, hidden: int, views: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> tuple[GateUp, PackedMatrix]:
    """Kernel-ready weights from a consumer's packed ``(gate, up, down)`` views of a slot.

    The intermediate size follows from the gate part's size: a packed ``[I, H]``
    matrix is ``I * H * (bits / 8 + 4 / group)`` bytes.

    Raises
    ------
    QuantError
        If the parts' sizes do not fit ``[I, H]``, ``[I, H]``, ``[H, I]`` in ``fmt_name``.
    """
    fmt = get_format(fmt_name)
    g = np.asarray(views[0]).reshape(-1)
    per_row = fmt.nbytes(1, hidden)
    inter = g.size // per_row
    if inter <= 0 or inter * per_row != g.size:
        raise QuantError(
            f"expert gate part of {g.size} bytes is not [I, {hidden}] in format {fmt.name}"
        )
    layout = ExpertLayout(fmt, inter, hidden)
    sizes = tuple(np.asarray(v).size for v in views)
    if sizes != layout.part_nbytes:
        raise QuantError(f"expert parts {sizes} B do not match {layout.part_nbytes} B")
    sg, su, sd = layout.shapes
    # prepare() keeps views of the slot: later reads into the slot are seen.
    return GateUp(prepare(views[0], fmt, sg), prepare(views[1], fmt, su)), prepare(
        views[2], fmt, sd
    )
