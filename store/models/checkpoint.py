"""A validating safetensors reader for Hugging Face checkpoint directories.

Scope: read-only access to ``config.json`` and the tensors of one checkpoint
(one ``*.safetensors`` file or shards with their ``*.safetensors.index.json``).
Nothing is trusted: every header is checked before a byte of data is used
(header length inside the file, JSON object, known dtype, shape of
non-negative ints, ``end - begin == prod(shape) * itemsize``, every extent
inside the file's data section, no two extents overlapping), and the index
must agree with the shards (each listed tensor present in the file it names,
no tensor in two shards, no shard tensor the index omits). Failures raise the
typed errors of :mod:`store.mount_errors`, naming the file and the tensor.

The header is validated exactly as the ``safetensors`` library does, so a file it
refuses is refused here too: the header starts with ``{``, and the tensors' data
offsets, sorted, tile the data section with no gap and no overlap and end
exactly at the end of the file (a header length off by one byte leaves the data
shifted and is caught by that). Only regular files are read (a FIFO or a device
named ``model.safetensors`` or ``config.json`` is refused before it is read, so
it can neither hang nor stream forever), JSON is bounded in size and nesting.

Tensors are zero-copy numpy views of a read-only ``mmap`` of the file.
bfloat16 has no numpy dtype: its views are ``uint16`` (the exact bytes) and
:func:`to_float32` widens them exactly (a bf16 is the top half of an fp32).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import stat
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from czyx.store.models.mount_errors import (
    CheckpointError,
    HeaderError,
    MissingTensorError,
    TruncatedFileError,
    UnexpectedTensorError,
)

# safetensors dtype name -> (numpy dtype of the zero-copy view, bytes per element).
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F64": (np.dtype("<f8"), 8),
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),  # raw bf16 bits
    "I64": (np.dtype("<i8"), 8),
    "I32": (np.dtype("<i4"), 4),
    "I16": (np.dtype("<i2"), 2),
    "I8": (np.dtype("i1"), 1),
    "U8": (np.dtype("u1"), 1),
    "F8_E4M3": (np.dtype("u1"), 1),  # raw fp8 bits; converted at mount (store.models.fp8)
    "BOOL": (np.dtype("?"), 1),
}
# Short format names recorded in manifests (``ModelInfo.expert_format``).
FORMAT_OF_DTYPE = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64"}
DTYPE_OF_FORMAT = {v: k for k, v in FORMAT_OF_DTYPE.items()}

# A header larger than this is refused before it is read: safetensors itself
# caps headers at 100 MB, and a lying length must not make us allocate GBs.
MAX_HEADER = 100_000_000
MAX_JSON = 64 << 20  # config.json / index: far above any real one, bounded before reading
_INDEX_SUFFIX = ".safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are, after validation.

    ``offset`` is absolute in ``file``; ``begin``/``end`` are the header's
    data offsets (relative to the data section), kept so an export can put the
    tensor back where it was.
    """

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    begin: int
    end: int


class SafetensorsFile:
    """One validated ``.safetensors`` file, memory-mapped read-only.

    Parameters
    ----------
    path
        The file. It is opened, its header validated and the file mapped;
        ``close`` (or the context manager) unmaps it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._mmap: mmap.mmap | None = None
        self._fd = -1
        with os.fdopen(open_regular(self.path), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            self.header_len, header = _read_header(fh, self.path, size)
            self._parse(header, size)
            if size > 0:
                self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._fd = open_regular(self.path)

    def _parse(self, header: dict[str, Any], size: int) -> None:
        data_start = 8 + self.header_len
        data_len = size - data_start
        spans: list[tuple[int, int, str]] = []
        for name, entry in header.items():
            if name == "__metadata__":
                if not isinstance(entry, dict) or not all(
                    isinstance(v, str) for v in entry.values()
                ):
                    raise HeaderError("__metadata__ is not a str->str map", file=str(self.path))
                self.metadata = dict(entry)
                continue
            info = _parse_entry(self.path, name, entry, data_start)
            if info.end > data_len:
                cls = TruncatedFileError if info.begin <= data_len else HeaderError
                raise cls(
                    f"data offsets [{info.begin}, {info.end}) run past the end of the "
                    f"data section ({data_len} bytes)",
                    file=str(self.path),
                    tensor=name,
                )
            self.tensors[name] = info
            spans.append((info.begin, info.end, name))
        spans.sort()
        for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
            if begin_b < end_a:
                raise HeaderError(
                    f"data overlaps tensor {name_a!r} at offset {begin_b}",
                    file=str(self.path),
                    tensor=name_b,
                )
            if begin_b > end_a:
                raise HeaderError(
                    f"{begin_b - end_a} unclaimed bytes before it (after {name_a!r}); "
                    "safetensors refuses gaps",
                    file=str(self.path),
                    tensor=name_b,
                )
        first = spans[0][0] if spans else 0
        last = spans[-1][1] if spans else 0
        if first != 0 or last != data_len:
            raise HeaderError(
                f"tensors cover data bytes [{first}, {last}) but the data section is "
                f"{data_len} bytes (header length off, or bytes appended?)",
                file=str(self.path),
            )

    def array(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of tensor ``name`` (bf16 as uint16 bits)."""
        info = self.info(name)
        dtype = DTYPES[info.dtype][0]
        if info.nbytes == 0 or self._mmap is None:
            return np.empty(info.shape, dtype)
        count = info.nbytes // dtype.itemsize
        return np.frombuffer(self._mmap, dtype, count, info.offset).reshape(info.shape)

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes as a read-only memoryview of the mapping."""
        info = self.info(name)
        if self._mmap is None:
            return memoryview(b"")
        return memoryview(self._mmap)[info.offset : info.offset + info.nbytes]

    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes of tensor ``name`` from byte ``start`` into ``out``.

        A positional read, not the mapping: bulk consumers (mount) copy from
        the page cache at memcpy speed instead of paying a page fault per
        4 KiB of a fresh mapping, and never hold a GB-sized mapping's pages.
        """
        info = self.info(name)
        n = out.nbytes
        if start < 0 or start + n > info.nbytes:
            raise ValueError(f"{name}: bytes [{start}, {start + n}) outside {info.nbytes}")
        view = memoryview(out).cast("B")
        done = 0
        while done < n:
            got = os.preadv(self._fd, [view[done:]], info.offset + start + done)
            if got <= 0:
                raise TruncatedFileError(
                    f"file ended {n - done} bytes early (changed since opened?)",
                    file=str(self.path),
                    tensor=name,
                )
            done += got

    def info(self, name: str) -> TensorInfo:
        """The validated :class:`TensorInfo` of ``name``."""
        try:
            return self.tensors[name]
        except KeyError:
            raise MissingTensorError("no such tensor", file=str(self.path), tensor=name) from None

    def close(self) -> None:
        """Unmap the file (views taken before stay valid only while referenced)."""
        if self._mmap is not None:
            # numpy views may still export the buffer; the mapping is then
            # released when the last of them is collected.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_header(fh: Any, path: Path, size: int) -> tuple[int, dict[str, Any]]:
    if size < 8:
        raise TruncatedFileError(
            f"{size} bytes, shorter than the 8-byte header length", file=str(path)
        )
    (n,) = struct.unpack("<Q", fh.read(8))
    if n > MAX_HEADER:
        raise HeaderError(f"header length {n} exceeds the {MAX_HEADER}-byte cap", file=str(path))
    if 8 + n > size:
        raise TruncatedFileError(
            f"header length {n} runs past the end of the file ({size} bytes)", file=str(path)
        )
    blob = fh.read(n)
    if blob[:1] != b"{":
        raise HeaderError("header does not start with '{'", file=str(path))
    header = _json(blob, path, HeaderError)
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object", file=str(path))
    return n, header


def _parse_entry(path: Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    where = {"file": str(path), "tensor": name}
    if not isinstance(entry, dict):
        raise HeaderError("entry is not an object", **where)
    dtype = entry.get("dtype")
    if dtype not in DTYPES:
        raise HeaderError(f"unknown dtype {dtype!r}", **where)
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise HeaderError(f"shape {shape!r} is not a list of non-negative ints", **where)
    offs = entry.get("data_offsets")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
        or offs[0] > offs[1]
    ):
        raise HeaderError(f"data_offsets {offs!r} are not [begin <= end]", **where)
    itemsize = DTYPES[dtype][1]
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize if shape else itemsize
    begin, end = offs
    if end - begin != expected:
        raise HeaderError(
            f"{end - begin} bytes for shape {shape} of {dtype} ({itemsize} bytes each) "
            f"needs {expected}",
            **where,
        )
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin, begin, end)


class Checkpoint:
    """A Hugging Face checkpoint directory: ``config.json`` plus validated safetensors.

    Parameters
    ----------
    path
        The directory. With a ``model.safetensors.index.json`` (any
        ``*.safetensors.index.json``) its weight map is authoritative and is
        checked against the shards; otherwise exactly one ``*.safetensors``.

    Raises
    ------
    CheckpointError
        Missing ``config.json`` or weights, several unindexed files, bad JSON.
    HeaderError, TruncatedFileError, MissingTensorError, UnexpectedTensorError
        As the files and index are validated.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError("not a checkpoint directory", file=str(self.path))
        self.config: dict[str, Any] = _load_json(self.path / "config.json")
        self.files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        self.index_name: str | None = None
        try:
            self._open_files()
        except BaseException:
            self.close()
            raise

    def _open_files(self) -> None:
        indexes = sorted(self.path.glob("*" + _INDEX_SUFFIX))
        if len(indexes) > 1:
            raise CheckpointError("more than one safetensors index", file=str(self.path))
        if indexes:
            self._open_indexed(indexes[0])
            return
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError("no *.safetensors file", file=str(self.path))
        if len(shards) > 1:
            raise CheckpointError(
                f"{len(shards)} safetensors files but no *{_INDEX_SUFFIX}", file=str(self.path)
            )
        st = SafetensorsFile(shards[0])
        self.files[shards[0].name] = st
        self._where = dict.fromkeys(st.tensors, st)

    def _open_indexed(self, index_path: Path) -> None:
        self.index_name = index_path.name
        index = _load_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError("index has no str->str weight_map", file=str(index_path))
        for fname in sorted(set(weight_map.values())):
            if Path(fname).name != fname:
                raise CheckpointError(
                    f"index names a path outside the directory: {fname!r}", file=str(index_path)
                )
            if not (self.path / fname).is_file():
                raise MissingTensorError(
                    f"shard {fname!r} named by the index is missing", file=str(index_path)
                )
            self.files[fname] = SafetensorsFile(self.path / fname)
        for name, fname in weight_map.items():
            st = self.files[fname]
            if name not in st.tensors:
                raise MissingTensorError(
                    "listed in the index but absent from its shard", file=str(st.path), tensor=name
                )
            self._where[name] = st
        for fname, st in self.files.items():
            for name in st.tensors:
                if weight_map.get(name) != fname:
                    raise UnexpectedTensorError(
                        f"present in shard but the index maps it to {weight_map.get(name)!r}",
                        file=str(st.path),
                        tensor=name,
                    )

    def names(self) -> list[str]:
        """All tensor names, in (file, data offset) order (the order they lie on disk)."""
        return sorted(self._where, key=lambda n: (self._where[n].path.name, self.info(n).begin))

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``name``; ``MissingTensorError`` if absent."""
        st = self._where.get(name)
        if st is None:
            raise MissingTensorError(
                "no such tensor in the checkpoint", file=str(self.path), tensor=name
            )
        return st.tensors[name]

    def array(self, name: str) -> np.ndarray:
        """Zero-copy view of ``name`` (bf16 as uint16 bits)."""
        return self._file_of(name).array(name)

    def raw(self, name: str) -> memoryview:
        """The bytes of ``name`` as a read-only memoryview."""
        return self._file_of(name).raw(name)

    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        """Positional read of part of ``name`` into ``out`` (see ``SafetensorsFile.read_into``)."""
        self._file_of(name).read_into(name, start, out)

    def _file_of(self, name: str) -> SafetensorsFile:
        self.info(name)
        return self._where[name]

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        """Unmap every file."""
        for st in self.files.values():
            st.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_regular(path: Path) -> int:
    """Open ``path`` read-only if it is a regular file (symlinks to one are fine).

    Opened non-blocking, so a FIFO cannot hang the open; anything but a regular
    file (FIFO, device, directory, socket) is refused before a byte is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError("missing", file=str(path)) from None
    except IsADirectoryError:
        raise CheckpointError("not a regular file (a directory)", file=str(path)) from None
    except OSError as exc:
        raise CheckpointError(f"cannot open: {exc.strerror}", file=str(path)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError("not a regular file (FIFO, device or socket)", file=str(path))
    return fd


_MAX_DEPTH = 64  # JSON nesting: configs and headers are a few levels deep


def _json(blob: bytes, path: Path, error: type[CheckpointError]) -> Any:
    depth = _nesting(blob)
    if depth > _MAX_DEPTH:
        raise error(f"JSON nested {depth} levels deep (limit {_MAX_DEPTH})", file=str(path))
    try:
        return json.loads(blob, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise error(f"not JSON: {exc}"[:300], file=str(path)) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        dup = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _nesting(blob: bytes) -> int:
    """Maximum bracket depth outside strings, by numpy (no recursion, linear time)."""
    a = np.frombuffer(blob, np.uint8)
    if a.size == 0:
        return 0
    quote = a == ord('"')
    if quote.any():
        # A quote escaped by an odd run of backslashes does not toggle strings.
        pos = np.arange(a.size)
        last_other = np.maximum.accumulate(np.where(a != ord("\\"), pos, -1))
        run = np.zeros(a.size, np.int64)  # backslashes right before each byte
        run[1:] = pos[:-1] - last_other[:-1]
        quote &= run % 2 == 0
    inside = (np.cumsum(quote) - quote) % 2 == 1
    step = np.where((a == ord("{")) | (a == ord("[")), 1, 0) - np.where(
        (a == ord("}")) | (a == ord("]")), 1, 0
    )
    step[inside | quote] = 0
    return int(np.cumsum(step).max(initial=0))


def _load_json(path: Path) -> dict[str, Any]:
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_JSON:
            raise CheckpointError(f"{size} bytes, over the {MAX_JSON}-byte cap", file=str(path))
        blob = fh.read(MAX_JSON + 1)
    data = _json(blob, path, CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError("not a JSON object", file=str(path))
    return data


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a tensor view of safetensors ``dtype`` to a new float32 array, exactly.

    bf16 (uint16 bits) becomes fp32 by a 16-bit left shift; f16/f32/f64 by
    numpy's cast (exact for f16; f64 rounds).
    """
    if dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return np.array(array, dtype=np.float32)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, tuple[str, tuple[int, ...], Any]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file from ``name -> (dtype, shape, bytes-like)``, in the given order.

    The header is compact JSON padded with spaces to a multiple of 8 (as the
    reference writer does), tensors packed in order without gaps.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name, (dtype, shape, data) in tensors.items():
        n = _flat_bytes(data).nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for _, _, data in tensors.values():
            fh.write(_flat_bytes(data))


def _flat_bytes(data: Any) -> memoryview:
    # A flat byte view of an array, bytes or memoryview (empty shapes included,
    # which memoryview.cast refuses).
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    view = memoryview(data)
    return view.cast("B") if view.nbytes else memoryview(b"")
