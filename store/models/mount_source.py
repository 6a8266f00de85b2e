"""Read side of a mount: the checkpoint bytes to hash and store, and the content hash.

Scope: byte access to a validated plan's tensors (experts assembled gate | up
| down, optionally through a quantizing codec), the content hash that makes
selectors, and the source facts recorded in a manifest (file headers,
tokenizer). Publishing those bytes as spaces is :mod:`store.mount`.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from czyx.store.io.reader import aligned_empty
from czyx.store.models.archs import MTP_ROLE, SIDE_FILE_MAX, SIDE_FILES, TOKENIZER_FILE
from czyx.store.models.checkpoint import DTYPES, Checkpoint
from czyx.store.models.expert_transform import to_contract
from czyx.store.models.mount_errors import CheckpointError
from czyx.store.models.mount_plan import ModelPlan

CONTENT_HASH = "blake3"


def content_hash(data: Any) -> str:
    """The content identity of a tensor or extent: BLAKE3-256, hex.

    Cryptographic (a selector must not be forgeable by a colliding checkpoint)
    and, unlike SHA-256, fast enough not to bound mount throughput (the
    comparison: ``bench/RATIONALE.md``; mount throughput: ``bench/bench_mount.py``).
    Recorded in every manifest as ``content_hash``.
    """
    return blake3.blake3(data).hexdigest()


def round_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a


class Spool:
    """An unlinked temporary file of byte entries, written once and read back.

    The quantizing mount's packed tensors between its hash pass and its write
    pass (:class:`MountSource`). Where the file system allows it the file is
    written and read with ``O_DIRECT`` through an aligned bounce buffer: the
    spool is read exactly once and soon, so passing it through the page cache
    only costs copies, page allocation and dirty-page throttling (and evicts
    the checkpoint being read). Entries start at multiples of the direct-I/O
    alignment. Elsewhere (``O_DIRECT`` refused at open or at the first write)
    it is an ordinary buffered file with the same entries.

    Parameters
    ----------
    directory : path or None
        Where the file lives (the store's directory; ``None``: the system's
        temporary directory).
    chunk : int
        Bounce buffer size (rounded up to the alignment).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, chunk: int = 8 << 20):
        from czyx.store.core.blockfile import dio_alignment

        # closed by close(); unlinked at once, so nothing outlives the process
        self._fh = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115
        self.align = dio_alignment(
            Path(directory) if directory is not None else tempfile.gettempdir()
        )
        self._direct: int | None = None
        try:
            self._direct = os.open(
                f"/proc/self/fd/{self._fh.fileno()}", os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC
            )
        except (OSError, AttributeError):  # no O_DIRECT here: buffered
            self._direct = None
        chunk = -(-chunk // self.align) * self.align
        self._raw = np.empty(chunk + self.align, np.uint8)
        start = -self._raw.ctypes.data % self.align
        self._bounce = self._raw[start : start + chunk]
        self.end = 0

    @property
    def direct(self) -> bool:
        """Whether entries go through ``O_DIRECT``."""
        return self._direct is not None

    def close(self) -> None:
        """Close the file (its space returns to the file system)."""
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None
        self._fh.close()

    def _fallback(self) -> None:
        assert self._direct is not None
        os.close(self._direct)
        self._direct = None

    def append(self, data: np.ndarray) -> int:
        """Write contiguous ``uint8`` ``data`` as a new entry; returns its offset."""
        base = self.end = round_up(self.end, self.align)
        n, chunk = data.nbytes, self._bounce.nbytes
        pos = 0
        while pos < n:
            m = min(chunk, n - pos)
            if self._direct is not None:
                span = round_up(m, self.align)
                self._bounce[:m] = data[pos : pos + m]
                self._bounce[m:span] = 0
                try:
                    got = os.pwrite(self._direct, memoryview(self._bounce[:span]), base + pos)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._fallback()  # the file system refused direct writes: buffered
                    continue
                if got != span:
                    raise OSError(f"spool: short write of {got} of {span} bytes")
            else:
                m = n - pos
                got = os.pwrite(self._fh.fileno(), memoryview(data[pos:]), base + pos)
                if got != m:
                    raise OSError(f"spool: short write of {got} of {m} bytes")
            pos += m
        self.end = base + n
        return base

    def read(self, offset: int, out: np.ndarray) -> None:
        """Fill contiguous ``uint8`` ``out`` with the entry bytes at ``offset``."""
        n, chunk = out.nbytes, self._bounce.nbytes
        pos = 0
        while pos < n:
            if self._direct is not None:
                m = min(chunk, n - pos)
                span = round_up(m, self.align)
                got = os.preadv(self._direct, [memoryview(self._bounce[:span])], offset + pos)
                if got < m:
                    raise OSError(f"spool: short read of {got} of {m} bytes")
                out[pos : pos + m] = self._bounce[:m]
            else:
                m = n - pos
                got = os.preadv(self._fh.fileno(), [memoryview(out[pos:])], offset + pos)
                if got != m:
                    raise OSError(f"spool: short read of {got} of {m} bytes")
            pos += m


class MountSource:
    """Byte access to the plan's tensors for hashing and writing, through one reused buffer.

    With a quantizing ``codec`` (``store.quant.codec.QuantCodec``) the bytes are
    the stored ones: experts packed in the codec's extent layout, trunk tensors
    packed where the policy says so (``stored_tensor``). A one-pass mount
    (:func:`czyx.store.models.mount._mount_one_pass`) stores each packed tensor
    itself as it is made (``spool=False``, and a ``sink`` for
    :meth:`expert_hashes`). A two-pass mount reads every
    tensor twice (hash pass, then write pass); quantizing is the expensive part,
    so each tensor is quantized once, in the hash pass, and its packed bytes are
    kept in a spool file (:class:`Spool`: an unlinked temporary file in
    ``spool_dir``, at most the version's stored size, direct I/O where the file
    system allows) that the write pass reads back. Nothing but one tensor (or,
    in the pipelined hash pass of :meth:`expert_hashes`, a few experts) at a
    time is held in memory.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        plan: ModelPlan,
        codec: Any = None,
        spool_dir: str | os.PathLike[str] | None = None,
        spool: bool = True,
    ) -> None:
        self.ckpt, self.plan, self.codec = ckpt, plan, codec
        self.qlayout = None if codec is None else codec.expert_layout(plan.inter, plan.hidden)
        self.expert_nbytes = plan.expert_nbytes if self.qlayout is None else self.qlayout.nbytes
        self.buf = np.empty(self.expert_nbytes, np.uint8)
        self._float = np.empty(plan.expert_nbytes if self.qlayout else 0, np.uint8)
        self._scratch = np.empty(0, np.uint8)
        self._packed = np.empty(0, np.uint8)  # a one-pass mount's packed trunk tensor
        # Read once: the manifest's hash and the stored extent are of the same bytes.
        self.tokenizer = tokenizer_bytes(ckpt)
        self.side_files = side_file_bytes(ckpt)
        # closed by close() (MountSource is itself the context manager)
        self._spool = None if codec is None or not spool else Spool(spool_dir)
        self._spooled: dict[Any, tuple[int, int, str | None]] = {}

    # A subclass that overrides assemble/stored_tensor (GGUF, FP8 sources) spools nothing.
    _spool = None
    _packed = np.empty(0, np.uint8)  # replaced per instance when it grows
    #: Side files (name -> bytes) kept beside the tokenizer; none unless a source reads them.
    side_files: dict[str, bytes] = {}  # noqa: RUF012 (never mutated: replaced per instance)

    def close(self) -> None:
        """Drop the spool file (its space returns to the file system)."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def __enter__(self) -> MountSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, key: Any, data: np.ndarray, fmt: str | None) -> None:
        if self._spool is None:  # a one-pass mount stores the bytes itself
            return
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._spooled[key] = (self._spool.append(data), data.nbytes, fmt)

    def _get(self, key: Any, out: np.ndarray | None = None) -> tuple[np.ndarray, str | None]:
        assert self._spool is not None
        off, n, fmt = self._spooled[key]
        if out is None:
            out = np.empty(n, np.uint8)
        self._spool.read(off, out[:n])
        return out, fmt

    def assemble(self, key: tuple[int, int], out: np.ndarray) -> None:
        """Read expert ``key``'s gate, up and down back to back into ``out`` (as stored)."""
        if self._spool is not None and ("expert", key) in self._spooled:
            self._get(("expert", key), out)
            return
        transform = self.plan.expert_transform
        raw = out if self.qlayout is None and transform is None else self._float
        if raw.nbytes < self.plan.expert_nbytes:
            raw = self._float = np.empty(self.plan.expert_nbytes, np.uint8)
        pos = 0
        for p in self.plan.experts[key]:
            self.ckpt.read_into(p.tensor, p.start, raw[pos : pos + p.nbytes])
            pos += p.nbytes
        if transform is not None:  # the source's layout -> gate | up | down
            item = DTYPES[self.plan.dtype][1]
            raw = to_contract(
                raw[: self.plan.expert_nbytes], self.plan.inter, self.plan.hidden, item, transform
            )
            if self.qlayout is None:
                out[:] = raw
        if self.qlayout is not None:
            self.codec.encode_expert_raw(self.qlayout, *key, raw, self.plan.dtype, out=out)
            self._put(("expert", key), out, None)

    def stored_tensor(self, t: Any) -> tuple[np.ndarray, str | None]:
        """``(bytes to store, quantized format or None)`` of trunk entry ``t``.

        The bytes may sit in a scratch buffer: valid until the next call."""
        if self._spool is not None and ("trunk", t.tensor) in self._spooled:
            return self._get(("trunk", t.tensor))
        raw = self.tensor(t.tensor)
        if self.codec is None or t.role == MTP_ROLE:  # kept tensors are stored as they are
            return raw, None
        info = self.ckpt.info(t.tensor)
        scratch = None
        if self._spool is None:  # one pass: stored at once, so the packed buffer is reused
            # a packed format never takes more bytes per weight than a float source
            if self._packed.nbytes < info.nbytes:
                self._packed = np.empty(info.nbytes, np.uint8)
            scratch = self._packed
        data, fmt = self.codec.encode_trunk_raw(
            t.role, t.layer, raw, info.dtype, info.shape, scratch=scratch
        )
        if fmt is not None:
            self._put(("trunk", t.tensor), data, fmt)
        return data, fmt

    def expert_hash(self, key: tuple[int, int]) -> str:
        """The content hash of expert ``key``'s stored bytes (assembled into :attr:`buf`)."""
        self.assemble(key, self.buf)
        return content_hash(self.buf)

    def expert_hashes(
        self,
        keys: Sequence[tuple[int, int]],
        sink: Callable[[tuple[int, int], str, np.ndarray, np.ndarray | None], None] | None = None,
        align: int = 4096,
    ) -> Iterator[tuple[tuple[int, int], str]]:
        """``(key, content hash)`` of each expert of ``keys``, in order: the hash pass.

        The same hashes and spooled bytes as :meth:`expert_hash` key by key. With a
        quantizing codec (and this class's own reading) the pass is a pipeline of
        three threads: one reads the next experts' source bytes, one quantizes
        them (the C quantizer, itself threaded), and the caller's thread spools
        and hashes each packed expert. Reads, the quantizer and the hash release
        the GIL, so the stages overlap; bounded rings of buffers (two source, three
        packed) keep memory at a few experts. An error in a stage is raised here;
        the stages stop when the caller stops iterating.

        ``sink(key, digest, data, padded)``, when given, receives each expert's
        stored bytes ``data`` (valid only during the call) before its key is
        yielded, and nothing is spooled: a one-pass mount writes them into the
        block file there. ``padded`` is ``None`` or a buffer aligned to ``align``
        that starts with ``data`` and runs, zero-filled, to the next multiple of
        ``align`` (so it can be written with ``O_DIRECT`` without a copy).
        """
        pipelined = (
            self.qlayout is not None
            and (self._spool is not None or sink is not None)
            and type(self).assemble is MountSource.assemble
        )
        if not pipelined:
            for k in keys:
                digest = self.expert_hash(k)
                if sink is not None:
                    sink(k, digest, self.buf, None)
                yield k, digest
            return
        keys = list(keys)
        stop = threading.Event()
        raw_free: queue.Queue[np.ndarray] = queue.Queue()
        out_free: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(2):
            raw_free.put(np.empty(self.plan.expert_nbytes, np.uint8))
        n = self.expert_nbytes
        span = round_up(n, align)
        for _ in range(3):
            padded = aligned_empty(span, align)
            padded[n:] = 0
            out_free.put(padded)
        raws: queue.Queue[Any] = queue.Queue()
        outs: queue.Queue[Any] = queue.Queue()

        def take(q: queue.Queue[Any]) -> Any:
            while not stop.is_set():
                try:
                    return q.get(timeout=0.1)
                except queue.Empty:
                    continue
            raise _Stopped

        def reader() -> None:
            try:
                for k in keys:
                    raw = take(raw_free)
                    raws.put((k, raw, self._read_source(k, raw)))
            except _Stopped:
                return
            except BaseException as exc:  # handed to the caller's thread
                raws.put((None, None, exc))

        def quantizer() -> None:
            try:
                for _ in keys:
                    k, raw, data = take(raws)
                    if k is None:
                        outs.put((None, data))
                        return
                    out = take(out_free)
                    self.codec.encode_expert_raw(
                        self.qlayout, *k, data, self.plan.dtype, out=out[:n]
                    )
                    raw_free.put(raw)
                    outs.put((k, out))
            except _Stopped:
                return
            except BaseException as exc:
                outs.put((None, exc))

        threads = [threading.Thread(target=f, daemon=True) for f in (reader, quantizer)]
        for t in threads:
            t.start()
        try:
            for _ in keys:
                k, out = outs.get()
                if k is None:
                    raise out
                digest = content_hash(out[:n])
                if sink is None:
                    self._put(("expert", k), out[:n], None)
                else:
                    sink(k, digest, out[:n], out)
                out_free.put(out)
                yield k, digest
        finally:
            stop.set()
            for t in threads:
                t.join()

    def _read_source(self, key: tuple[int, int], raw: np.ndarray) -> np.ndarray:
        """Expert ``key``'s source bytes as gate | up | down (``raw`` or a transformed copy)."""
        pos = 0
        for p in self.plan.experts[key]:
            self.ckpt.read_into(p.tensor, p.start, raw[pos : pos + p.nbytes])
            pos += p.nbytes
        transform = self.plan.expert_transform
        if transform is None:
            return raw[: self.plan.expert_nbytes]
        item = DTYPES[self.plan.dtype][1]
        return to_contract(
            raw[: self.plan.expert_nbytes], self.plan.inter, self.plan.hidden, item, transform
        )

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor ``name``'s bytes, in a scratch buffer valid until the next call."""
        n = self.ckpt.info(name).nbytes
        if self._scratch.nbytes < n:
            self._scratch = np.empty(n, np.uint8)
        out = self._scratch[:n]
        self.ckpt.read_into(name, 0, out)
        return out


class _Stopped(Exception):
    """A pipeline stage saw the stop flag (the consumer stopped iterating)."""


def tokenizer_bytes(ckpt: Checkpoint) -> bytes | None:
    """The checkpoint directory's ``tokenizer.json``, if it has one."""
    path = ckpt.path / TOKENIZER_FILE
    return path.read_bytes() if path.is_file() else None


def side_file_bytes(ckpt: Any) -> dict[str, bytes]:
    """The checkpoint directory's :data:`~czyx.store.models.archs.SIDE_FILES` it has.

    Only regular files are read (a FIFO or device under that name is refused, not
    waited on), and only up to :data:`~czyx.store.models.archs.SIDE_FILE_MAX` bytes.

    Raises
    ------
    CheckpointError
        A side file that is not a regular file, is larger than the bound, or is not
        what its name says (JSON for ``.json``, UTF-8 text otherwise).
    """
    import stat

    out: dict[str, bytes] = {}
    base = Path(ckpt.path)
    if not base.is_dir():
        return out
    for name in sorted(SIDE_FILES):
        path = base / name
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{name}: not a regular file")
        if st.st_size > SIDE_FILE_MAX:
            raise CheckpointError(f"{name}: {st.st_size} bytes, over the {SIDE_FILE_MAX} bound")
        with open(path, "rb") as fh:
            data = fh.read(SIDE_FILE_MAX + 1)
        if len(data) > SIDE_FILE_MAX:
            raise CheckpointError(f"{name}: over the {SIDE_FILE_MAX} byte bound")
        if name.endswith(".json"):
            try:
                json.loads(data)
            except (ValueError, RecursionError) as exc:
                raise CheckpointError(f"{name}: not JSON ({type(exc).__name__})") from None
        else:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                raise CheckpointError(f"{name}: not UTF-8 text") from None
        out[name] = data
    return out


def source_manifest(ckpt: Checkpoint) -> dict[str, Any]:
    """File names and their exact header text, so export can rebuild the files byte for byte."""
    files = {}
    for fname, st in sorted(ckpt.files.items()):
        with open(st.path, "rb") as fh:
            fh.seek(8)
            files[fname] = fh.read(st.header_len).decode("utf-8")
    index = None
    if ckpt.index_name is not None:
        raw = json.loads((ckpt.path / ckpt.index_name).read_text())
        index = {"name": ckpt.index_name, "metadata": raw.get("metadata", {})}
    return {"files": files, "index": index}
