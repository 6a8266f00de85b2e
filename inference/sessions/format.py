"""The SES extent: one saved session state as one contiguous, self-describing byte range.

Scope: the byte layout, encoding a :class:`SessionState` into an aligned
buffer, and parsing (validating) such a buffer back into views. No I/O and no
store: :mod:`inference.sessions.store` writes and reads the extents.

Layout (little-endian; every section offset is recorded in the header)::

    [0, 128)           header   magic, format version, block size, dims, length,
                                KV capacity, section offsets, model selector (32 B)
    meta_off           meta     msgpack: tenant, sampling params, RNG state
    tokens_off         tokens   int32 [L]                 (8-byte aligned)
    logits_off         logits   float32 [V], or absent    (8-byte aligned)
    rec_off            recurrent float32 arrays, or absent (8-byte aligned; format 2)
    kv_off             KV       ceil(L / B) blocks        (4096-byte aligned)

Format 2 (a hybrid model's state) adds the recurrent section: the
linear-attention layers' states (:meth:`HybridCache.recurrent_arrays
<czyx.inference.models.deltanet.HybridCache.recurrent_arrays>`), their shapes
listed in the meta under ``"recurrent"``. It sits in the head, so the head's
checksum covers it and every read (a prefix too) has it. A state without one
is written as format 1, byte for byte as before, and both formats are read.
The recurrent state exists only at the saved length: a hybrid state is
resumed whole (:class:`~inference.sessions.errors.RecurrentCutError` for a
prefix of it), never recomputed.

The KV is stored *block-major*: block ``b`` holds positions
``[b*B, min((b+1)*B, L))`` of every layer as ``float32 [n_layers, 2, n_kv, n, hd]``
(2 = keys, values). Why: a prefix of ``p`` positions is then a contiguous
prefix of the extent (header .. end of block ``ceil(p/B) - 1``), so prefix reuse
reads only what it needs in one read, while inside a block each
``(layer, k|v, kv-head)`` run of ``n * hd`` floats is contiguous, so copying
into the engine's ``[n_kv, capacity, hd]`` arrays is a few large strided
copies per layer, not a per-position loop. ``B`` (:data:`BLOCK`) is also the
granularity of the prefix hashes (:mod:`inference.sessions.prefix`).

Only the filled length of the KV cache is stored; its capacity is recorded so
a resumed cache has the very same array shapes as the one that was saved.

Integrity: the head ``[0, kv_off)`` and each KV block have their own XXH3-64
checksum (kept in the store record, next to the whole extent's), so a prefix
read is verified without reading the rest.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from czyx.inference.sessions.errors import RecurrentCutError, SessionFormatError
from czyx.store.core.checksum import checksum

MAGIC = b"CZYXSES\x00"
FORMAT_VERSION = 1
#: The format of a state with a recurrent section (a hybrid model's).
FORMAT_RECURRENT = 2
FORMATS = (FORMAT_VERSION, FORMAT_RECURRENT)
BLOCK = 64  # positions per KV block and per prefix-hash step
KV_ALIGN = 4096
HEADER = struct.Struct("<8sIIIIIIQQQQQQQQ32s")
F32 = np.dtype("<f4")
I32 = np.dtype("<i4")


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class SessionState:
    """Everything needed to continue a sequence exactly where it stopped.

    Attributes
    ----------
    model
        The 32-byte selector of the model version the KV was computed with.
    tenant
        The tenant that owns the session.
    tokens
        ``int32 [L]``: every token whose keys/values are in the cache, in order.
    k, v
        Per layer, ``float32 [n_kv_heads, L, head_dim]`` (views are fine: only
        the filled length is read).
    logits
        ``float32 [V]``: the logits after the last token (the next token is
        sampled from them), or ``None`` when unknown (a prefix cut).
    sampling
        The sampler's parameters (``temperature``, ``top_k``, ``top_p``, ``seed``).
    rng_state
        ``numpy.random.Generator.bit_generator.state`` of the sampler, or ``None``.
    capacity
        The KV cache capacity (positions) when it was saved.
    recurrent
        A hybrid model's recurrent arrays at length ``L`` (float32, in
        :meth:`HybridCache.recurrent_arrays` order), or ``()``.
    """

    model: bytes
    tenant: str
    tokens: np.ndarray
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    logits: np.ndarray | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    rng_state: dict[str, Any] | None = None
    capacity: int = 0
    recurrent: tuple[np.ndarray, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model, bytes) or len(self.model) != 32:
            raise SessionFormatError("state: model selector must be 32 bytes")
        if not isinstance(self.tenant, str):
            raise SessionFormatError("state: tenant must be a string")
        if len(self.k) != len(self.v) or not self.k:
            raise SessionFormatError("state: k and v need one array per layer (at least one)")
        n = self.length
        shape = (self.k[0].shape[0], n, self.k[0].shape[2])
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            if k.dtype != np.float32 or v.dtype != np.float32:
                # The extent stores float32 KV (the engine's); a wider or narrower
                # cache would need its own format version, not a silent cast.
                raise SessionFormatError(f"state: layer {i} k/v are {k.dtype}/{v.dtype}, not f32")
            if k.ndim != 3 or k.shape != shape or v.shape != shape:
                raise SessionFormatError(
                    f"state: layer {i} k/v shapes {k.shape}/{v.shape}, expected {shape}"
                )
        for i, a in enumerate(self.recurrent):
            if a.dtype != np.float32 or a.ndim < 1:
                raise SessionFormatError(f"state: recurrent array {i} is {a.dtype}, not f32")

    @property
    def format(self) -> int:
        """The extent format this state is written in (2 with a recurrent section)."""
        return FORMAT_RECURRENT if self.recurrent else FORMAT_VERSION

    @property
    def length(self) -> int:
        """Tokens in the history (and positions in the KV cache)."""
        return int(self.tokens.shape[0])

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def n_kv_heads(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.k[0].shape[2])


@dataclass(frozen=True)
class Layout:
    """Byte offsets of one SES extent's sections (see the module docstring)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    length: int
    vocab: int
    meta_len: int
    block: int = BLOCK
    rec_len: int = 0  # bytes of the recurrent section (format 2)

    @property
    def meta_off(self) -> int:
        return HEADER.size

    @property
    def tokens_off(self) -> int:
        return _round_up(self.meta_off + self.meta_len, 8)

    @property
    def logits_off(self) -> int:
        return _round_up(self.tokens_off + 4 * self.length, 8)

    @property
    def rec_off(self) -> int:
        return _round_up(self.logits_off + 4 * self.vocab, 8)

    @property
    def kv_off(self) -> int:
        # rec_len 0: the same offset as format 1 (4096 is a multiple of 8).
        return _round_up(self.rec_off + self.rec_len, KV_ALIGN)

    @property
    def row_bytes(self) -> int:
        """Bytes of one position across every layer, keys and values."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * 4

    @property
    def n_blocks(self) -> int:
        return -(-self.length // self.block)

    def block_len(self, b: int) -> int:
        """Positions in block ``b``."""
        return min(self.block, self.length - b * self.block)

    def block_off(self, b: int) -> int:
        """Offset of block ``b`` (every block before it is full)."""
        return self.kv_off + b * self.block * self.row_bytes

    def prefix_nbytes(self, rows: int) -> int:
        """Bytes from the extent's start that hold the blocks covering ``rows`` positions."""
        if not 0 <= rows <= self.length:
            raise ValueError(f"rows {rows} outside [0, {self.length}]")
        nb = -(-rows // self.block)
        return (
            self.kv_off
            if nb == 0
            else self.block_off(nb - 1) + self.block_len(nb - 1) * (self.row_bytes)
        )

    @property
    def total(self) -> int:
        """Bytes of the whole extent."""
        return self.prefix_nbytes(self.length)


def _meta_bytes(state: SessionState) -> bytes:
    # The PCG64 state holds 128-bit integers, beyond msgpack's 64; JSON keeps them exact.
    rng = None if state.rng_state is None else json.dumps(state.rng_state, sort_keys=True)
    meta: dict[str, Any] = {"tenant": state.tenant, "sampling": dict(state.sampling), "rng": rng}
    if state.recurrent:  # format 2 only: a format-1 meta keeps its exact bytes
        meta["recurrent"] = [list(a.shape) for a in state.recurrent]
    return msgpack.packb(meta, use_bin_type=True)


@dataclass(frozen=True)
class Encoded:
    """An encoded SES extent and the checksums the store record keeps."""

    payload: np.ndarray  # uint8 [layout.total]
    layout: Layout
    head_sum: int
    block_sums: tuple[int, ...]


def encode(state: SessionState) -> Encoded:
    """Serialise ``state`` into one contiguous buffer laid out as the module docstring says.

    Raises
    ------
    SessionFormatError
        If the state's arrays are inconsistent (see :class:`SessionState`).
    """
    meta = _meta_bytes(state)
    vocab = 0 if state.logits is None else int(state.logits.shape[0])
    rec_len = sum(4 * a.size for a in state.recurrent)
    lay = Layout(
        state.n_layers, state.n_kv_heads, state.head_dim, state.length, vocab, len(meta),
        rec_len=rec_len,
    )  # fmt: skip
    buf = np.zeros(lay.total, np.uint8)
    HEADER.pack_into(
        buf,
        0,
        MAGIC,
        state.format,
        lay.block,
        lay.n_layers,
        lay.n_kv_heads,
        lay.head_dim,
        lay.vocab,
        lay.length,
        max(int(state.capacity), lay.length),
        lay.meta_off,
        lay.meta_len,
        lay.tokens_off,
        lay.logits_off,
        lay.kv_off,
        lay.total,
        state.model,
    )
    buf[lay.meta_off : lay.meta_off + len(meta)] = np.frombuffer(meta, np.uint8)
    buf[lay.tokens_off : lay.tokens_off + 4 * lay.length].view(I32)[:] = state.tokens
    if vocab:
        buf[lay.logits_off : lay.logits_off + 4 * vocab].view(F32)[:] = state.logits
    off = lay.rec_off
    for a in state.recurrent:
        buf[off : off + 4 * a.size].view(F32)[:] = a.reshape(-1)
        off += 4 * a.size
    sums = []
    for b in range(lay.n_blocks):
        n, p0 = lay.block_len(b), b * lay.block
        off = lay.block_off(b)
        blk = buf[off : off + n * lay.row_bytes].view(F32)
        blk = blk.reshape(lay.n_layers, 2, lay.n_kv_heads, n, lay.head_dim)
        for i in range(lay.n_layers):
            blk[i, 0] = state.k[i][:, p0 : p0 + n]
            blk[i, 1] = state.v[i][:, p0 : p0 + n]
        sums.append(checksum(memoryview(buf[off : off + n * lay.row_bytes])))
    head_sum = checksum(memoryview(buf[: lay.kv_off]))
    return Encoded(buf, lay, head_sum, tuple(sums))


def _blocked(dst: np.ndarray, nblocks: int, block: int) -> np.ndarray:
    """A writable ``[n_kv, nblocks, block, hd]`` view of positions ``[0, nblocks*block)``
    of a ``[n_kv, capacity, hd]`` array (built from strides, so it can never be a copy)."""
    if dst.ndim != 3 or dst.shape[1] < nblocks * block or dst.dtype != np.float32:
        raise SessionFormatError(f"KV destination {dst.shape} {dst.dtype} too small or not f32")
    s0, s1, s2 = dst.strides
    return np.lib.stride_tricks.as_strided(
        dst, (dst.shape[0], nblocks, block, dst.shape[2]), (s0, block * s1, s1, s2)
    )


class ParsedExtent:
    """A validated view of (a prefix of) a SES extent held in a caller's buffer.

    Parameters
    ----------
    buf
        ``uint8`` bytes of the extent from its start; at least the head, and
        the blocks covering ``rows`` positions.
    rows
        Positions to use (``None``: the whole history, which ``buf`` must hold).
    where
        Names the source in errors (the store, space and offset).

    Raises
    ------
    SessionFormatError
        Bad magic or version, offsets that disagree with the dimensions, or a
        buffer too short for what the header promises.
    """

    def __init__(self, buf: np.ndarray, rows: int | None = None, where: str = "SES extent"):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise SessionFormatError(f"{where}: expected a 1-D uint8 buffer")
        if buf.size < HEADER.size:
            raise SessionFormatError(f"{where}: {buf.size} bytes, shorter than the header")
        (
            magic,
            version,
            block,
            n_layers,
            n_kv,
            hd,
            vocab,
            length,
            capacity,
            meta_off,
            meta_len,
            tokens_off,
            logits_off,
            kv_off,
            total,
            model,
        ) = HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise SessionFormatError(f"{where}: bad magic {magic!r} at offset 0")
        if version not in FORMATS:
            raise SessionFormatError(f"{where}: format version {version}, expected {FORMATS}")
        if block <= 0 or n_layers <= 0 or n_kv <= 0 or hd <= 0:
            raise SessionFormatError(
                f"{where}: header dims block={block} n_layers={n_layers} n_kv={n_kv} hd={hd}"
            )
        if meta_off != HEADER.size:
            raise SessionFormatError(f"{where}: header field meta_off={meta_off}, layout says 128")
        if buf.size < meta_off + meta_len:
            raise SessionFormatError(
                f"{where}: {buf.size} bytes, its meta needs {meta_off + meta_len} (truncated read?)"
            )
        try:
            meta = msgpack.unpackb(bytes(buf[meta_off : meta_off + meta_len]), raw=False)
            rng = None if meta.get("rng") is None else json.loads(meta["rng"])
            tenant, sampling = meta["tenant"], dict(meta["sampling"])
            shapes = [tuple(int(n) for n in s) for s in meta.get("recurrent") or ()]
        except Exception as exc:
            raise SessionFormatError(
                f"{where}: undecodable meta at offset {meta_off} ({exc})"
            ) from exc
        if (version == FORMAT_RECURRENT) != bool(shapes) or any(
            not s or min(s) <= 0 for s in shapes
        ):
            raise SessionFormatError(
                f"{where}: format {version} with recurrent shapes {shapes} (format 2 needs some)"
            )
        sizes = [int(np.prod(s)) for s in shapes]
        lay = Layout(n_layers, n_kv, hd, length, vocab, meta_len, block, 4 * sum(sizes))
        for name, got, want in (
            ("meta_off", meta_off, lay.meta_off),
            ("tokens_off", tokens_off, lay.tokens_off),
            ("logits_off", logits_off, lay.logits_off),
            ("kv_off", kv_off, lay.kv_off),
            ("total", total, lay.total),
        ):
            if got != want:
                raise SessionFormatError(f"{where}: header field {name}={got}, layout says {want}")
        rows = length if rows is None else rows
        if not 0 <= rows <= length:
            raise SessionFormatError(f"{where}: asked for {rows} positions of {length}")
        need = lay.prefix_nbytes(rows)
        if buf.size < need:
            raise SessionFormatError(
                f"{where}: {buf.size} bytes, {rows} positions need {need} (truncated read?)"
            )
        self.where = where
        self.layout = lay
        self.rows = rows
        self.capacity = int(capacity)
        self.model = bytes(model)
        self.tenant: str = tenant
        self.sampling: dict[str, Any] = sampling
        self.rng_state: dict[str, Any] | None = rng
        self.tokens = buf[tokens_off : tokens_off + 4 * length].view(I32)
        self.logits = buf[logits_off : logits_off + 4 * vocab].view(F32) if vocab else None
        rec, off = [], lay.rec_off
        for shape, n in zip(shapes, sizes, strict=True):
            rec.append(buf[off : off + 4 * n].view(F32).reshape(shape))
            off += 4 * n
        #: The recurrent arrays (views of the buffer), or () for a format-1 state.
        self.recurrent: tuple[np.ndarray, ...] = tuple(rec)
        self._buf = buf

    def verify(self, head_sum: int, block_sums: list[int] | tuple[int, ...]) -> None:
        """Check the head and the blocks covering :attr:`rows` against the record's sums.

        Raises
        ------
        SessionFormatError
            A checksum differs (naming the section and its offset).
        """
        lay, buf = self.layout, self._buf
        if len(block_sums) != lay.n_blocks:
            raise SessionFormatError(
                f"{self.where}: record has {len(block_sums)} block sums, extent {lay.n_blocks}"
            )
        got = checksum(memoryview(buf[: lay.kv_off]))
        if got != head_sum:
            raise SessionFormatError(
                f"{self.where}: head [0, {lay.kv_off}) checksum {got:016x} != {head_sum:016x}"
            )
        for b in range(-(-self.rows // lay.block)):
            off, n = lay.block_off(b), lay.block_len(b) * lay.row_bytes
            got = checksum(memoryview(buf[off : off + n]))
            if got != block_sums[b]:
                raise SessionFormatError(
                    f"{self.where}: KV block {b} at offset {off} checksum {got:016x} "
                    f"!= {block_sums[b]:016x}"
                )

    def _blocks(self) -> list[tuple[int, int, np.ndarray]]:
        """``(first position, count, [n_layers, 2, n_kv, count, hd] view)`` per needed block."""
        lay, out = self.layout, []
        for b in range(-(-self.rows // lay.block)):
            n, off = lay.block_len(b), lay.block_off(b)
            blk = self._buf[off : off + n * lay.row_bytes].view(F32)
            out.append((b * lay.block, n, blk.reshape(lay.n_layers, 2, lay.n_kv_heads, n, -1)))
        return out

    def copy_kv_into(
        self, k: list[np.ndarray], v: list[np.ndarray], rows: int | None = None
    ) -> None:
        """Copy the first ``rows`` positions (default :attr:`rows`) into per-layer
        ``[n_kv, cap, hd]`` arrays.

        Full blocks go in one strided copy per layer and k/v (the block axis is
        folded into the position axis of the destination view); only the last,
        partial block is copied on its own.
        """
        lay = self.layout
        rows = self.rows if rows is None else rows
        if not 0 <= rows <= self.rows:
            raise ValueError(f"rows {rows} outside the {self.rows} positions read")
        nfull = rows // lay.block
        if nfull:
            full = self._buf[lay.kv_off : lay.block_off(nfull)].view(F32)
            full = full.reshape(nfull, lay.n_layers, 2, lay.n_kv_heads, lay.block, lay.head_dim)
            for i in range(lay.n_layers):
                for j, dst in enumerate((k[i], v[i])):
                    _blocked(dst, nfull, lay.block)[...] = full[:, i, j].transpose(1, 0, 2, 3)
        if rows > nfull * lay.block:
            p0 = nfull * lay.block
            n = rows - p0
            off = lay.block_off(nfull)
            blk = self._buf[off : off + lay.block_len(nfull) * lay.row_bytes].view(F32)
            blk = blk.reshape(lay.n_layers, 2, lay.n_kv_heads, lay.block_len(nfull), -1)
            for i in range(lay.n_layers):
                k[i][:, p0 : p0 + n] = blk[i, 0, :, :n]
                v[i][:, p0 : p0 + n] = blk[i, 1, :, :n]

    def to_state(self) -> SessionState:
        """A self-contained :class:`SessionState` of the first :attr:`rows` positions (copies).

        ``logits`` is kept only when every position is used (a prefix cut has
        no logits for its last position).
        """
        lay, rows = self.layout, self.rows
        if self.recurrent and rows != lay.length:
            raise RecurrentCutError(
                f"{self.where}: a hybrid model's state exists at its {lay.length} positions "
                f"only; {rows} would need the recurrent state there (fork or resume it whole)"
            )
        shape = (lay.n_kv_heads, rows, lay.head_dim)
        k = [np.empty(shape, np.float32) for _ in range(lay.n_layers)]
        v = [np.empty(shape, np.float32) for _ in range(lay.n_layers)]
        self.copy_kv_into(k, v)
        full = rows == lay.length
        return SessionState(
            model=self.model,
            tenant=self.tenant,
            tokens=self.tokens[:rows].astype(np.int32),
            k=tuple(k),
            v=tuple(v),
            logits=None if self.logits is None or not full else self.logits.copy(),
            sampling=dict(self.sampling),
            rng_state=self.rng_state,
            capacity=self.capacity if full else rows,
            recurrent=tuple(a.copy() for a in self.recurrent),
        )
