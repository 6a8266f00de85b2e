"""``czyx pull URL NAME@VERSION``: copy a model version from a remote store into this one.

Only the extents this store lacks move (content-addressed: a version that
shares experts with one already here fetches only the others); every extent
is verified by its checksum on arrival (a corrupted one is refused and
fetched again); an interrupted pull resumes without fetching again what
arrived; the version is published atomically once complete, then tagged.
``--classes`` / ``--layers`` pull a subset of the experts (with the whole
trunk), published as its own content-derived space.

The source is a ``czyx serve`` (or :func:`czyx.server.replication.create_replication_app`)
and the portal must grant ``read`` on the version. The planning, staging
and publishing are :mod:`czyx.store.models.replicate`; this module is the
HTTP client (httpx) and the argparse layer.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from czyx.cli.commands._storearg import add_store_arg, store_dir
from czyx.errors import CzyxError

TIMEOUT_S = 60.0


class PullError(CzyxError):
    """The source refused or failed a request (HTTP status and its message)."""


def register(subparsers: Any) -> None:
    """Add the ``pull`` subcommand."""
    p = subparsers.add_parser("pull", help="copy a model version from a remote store")
    p.add_argument("url", help="the source server, e.g. http://127.0.0.1:8000")
    p.add_argument("ref", metavar="NAME@VERSION", help="tag (or 64-hex selector) at the source")
    add_copy_args(p)
    add_store_arg(p)
    p.set_defaults(func=run)


def add_copy_args(p: Any) -> None:
    """The options ``czyx pull`` and ``czyx sync`` share."""
    p.add_argument("--classes", metavar="LO-HI", help="only experts of these classes")
    p.add_argument("--layers", metavar="LO-HI", help="only experts of these layers")
    p.add_argument("--portal", required=True, metavar="TOKEN", help="portal with the read right")
    p.add_argument("--tag", help="tag to set here (default: NAME@VERSION for a tag ref)")
    p.add_argument("--workers", type=int, default=4, help="parallel range requests (default 4)")
    p.add_argument(
        "--max-range",
        type=int,
        default=16 << 20,
        metavar="BYTES",
        help="largest coalesced range read (default 16 MiB)",
    )


def _raise_for(resp: Any, what: str) -> None:
    if resp.status_code in (200, 206):
        return
    try:
        msg = resp.json().get("error", resp.text)
    except ValueError:
        msg = resp.text[:200]
    raise PullError(f"{what}: HTTP {resp.status_code}: {msg}")


def _get(http: Any, path: str, **kw: Any) -> Any:
    """One GET; a transport failure (refused, reset, timeout) as a :class:`PullError`."""
    import httpx

    try:
        return http.get(path, **kw)
    except httpx.HTTPError as exc:
        raise PullError(f"GET {path}: {type(exc).__name__}: {exc}") from exc


def is_url(location: str) -> bool:
    """Whether ``location`` names a server (``http://``/``https://``) rather than a directory."""
    return location.startswith(("http://", "https://"))


@contextmanager
def _http_source(
    url: str, ref: str, token: str, params: dict[str, str], workers: int
) -> Iterator[tuple[dict, Callable[[str, int, int], bytes]]]:
    """The offer and the range reader of a ``czyx serve --replicate`` at ``url`` (httpx)."""
    import httpx
    import msgpack

    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=max(1, workers))
    with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT_S, limits=limits) as http:
        resp = _get(http, "/v1/replicate/offer", params=params)
        _raise_for(resp, f"offer of {ref}")
        offer = msgpack.unpackb(resp.content, raw=False, strict_map_key=False)

        def fetch_range(space: str, start: int, end: int) -> bytes:
            r = _get(
                http,
                f"/v1/replicate/block/{space}",
                params=params,
                headers={"Range": f"bytes={start}-{end - 1}"},
            )
            _raise_for(r, f"bytes {start}-{end - 1} of {space[:16]}")
            return r.content

        yield offer, fetch_range


@contextmanager
def _local_source(
    src_dir: str, ref: str, token: str, classes: Any, layers: Any
) -> Iterator[tuple[dict, Callable[[str, int, int], bytes]]]:
    """The offer and the range reader of a store directory on this machine: the very
    :class:`~czyx.server.replication.ReplicationSource` the endpoints serve from
    (same portal checks, same extent bounds), without HTTP."""
    from czyx.server.replication import ReplicationSource

    src = ReplicationSource(src_dir)
    try:
        offer = src.offer(token, ref, classes, layers)

        def fetch_range(space: str, start: int, end: int) -> bytes:
            return bytes(src.block(token, ref, classes, layers, space, start, end))

        yield offer, fetch_range
    finally:
        src.close()


def sync(
    source: str,
    dest_dir: str,
    ref: str,
    token: str,
    *,
    classes: str | None = None,
    layers: str | None = None,
    tag: str | None = None,
    workers: int = 4,
    max_range: int = 16 << 20,
    progress: Any = None,
) -> Any:
    """Copy ``ref`` from ``source`` (a server URL or a store directory) into ``dest_dir``.

    Both sources go through the same plan, staging, verification and atomic
    publication (:mod:`czyx.store.models.replicate`); only the range reader
    differs. ``progress`` hears (bytes here, bytes of the version) as extents
    arrive. Returns the :class:`czyx.store.models.replicate.PullResult`.

    Raises
    ------
    PullError
        The server refused (401/403) or failed a request; a destination that is
        a URL (pushing needs a receiving endpoint ``czyx serve`` does not have) or
        the source's own directory.
    PortalDenied
        A local source's portal lacks ``read`` on the version.
    ReplicationError, StagingError
        The offer does not verify, or an extent stays bad after retries.
    """
    from czyx.store import Store
    from czyx.store.models.replicate import Range, plan_pull, run_pull

    cls = Range.parse(classes, 256, "class")  # fail on malformed input before any request
    lay = Range.parse(layers, 1 << 16, "layer")
    if is_url(dest_dir):
        raise PullError(
            f"destination {dest_dir}: a server cannot receive a push; run czyx pull (or "
            "czyx sync URL DIR) on the destination's machine"
        )
    if tag is None and "@" in ref:
        tag = ref
    if is_url(source):
        params = {"ref": ref}
        if classes:
            params["classes"] = classes
        if layers:
            params["layers"] = layers
        src_ctx = _http_source(source, ref, token, params, workers)
    else:
        if os.path.realpath(source) == os.path.realpath(dest_dir):
            raise PullError(f"source and destination are the same store ({source})")
        src_ctx = _local_source(source, ref, token, cls, lay)
    # The destination is opened (or created) only once the source answered.
    with src_ctx as (offer, fetch_range), Store.open(dest_dir) as dest:
        plan = plan_pull(dest, offer)
        return run_pull(
            dest,
            plan,
            fetch_range,
            tag=tag,
            workers=workers,
            max_range=max_range,
            progress=progress,
        )


def pull(
    url: str,
    ref: str,
    token: str,
    dest_dir: str,
    *,
    classes: str | None = None,
    layers: str | None = None,
    tag: str | None = None,
    workers: int = 4,
    max_range: int = 16 << 20,
) -> Any:
    """Pull ``ref`` from the server at ``url`` into the store at ``dest_dir`` (:func:`sync`
    from a URL).

    Returns the :class:`czyx.store.models.replicate.PullResult`.

    Raises
    ------
    PullError
        The server refused (401/403) or failed a request.
    ReplicationError, StagingError
        The offer does not verify, or an extent stays bad after retries.
    """
    return sync(
        _require_url(url), dest_dir, ref, token,
        classes=classes, layers=layers, tag=tag, workers=workers, max_range=max_range,
    )  # fmt: skip


def _require_url(url: str) -> str:
    if not is_url(url):
        raise PullError(f"{url!r} is not an http:// or https:// URL (czyx sync copies from a dir)")
    return url


def copy_and_report(args: argparse.Namespace, source: str, dest: str) -> int:
    """:func:`sync` with the options of :func:`add_copy_args` (a progress bar on a
    terminal); print the summary."""
    from czyx.cli.commands._progress import byte_progress

    with byte_progress(f"copy {args.ref}") as progress:
        res = sync(
            source,
            dest,
            args.ref,
            args.portal,
            classes=args.classes,
            layers=args.layers,
            tag=args.tag,
            workers=args.workers,
            max_range=args.max_range,
            progress=progress,
        )
    print(res.summary())
    return 0


def run(args: argparse.Namespace) -> int:
    """Pull and print the one-line summary."""
    return copy_and_report(args, _require_url(args.url), store_dir(args))
