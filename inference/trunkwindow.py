"""A dense-style sliding window over a decoder's trunk layers.

Scope: holding at most ``window`` layers' trunk tensors for a model whose
trunk does not fit the memory budget, and hiding their reads behind compute.
:meth:`TrunkWindow.layer` returns layer ``i`` (waiting for it if its load is
in flight, loading it on the calling thread if nobody asked for it yet),
drops every layer outside ``i .. i + window - 1`` (cyclically: after the last
layer comes layer 0 of the next token) and schedules the loads of the layers
of that range not yet held on one background thread, so layer ``i + 1`` is
read while layer ``i`` computes.

The bound is on layers resident *or loading*: with ``window=1`` nothing is
prefetched (each layer is read synchronously after the previous one is
dropped), with ``window=2`` one layer computes while the next is read
(double buffering), with ``window >= n_layers`` every layer stays resident
after the first pass. What a "layer" is and how it is loaded is the caller's
(``load(i)``); the decoder passes a function that reads the layer's big
matrices through a lazy-trunk consumer (``store.model.open_model(...,
lazy_trunk=True)``).

Fail closed: a load that raised is never replaced by an older copy; its
error reaches the consumer at :meth:`TrunkWindow.layer` (a
:class:`~czyx.errors.CzyxError` as raised, e.g. the store's
``ChecksumError``; anything else as :class:`TrunkLoadError`), and a later
call for that layer loads it again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from czyx.errors import CzyxError
from czyx.inference.errors import InferenceError

T = TypeVar("T")


class TrunkWindowError(InferenceError):
    """A trunk window was misused (bad size, used after close)."""


class TrunkLoadError(TrunkWindowError):
    """A layer's trunk could not be loaded (the cause is chained)."""


@dataclass(frozen=True)
class TrunkWindowStats:
    """A trunk window's counters since it was made.

    Attributes
    ----------
    window, n_layers
        The bound (clipped to the layer count) and the layer count.
    loads, background_loads
        Layer loads in all, and those run on the background thread.
    hits
        :meth:`TrunkWindow.layer` calls that found the layer loaded.
    peak_layers
        Most layers resident or loading at once (never above ``window``).
    peak_bytes
        Most bytes of loaded layers held at once (as ``nbytes`` measures them).
    wait_seconds
        Time :meth:`TrunkWindow.layer` blocked: the exposed load time.
    load_seconds, background_seconds
        Time spent loading in all, and on the background thread.
    """

    window: int
    n_layers: int
    loads: int
    background_loads: int
    hits: int
    peak_layers: int
    peak_bytes: int
    wait_seconds: float
    load_seconds: float
    background_seconds: float

    def summary(self) -> str:
        """One line for a terminal."""
        return (
            f"trunk window: {self.window} of {self.n_layers} layers, {self.loads} loads "
            f"({self.background_loads} in background), peak {self.peak_layers} layers / "
            f"{self.peak_bytes / 2**20:.2f} MiB resident, exposed load wait "
            f"{self.wait_seconds * 1e3:.1f} ms, background load "
            f"{self.background_seconds * 1e3:.1f} ms"
        )


class TrunkWindow(Generic[T]):
    """At most ``window`` layers resident or loading; the next ones read in background.

    Parameters
    ----------
    n_layers
        Layers of the model (``layer(i)`` takes ``0 <= i < n_layers``).
    window
        Layers held at most (resident plus loading), ``>= 1``; above
        ``n_layers`` it is clipped.
    load
        ``load(i)`` returns layer ``i``'s object (a new one each call: the
        window drops its references when the layer leaves). Runs on the
        background thread for prefetches, so it must be thread-safe with
        respect to the consumer's compute.
    nbytes
        Bytes a loaded layer holds (for the peak-bytes counter).

    Notes
    -----
    One consumer thread calls :meth:`layer`; the background thread only runs
    ``load`` and updates counters (under a lock).
    """

    def __init__(
        self,
        n_layers: int,
        window: int,
        load: Callable[[int], T],
        nbytes: Callable[[T], int],
    ) -> None:
        if n_layers < 1:
            raise TrunkWindowError(f"a trunk window needs at least one layer, got {n_layers}")
        if window < 1:
            raise TrunkWindowError(f"trunk window of {window} layers: it must be at least 1")
        self.n_layers = n_layers
        self.window = min(window, n_layers)
        self._load, self._nbytes = load, nbytes
        self._held: dict[int, tuple[T, int]] = {}  # layer -> (object, bytes)
        self._pending: dict[int, Future] = {}
        # window 1 prefetches nothing: a second layer in flight would break the bound.
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="czyx-trunk") if self.window > 1 else None
        )
        self._lock = threading.Lock()
        self._closed = False
        self._live_bytes = 0
        self._loads = self._bg_loads = self._hits = 0
        self._peak_layers = self._peak_bytes = 0
        self._wait = self._load_s = self._bg_s = 0.0

    # ------------------------------------------------------------------ loading

    def _run_load(self, i: int, background: bool) -> tuple[T, int]:
        """Load layer ``i`` and count it (on either thread)."""
        t0 = time.perf_counter()
        obj = self._load(i)
        nb = int(self._nbytes(obj))
        dt = time.perf_counter() - t0
        with self._lock:
            self._loads += 1
            self._load_s += dt
            if background:
                self._bg_loads += 1
                self._bg_s += dt
            # Counted from completion until dropped: the bytes exist from here.
            self._live_bytes += nb
            self._peak_bytes = max(self._peak_bytes, self._live_bytes)
        return obj, nb

    def _forget(self, nb: int) -> None:
        with self._lock:
            self._live_bytes -= nb

    def _retire(self, fut: Future) -> None:
        """Cancel a prefetch no longer wanted, or wait for it and discard its layer."""
        if fut.cancel():
            return
        try:
            _, nb = fut.result()
        except (CancelledError, Exception):  # a dropped layer's error is moot
            return
        self._forget(nb)

    # ------------------------------------------------------------------ use

    def layer(self, i: int) -> T:
        """Layer ``i``, loaded; drops layers outside the window and prefetches the next.

        Raises
        ------
        TrunkWindowError
            ``i`` out of range, or the window is closed.
        CzyxError
            The load of layer ``i`` failed (the store's typed error as raised,
            else :class:`TrunkLoadError`); no layer is returned.
        """
        if self._closed:
            raise TrunkWindowError("the trunk window is closed")
        n = self.n_layers
        if not 0 <= i < n:
            raise TrunkWindowError(f"layer {i} outside 0..{n - 1}")
        want = [(i + d) % n for d in range(self.window)]
        keep = set(want)
        # Drop first, so the bound holds while layer i (and the next) load.
        for j in [j for j in self._held if j not in keep]:
            self._forget(self._held.pop(j)[1])
        t0 = time.perf_counter()
        for j in [j for j in self._pending if j not in keep]:
            self._retire(self._pending.pop(j))
        got = self._held.get(i)
        if got is not None:
            self._hits += 1
        else:
            fut = self._pending.pop(i, None)
            try:
                got = fut.result() if fut is not None else self._run_load(i, False)
            except CzyxError:
                self._wait += time.perf_counter() - t0
                raise  # already typed (ChecksumError, ShortReadError, MissingTensorError...)
            except Exception as exc:
                self._wait += time.perf_counter() - t0
                raise TrunkLoadError(f"trunk of layer {i}: {type(exc).__name__}: {exc}") from exc
            self._held[i] = got
        self._wait += time.perf_counter() - t0
        if self._pool is not None:
            for j in want[1:]:
                if j not in self._held and j not in self._pending:
                    self._pending[j] = self._pool.submit(self._run_load, j, True)
        self._peak_layers = max(self._peak_layers, len(self._held) + len(self._pending))
        return got[0]

    def resident(self) -> list[int]:
        """The layers loaded and held now (ascending)."""
        return sorted(self._held)

    def stats(self) -> TrunkWindowStats:
        """The counters so far."""
        with self._lock:
            return TrunkWindowStats(
                window=self.window,
                n_layers=self.n_layers,
                loads=self._loads,
                background_loads=self._bg_loads,
                hits=self._hits,
                peak_layers=self._peak_layers,
                peak_bytes=self._peak_bytes,
                wait_seconds=self._wait,
                load_seconds=self._load_s,
                background_seconds=self._bg_s,
            )

    def close(self) -> None:
        """Cancel or finish the loads in flight, stop the thread, drop every layer."""
        if self._closed:
            return
        self._closed = True
        for fut in self._pending.values():
            self._retire(fut)
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for _, nb in self._held.values():
            self._forget(nb)
        self._held.clear()
