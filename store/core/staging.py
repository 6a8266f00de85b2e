"""Receiving a space from elsewhere: a resumable staged block file, published at once.

Scope: the store side of replication that knows nothing about models or the
network. A :class:`StagedSpace` is one space being received into this store:
its block file is written at the final offsets as extents arrive (in any
order), each extent is verified against its checksum before it is written,
and an append-only *arrival journal* records which extents are durable. A
copy interrupted at any point (even ``SIGKILL``) resumes from the journal:
what was journaled is re-verified from the local file and never fetched
again; what was not is fetched again.

Files, under ``<store>/staging/<selector hex>/``:

``plan``
    msgpack: the manifest, the block size, the header generation and the
    records to publish. Written once (atomically, by rename) when staging
    starts; a resumed copy must present the same plan, else it is refused.
``block``
    A block file (:mod:`store.core.blockfile` header) of the final size, with
    holes where extents have not arrived yet.
``arrived``
    16-byte entries ``(offset, checksum)`` (little-endian u64): an entry is
    appended only after its extent's bytes were ``fdatasync``-ed; a torn last
    entry (a crash mid-append) is ignored.

Publication (:meth:`StagedSpace.publish`) refuses unless every planned
extent has arrived; then the block file goes through the same protocol as a
locally written space (:class:`store.core.writer.SpaceWriter`: ``fsync``,
rename into ``blocks/``, one LMDB transaction), so readers see all of the
space or none of it.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import numpy as np

from czyx.space import Selector
from czyx.store.core.blockfile import BlockWriter, dio_alignment, fsync_file, read_header
from czyx.store.core.checksum import checksum
from czyx.store.core.records import check_key, check_selector
from czyx.store.core.writer import SpaceWriter
from czyx.store.errors import StoreError

if TYPE_CHECKING:
    from czyx.store.core.lmdb_store import Store

_ENTRY = struct.Struct("<QQ")
STAGING_DIR = "staging"


class StagingError(StoreError):
    """A staged space cannot be used: its plan differs, an extent is bad, or it is incomplete."""


class ExtentChecksumError(StagingError):
    """Bytes received for an extent do not match its checksum (refused, not written)."""


@dataclass(frozen=True)
class PlannedExtent:
    """One extent a staged space expects: where it goes and what its bytes must sum to."""

    offset: int
    length: int
    checksum: int


def staging_path(store: Store, space: Selector) -> Path:
    """The staging directory of ``space`` in ``store`` (it may not exist)."""
    return Path(store.path) / STAGING_DIR / check_selector(space).hex()


class StagedSpace:
    """One space being received; see the module docstring.

    Use :meth:`open` (creates or resumes). Not thread-safe: one receiver
    per staged space (a second process resuming the same space concurrently
    is not supported).

    Attributes
    ----------
    space
        The selector being received.
    align
        The block file's alignment (this store's).
    data_start
        Offset of the first extent (the header takes one alignment unit).
    extents
        ``{offset: PlannedExtent}``: every extent the space needs.
    arrived
        Offsets of the extents already durable (journaled and verified).
    """

    def __init__(self) -> None:  # use StagedSpace.open
        raise TypeError("use StagedSpace.open(...)")

    @classmethod
    def data_start_for(cls, store: Store) -> int:
        """Where extents begin in a block file staged in ``store`` (one alignment unit)."""
        blocks = Path(store.path) / "blocks"
        blocks.mkdir(parents=True, exist_ok=True)
        return dio_alignment(blocks)

    @classmethod
    def open(
        cls,
        store: Store,
        space: Selector,
        manifest: dict,
        size: int,
        records: Sequence[tuple[bytes, dict]],
        extents: Iterable[PlannedExtent],
    ) -> StagedSpace:
        """Create the staging of ``space``, or resume the one already there.

        Parameters
        ----------
        store
            The destination store (open for writing).
        space, manifest
            The space and the manifest it will be published with.
        size
            The block file's final size (a multiple of the alignment).
        records
            ``(key, record)`` to publish; a record's ``off``/``len`` must lie
            inside ``size``.
        extents
            The extents the block file must hold before publication.

        Raises
        ------
        StagingError
            An existing staging of the same space was planned differently, or
            its files are damaged.
        """
        self = object.__new__(cls)
        self.store = store
        self.space = Selector(check_selector(space))
        self.dir = staging_path(store, space)
        self.align = cls.data_start_for(store)
        self.data_start = self.align
        if size % self.align or size < self.data_start:
            raise StagingError(f"staged size {size} is not a multiple of {self.align}")
        self.extents = {e.offset: e for e in extents}
        for e in self.extents.values():
            if e.offset % self.align or e.offset < self.data_start or e.offset + e.length > size:
                raise StagingError(
                    f"extent at {e.offset} (+{e.length}) does not fit an aligned block of {size}"
                )
        recs = [[check_key(k), r] for k, r in records]
        plan = {"manifest": manifest, "size": size, "records": recs}
        self.dir.mkdir(parents=True, exist_ok=True)
        plan_path, block_path = self.dir / "plan", self.dir / "block"
        if plan_path.exists() and block_path.exists():
            old = msgpack.unpackb(plan_path.read_bytes(), raw=False, strict_map_key=False)
            gen = bytes(old.pop("gen", b""))
            if old != msgpack.unpackb(msgpack.packb(plan, use_bin_type=True), raw=False):
                raise StagingError(
                    f"{self.dir}: a staging of this space with another plan exists; "
                    "remove it to start over"
                )
            sel, hgen, align = read_header(block_path)
            if sel != self.space.raw or hgen != gen or align != self.align:
                raise StagingError(f"{block_path}: header does not match its plan")
            if os.stat(block_path).st_size != size:
                raise StagingError(f"{block_path}: size differs from its plan")
        else:
            for p in (plan_path, block_path, self.dir / "arrived"):
                p.unlink(missing_ok=True)
            gen = os.urandom(16)
            w = BlockWriter(block_path, self.space.raw, gen, self.align)
            w.skip_to(size)
            w.sync()
            w.close()
            tmp = self.dir / "plan.tmp"
            tmp.write_bytes(msgpack.packb({**plan, "gen": gen}, use_bin_type=True))
            fsync_file(tmp)
            os.replace(tmp, plan_path)
        self.manifest, self.size, self.generation = manifest, size, gen
        self.records = [(bytes(k), r) for k, r in recs]
        self._block_path = block_path
        self._fd = os.open(block_path, os.O_RDWR | os.O_CLOEXEC)
        self._jfd = os.open(self.dir / "arrived", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.arrived: set[int] = set()
        self._pending: list[PlannedExtent] = []
        self._pending_bytes = 0
        self._load_journal()
        return self

    def _load_journal(self) -> None:
        raw = b""
        while chunk := os.read(self._jfd, 1 << 20):
            raw += chunk
        whole = len(raw) - len(raw) % _ENTRY.size
        if whole != len(raw):  # a torn last entry: drop it
            os.ftruncate(self._jfd, whole)
        os.lseek(self._jfd, whole, os.SEEK_SET)
        for off, s in _ENTRY.iter_unpack(raw[:whole]):
            e = self.extents.get(off)
            if e is None or e.checksum != s:
                raise StagingError(f"{self.dir}: journal names an extent not in the plan ({off})")
            # Re-verify from the file: a journaled extent must still hold its bytes.
            buf = np.empty(e.length, np.uint8)
            n = os.preadv(self._fd, [buf], off)
            if n != e.length or checksum(buf) != e.checksum:
                continue  # damaged since: fetch it again
            self.arrived.add(off)

    @property
    def missing(self) -> list[PlannedExtent]:
        """The planned extents not yet arrived, by offset."""
        return [self.extents[o] for o in sorted(self.extents) if o not in self.arrived]

    @property
    def bytes_arrived(self) -> int:
        """Payload bytes of the extents already durable."""
        return sum(self.extents[o].length for o in self.arrived)

    def receive(
        self, items: Iterable[tuple[int, bytes | memoryview]], *, durable: bool = True
    ) -> list[PlannedExtent]:
        """Verify and write arrived extents; make them durable and journal them.

        ``items`` are ``(offset, bytes)``. Each is checked against its planned
        length and checksum before it is written. The good ones are then made
        durable and journaled (so they are never fetched again), now, or with
        ``durable=False`` at the next :meth:`flush` (fewer ``fdatasync`` calls
        for many small batches; until then a crash loses only their journal
        entries, and they are fetched again).

        Returns
        -------
        list[PlannedExtent]
            The extents refused (wrong length or checksum): nothing of them was
            written; the caller fetches them again.
        """
        bad: list[PlannedExtent] = []
        for off, data in items:
            e = self.extents.get(off)
            if e is None:
                raise StagingError(f"no extent planned at offset {off}")
            mv = memoryview(data).cast("B")
            if len(mv) != e.length or checksum(mv) != e.checksum:
                bad.append(e)
                continue
            done = 0
            while done < e.length:
                done += os.pwrite(self._fd, mv[done:], off + done)
            self._pending.append(e)
            self._pending_bytes += e.length
        if durable:
            self.flush()
        return bad

    @property
    def pending_bytes(self) -> int:
        """Payload bytes written but not yet durable and journaled."""
        return self._pending_bytes

    def flush(self) -> None:
        """``fdatasync`` the written extents, then journal them (durable order)."""
        if not self._pending:
            return
        os.fdatasync(self._fd)
        os.write(self._jfd, b"".join(_ENTRY.pack(e.offset, e.checksum) for e in self._pending))
        os.fsync(self._jfd)
        self.arrived.update(e.offset for e in self._pending)
        self._pending, self._pending_bytes = [], 0

    def publish(self) -> None:
        """Publish the space (all of it, atomically) and remove the staging.

        Raises
        ------
        StagingError
            Extents are still missing.
        SealedSpaceError
            The space was published meanwhile (the staging is then removed).
        """
        self.flush()
        if self.missing:
            raise StagingError(
                f"space {self.space.hex()[:16]}: {len(self.missing)} extents have not arrived"
            )
        self.close()
        w = SpaceWriter.adopt(
            self.store,
            self.space.raw,
            self.manifest,
            self._block_path,
            self.generation,
            self.align,
            self.size,
        )
        for k, r in self.records:
            w.put(k, r)
        w.commit()
        shutil.rmtree(self.dir, ignore_errors=True)

    def discard(self) -> None:
        """Close and delete the staging (nothing was published)."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        """Flush, then close the staged files (idempotent); the staging stays for a resume."""
        if getattr(self, "_fd", -1) >= 0 and self._pending:
            self.flush()
        for name in ("_fd", "_jfd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
