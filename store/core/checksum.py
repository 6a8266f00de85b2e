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
