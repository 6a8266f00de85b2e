"""Read a GGUF file (or a set of split GGUF files) as the checkpoint it was converted from.

Scope: :class:`GGUFCheckpoint` opens the file(s) with ``gguf.GGUFReader`` and
presents what :mod:`store.models.mount_plan` expects of a
:class:`~store.models.checkpoint.Checkpoint`: an HF ``config`` rebuilt from
the metadata, HF tensor names (stacked ``ffn_*_exps`` experts become
per-expert tensors; q/k rows put back in HF rope order), and float bytes for
every tensor (quantized ones dequantized by the ``gguf`` package's own
reference dequantizers). :class:`GGUFMountSource` then decides what is stored:

* F32 / F16 / BF16 tensors: their bytes, unchanged (rows reordered for q/k);
* Q8_0, Q4_0, Q4_1: repacked without loss into the store's ``q8`` / ``q4``
  (groups of 32, fp16 scale and offset; ``d (q - z) = d q + m`` with
  ``m = -z d`` exact in fp16), which the C kernels compute from directly;
* any other type: only under an explicit conversion policy
  (:data:`POLICIES`), never silently. ``f32``/``f16``/``bf16`` dequantize to
  that float type; ``q8``/``q4`` requantize with the store's quantizer. Each
  converted tensor's drift (relative RMS error against the GGUF reference
  dequantization, and max abs error) is measured at mount and recorded in
  the manifest's ``quant.converted``, and printed by the CLI.

DeepSeek's ``kv_b_proj`` is rebuilt from its two GGUF halves (``attn_k_b``,
transposed per head, and ``attn_v_b``): in their float type when they share one,
else as the exact float32 of their values (a quantized half's rows run along the
other axis, so no store group format can hold it without requantizing).

The routed experts of a version share one format (one extent layout): if the
expert stacks do not all have the same native type, the policy decides for
all of them (``native`` refuses).

Requantizing (``czyx mount --quant POLICY --allow-requantize``, llama-quantize's
flag): a store quant policy (``store.quant.policy``) on a quantized GGUF. Each
tensor whose role class the policy names a format for is dequantized by the
``gguf`` package's reference dequantizer and quantized by the store's quantizer,
exactly as ``--quant`` quantizes a float32 checkpoint of those values (the
policy's group fallbacks and importance map included); its drift is recorded as a
conversion's. A tensor whose native repack already is that format (Q8_0 under
``q8``) keeps the lossless repack. Every other tensor is stored as a plain mount
stores it, so ``none,expert=q4`` leaves the trunk, its records and its selector
those of the plain mount (two such versions pair as tiers:
:mod:`store.models.tiered`). The manifest's ``quant.policy`` then reads
``gguf:<conversion policy>+requantize:<store policy>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from czyx.store.models.archs import MTP_ROLE
from czyx.store.models.checkpoint import DTYPES, TensorInfo
from czyx.store.models.gguf import (
    ARCHS,
    ConversionPolicyError,
    GGUFArch,
    GGUFError,
    UnsupportedGGUFError,
    classify,
    config_from_gguf,
    kv_b_join,
    qk_rows,
    qkvz_dims,
    qkvz_rows,
    resolve_arch,
    tokenizer_json_from_gguf,
)
from czyx.store.models.mount_errors import MissingTensorError
from czyx.store.models.mount_source import MountSource
from czyx.store.quant.extent import ExpertLayout
from czyx.store.quant.formats import assemble, dequantize, get_format, pack_codes, quantize

#: Conversion policies for source types the store has no native format for.
POLICIES = ("native", "f32", "f16", "bf16", "q8", "q4")
_FLOAT_POLICY = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")


def _qt() -> Any:
    import gguf

    return gguf.GGMLQuantizationType


def _float_types() -> dict[Any, str]:
    q = _qt()
    return {q.F32: "F32", q.F16: "F16", q.BF16: "BF16"}


def _native_types() -> dict[Any, str]:
    q = _qt()
    return {q.Q8_0: "q8", q.Q4_0: "q4", q.Q4_1: "q4"}


@dataclass(frozen=True)
class VTensor:
    """One HF tensor seen through a GGUF tensor: ``expert`` selects a slice of a
    stack, ``rows`` reorders rows (q/k rope order), ``dtype`` is what readers get.

    ``halves``: deepseek2's ``(attn_k_b, attn_v_b)`` that together are HF's
    ``kv_b_proj`` (``tensor`` is the first); ``joined`` the type they are read as:
    their own float type when they share one, else F32 (a quantized half's exact
    dequantized values, a float one widened exactly).
    """

    name: str
    gguf: str
    tensor: Any  # gguf ReaderTensor
    file: Path
    shape: tuple[int, ...]
    dtype: str
    expert: int | None = None
    rows: np.ndarray | None = None
    halves: tuple[Any, Any] | None = None
    joined: Any = None

    @property
    def qtype(self) -> Any:
        return self.joined if self.halves is not None else self.tensor.tensor_type

    @property
    def type_name(self) -> str:
        return self.qtype.name


def is_gguf(path: str | Any) -> bool:
    """Whether ``path`` is a ``.gguf`` file or a directory of them without ``config.json``."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def _split_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if not files:
            raise GGUFError("no *.gguf file", file=str(path))
        return files
    m = _SPLIT.fullmatch(path.name)
    if not m:
        return [path]
    n = int(m.group(3))
    files = [path.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    for f in files:
        if not f.is_file():
            raise MissingTensorError(f"split {f.name} of {n} is missing", file=str(path))
    return files


def _fields(reader: Any) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            out[name] = field.contents()
        except Exception as exc:  # the reader raises plain errors on odd fields
            raise GGUFError(f"metadata field {name!r} is unreadable: {exc}") from None
    return out


class GGUFCheckpoint:
    """A GGUF model as a read-only checkpoint with HF names (see the module docstring).

    Parameters
    ----------
    path
        A ``.gguf`` file, the first (any) file of a ``-0000N-of-0000M.gguf``
        split, or a directory holding the split files.
    policy
        Conversion policy for types without a native store format (:data:`POLICIES`).

    Raises
    ------
    GGUFError, UnsupportedGGUFError, ConversionPolicyError, MissingTensorError
    """

    index_name = None

    def __init__(self, path: str | Any, policy: str = "native") -> None:
        import gguf

        if policy not in POLICIES:
            raise ConversionPolicyError(
                f"conversion policy {policy!r} is not one of {', '.join(POLICIES)}"
            )
        self.path = Path(path)
        self.policy = policy
        self.files = _split_files(self.path)
        readers = []
        for f in self.files:
            try:
                readers.append(gguf.GGUFReader(f, "r"))
            except Exception as exc:  # malformed file: the reader raises ValueError & co
                raise GGUFError(f"not a readable GGUF file: {exc}", file=str(f)) from None
        self.metadata = _fields(readers[0])
        count = int(self.metadata.get("split.count", 1))
        if count != len(self.files):
            raise GGUFError(f"split.count {count} but {len(self.files)} files", file=str(path))
        arch_name = self.metadata.get("general.architecture")
        self.arch: GGUFArch | None = resolve_arch(str(arch_name), self.metadata)
        if self.arch is None:
            raise UnsupportedGGUFError(
                f"GGUF architecture {arch_name!r} is not supported (known: "
                f"{', '.join(sorted(ARCHS))})",
                file=str(self.files[0]),
            )
        raw: dict[str, tuple[Any, Path]] = {}
        for f, r in zip(self.files, readers, strict=True):
            for t in r.tensors:
                if t.name in raw:
                    raise GGUFError("tensor in two split files", file=str(f), tensor=t.name)
                raw[t.name] = (t, f)
        self.gguf_tensors = raw
        self._maps = {f: r.data for f, r in zip(self.files, readers, strict=True)}
        n_vocab = int(raw["token_embd.weight"][0].shape[1]) if "token_embd.weight" in raw else 0
        if not n_vocab:
            raise MissingTensorError("no token_embd.weight", file=str(self.files[0]))
        self.config = config_from_gguf(
            self.metadata, self.arch, n_vocab, "output.weight" not in raw, raw.keys()
        )
        self.tokenizer_json = tokenizer_json_from_gguf(self.metadata)
        self._vt: dict[str, VTensor] = {}
        self._halves: dict[str, dict[str, tuple[str, Any, Path]]] = {}
        for name, (t, f) in raw.items():
            self._add(name, t, f)
        self._join_halves()

    # -- naming ---------------------------------------------------------------------
    def _dtype(self, t: Any, name: str) -> str:
        if t.tensor_type in _float_types():
            return _float_types()[t.tensor_type]
        if self.policy in _FLOAT_POLICY:
            return _FLOAT_POLICY[self.policy]  # every quantized tensor becomes that float
        return "F32"  # read as its dequantized float32, stored packed

    def _add(self, name: str, t: Any, f: Path) -> None:
        kind = classify(self.arch, name)
        if kind is None:
            raise UnsupportedGGUFError(
                f"not a tensor of a {self.arch.gguf} model", file=str(f), tensor=name
            )
        ftypes, ntypes = _float_types(), _native_types()
        if t.tensor_type not in ftypes and t.tensor_type not in ntypes and self.policy == "native":
            raise ConversionPolicyError(
                f"type {t.tensor_type.name} has no native store format: mount with a conversion "
                f"policy ({', '.join(p for p in POLICIES if p != 'native')})",
                file=str(f),
                tensor=name,
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        dtype = self._dtype(t, name)
        if kind.hf is not None and kind.hf in self._vt:
            raise GGUFError(f"two tensors read as {kind.hf}", file=str(f), tensor=name)
        if kind.kv is not None:  # a half of kv_b_proj / in_proj_qkvz: joined once both are seen
            if len(shape) != (3 if kind.kv in ("k", "v") else 2):
                raise GGUFError(f"a split half of shape {list(shape)}", file=str(f), tensor=name)
            self._halves.setdefault(kind.hf, {})[kind.kv] = (name, t, f)
            return
        if kind.squeezed and len(shape) == 2:  # the converter's squeezed conv1d [C, K]
            shape = (shape[0], 1, shape[1])
        if kind.part is not None:
            if len(shape) != 3:
                raise GGUFError(f"expert stack of shape {list(shape)}", file=str(f), tensor=name)
            tmpl = self.arch.expert_names[kind.part]
            for e in range(shape[0]):
                hf = tmpl.format(l=kind.layer, e=e)
                self._vt[hf] = VTensor(hf, name, t, f, shape[1:], dtype, expert=e)
            return
        if kind.hf.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])
        rows = None
        if kind.qk is not None:
            key = "attention.head_count" if kind.qk == "q" else "attention.head_count_kv"
            heads = int(self.metadata[f"{self.arch.gguf}.{key}"])
            rows = qk_rows(shape[0], heads)
        self._vt[kind.hf] = VTensor(kind.hf, name, t, f, shape, dtype, rows=rows)

    def _join_halves(self) -> None:
        """HF ``kv_b_proj`` of each layer's ``attn_k_b`` / ``attn_v_b`` pair (deepseek2),
        ``in_proj_qkvz`` of each ``attn_qkv`` / ``attn_gate`` pair (qwen3next)."""
        ftypes = _float_types()
        qkvz = self.arch.gguf == "qwen3next"  # type: ignore[union-attr]
        pair = ("qkv", "z") if qkvz else ("k", "v")
        for hf, halves in self._halves.items():
            if set(halves) != set(pair):
                have = next(iter(halves.values()))[0]
                raise MissingTensorError(
                    f"the split halves {pair} come in pairs", file=str(self.path), tensor=have
                )
            if hf in self._vt:
                raise GGUFError("both a tensor and its split halves", file=str(self.path))
            if qkvz:
                self._join_qkvz(hf, halves["qkv"], halves["z"])
                continue
            (kname, k, f), (_, v, _) = halves["k"], halves["v"]
            heads, rank, nope = (int(d) for d in reversed(k.shape.tolist()))
            vheads, vdim, vrank = (int(d) for d in reversed(v.shape.tolist()))
            cfg = self.config
            if (heads, nope, vheads, vdim, rank) != (
                cfg["num_attention_heads"],
                cfg["qk_nope_head_dim"],
                cfg["num_attention_heads"],
                cfg["v_head_dim"],
                cfg["kv_lora_rank"],
            ) or vrank != rank:
                raise GGUFError(
                    f"attn_k_b {[heads, rank, nope]} / attn_v_b {[vheads, vdim, vrank]} do not "
                    "match the metadata's heads and latent widths",
                    file=str(f),
                    tensor=kname,
                )
            same = k.tensor_type == v.tensor_type and k.tensor_type in ftypes
            joined = k.tensor_type if same else _qt().F32
            dtype = ftypes[joined]  # (under every policy: the F32 of a quantized pair is exact)
            shape = (heads * (nope + vdim), rank)
            self._vt[hf] = VTensor(hf, kname, k, f, shape, dtype, halves=(k, v), joined=joined)

    def _join_qkvz(self, hf: str, qkv: tuple[str, Any, Path], z: tuple[str, Any, Path]) -> None:
        """HF ``in_proj_qkvz`` of one ``attn_qkv`` / ``attn_gate`` pair: a row permutation
        (:func:`~store.models.gguf.qkvz_rows`), read in the pair's own type when they share
        one (quantized rows too), else as the exact float32 of their values."""
        (qname, q, f), (_, g, _) = qkv, z
        nk, nv, dk, dv = qkvz_dims(self.config)
        rows = (int(q.shape[-1]), int(g.shape[-1]))
        cols = {int(q.shape[0]), int(g.shape[0])}
        if rows != (2 * nk * dk + nv * dv, nv * dv) or cols != {self.config["hidden_size"]}:
            raise GGUFError(
                f"attn_qkv {rows[0]} / attn_gate {rows[1]} rows do not match the metadata's "
                "DeltaNet widths",
                file=str(f),
                tensor=qname,
            )
        same = q.tensor_type == g.tensor_type
        joined = q.tensor_type if same else _qt().F32
        dtype = self._dtype(q, qname) if same else "F32"
        shape = (sum(rows), self.config["hidden_size"])
        self._vt[hf] = VTensor(hf, qname, q, f, shape, dtype, halves=(q, g), joined=joined)

    def _qkvz_join_rows(self, vt: VTensor) -> np.ndarray:
        q, g = vt.halves  # type: ignore[misc]
        if vt.joined == q.tensor_type:  # one type: the stored rows (quant blocks) as they are
            parts = [_rows(t) for t in (q, g)]
        else:
            parts = [_widened(self._half(t), t) for t in (q, g)]
        return np.concatenate(parts)[qkvz_rows(*qkvz_dims(self.config))]

    def _half(self, t: Any) -> np.ndarray:
        """One split half (kv_b's ``[n_head, ., .]``, qkvz's 2-D) as a numpy array of its
        float type (bf16 as uint16 bits), or, quantized, its reference float32
        dequantization."""
        import gguf

        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type in _float_types():
            data = np.asarray(t.data)
            if t.tensor_type == _qt().BF16:
                data = data.view(np.uint16)
            return data.reshape(shape)
        return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)

    def _kv_b_rows(self, vt: VTensor) -> np.ndarray:
        k, v = (self._half(t) for t in vt.halves)  # type: ignore[union-attr]
        if vt.joined == _qt().F32:  # a quantized or mixed pair: exact float32 values
            k, v = (_widened(a, t) for a, t in zip((k, v), vt.halves, strict=True))  # type: ignore[arg-type]
        return kv_b_join(k, v)

    # -- the Checkpoint interface ---------------------------------------------------
    def names(self) -> list[str]:
        """HF tensor names, in GGUF file order."""
        return sorted(
            self._vt,
            key=lambda n: (
                self._vt[n].file.name,
                int(self._vt[n].tensor.data_offset),
                self._vt[n].expert or 0,
            ),
        )

    def vtensor(self, name: str) -> VTensor:
        """The :class:`VTensor` of HF tensor ``name``."""
        try:
            return self._vt[name]
        except KeyError:
            raise MissingTensorError(
                "no such tensor in the GGUF model", file=str(self.path), tensor=name
            ) from None

    def info(self, name: str) -> TensorInfo:
        """HF-side :class:`TensorInfo` (dtype as read; offsets those of the GGUF data)."""
        vt = self.vtensor(name)
        n = int(np.prod(vt.shape)) * DTYPES[vt.dtype][1]
        begin = int(vt.tensor.data_offset)
        if vt.expert is not None:
            begin += vt.expert * (int(vt.tensor.n_bytes) // int(vt.tensor.shape[-1]))
        return TensorInfo(name, vt.file, vt.dtype, vt.shape, begin, n, begin, begin + n)

    def gguf_rows(self, vt: VTensor) -> np.ndarray:
        """The tensor's stored rows as numpy (quantized: ``uint8 [R, row bytes]``), HF order."""
        if vt.halves is not None:
            qkvz = self.arch.gguf == "qwen3next"  # type: ignore[union-attr]
            return self._qkvz_join_rows(vt) if qkvz else self._kv_b_rows(vt)
        data = vt.tensor.data
        if vt.expert is not None:
            data = data[vt.expert]
        if vt.qtype == _qt().BF16:
            data = data.view(np.uint16)
        data = data.reshape(vt.shape[0], -1) if data.ndim != 1 else data
        if vt.rows is not None:
            data = data[vt.rows]
        return data

    def release(self, vt: VTensor) -> None:
        """Drop the pages of ``vt``'s bytes from this process's mapping of its file.

        A mount reads each expert once; without this every page of the file it read
        would stay mapped, and the mount's resident size grow to the file's. The pages
        stay in the page cache (a later read maps them back), so this is only ever a
        hint; where the mapping offers no ``madvise`` it does nothing.
        """
        import mmap

        whole = self._maps.get(vt.file)
        mm = getattr(whole, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or vt.halves is not None:
            return
        data = vt.tensor.data if vt.expert is None else vt.tensor.data[vt.expert]
        start = data.ctypes.data - whole.ctypes.data  # type: ignore[union-attr]
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the bytes only
        hi = (start + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def reference(self, name: str) -> np.ndarray:
        """Float32 values of ``name`` (GGUF's reference dequantization; exact for floats)."""
        import gguf

        vt = self.vtensor(name)
        data = self.gguf_rows(vt)
        if vt.qtype == _qt().F32:
            out = np.asarray(data, np.float32)
        elif vt.qtype == _qt().F16:
            out = data.astype(np.float32)
        elif vt.qtype == _qt().BF16:
            out = (data.astype(np.uint32) << 16).view(np.float32)
        else:
            out = gguf.quants.dequantize(np.ascontiguousarray(data), vt.qtype)
        return out.reshape(vt.shape)

    def array(self, name: str) -> np.ndarray:
        """``name`` as its :meth:`info` dtype (bf16 as uint16 bits), a new array."""
        vt = self.vtensor(name)
        if vt.qtype in _float_types():
            return np.ascontiguousarray(self.gguf_rows(vt)).reshape(vt.shape)
        ref = self.reference(name)
        if vt.dtype == "F32":
            return ref
        if vt.dtype == "F16":
            return ref.astype(np.float16)
        return _to_bf16(ref)

    def raw(self, name: str) -> memoryview:
        """The bytes of :meth:`array`."""
        return memoryview(self.array(name).reshape(-1).view(np.uint8))

    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes of :meth:`raw` from ``start`` into ``out``."""
        data = self.array(name).reshape(-1).view(np.uint8)
        n = out.nbytes
        if start < 0 or start + n > data.size:
            raise ValueError(f"{name}: bytes [{start}, {start + n}) outside {data.size}")
        out.reshape(-1).view(np.uint8)[:] = data[start : start + n]

    def __contains__(self, name: object) -> bool:
        return name in self._vt

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.gguf_tensors)

    def source_manifest(self) -> dict[str, Any]:
        """What the manifest records of the source: format, files, metadata, tensor types."""
        skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
        meta = {k: _plain(v) for k, v in sorted(self.metadata.items()) if k not in skip}
        types = {n: t.tensor_type.name for n, (t, _) in sorted(self.gguf_tensors.items())}
        return {
            "format": "gguf",
            "files": [f.name for f in self.files],
            "metadata": meta,
            "tensor_types": types,
            "index": None,
        }

    def close(self) -> None:
        """Drop the readers' mappings."""
        self._vt.clear()
        self.gguf_tensors.clear()

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _rows(t: Any) -> np.ndarray:
    """A 2-D GGUF tensor's stored rows (bf16 as uint16 bits, quantized as uint8 blocks)."""
    data = np.asarray(t.data)
    if t.tensor_type == _qt().BF16:
        data = data.view(np.uint16)
    return data.reshape(int(t.shape[-1]), -1)


def _widened(a: np.ndarray, t: Any) -> np.ndarray:
    """Float32 of a split half read by ``_half`` (exact: f16/bf16 widen, f32 and
    dequantized values are already float32)."""
    if t.tensor_type == _qt().BF16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (as torch does)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def native_pack(rows: np.ndarray, qtype: Any) -> tuple[np.ndarray, str]:
    """Repack GGUF Q8_0 / Q4_0 / Q4_1 rows (``uint8 [R, row bytes]``) as the store's
    ``q8`` / ``q4`` planar buffer, without loss. Returns ``(bytes, format name)``."""
    q = _qt()
    rows = np.ascontiguousarray(rows, np.uint8)
    r = rows.shape[0]
    bs = {q.Q8_0: 34, q.Q4_0: 18, q.Q4_1: 20}[qtype]
    blocks = rows.reshape(r, -1, bs)
    d = np.ascontiguousarray(blocks[:, :, :2]).view("<f2")[:, :, 0]
    if qtype == q.Q8_0:
        codes = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        zero, bits = 128, 8
    else:
        qs = blocks[:, :, 4:] if qtype == q.Q4_1 else blocks[:, :, 2:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
        zero, bits = 8, 4
    if qtype == q.Q4_1:
        m = np.ascontiguousarray(blocks[:, :, 2:4]).view("<f2")[:, :, 0]
    else:
        m = (d.astype(np.float32) * -zero).astype(np.float16)
        if not np.array_equal(m.astype(np.float32), d.astype(np.float32) * -zero):
            raise GGUFError(f"{qtype.name} scale too large for an exact fp16 offset")
    fmt = get_format(f"q{bits}")
    packed = pack_codes(codes.reshape(r, -1), bits)
    return assemble(packed, d, m, fmt), fmt.name


@dataclass
class Drift:
    """Accumulated error of one converted GGUF tensor against its reference."""

    source: str
    target: str
    sq_err: float = 0.0
    sq_ref: float = 0.0
    max_abs: float = 0.0

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        diff = got.astype(np.float64) - ref
        self.sq_err += float((diff * diff).sum())
        self.sq_ref += float((ref.astype(np.float64) ** 2).sum())
        self.max_abs = max(self.max_abs, float(np.abs(diff).max(initial=0.0)))

    def add32(self, got: np.ndarray, ref: np.ndarray) -> None:
        """:meth:`add` for float32 arrays at a third of its cost (a requantized expert's
        three matrices each): the difference in float32, its squares summed in float64."""
        diff = np.subtract(got, ref, dtype=np.float32)
        self.sq_err += float(np.square(diff).sum(dtype=np.float64))
        self.sq_ref += float(np.square(ref, dtype=np.float32).sum(dtype=np.float64))
        self.max_abs = max(self.max_abs, float(np.abs(diff).max(initial=0.0)))

    @property
    def rel_rms(self) -> float:
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref else 0.0


class DriftConversion:
    """The manifest's ``quant`` section of a converting mount (GGUF, FP8).

    Shared by every source that converts tensors on the way in: the stored formats
    by class and one :class:`Drift` per converted tensor (group). Subclasses name
    their policy (:attr:`policy_label`).
    """

    def __init__(self, expert_fmt: str) -> None:
        self.expert_fmt = expert_fmt
        self.trunk_formats: dict[str, str] = {}
        self.drift: dict[str, Drift] = {}

    @property
    def policy_label(self) -> str:
        """The manifest's ``policy`` value, ``<source>:<policy>``."""
        raise NotImplementedError

    def manifest(self) -> dict[str, object]:
        """``policy`` (:attr:`policy_label`), formats by class, and per converted tensor
        ``[source type, stored format, relative RMS error, max abs error]``."""
        return {
            "policy": self.policy_label,
            "formats": {"expert": self.expert_fmt, **self.trunk_formats},
            "importance": None,
            "converted": {
                n: [d.source, d.target, round(d.rel_rms, 9), round(d.max_abs, 9)]
                for n, d in sorted(self.drift.items())
            },
        }

    def report(self) -> list[str]:
        """One line per converted tensor (group) (what the CLI prints)."""
        return [
            f"converted {n}: {d.source} -> {d.target}, relative RMS error {d.rel_rms:.3e}, "
            f"max abs {d.max_abs:.3e}"
            for n, d in sorted(self.drift.items())
        ]


class GGUFConversion(DriftConversion):
    """The manifest's ``quant`` section of a GGUF mount: policy, stored formats, drift.

    ``requant``: the store quant codec of a requantizing mount (its policy is named in
    :attr:`policy_label`, its importance map's provenance recorded)."""

    def __init__(self, ckpt: GGUFCheckpoint, expert_fmt: str, requant: Any = None) -> None:
        super().__init__(expert_fmt)
        self.ckpt = ckpt
        self.requant = requant
        #: drift keys of the tensors requantized under :attr:`requant`'s policy
        self.requantized: set[str] = set()

    @property
    def policy_label(self) -> str:
        """``gguf:<the checkpoint's policy>``, with ``+requantize:<store policy>`` when
        requantizing."""
        label = f"gguf:{self.ckpt.policy}"
        if self.requant is not None:
            label += f"+requantize:{self.requant.policy.name}"
        return label

    def manifest(self) -> dict[str, object]:
        """:meth:`DriftConversion.manifest`, with a requantizing codec's importance origin."""
        out = super().manifest()
        if self.requant is not None:
            out["importance"] = self.requant.provenance
        return out

    def report(self) -> list[str]:
        """:meth:`DriftConversion.report`, then (when requantizing) one summary line."""
        lines = super().report()
        if self.requant is None:
            return lines
        policy = self.requant.policy.name
        if not self.requantized:
            return [*lines, f"requantized no tensor under --quant {policy} (all kept as stored)"]
        worst = max(self.drift[k].rel_rms for k in self.requantized)
        return [
            *lines,
            f"requantized {len(self.requantized)} tensors under --quant {policy} (lossy: the "
            f"file's values are not kept); worst relative RMS error {worst:.3e}",
        ]


class GGUFMountSource(MountSource):
    """Stored bytes of a GGUF model's tensors, per the module docstring's rules.

    ``requant``: a ``store.quant.codec.QuantCodec`` whose policy's formats replace
    the file's own for the classes it names (the module docstring's requantizing);
    ``None``: every tensor as the file and the conversion policy say.
    """

    def __init__(self, ckpt: GGUFCheckpoint, plan: Any, requant: Any = None) -> None:
        self.ckpt, self.plan = ckpt, plan
        self.requant = requant
        self.tokenizer = None if ckpt.tokenizer_json is None else ckpt.tokenizer_json.encode()
        stacks = {ckpt.vtensor(p.tensor).qtype for parts in plan.experts.values() for p in parts}
        ntypes, ftypes = _native_types(), _float_types()
        fmts = {ntypes.get(t) for t in stacks}
        self.expert_fmt: str | None
        requant_layout = None if requant is None else requant.expert_layout(plan.inter, plan.hidden)
        if requant_layout is not None:
            self.expert_fmt = requant_layout.fmt.name  # the store policy's, for every stack
        elif stacks <= set(ftypes) or ckpt.policy in _FLOAT_POLICY:
            self.expert_fmt = None  # float experts (the plan checked they share a dtype)
        elif len(fmts) == 1 and None not in fmts:
            self.expert_fmt = fmts.pop()  # one native type: repacked without loss
        elif ckpt.policy == "native":
            raise ConversionPolicyError(
                f"routed experts mix types {sorted(t.name for t in stacks)}; one extent format "
                "needs a conversion policy (q8, q4, f32, f16, bf16)",
                file=str(ckpt.path),
            )
        else:
            self.expert_fmt = ckpt.policy
        self.qlayout = (
            None
            if self.expert_fmt is None
            else ExpertLayout(get_format(self.expert_fmt), plan.inter, plan.hidden)
        )
        self.expert_nbytes = plan.expert_nbytes if self.qlayout is None else self.qlayout.nbytes
        self.buf = np.empty(self.expert_nbytes, np.uint8)
        self._scratch = np.empty(0, np.uint8)
        self._float = np.empty(0, np.float32)  # a requantized expert's reference values
        self._requant_experts = requant_layout is not None
        quantized = any(t.tensor_type not in ftypes for t, _ in ckpt.gguf_tensors.values())
        self.conversion = GGUFConversion(ckpt, self.expert_fmt or plan.expert_format, requant)
        self.codec = self.conversion if quantized or requant is not None else None
        # The trunk manifest names the store policy only where a trunk tensor is
        # requantized: otherwise the trunk is the plain mount's, selector included.
        self.trunk_quant = requant if any(self._trunk_requant(t) for t in plan.trunk) else None
        self._seen: set[tuple[int, int]] = set()

    def _requantizes(self, vt: VTensor, fmt: str) -> bool:
        """Whether storing ``vt`` as ``fmt`` requantizes it (its native repack, if it has
        one, is another format)."""
        return _native_types().get(vt.qtype) != fmt

    def _trunk_requant(self, t: Any) -> str | None:
        """The format the store policy requantizes trunk entry ``t`` to, or None (kept as
        a plain mount stores it; multi-token-prediction tensors are, as ``--quant`` keeps
        them)."""
        if self.requant is None or t.role == MTP_ROLE:
            return None
        vt = self.ckpt.vtensor(t.tensor)
        fmt = self.requant.policy.decide(t.role, vt.shape).fmt
        if fmt is None or not self._requantizes(vt, fmt.name):
            return None
        return fmt.name

    def _pack(self, vt: VTensor, fmt: str | None, drift_key: str | None) -> np.ndarray:
        """Bytes of ``vt`` stored as ``fmt`` (None: its float dtype); drift recorded once."""
        ntypes = _native_types()
        if fmt is None:
            if vt.qtype not in _float_types() and drift_key is not None:
                ref = self.ckpt.reference(vt.name)
                got = self.ckpt.array(vt.name)
                got32 = (
                    got
                    if vt.dtype == "F32"
                    else got.astype(np.float32)
                    if vt.dtype == "F16"
                    else (got.astype(np.uint32) << 16).view(np.float32)
                )
                self._drift(drift_key, vt, vt.dtype.lower()).add(got32, ref)
            return self.ckpt.array(vt.name).reshape(-1).view(np.uint8)
        if ntypes.get(vt.qtype) == fmt:
            return native_pack(self.ckpt.gguf_rows(vt), vt.qtype)[0]
        ref = self.ckpt.reference(vt.name)
        packed = quantize(ref.reshape(vt.shape[0], -1), fmt)
        if drift_key is not None:
            got = dequantize(packed, fmt, ref.reshape(vt.shape[0], -1).shape)
            self._drift(drift_key, vt, fmt).add(got, ref.reshape(got.shape))
        return packed

    def _requantize_expert(
        self, key: tuple[int, int], vts: list[VTensor], out: np.ndarray, first: bool
    ) -> None:
        """Expert ``key`` (its gate, up and down ``vts``, one at least not natively in the
        format) under the store policy: their reference values, back to back as a float32
        checkpoint's extent, through the codec (as ``--quant`` on that checkpoint); a part
        whose native repack is the format is repacked instead."""
        fmt = self.qlayout.fmt  # type: ignore[union-attr]
        n = sum(int(np.prod(vt.shape)) for vt in vts)
        if self._float.size < n:
            self._float = np.empty(n, np.float32)
        pos = 0
        for vt in vts:
            size = int(np.prod(vt.shape))
            self._float[pos : pos + size] = self.ckpt.reference(vt.name).reshape(-1)
            pos += size
        raw = self._float[:n].view(np.uint8)
        self.requant.encode_expert_raw(self.qlayout, *key, raw, "F32", out=out)
        pos = 0
        for vt, part in zip(vts, self.qlayout.split(out), strict=True):  # type: ignore[union-attr]
            size = int(np.prod(vt.shape))
            if not self._requantizes(vt, fmt.name):  # lossless where the format allows
                part[:] = native_pack(self.ckpt.gguf_rows(vt), vt.qtype)[0]
            elif first:  # drift once per expert (a two-pass mount assembles twice)
                ref = self._float[pos : pos + size].reshape(vt.shape)
                self._drift(vt.gguf, vt, fmt.name).add32(dequantize(part, fmt, vt.shape), ref)
                self.conversion.requantized.add(vt.gguf)
            pos += size

    def _drift(self, key: str, vt: VTensor, target: str) -> Drift:
        return self.conversion.drift.setdefault(key, Drift(vt.type_name, target))

    def assemble(self, key: tuple[int, int], out: np.ndarray) -> None:
        """Expert ``key``'s extent (gate | up | down) as stored, into ``out``."""
        first = key not in self._seen
        self._seen.add(key)
        vts = [self.ckpt.vtensor(p.tensor) for p in self.plan.experts[key]]
        if self._requant_experts and any(self._requantizes(vt, self.expert_fmt) for vt in vts):
            self._requantize_expert(key, vts, out, first)
        else:  # (every part natively in the policy's format: repacked, as a plain mount does)
            pos = 0
            for vt in vts:
                data = self._pack(vt, self.expert_fmt, vt.gguf if first else None)
                out[pos : pos + data.size] = data
                pos += data.size
            if pos != out.size:
                raise GGUFError(f"expert {key}: {pos} bytes assembled, the extent has {out.size}")
        for vt in vts:  # read once per pass: keep the mount's resident size at a few experts
            self.ckpt.release(vt)

    def stored_tensor(self, t: Any) -> tuple[np.ndarray, str | None]:
        """``(bytes, quantized format or None)`` of trunk entry ``t``."""
        vt = self.ckpt.vtensor(t.tensor)
        fmt = self._trunk_requant(t)
        if fmt is not None:  # the store policy's format: quantized as --quant would
            ref = self.ckpt.reference(vt.name)
            data, got_fmt = self.requant.encode_trunk(t.role, t.layer, ref)
            if got_fmt != fmt:  # the codec decided otherwise than the policy it holds
                raise GGUFError(f"{vt.name}: requantized to {got_fmt}, the policy says {fmt}")
            packed = dequantize(data, fmt, ref.shape)
            self._drift(vt.gguf, vt, fmt).add(packed, ref)
            self.conversion.requantized.add(vt.gguf)
            self.conversion.trunk_formats[t.role] = fmt
            return data, fmt
        if vt.qtype not in _float_types() and self.ckpt.policy not in _FLOAT_POLICY:
            fmt = _native_types().get(vt.qtype) or self.ckpt.policy  # native, else the policy's
        if fmt is not None and len(vt.shape) != 2:
            raise UnsupportedGGUFError(
                f"a quantized {len(vt.shape)}-D tensor", file=str(vt.file), tensor=vt.gguf
            )
        data = self._pack(vt, fmt, vt.gguf)
        if fmt is not None:
            self.conversion.trunk_formats[t.role] = fmt
        return data, fmt

    def tensor(self, name: str) -> np.ndarray:
        """The float bytes of HF tensor ``name``."""
        return self.ckpt.array(name).reshape(-1).view(np.uint8)
