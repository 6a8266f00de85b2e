"""Export a mounted model version back to a Hugging Face checkpoint directory.

Scope: the inverse of :mod:`store.mount` for unquantized versions. The full
model at the root of the version's chain recorded its source files' exact
header text and, at every record, where its bytes came from (tensor name and
byte range inside it). Export recreates those files: the same header, every
tensor's bytes put back at the same data offset, taken from the most derived
version (so an adapter's replacements land where the base's tensors were).
For an unquantized mount the files are therefore byte-identical to the
source, and transformers loads them (``config.json`` is written from the
manifest; a sharded source gets its ``*.safetensors.index.json`` back).

Every extent read is checksum-verified; a file whose tensors are not fully
covered by records is an error, never a file with silent zeros.

A version whose stored values are not its source files' bytes is rebuilt
instead (:func:`_export_rebuilt`): one ``model.safetensors`` with HF names,
each tensor in its compute dtype (the source dtype the record names: the
checkpoint's own, F32 for a GGUF quant type or an FP8 weight converted to
f32). That covers GGUF sources and FP8 conversions (the values are exactly
what is stored) and, only when asked (``dequantize=True``, ``czyx export
--dequantize``), versions with packed (quantized) tensors, whose values are
then their dequantization: lossy against the source, so never implicit. The
version's format history (source format, conversion policy and drift, stored
formats) is written to ``czyx_format_history.json`` and to the safetensors
metadata (``czyx_format_history``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from czyx.space import Selector
from czyx.store.core.blockfile import fsync_dir, fsync_file
from czyx.store.core.checksum import checksum
from czyx.store.errors import ChecksumError
from czyx.store.interfaces import StoreInterface
from czyx.store.models.archs import (
    FILE_ROLES,
    NORMS_HOLD_ONE_PLUS,
    SIDE_FILES,
    TOKENIZER_FILE,
    TOKENIZER_ROLE,
)
from czyx.store.models.checkpoint import DTYPES
from czyx.store.models.expert_transform import from_contract
from czyx.store.models.model import ModelSpace
from czyx.store.models.mount_errors import ModelSpaceError, MountError
from czyx.store.quant.formats import dequantize as dequantize_packed
from czyx.store.quant.formats import get_format, is_quant_format

RAW_FORMATS = frozenset({"f32", "f16", "bf16", "f64"})


class ExportError(MountError):
    """A version cannot be exported as a faithful checkpoint."""


#: An export's progress: called with (bytes written, bytes to write in all).
Progress = Callable[[int, int], None]
#: The names an export writes under until it is complete (see :func:`staging_leftovers`).
_STAGE_PREFIX, _PARTIAL = ".czyx-export-", ".partial"


@contextlib.contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """A temporary name beside ``path`` to write it under: renamed to ``path`` (after an
    fsync) when the block ends, removed if it raises, so ``path`` is never half written
    and a failed export leaves nothing (a directory it had to create included)."""
    made = _make_parent(path.parent)
    # A fresh name the writer creates (not mkstemp's file: that one is 0600, and the
    # export would keep that mode instead of the umask's).
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_PARTIAL}"
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        _remove_made(made)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A hidden directory inside ``out`` to write an export's files into: each moved into
    ``out`` (fsynced, then an atomic rename) when the block ends, all removed if it
    raises, so a failed export changes nothing in ``out``."""
    made = _make_parent(out)
    stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=out))
    try:
        yield stage
        names = sorted(os.listdir(stage))
        for name in names:
            fsync_file(stage / name)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_made(made)
        raise
    for name in names:
        os.replace(stage / name, out / name)
    stage.rmdir()
    fsync_dir(out)


def staging_leftovers(out: Path) -> list[Path]:
    """What exports into ``out`` (a directory, or a ``.gguf`` path) killed midway left:
    their staging directories and partial GGUF files (an export that sees its own error
    removes them itself)."""
    if out.suffix == ".gguf":
        return sorted(out.parent.glob(f".{out.name}.*{_PARTIAL}"))
    return sorted([*out.glob(f"{_STAGE_PREFIX}*"), *out.glob(f".*{_PARTIAL}")])


def _make_parent(path: Path) -> Path | None:
    """Create directory ``path`` (and parents) if absent; the topmost one created."""
    top = None
    for p in [path, *path.parents]:
        if p.exists():
            break
        top = p
    path.mkdir(parents=True, exist_ok=True)
    return top


def _remove_made(top: Path | None) -> None:
    if top is not None:
        shutil.rmtree(top, ignore_errors=True)


def export(
    store: StoreInterface,
    ref: str | Selector,
    out_dir: str | os.PathLike[str],
    *,
    dequantize: bool = False,
    progress: Progress | None = None,
) -> list[Path]:
    """Write the model version ``ref`` as a checkpoint directory ``out_dir``.

    The files are written into a hidden directory inside ``out_dir`` and moved into
    place only once every one is complete and checked, so a failed export (a
    checksum mismatch, a full disk) changes nothing there.

    Parameters
    ----------
    store
        An open :class:`store.Store`.
    ref
        ``NAME@VERSION``, 64-hex selector or :class:`Selector`.
    out_dir
        Created if absent; files of the same names are replaced.
    dequantize
        Allow a version with quantized tensors: they are written dequantized
        to their compute dtype (see the module docstring).
    progress
        Called with (tensor bytes written, total) as the export goes.

    Returns
    -------
    list of Path
        The files written.

    Raises
    ------
    ExportError
        A quantized version without ``dequantize``, a replaced tensor whose
        format differs from the source's, or source bytes no record covers.
    """
    space = ModelSpace(store, ref)
    if any(k[0] == "rope_freqs" for k in space.trunk):  # (before what dequantizing answers)
        raise ExportError(
            "version holds a GGUF's rope_freqs (llama.cpp's rope factors), which no "
            "transformers config expresses: export it as GGUF"
        )
    fmt = space.root["expert"]["format"]
    packed = is_quant_format(fmt) or any("qfmt" in r.record for r in space.trunk.values())
    if packed and not dequantize:
        raise ExportError(
            f"version is quantized (expert format {fmt!r}, policy "
            f"{(space.root.get('quant') or {}).get('policy')!r}); export with dequantize=True "
            "(czyx export --dequantize) to write its dequantized values"
        )
    held = [r for r in ("lin_neg_a", "mamba_neg_a") if any(k[0] == r for k in space.trunk)]
    if held or space.root["config"].get(NORMS_HOLD_ONE_PLUS):
        raise ExportError(
            "version holds llama.cpp's own values (ssm_a = -exp(A_log), norms as 1 + w), "
            "whose HF inverse is not exact in float32: export it as GGUF"
        )
    source = space.root["source"]
    rebuilt = packed or source.get("format") == "gguf" or source.get("conversion")
    if not rebuilt:
        if fmt not in RAW_FORMATS:
            raise ExportError(f"expert format {fmt!r} is quantized; export writes only raw formats")
        if space.root.get("quant"):  # trunk tensors may be packed even when experts are raw
            raise ExportError(
                f"version is quantized (policy {space.root['quant'].get('policy')!r}); "
                "export writes only raw formats"
            )
    out = Path(out_dir)
    with staged_dir(out) as stage:
        files = (_export_rebuilt if rebuilt else _export_raw)(space, stage, progress)
    return [out / f.name for f in files]


def _export_raw(space: ModelSpace, out: Path, progress: Progress | None) -> list[Path]:
    """The source's own files, byte for byte (see the module docstring)."""
    root_sel = space.chain[0][0]
    files = space.root["source"]["files"]
    layout = _file_layout(files)
    handles = {name: _create(out / name, text, layout[name][1]) for name, text in files.items()}
    where = {t: (name, off) for name, (offs, _) in layout.items() for t, off in offs.items()}
    covered = dict.fromkeys(files, 0)
    total = sum(need for _, need in layout.values())

    def tick() -> None:
        if progress is not None:
            progress(sum(covered.values()), total)

    try:
        _export_trunk(space, where, handles, covered, tick)
        _export_experts(space, root_sel, where, handles, covered, tick)
    finally:
        for fh in handles.values():
            fh.close()
    for name, (_, need) in layout.items():
        if covered[name] != need:
            raise ExportError(f"{name}: records cover {covered[name]} of {need} data bytes")
    written = [out / name for name in files]
    tok = space.trunk.get((TOKENIZER_ROLE, None))
    if tok is not None:
        (out / TOKENIZER_FILE).write_bytes(space.read_trunk_raw(tok).tobytes())
        written.append(out / TOKENIZER_FILE)
    written += _export_side_files(space, out)
    (out / "config.json").write_text(json.dumps(space.root["config"], indent=2) + "\n")
    written.append(out / "config.json")
    index = space.root["source"]["index"]
    if index is not None:
        weight_map = {t: f for f, (tensors, _) in layout.items() for t in tensors}
        body = {"metadata": index["metadata"], "weight_map": dict(sorted(weight_map.items()))}
        (out / index["name"]).write_text(json.dumps(body, indent=2) + "\n")
        written.append(out / index["name"])
    return written


def _file_layout(files: dict[str, str]) -> dict[str, tuple[dict[str, int], int]]:
    """Per source file: ``({tensor: absolute data offset}, data bytes)``."""
    layout = {}
    for name, text in files.items():
        header = json.loads(text)
        data_start = 8 + len(text.encode())
        offsets = {
            t: data_start + e["data_offsets"][0] for t, e in header.items() if t != "__metadata__"
        }
        size = sum(
            e["data_offsets"][1] - e["data_offsets"][0]
            for t, e in header.items()
            if t != "__metadata__"
        )
        layout[name] = (offsets, size)
    return layout


def _create(path: Path, header_text: str, data_bytes: int) -> Any:
    blob = header_text.encode()
    fh = open(path, "wb")  # noqa: SIM115 - closed by export() after all pieces are written
    fh.write(struct.pack("<Q", len(blob)) + blob)
    fh.truncate(8 + len(blob) + data_bytes)
    return fh


def _where(where: dict[str, tuple[str, int]], tensor: str) -> tuple[str, int]:
    try:
        return where[tensor]
    except KeyError:
        raise ExportError(f"tensor {tensor!r} is in no source file header") from None


def _export_trunk(
    space: ModelSpace, where: dict, handles: dict, covered: dict, tick: Callable[[], None]
) -> None:
    root_trunk = Selector.from_hex(space.root["trunk"]) if space.root["trunk"] else None
    roots = (
        {}
        if root_trunk is None
        else {(r["role"], r["layer"]): r for _, r in space.store.scan(root_trunk)}
    )
    for key, ref in space.trunk.items():
        if key[0] in FILE_ROLES:  # not a tensor: written beside the files by export
            continue
        base = roots.get(key)
        if base is None:
            raise ExportError(f"trunk {key} is not in the base model's source files")
        if (ref.dtype, list(ref.shape)) != (base["dtype"], base["shape"]):
            raise ExportError(
                f"trunk {key}: {ref.dtype}{list(ref.shape)} replaces "
                f"{base['dtype']}{base['shape']}; the source header cannot hold it"
            )
        fname, pos = _where(where, base["src"][1])
        data = space.read_trunk_raw(ref)
        os.pwrite(handles[fname].fileno(), data, pos)
        covered[fname] += data.nbytes
        tick()


def _export_experts(
    space: ModelSpace,
    root_sel: Selector,
    where: dict,
    handles: dict,
    covered: dict,
    tick: Callable[[], None],
) -> None:
    base_src = {(r["layer"], r["expert"]): r["src"] for _, r in space.store.scan(root_sel)}
    readers = [space.store.open_reader(sel) for sel in space.blocks]
    buf = np.empty(space.nbytes, np.uint8)
    ex = space.root["expert"]
    transform = ex.get("transform")
    try:
        for (layer, e), rec in sorted(space.records.items()):
            blk = int(space.blk[layer, e])
            readers[blk].read_into(int(space.off[layer, e]), buf)
            if checksum(buf) != rec["sum"]:
                raise ChecksumError(
                    f"expert ({layer}, {e}): checksum mismatch in {readers[blk].path}"
                )
            src = base_src.get((layer, e))
            if src is None:
                raise ModelSpaceError(f"expert ({layer}, {e}) is not in the base model")
            raw = buf
            if transform is not None:  # back to the source's layout (store.models.expert_transform)
                item = DTYPES[ex["dtype"]][1]
                raw = from_contract(buf[: space.nbytes], ex["inter"], ex["hidden"], item, transform)
            pos = 0
            for _, tensor, start, nbytes in src:
                fname, at = _where(where, tensor)
                os.pwrite(handles[fname].fileno(), raw[pos : pos + nbytes], at + start)
                covered[fname] += nbytes
                pos += nbytes
            tick()
    finally:
        for r in readers:
            r.close()


_MIXTRAL_EXPERT = "model.layers.{l}.block_sparse_moe.experts.{e}.{p}.weight"
_PROJ_EXPERT = "model.layers.{l}.mlp.experts.{e}.{p}_proj.weight"


def expert_tensor_name(arch: str, layer: int, expert: int, part: int) -> str:
    """The HF per-expert tensor name of ``part`` (0 gate, 1 up, 2 down)."""
    if arch in ("mixtral", "phimoe", "minimax_m2"):
        return _MIXTRAL_EXPERT.format(l=layer, e=expert, p=("w1", "w3", "w2")[part])
    return _PROJ_EXPERT.format(l=layer, e=expert, p=("gate", "up", "down")[part])


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in safetensors ``dtype`` (bf16 as uint16 bits, round to nearest even)."""
    if dtype == "F32":
        return np.ascontiguousarray(values, np.float32)
    if dtype == "F16":
        return values.astype(np.float16)
    if dtype == "BF16":
        u = np.ascontiguousarray(values, np.float32).view(np.uint32)
        out = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> 16
        out = out.astype(np.uint16)
        out[np.isnan(values)] = 0x7FC0
        return out
    raise ExportError(f"compute dtype {dtype} is not a float type")


def _export_rebuilt(space: ModelSpace, out: Path, progress: Progress | None) -> list[Path]:
    """One new ``model.safetensors`` from the records (see the module docstring)."""
    root = space.root
    ex = root["expert"]
    fmt, dtype = ex["format"], ex["dtype"]
    inter, hidden = int(ex["inter"]), int(ex["hidden"])
    entries: list[tuple[str, str, tuple[int, ...], Any]] = []
    tok = None
    for key, ref in sorted(space.trunk.items(), key=lambda kv: str(kv[0])):
        if key[0] == TOKENIZER_ROLE:
            tok = ref
            continue
        if key[0] in FILE_ROLES:
            continue
        entries.append((ref.record["src"][1], ref.dtype, ref.shape, ("trunk", ref)))
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    transform = ex.get("transform")
    if transform is not None:  # stacked in the source's layout (GPT-OSS: nothing per expert)
        entries += _stacked_entries(space, dtype, inter, hidden, root["arch"])
    for layer, e in sorted(space.records) if transform is None else ():
        for part in range(3):
            name = expert_tensor_name(root["arch"], layer, e, part)
            entries.append((name, dtype, shapes[part], ("expert", layer, e, part)))
    history = format_history(root)
    readers = [space.store.open_reader(sel) for sel in space.blocks]
    cache: dict[tuple[int, int], list[np.ndarray]] = {}
    buf = np.empty(space.nbytes, np.uint8)

    def produce(what: Any) -> np.ndarray:
        if what[0] == "trunk":
            ref = what[1]
            raw = space.read_trunk_raw(ref)
            if "qfmt" not in ref.record:
                return raw
            values = dequantize_packed(raw, ref.record["qfmt"], tuple(ref.shape))
            return _cast(values, ref.dtype)
        if what[0] == "stacked":
            return _stacked(what, dtype, inter, hidden, expert_parts, transform)
        _, layer, e, part = what
        return expert_parts(layer, e)[part]

    def expert_parts(layer: int, e: int) -> list[np.ndarray]:
        if (layer, e) not in cache:
            cache.clear()
            blk = int(space.blk[layer, e])
            readers[blk].read_into(int(space.off[layer, e]), buf)
            if checksum(buf) != int(space.sums[layer, e]):
                raise ChecksumError(f"expert ({layer}, {e}): checksum mismatch")
            cache[(layer, e)] = _expert_parts(buf, fmt, dtype, shapes)
        return cache[(layer, e)]

    path = out / "model.safetensors"
    try:
        write_safetensors_streamed(
            path,
            [(n, d, s) for n, d, s, _ in entries],
            (produce(w) for *_, w in entries),
            metadata={"format": "pt", "czyx_format_history": json.dumps(history)},
            progress=progress,
        )
    finally:
        for r in readers:
            r.close()
    written = [path]
    if tok is not None:
        (out / TOKENIZER_FILE).write_bytes(space.read_trunk_raw(tok).tobytes())
        written.append(out / TOKENIZER_FILE)
    kept = _export_side_files(space, out)
    written += kept
    template = chat_template(root)
    if template is not None and out / "tokenizer_config.json" not in kept:
        # a GGUF source's chat template, where transformers looks for it
        (out / "tokenizer_config.json").write_text(
            json.dumps({"chat_template": template}, indent=2) + "\n"
        )
        written.append(out / "tokenizer_config.json")
    (out / "config.json").write_text(json.dumps(root["config"], indent=2) + "\n")
    (out / "czyx_format_history.json").write_text(json.dumps(history, indent=2) + "\n")
    return [*written, out / "config.json", out / "czyx_format_history.json"]


def _export_side_files(space: ModelSpace, out: Path) -> list[Path]:
    """Write the kept side files (:data:`~czyx.store.models.archs.SIDE_FILES`) back
    byte for byte; returns their paths."""
    written = []
    for name, (role, _) in sorted(SIDE_FILES.items()):
        ref = space.trunk.get((role, None))
        if ref is not None:
            (out / name).write_bytes(space.read_trunk_raw(ref).tobytes())
            written.append(out / name)
    return written


def _stacked_entries(space: ModelSpace, dtype: str, inter: int, hidden: int, arch: str) -> list:
    """GPT-OSS's (Llama 4's) stacked ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``."""
    block = "feed_forward" if arch == "llama4_text" else "mlp"
    layers = sorted({layer for layer, _ in space.records})
    n = {layer: 1 + max(e for lay, e in space.records if lay == layer) for layer in layers}
    out = []
    for layer in layers:
        pre, e = f"model.layers.{layer}.{block}.experts.", n[layer]
        out.append((pre + "gate_up_proj", dtype, (e, hidden, 2 * inter), ("stacked", layer, 0, e)))
        out.append((pre + "down_proj", dtype, (e, inter, hidden), ("stacked", layer, 1, e)))
    return out


def _stacked(
    what: Any, dtype: str, inter: int, hidden: int, parts: Any, transform: str
) -> np.ndarray:
    """One stacked tensor's bytes: each expert's gate | up | down back to the source layout
    (``expert_transform.from_contract``, exact)."""
    _, layer, which, count = what
    item = DTYPES[dtype][1]
    n, out = inter * hidden * item, []
    for e in range(count):
        gate, up, down = parts(layer, e)
        ext = np.concatenate(
            [np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in (gate, up, down)]
        )
        src = from_contract(ext, inter, hidden, item, transform)
        out.append(src[: 2 * n] if which == 0 else src[2 * n :])
    return np.concatenate(out)


def chat_template(root: dict) -> str | None:
    """The chat template a GGUF source carried (``tokenizer.chat_template``), if any."""
    value = ((root.get("source") or {}).get("metadata") or {}).get("tokenizer.chat_template")
    return value if isinstance(value, str) else None


def _expert_parts(buf: np.ndarray, fmt: str, dtype: str, shapes: tuple) -> list[np.ndarray]:
    if is_quant_format(fmt):
        f = get_format(fmt)
        sizes = [f.nbytes(*s) for s in shapes]
    else:
        sizes = [s[0] * s[1] * DTYPES[dtype][1] for s in shapes]
    parts, pos = [], 0
    for size, shape in zip(sizes, shapes, strict=True):
        raw = buf[pos : pos + size]
        pos += size
        if is_quant_format(fmt):
            parts.append(_cast(dequantize_packed(raw, fmt, shape), dtype))
        else:
            parts.append(raw.copy())
    return parts


def format_history(root: dict) -> list[dict[str, Any]]:
    """A version's format history: source format, conversion at mount, stored formats."""
    src = root.get("source") or {}
    types = sorted(set((src.get("tensor_types") or {}).values()))
    history: list[dict[str, Any]] = [
        {
            "step": "source",
            "format": src.get("format", "safetensors"),
            "types": types or [root["expert"]["dtype"]],
        }
    ]
    if src.get("conversion"):
        history.append({"step": "convert", **src["conversion"]})
    quant = root.get("quant") or {}
    history.append(
        {
            "step": "mount",
            "expert_format": root["expert"]["format"],
            "policy": quant.get("policy"),
            "formats": quant.get("formats"),
            "converted": quant.get("converted"),
        }
    )
    return history


def write_safetensors_streamed(
    path: Path,
    specs: list[tuple[str, str, tuple[int, ...]]],
    arrays: Any,
    metadata: dict[str, str] | None = None,
    progress: Progress | None = None,
) -> None:
    """A safetensors file from ``(name, dtype, shape)`` specs and their arrays, produced
    one at a time (so a large version never sits in memory whole). Each array's byte
    size is checked against its spec; ``progress`` hears of each one written."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    sizes = []
    for name, dtype, shape in specs:
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        sizes.append(n)
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    done = 0
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        for (name, _, _), n, arr in zip(specs, sizes, arrays, strict=True):
            data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            if data.size != n:
                raise ExportError(f"{name}: {data.size} bytes, its header says {n}")
            fh.write(data)
            done += n
            if progress is not None:
                progress(done, pos)
