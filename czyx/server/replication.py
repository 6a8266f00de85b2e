"""Replication endpoints: a model version's offer and HTTP range reads of its extents.

Scope: the source side of ``czyx pull`` (:mod:`czyx.cli.commands.pull`).
:func:`routes` returns Starlette routes that ``czyx serve`` mounts;
:func:`create_replication_app` serves them alone. Two endpoints:

``GET /v1/replicate/offer?ref=NAME@VER[&classes=LO-HI][&layers=LO-HI]``
    The version's spaces, manifests and records, msgpack
    (:func:`czyx.store.models.replicate.build_offer`).
``GET /v1/replicate/block/{space}?ref=...[&classes=..][&layers=..]`` + ``Range: bytes=A-B``
    ``206`` with bytes ``A..B`` (inclusive) of a block file the offer names,
    only inside extents the offer holds (padding between two of them
    included), at most 64 MiB per request.

Authorisation: every request carries a portal token as ``Authorization:
Bearer TOKEN``; the portal must grant ``read`` on the version, its bases and
its trunk (:func:`czyx.portals.open_model` with ``right="read"``), and its
class/layer caveats bound what may be offered. No or malformed header: 401;
any portal refusal (audited by the portal authority): 403. A block request
re-verifies the token (revocation takes effect at once); the offer's byte
intervals are cached per (version, subset, portal).

Servers bind 127.0.0.1 (the app itself does not listen; see ``czyx serve``).
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgpack
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from czyx.portals.caveats import READ
from czyx.portals.errors import PortalDenied
from czyx.store import Store
from czyx.store.errors import SpaceNotFoundError, StoreError, TagNotFoundError
from czyx.store.models.replicate import (
    Range,
    ReplicationError,
    SubsetNotAllowed,
    build_offer,
    offer_intervals,
    range_allowed,
)

MAX_RANGE_BYTES = 64 << 20
_CACHE = 64
_RANGE_RX = re.compile(r"bytes=(\d+)-(\d+)")
_HEX64 = re.compile(r"[0-9a-f]{64}")
MSGPACK = "application/msgpack"


class _Unauthorised(Exception):
    pass


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _token(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _Unauthorised("a portal token is required: Authorization: Bearer TOKEN")
    return token.strip()


class ReplicationSource:
    """One store as a replication source: the open store and the offers' interval cache.

    The endpoints' work without HTTP: :meth:`offer` and :meth:`block` check the
    portal exactly as the endpoints do (``czyx sync`` from a local store
    directory uses them directly, so both sources share one code path).
    """

    def __init__(self, store_dir: str | os.PathLike) -> None:
        if not os.path.isdir(store_dir):
            raise StoreError(f"no store at {str(store_dir)!r}")
        self._dir = Path(store_dir).resolve()
        self._store: Store | None = None
        self._owned = False
        self._lock = threading.Lock()
        self._intervals: OrderedDict[tuple, dict] = OrderedDict()

    @property
    def store(self) -> Store:
        """The store, opened at the first request: the handle this process already has
        open on the directory (``czyx serve`` opens it too, and LMDB allows one
        environment per process), else one of our own."""
        with self._lock:
            if self._store is None or self._store.closed:
                from czyx.store.core.lifecycle import OPEN_STORES

                found = [
                    s for s in list(OPEN_STORES)
                    if not s.closed and Path(s.path).resolve() == self._dir
                ]  # fmt: skip
                if found:
                    self._store, self._owned = found[0], False
                else:
                    self._store, self._owned = Store.open(self._dir, create=False), True
            return self._store

    def _args(self, request: Request) -> tuple[str, Range | None, Range | None]:
        q = request.query_params
        ref = q.get("ref")
        if not ref:
            raise ValueError("the query needs ref=NAME@VERSION (or a 64-hex selector)")
        classes = Range.parse(q.get("classes"), 256, "class")
        layers = Range.parse(q.get("layers"), 1 << 16, "layer")
        return ref, classes, layers

    def offer(self, token: str, ref: str, classes: Range | None, layers: Range | None) -> dict:
        """The offer of ``ref`` (or its subset) to the bearer of ``token`` (``read`` right)."""
        from czyx.portals import open_model

        view = open_model(self.store, token, ref, right=READ)
        try:
            offer = build_offer(
                self.store, view.space, classes=classes, layers=layers, allows=view.allows
            )
        finally:
            view.close()
        key = (offer["version"], classes, layers, token)
        with self._lock:
            self._intervals[key] = offer_intervals(offer)
            self._intervals.move_to_end(key)
            while len(self._intervals) > _CACHE:
                self._intervals.popitem(last=False)
        return offer

    def block(
        self,
        token: str,
        ref: str,
        classes: Range | None,
        layers: Range | None,
        space: str,
        start: int,
        end: int,
    ) -> memoryview:
        """Bytes ``start..end-1`` of block file ``space``, inside the extents offered."""
        from czyx.portals.authority import open_authority
        from czyx.store.models.mount import resolve

        sel = resolve(self.store, ref)
        open_authority(self.store).verify(token, space=sel, right=READ)  # raises PortalDenied
        key = (sel.hex(), classes, layers, token)
        with self._lock:
            iv = self._intervals.get(key)
        if iv is None:
            self.offer(token, ref, classes, layers)
            with self._lock:
                iv = self._intervals[key]
        if not range_allowed(iv.get(space, []), start, end):
            raise SubsetNotAllowed(
                f"bytes {start}-{end - 1} of {space[:16]} are outside the extents offered"
            )
        from czyx.space import Selector

        path = self.store.block_path(Selector.from_hex(space))
        buf = bytearray(end - start)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            n = os.preadv(fd, [buf], start)
        finally:
            os.close(fd)
        if n != len(buf):
            raise StoreError(f"{path}: short read at {start} ({n} of {len(buf)} bytes)")
        return memoryview(buf)

    def close(self) -> None:
        """Close the store if this source opened it."""
        if self._store is not None and self._owned:
            self._store.close()
        self._store = None


async def _guard(fn: Any) -> Response:
    try:
        return await fn()
    except _Unauthorised as exc:
        return _error(401, str(exc))
    except (PortalDenied, SubsetNotAllowed) as exc:
        return _error(403, str(exc))
    except (SpaceNotFoundError, TagNotFoundError) as exc:
        return _error(404, str(exc))
    except (ReplicationError, ValueError) as exc:
        return _error(400, str(exc))


def routes(store_dir: str | os.PathLike) -> list[Route]:
    """The replication routes over the store at ``store_dir`` (opened at the first request,
    or shared with the serving app's handle on the same directory).

    Raises
    ------
    StoreError
        No store at ``store_dir``.
    """
    src = ReplicationSource(store_dir)

    async def offer(request: Request) -> Response:
        async def go() -> Response:
            token = _token(request)
            ref, classes, layers = src._args(request)
            body = await run_in_threadpool(src.offer, token, ref, classes, layers)
            return Response(msgpack.packb(body, use_bin_type=True), media_type=MSGPACK)

        return await _guard(go)

    async def block(request: Request) -> Response:
        async def go() -> Response:
            token = _token(request)
            ref, classes, layers = src._args(request)
            space = request.path_params["space"]
            if not _HEX64.fullmatch(space):
                raise ValueError("block space must be 64 lowercase hex digits")
            m = _RANGE_RX.fullmatch(request.headers.get("range", "").strip())
            if not m:
                raise ValueError("a single Range: bytes=A-B header is required")
            start, end = int(m.group(1)), int(m.group(2)) + 1
            if end <= start or end - start > MAX_RANGE_BYTES:
                raise ValueError(f"range must hold 1..{MAX_RANGE_BYTES} bytes")
            data = await run_in_threadpool(
                src.block, token, ref, classes, layers, space, start, end
            )
            return Response(
                data,
                status_code=206,
                media_type="application/octet-stream",
                headers={"Content-Range": f"bytes {start}-{end - 1}/*"},
            )

        return await _guard(go)

    return [
        Route("/v1/replicate/offer", offer, methods=["GET"]),
        Route("/v1/replicate/block/{space}", block, methods=["GET"]),
    ]


def create_replication_app(store_dir: str | os.PathLike) -> Starlette:
    """A Starlette app serving only :func:`routes` (until ``czyx serve`` mounts them)."""
    return Starlette(routes=routes(store_dir))
