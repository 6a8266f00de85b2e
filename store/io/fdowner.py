"""Shared lifetime of the objects that own file descriptors (readers, transfer sources).

Both :class:`~czyx.store.io.reader.RawReader` and
:class:`~czyx.store.io.iopaths.TransferSource` hold raw descriptors that must be
closed exactly once, by ``close()``, a ``with`` block or, as a last resort,
garbage collection; this module writes that protocol once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Self


def close_fds(owner: object, names: Iterable[str]) -> None:
    """Close each descriptor attribute of ``owner`` named in ``names`` that is open.

    A closed (or never-set) attribute reads as ``-1`` and is left alone; a closed
    one is set to ``-1``, so calling this again is harmless.
    """
    for name in names:
        fd = getattr(owner, name, -1)
        if fd >= 0:
            os.close(fd)
            setattr(owner, name, -1)


class FdOwner:
    """A context manager whose exit, and whose collection, call ``close()``.

    Subclasses implement an idempotent ``close``; errors during collection are
    suppressed (an interpreter shutting down may already have dropped ``os``).
    """

    def close(self) -> None:
        """Release what the object holds (idempotent)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
