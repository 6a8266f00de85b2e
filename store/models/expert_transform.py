"""Expert tensors whose source layout is not the extent contract's, and the exact inverse.

Scope: GPT-OSS stores each layer's routed experts stacked and transposed:
``gate_up_proj [E, H, 2I]`` with gate and up *interleaved* along the last axis
(gate = columns ``0::2``, up = columns ``1::2``) and ``down_proj [E, I, H]``.
One expert's bytes are still contiguous in each tensor (``[H, 2I]`` then
``[I, H]``), so mount reads them as plain byte ranges; :func:`to_contract`
then rearranges them into the extent contract (gate ``[I, H]`` | up
``[I, H]`` | down ``[H, I]``, row-major), and export applies
:func:`from_contract` before writing the source's byte ranges back, so an
export is byte-identical. Both are pure permutations of elements (any dtype,
bf16 as its raw 16 bits): nothing is rounded.

Llama 4 stores its experts the same way but with gate and up as the two
*halves* of the last axis (gate = columns ``:I``, up = columns ``I:``):
the ``gate_up_t`` transform.
"""

from __future__ import annotations

import numpy as np

#: The transforms by name (recorded in the model manifest as ``expert.transform``).
TRANSFORMS = ("gate_up_t_interleaved", "gate_up_t")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elements(buf: np.ndarray, itemsize: int) -> np.ndarray:
    return buf.view(_UINT[itemsize])


def _columns(transform: str, inter: int) -> tuple[slice, slice]:
    """The gate and up columns of a ``[H, 2I]`` block under ``transform``."""
    if transform == "gate_up_t_interleaved":
        return slice(0, None, 2), slice(1, None, 2)
    if transform == "gate_up_t":
        return slice(0, inter), slice(inter, 2 * inter)
    raise ValueError(f"expert transform {transform!r} is not one of {TRANSFORMS}")


def to_contract(
    raw: np.ndarray,
    inter: int,
    hidden: int,
    itemsize: int,
    transform: str = "gate_up_t_interleaved",
) -> np.ndarray:
    """``[H, 2I]`` gate/up (as ``transform`` lays them) then ``[I, H]`` down -> gate | up |
    down (uint8 bytes)."""
    g, u = _columns(transform, inter)
    el = _elements(raw, itemsize)
    n = inter * hidden
    gu = el[: 2 * n].reshape(hidden, 2 * inter)
    down_t = el[2 * n : 3 * n].reshape(inter, hidden)
    out = np.empty(3 * n, el.dtype)
    out[:n].reshape(inter, hidden)[:] = gu[:, g].T
    out[n : 2 * n].reshape(inter, hidden)[:] = gu[:, u].T
    out[2 * n :].reshape(hidden, inter)[:] = down_t.T
    return out.view(np.uint8)


def from_contract(
    ext: np.ndarray,
    inter: int,
    hidden: int,
    itemsize: int,
    transform: str = "gate_up_t_interleaved",
) -> np.ndarray:
    """The exact inverse of :func:`to_contract` (uint8 bytes in the source's layout)."""
    g, u = _columns(transform, inter)
    el = _elements(ext, itemsize)
    n = inter * hidden
    out = np.empty(3 * n, el.dtype)
    gu = out[: 2 * n].reshape(hidden, 2 * inter)
    gu[:, g] = el[:n].reshape(inter, hidden).T
    gu[:, u] = el[n : 2 * n].reshape(inter, hidden).T
    out[2 * n :].reshape(inter, hidden)[:] = el[2 * n : 3 * n].reshape(hidden, inter).T
    return out.view(np.uint8)
