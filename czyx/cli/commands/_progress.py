"""Progress bars on stderr for the long CLI work (profile, calibrate, export), only on a TTY."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """``items`` with a tqdm bar on stderr when stderr is a terminal (else unchanged)."""
    if not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False)


@contextlib.contextmanager
def byte_progress(desc: str) -> Iterator[Callable[[int, int], None] | None]:
    """A ``(bytes done, total)`` callback drawing a tqdm bar on stderr when stderr is a
    terminal (else None); the bar is closed when the block ends."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(
                total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False
            )
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
