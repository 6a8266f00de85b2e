"""The extent checksum: XXH3-64 over the extent's bytes.

Why XXH3-64 and not CRC32C
--------------------------
Both are available as maintained wheels (``xxhash``, ``crc32c``). The checksum
is verified on every cold expert read, so it must hash far faster than the
device reads; XXH3-64 measured the faster of the two over a cache-resident
buffer (figures and how they were taken: ``bench/RATIONALE.md``). A 64-bit sum also
makes an undetected random corruption of a multi-MiB extent a 2**-64 event
rather than 2**-32. CRC's one advantage, guaranteed detection of short burst
errors, matters for links, not for whole-extent comparisons against a stored
value. The algorithm is named in every space's manifest (``CHECKSUM_NAME``) so a
later format can change it without ambiguity.
"""

from __future__ import annotations

import numpy as np
import xxhash

CHECKSUM_NAME = "xxh3_64"

_xxh3 = xxhash.xxh3_64_intdigest


def checksum(buf: bytes | bytearray | memoryview | np.ndarray) -> int:
    """Return the XXH3-64 checksum of ``buf`` as an unsigned 64-bit integer.

    Parameters
    ----------
    buf
        Any C-contiguous buffer; numpy arrays are hashed as their raw bytes.

    Returns
    -------
    int
        The checksum, ``0 <= value < 2**64``.
    """
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("checksum: array must be C-contiguous")
        buf = buf.reshape(-1).view(np.uint8)
    return _xxh3(buf)


_NATIVE: list[int | None] = []  # the address, found once (None: not available)


def native_checksum() -> int | None:
    """The address of a C function ``uint64_t f(const void *data, size_t len)`` computing
    :func:`checksum`, or None where there is none.

    It is the ``XXH3_64bits`` the ``xxhash`` extension exports (the function behind
    :func:`checksum`), so C code (the native read pool's threads) can hash an extent
    without the GIL. It is checked against :func:`checksum` on sample buffers before it
    is returned: a build whose symbol is missing or computes anything else gives None,
    and callers hash in Python instead.
    """
    if not _NATIVE:
        _NATIVE.append(_find_native())
    return _NATIVE[0]


def _find_native() -> int | None:
    import ctypes

    try:
        from xxhash import _xxhash

        fn = ctypes.CDLL(_xxhash.__file__).XXH3_64bits
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    rng = np.random.default_rng(0)
    for n in (0, 1, 17, 240, 4096 + 3, 1 << 20):
        buf = rng.integers(0, 256, n, dtype=np.uint8)
        if fn(buf.ctypes.data, n) != checksum(buf):
            return None
    return ctypes.cast(fn, ctypes.c_void_p).value
