"""Publishing a space: stage extents and records, then make them visible at once.

Protocol (why each step is where it is):

1. Extents are appended to a *new* block file under a private name
   (``<selector>-<generation>.blk.<pid>.part``), created exclusively, so no
   published file is ever touched.
2. On commit the file is ``fsync``-ed, renamed to its final, unique name
   (``<selector>-<generation>.blk``) and the directory is ``fsync``-ed: the
   bytes are durable before anything refers to them.
3. One LMDB write transaction then checks the space is still unpublished,
   inserts every staged record, the manifest entry (with the block file's
   identity: name, generation, size, alignment) and an audit event, and
   commits. That commit is the single instant of publication.

A crash before step 3 commits leaves an unreferenced file (removed by
:func:`collect_garbage`) and the old index; after it, the new state. Readers
never see a half-published space because nothing in the index points at the
new file until the one transaction that publishes all of it.

gc against a publication in flight (why both guards): the writer holds a shared
``flock`` on its file from creation until its transaction ends, and gc skips a
file it cannot lock exclusively, so gc never removes a file being published,
whatever its grace. And gc decides and unlinks inside an LMDB write transaction
while the publish transaction re-checks its file (name, size) before it
commits: the two are serialised by LMDB's write lock, so even a file lost by
other means is never published (the publication fails with
:class:`~store.errors.BlockFileError` instead of reporting success).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import numpy as np

from czyx.space import Selector
from czyx.store.core.blockfile import (
    BlockIdentity,
    BlockWriter,
    dio_alignment,
    encode_header,
    fsync_dir,
)
from czyx.store.core.checksum import CHECKSUM_NAME, checksum
from czyx.store.core.records import (
    SEEDS,
    Extent,
    check_key,
    check_selector,
    decode_sealed,
    encode,
    seal,
)
from czyx.store.errors import (
    BlockFileError,
    SealedSpaceError,
    SpaceNotEmptyError,
    SpaceNotFoundError,
    StoreError,
)
from czyx.store.interfaces import SpaceWriterInterface

if TYPE_CHECKING:
    from czyx.store.core.lmdb_store import Store


class SpaceWriter(SpaceWriterInterface):
    """Stages one space's block file and records; see the module docstring.

    Obtain one from :meth:`store.lmdb_store.Store.begin_space`. Use it as a
    context manager: a clean exit commits, an exception aborts.

    Attributes
    ----------
    space
        The selector being published.
    alignment
        Every extent offset is a multiple of this (>= 4096).
    data_start
        Offset of the first extent (the header occupies one alignment unit).
    """

    def __init__(self, store: Store, sel: bytes, manifest: dict) -> None:
        self._store = store
        self.space = Selector(sel)
        self._manifest = manifest
        encode(manifest)  # refuse an unencodable manifest now, not at commit
        blocks = store.path / "blocks"
        blocks.mkdir(parents=True, exist_ok=True)
        self._blocks = blocks
        self.alignment = dio_alignment(blocks)
        self._gen = os.urandom(16)
        name = f"{sel.hex()}-{self._gen.hex()}.blk"
        self._final = blocks / name
        self._part = blocks / f"{name}.{os.getpid()}.part"
        self._block = BlockWriter(self._part, sel, self._gen, self.alignment)
        # Held until publication ends (the lock follows the inode across the rename):
        # gc skips a file it cannot lock exclusively.
        self._lockfd: int | None = os.open(self._part, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self._lockfd, fcntl.LOCK_SH)
        self.data_start = self._block.size
        self._staged: dict[bytes, bytes] = {}
        self._state = "open"

    @classmethod
    def adopt(
        cls,
        store: Store,
        sel: bytes,
        manifest: dict,
        part: os.PathLike,
        generation: bytes,
        align: int,
        size: int,
    ) -> SpaceWriter:
        """A writer over a block file written elsewhere, complete at ``size`` bytes.

        For a space received from another store (:mod:`store.core.staging`):
        ``part`` (on this store's filesystem) already holds the header for
        ``sel`` and ``generation`` and every extent; :meth:`put` the records,
        then :meth:`commit` publishes it by the same protocol as a locally
        written space (fsync, rename into ``blocks/``, one transaction, the gc
        lock held throughout). Nothing can be written through it.
        """
        self = object.__new__(cls)
        self._store = store
        self.space = Selector(sel)
        self._manifest = manifest
        encode(manifest)
        self._blocks = store.path / "blocks"
        self._blocks.mkdir(parents=True, exist_ok=True)
        self.alignment = align
        self._gen = generation
        self._final = self._blocks / f"{sel.hex()}-{generation.hex()}.blk"
        self._part = Path(part)
        self._block = _FinishedBlock(self._part, size)
        self._lockfd = os.open(self._part, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self._lockfd, fcntl.LOCK_SH)
        self.data_start = align
        self._staged = {}
        self._state = "open"
        return self

    @property
    def size(self) -> int:
        """Bytes in the block file so far."""
        return self._block.size

    @property
    def block_path(self) -> os.PathLike:
        """Where the block file will live once published."""
        return self._final

    def _check_open(self) -> None:
        if self._state != "open":
            raise StoreError(f"space writer for {self.space.hex()} is {self._state}")

    def write_extent(self, data: bytes | bytearray | memoryview | np.ndarray) -> Extent:
        """Append ``data`` at the next aligned offset and return its :class:`Extent`."""
        self._check_open()
        return self._block.write(data)

    def skip_to(self, offset: int) -> None:
        """Continue writing at ``offset`` (aligned, not behind the end), leaving a hole."""
        self._check_open()
        self._block.skip_to(offset)

    def put(self, key: bytes, record: dict) -> None:
        """Stage ``record`` at ``key``; a later put of the same key replaces it.

        Raises
        ------
        KeyLengthError
            ``key`` is not 24 bytes.
        ValueError
            The record's ``off``/``len`` reach past what has been written.
        """
        self._check_open()
        k = check_key(key)
        if not isinstance(record, dict):
            raise TypeError(f"record: expected a dict, got {type(record).__name__}")
        off, n = record.get("off"), record.get("len")
        if isinstance(off, int) and isinstance(n, int) and off + n > self._block.size:
            raise ValueError(
                f"record {k.hex()}: extent [{off}, {off + n}) past the {self._block.size} "
                "bytes written so far"
            )
        self._staged[k] = encode(record)

    def put_many(self, items: Iterable[tuple[bytes, dict]]) -> None:
        """Stage several records."""
        for k, r in items:
            self.put(k, r)

    def commit(self) -> None:
        """Make the block file durable, then publish everything in one transaction.

        Raises
        ------
        SealedSpaceError
            Another writer published the same space first; nothing of ours is visible.
        SpaceNotEmptyError
            Records were put into the space outside this writer.
        """
        self._check_open()
        store, sel = self._store, self.space.raw
        try:
            self._block.sync()
            self._block.close()
            os.rename(self._part, self._final)
            fsync_dir(self._blocks)
        except BaseException:
            self.abort()
            raise
        self._state = "committing"
        ident = BlockIdentity(self._final.name, self._gen, self._block.size, self.alignment)
        entry = seal(
            SEEDS["spaces"],
            sel,
            encode(
                {
                    "manifest": self._manifest,
                    "block": ident.to_record(),
                    "checksum": CHECKSUM_NAME,
                    "count": len(self._staged),
                    "time": time.time(),
                }
            ),
        )
        rec_seed = SEEDS["records"]
        rows = [(sel + k, seal(rec_seed, sel + k, v)) for k, v in sorted(self._staged.items())]
        records_db, spaces_db = store._records, store._spaces

        final = self._final

        def publish(txn: lmdb.Transaction) -> None:
            # Under the write lock gc also takes: the file we name must be there, whole.
            try:
                size = os.stat(final).st_size
            except FileNotFoundError:
                size = -1
            if size != ident.size:
                raise BlockFileError(
                    f"{final}: block file vanished or changed before publication "
                    f"({size} bytes, wrote {ident.size}); nothing was published"
                )
            if txn.get(sel, db=spaces_db) is not None:
                raise SealedSpaceError(f"space {sel.hex()} was published by another writer")
            with txn.cursor(db=records_db) as cur:
                if cur.set_range(sel) and cur.key()[: len(sel)] == sel:
                    raise SpaceNotEmptyError(
                        f"space {sel.hex()} already holds records written with Store.put; "
                        "publish into an empty space"
                    )
                cur.putmulti(rows)
            txn.put(sel, entry, db=spaces_db)
            store._audit_in(
                txn,
                "space.publish",
                {"space": sel.hex(), "records": len(rows), "bytes": ident.size},
            )

        try:
            store._write(publish)
        except BaseException:
            self._state = "aborted"
            self._unlink_unless_published()
            self._unlock()
            raise
        self._state = "committed"
        self._staged.clear()
        self._unlock()

    def _unlock(self) -> None:
        if self._lockfd is not None:
            os.close(self._lockfd)  # closing the descriptor releases the flock
            self._lockfd = None

    def _unlink_unless_published(self) -> None:
        # Only a definite "not published" deletes the block file. If the store
        # cannot say (closed, unreadable entry), the file is kept: an orphan is
        # reclaimed by collect_garbage, a deleted published block is data loss.
        try:
            published = self._store.block_identity(self.space).generation == self._gen
        except SpaceNotFoundError:
            published = False
        except Exception:
            return
        if not published:
            self._final.unlink(missing_ok=True)

    def abort(self) -> None:
        """Discard the staged records and the unpublished block file (idempotent)."""
        if self._state in ("committed", "aborted"):
            return
        self._state = "aborted"
        self._block.close()
        self._part.unlink(missing_ok=True)
        self._staged.clear()
        self._unlock()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._state == "open" and os.getpid() == self._store._pid:
                self.abort()


class _FinishedBlock:
    """A complete block file seen as the :class:`BlockWriter` a commit uses (no writes)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size

    def write(self, data: object) -> Extent:
        raise StoreError(f"{self.path}: an adopted block file is complete; nothing to write")

    def skip_to(self, offset: int) -> None:
        raise StoreError(f"{self.path}: an adopted block file is complete; nothing to write")

    def sync(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


def collect_garbage(store: Store, *, grace_s: float = 3600.0) -> list[str]:
    """Remove block files no published space refers to; return their names.

    A ``.part`` file is removed when the process that was writing it is gone;
    an unreferenced ``.blk`` file (left by a crash between rename and commit)
    when it is older than ``grace_s`` seconds. A file whose writer still holds
    its lock is never removed, and the decision is taken inside a write
    transaction (see the module docstring), so a publication in flight is never
    disturbed, whatever ``grace_s``.
    """
    blocks = store.path / "blocks"
    spaces_db = store._spaces
    seed = SEEDS["spaces"]

    def sweep(txn: lmdb.Transaction) -> list[str]:
        live = set()
        for k, v in txn.cursor(db=spaces_db):
            entry = decode_sealed(seed, k, v, "space entry")
            live.add(BlockIdentity.from_record(entry["block"]).name)
        removed = []
        now = time.time()
        for p in sorted(blocks.iterdir()):
            if p.name in live:
                continue
            try:
                if p.suffix == ".part":
                    pid_text = p.name.rsplit(".", 2)[-2] if p.name.count(".") >= 2 else ""
                    pid = int(pid_text) if pid_text.isdigit() else -1
                    if pid > 0 and _pid_alive(pid):
                        continue
                elif p.suffix != ".blk" or now - p.stat().st_mtime < grace_s:
                    continue
                if _locked(p):
                    continue
                p.unlink()
            except FileNotFoundError:
                continue
            removed.append(p.name)
        return removed

    return store._write(sweep)


def _locked(path: os.PathLike) -> bool:
    """Whether a writer holds ``path``'s publication lock (see the module docstring)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PendingSpace:
    """A space's block file written before its selector is known.

    For content-addressed publishing in one pass (a quantizing mount): the
    selector is a hash of what is being written, so it exists only once every
    extent has been produced. The file is created in ``blocks/`` under a
    private ``pending-<generation>.blk.<pid>.part`` name with a placeholder
    header (a zero selector), so no published file is ever touched, a killed
    writer leaves only a ``.part`` file that :func:`collect_garbage` removes once
    the process is gone, and the shared gc lock is held from creation on, as
    :class:`SpaceWriter` holds it. Extents are written at explicit aligned
    offsets (:meth:`write_at`) or appended (:meth:`append`); :meth:`publish`
    writes the real header and hands the file to :meth:`SpaceWriter.adopt`,
    which publishes it by the ordinary protocol (``fsync``, rename, one LMDB
    transaction); :meth:`abort` deletes it.

    Where the file system accepts it the file is written with ``O_DIRECT``: its
    bytes are written once and not read back by the writer, so the page cache
    would only add a copy, page allocation and dirty-page throttling. A caller
    that hands :meth:`write_at` an aligned buffer padded to the alignment is
    written without a copy; anything else goes through an aligned bounce
    buffer. Where ``O_DIRECT`` is refused (at open or at the first write) the
    same bytes are written through the page cache.

    Parameters
    ----------
    store
        The :class:`~store.core.lmdb_store.Store` the space will be published in.
    chunk
        Bounce buffer size in bytes (rounded up to the alignment).
    """

    def __init__(self, store: Store, chunk: int = 8 << 20) -> None:
        self._store = store
        blocks = store.path / "blocks"
        blocks.mkdir(parents=True, exist_ok=True)
        self._blocks = blocks
        self.alignment = align = dio_alignment(blocks)
        self._gen = os.urandom(16)
        self.path = blocks / f"pending-{self._gen.hex()}.blk.{os.getpid()}.part"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._lockfd: int | None = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self._lockfd, fcntl.LOCK_SH)
        self._direct: int | None = None
        try:
            self._direct = os.open(self.path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except (OSError, AttributeError):  # no O_DIRECT here: through the page cache
            self._direct = None
        chunk = -(-chunk // align) * align
        self._raw = np.empty(chunk + align, np.uint8)
        start = -self._raw.ctypes.data % align
        self._bounce = self._raw[start : start + chunk]
        self.data_start = align
        self._end = align  # the header's unit
        self._state = "open"
        self._write_header(bytes(32))

    @property
    def direct(self) -> bool:
        """Whether extents go through ``O_DIRECT``."""
        return self._direct is not None

    @property
    def size(self) -> int:
        """The file's size so far (a multiple of the alignment)."""
        return self._end

    def _check_open(self) -> None:
        if self._state != "open":
            raise StoreError(f"{self.path}: pending space is {self._state}")

    def _write_header(self, selector: bytes) -> None:
        head = np.frombuffer(encode_header(selector, self._gen, self.alignment), np.uint8)
        self._pwrite(head, 0)

    def _pwrite_fd(self, fd: int, mv: memoryview, offset: int) -> None:
        done, n = 0, len(mv)
        while done < n:
            try:
                got = os.pwrite(fd, mv[done:], offset + done)
            except InterruptedError:
                continue
            except OSError as exc:
                raise StoreError(
                    f"{self.path}: write of {n} bytes at offset {offset} failed "
                    f"([errno {exc.errno}] {exc.strerror})"
                ) from exc
            if got <= 0:
                raise StoreError(f"{self.path}: write at offset {offset + done} made no progress")
            done += got

    def _direct_ok(self, data: np.ndarray) -> bool:
        a = self.alignment
        return self._direct is not None and data.ctypes.data % a == 0 and data.nbytes % a == 0

    def _pwrite(self, data: np.ndarray, offset: int) -> None:
        """Write ``data`` (``uint8``, padded to the alignment by the caller) at ``offset``."""
        if self._direct is not None:
            try:
                if self._direct_ok(data):
                    self._pwrite_fd(self._direct, memoryview(data), offset)
                    return
                pos, n, chunk = 0, data.nbytes, self._bounce.nbytes
                while pos < n:
                    m = min(chunk, n - pos)
                    span = -(-m // self.alignment) * self.alignment
                    self._bounce[:m] = data[pos : pos + m]
                    self._bounce[m:span] = 0
                    self._pwrite_fd(self._direct, memoryview(self._bounce[:span]), offset + pos)
                    pos += m
                return
            except StoreError as exc:
                if not isinstance(exc.__cause__, OSError) or exc.__cause__.errno != errno.EINVAL:
                    raise
                os.close(self._direct)  # the file system refused direct writes: buffered
                self._direct = None
        self._pwrite_fd(self._fd, memoryview(data), offset)

    def write_at(self, offset: int, data: np.ndarray, padded: np.ndarray | None = None) -> Extent:
        """Write ``data`` as the extent at ``offset`` (aligned, at or after :attr:`data_start`).

        ``padded``, when given, is an aligned buffer that begins with ``data`` and
        runs to the next multiple of the alignment with zeros: it is written as
        it is (no copy). Returns the extent (its checksum over ``data`` only).
        """
        self._check_open()
        a = self.alignment
        if offset % a or offset < self.data_start:
            raise ValueError(f"{self.path}: write_at({offset}): not an aligned extent offset")
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        n = data.nbytes
        span = -(-n // a) * a
        ext = Extent(offset, n, checksum(data))
        if (
            padded is not None
            and padded.nbytes == span
            and padded.ctypes.data == data.ctypes.data
            and self._direct_ok(padded)
        ):
            self._pwrite(padded, offset)  # aligned and padded by the caller: no copy
        else:
            self._pwrite(data, offset)  # direct: the bounce buffer pads with zeros
            if self._direct is None and span > n:
                self._pwrite(np.zeros(span - n, np.uint8), offset + n)
        self._end = max(self._end, offset + span)
        return ext

    def append(self, data: np.ndarray | bytes) -> Extent:
        """Write ``data`` as a new extent at the end of the file."""
        if isinstance(data, bytes | bytearray | memoryview):
            data = np.frombuffer(data, np.uint8)
        return self.write_at(self._end, data)

    def publish(self, sel: Selector | bytes, manifest: dict) -> SpaceWriter:
        """Seal the file as space ``sel``'s and return the writer that publishes it.

        Writes the real header, then hands the file to :meth:`SpaceWriter.adopt`:
        :meth:`SpaceWriter.put` the records, then :meth:`SpaceWriter.commit` (or
        use it as a context manager). Nothing can be written here afterwards.
        """
        self._check_open()
        try:
            raw = check_selector(sel)
            self._write_header(raw)
            os.ftruncate(self._fd, self._end)  # holes at the end (a layout's last gaps)
            w = SpaceWriter.adopt(
                self._store, raw, manifest, self.path, self._gen, self.alignment, self._end
            )
        except BaseException:
            self.abort()
            raise
        self._close_fds()
        self._state = "published"
        self._unlock()  # the adopted writer holds its own lock on the same file now
        return w

    def _close_fds(self) -> None:
        for fd in (self._direct, self._fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._direct, self._fd = None, -1

    def _unlock(self) -> None:
        if self._lockfd is not None:
            os.close(self._lockfd)
            self._lockfd = None

    def abort(self) -> None:
        """Delete the file (idempotent; nothing after :meth:`publish`)."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._close_fds()
        self.path.unlink(missing_ok=True)
        self._unlock()

    def __enter__(self) -> PendingSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._state == "open" and os.getpid() == self._store._pid:
                self.abort()
