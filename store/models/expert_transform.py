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
"""

from __future__ import annotations

import numpy as np

#: The transforms by name (recorded in the model manifest as ``expert.transform``).
TRANSFORMS = ("gate_up_t_interleaved",)

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elements(buf: np.ndarray, itemsize: int) -> np.ndarray:
    return buf.view(_UINT[itemsize])


def to_contract(raw: np.ndarray, inter: int, hidden: int, itemsize: int) -> np.ndarray:
    """``[H, 2I]`` interleaved gate/up then ``[I, H]`` down -> gate | up | down (uint8 bytes)."""
    el = _elements(raw, itemsize)
    n = inter * hidden
    gu = el[: 2 * n].reshape(hidden, 2 * inter)
    down_t = el[2 * n : 3 * n].reshape(inter, hidden)
    out = np.empty(3 * n, el.dtype)
    out[:n].reshape(inter, hidden)[:] = gu[:, 0::2].T
    out[n : 2 * n].reshape(inter, hidden)[:] = gu[:, 1::2].T
    out[2 * n :].reshape(hidden, inter)[:] = down_t.T
    return out.view(np.uint8)


def from_contract(ext: np.ndarray, inter: int, hidden: int, itemsize: int) -> np.ndarray:
    """The exact inverse of :func:`to_contract` (uint8 bytes in the source's layout)."""
    el = _elements(ext, itemsize)
    n = inter * hidden
    out = np.empty(3 * n, el.dtype)
    gu = out[: 2 * n].reshape(hidden, 2 * inter)
    gu[:, 0::2] = el[:n].reshape(inter, hidden).T
    gu[:, 1::2] = el[n : 2 * n].reshape(inter, hidden).T
    out[2 * n :].reshape(inter, hidden)[:] = el[2 * n : 3 * n].reshape(hidden, inter).T
    return out.view(np.uint8)
