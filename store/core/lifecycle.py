"""Lifecycle guards of LMDB-backed stores: closed handles and ``fork()``.

A closed store, or one inherited by a fork child, has its environment
replaced by :class:`Unusable`, so the read hot path needs no ``closed`` or
pid checks of its own: any use raises the right typed error. The fork hook
(:func:`close_inherited`) decides, per inherited store, whether the child's
copy of the environment may be closed (idle at fork time) or must be pinned
open (a transaction was in flight: closing would release the parent's
reader slot).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import weakref
from typing import TYPE_CHECKING, Any

import lmdb

from czyx.store.errors import StoreError, StoreForkError

if TYPE_CHECKING:
    from czyx.store.core.lmdb_store import Store


class Unusable:
    """Stands in for the LMDB environment of a closed or fork-inherited store.

    Every use raises the stored error, so the read hot path needs no
    ``closed``/pid checks of its own.
    """

    def __init__(self, exc_type: type[StoreError], message: str) -> None:
        self._exc_type, self._message = exc_type, message

    def __getattr__(self, name: str) -> Any:
        raise self._exc_type(self._message)


OPEN_STORES: weakref.WeakSet[Store] = weakref.WeakSet()  # every open Store of this process
# Environments (and snapshot transactions) a fork child inherited while a
# transaction was open in the parent: never closed, aborted or garbage-collected
# (which would abort them) in the child.
INHERITED: list[lmdb.Environment | lmdb.Transaction] = []


def close_inherited() -> None:
    """In a fork child: retire every environment inherited from the parent.

    Closing the child's copy is what lets the child open the same store
    again (py-lmdb refuses a second open of files still open in the
    process), and LMDB's close only frees the child's own reader slots. But
    py-lmdb aborts the live transactions of an environment it closes, and
    aborting the child's copy of a transaction that was open in the parent
    at fork time would release the *parent's* reader slot in the shared lock
    table. So a store busy at fork time (a read, snapshot or write in
    flight) is left open and pinned in the child instead: it still refuses
    every use, and the child cannot reopen that store.
    """
    for st in list(OPEN_STORES):
        env = st._env
        busy = bool(st._readers) or st._writing > 0
        st._env = Unusable(
            StoreForkError,
            f"{st.path}: store opened in pid {st._pid} used in pid {os.getpid()}; LMDB "
            "environments must not cross fork(): call Store.open again in the child",
        )
        for snap in list(st._snapshots):
            snap.retire_after_fork(INHERITED)
        if busy:
            INHERITED.append(env)
        else:
            with contextlib.suppress(Exception):
                env.close()
    OPEN_STORES.clear()
    for obj in INHERITED:
        # One reference that is never given back: even interpreter shutdown, which
        # clears module globals, must not free (so abort) these in the child.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


os.register_at_fork(after_in_child=close_inherited)
