"""Where a routed expert sits in the key space, for any number of experts a layer.

A router over at most 256 experts emits one byte, and the key's class byte takes
it unchanged: the expert with class value ``v`` (its router index after the
space's optional learned permutation) in MoE layer ``L`` is ``Key(cls=v, z=L)``.

Models with more experts a layer (Kimi-K2: 384, Qwen3-Next: 512) split the
class value with a per-space *class shift* ``s``, the fewest bits that bring
the value range under 256::

    s     = max(0, bit_length(n_experts - 1) - 8)
    key   = Key(cls=v >> s, z=L, y=v & (2**s - 1))
    value = (key.cls << s) | key.y

So a key class holds ``2**s`` consecutive class values: class ranges (portal
caveats, replication subsets, placement of a class range on another node) stay
contiguous ranges of experts and key-prefix ranges of the index, and the
router's output still resolves to a key (and, through the layout, to a block
offset) by a shift and a mask, with no table. ``s`` is a function of the
space's ``n_experts`` alone, so nothing new is recorded: with at most 256
experts ``s == 0`` and ``y == 0``, the keys of every store written before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from czyx.key import Key

CLASS_VALUES = 256  # one class byte
MAX_EXPERTS = 1 << 16  # class shift at most 8: y stays below 256
MAX_CLASS_SHIFT = 8


def class_shift(n_experts: int) -> int:
    """Bits of a class value that go into the key's ``y`` for ``n_experts`` a layer.

    Raises
    ------
    ValueError
        ``n_experts`` is not an integer in ``[1, MAX_EXPERTS]``.
    """
    if not isinstance(n_experts, int | np.integer) or isinstance(n_experts, bool):
        raise ValueError(f"n_experts: {n_experts!r} is not an integer")
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"n_experts: {n_experts} outside [1, {MAX_EXPERTS}]")
    return max(0, (int(n_experts) - 1).bit_length() - 8)


def _check_shift(shift: Any) -> int:
    if not isinstance(shift, int | np.integer) or not 0 <= shift <= MAX_CLASS_SHIFT:
        raise ValueError(f"class shift: {shift!r} outside [0, {MAX_CLASS_SHIFT}]")
    return int(shift)


def expert_key(value: int, layer: int, shift: int) -> Key:
    """The key of the expert with class value ``value`` in MoE layer ``layer``.

    Raises
    ------
    ValueError
        ``value`` is negative or needs more than ``8 + shift`` bits, or the
        layer is not a key coordinate.
    """
    s = _check_shift(shift)
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise ValueError(f"class value: {value!r} is not an integer")
    if not 0 <= value < CLASS_VALUES << s:
        raise ValueError(f"class value: {value} outside [0, {CLASS_VALUES << s}) (shift {s})")
    v = int(value)
    return Key(v >> s, layer, v & ((1 << s) - 1))


def expert_value(key: Key, shift: int) -> int:
    """Inverse of :func:`expert_key`: the class value of an expert's key.

    Raises
    ------
    ValueError
        ``key.y`` does not fit in ``shift`` bits or ``key.x`` is not zero: no
        expert of a space with that shift sits there.
    """
    s = _check_shift(shift)
    if key.y >> s or key.x:
        raise ValueError(f"key {key} is not an expert key under class shift {s}")
    return (key.cls << s) | key.y


def key_classes(values: Any, shift: int) -> np.ndarray:
    """Vectorised class bytes of class values (``values >> shift``, ``int64``)."""
    return np.asarray(values, dtype=np.int64) >> _check_shift(shift)
