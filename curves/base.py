"""The ``Curve`` protocol: coordinates <-> linear ordinal, scalar and vectorised."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Curve(Protocol):
    """A bijection between ``ndim`` coordinates of ``bits`` bits and ``[0, 2**(ndim*bits))``.

    Scalar methods take and return Python ints (arbitrary precision, so the
    full 3 x 61 = 183-bit ordinals of a key are exact).
    """

    name: str
    ndim: int
    bits: int

    def encode(self, coords: tuple[int, ...]) -> int: ...

    def decode(self, ordinal: int) -> tuple[int, ...]: ...

    def encode_array(self, coords: np.ndarray) -> np.ndarray: ...

    def decode_array(self, ordinals: np.ndarray) -> np.ndarray: ...
