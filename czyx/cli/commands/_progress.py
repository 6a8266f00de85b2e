"""A progress bar on stderr for the long CLI loops (profile, calibrate), only on a TTY."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """``items`` with a tqdm bar on stderr when stderr is a terminal (else unchanged)."""
    if not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False)
