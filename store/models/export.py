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
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from czyx.space import Selector
from czyx.store.core.checksum import checksum
from czyx.store.errors import ChecksumError
from czyx.store.interfaces import StoreInterface
from czyx.store.models.archs import TOKENIZER_FILE, TOKENIZER_ROLE
from czyx.store.models.checkpoint import DTYPES
from czyx.store.models.expert_transform import from_contract
from czyx.store.models.model import ModelSpace
from czyx.store.models.mount_errors import ModelSpaceError, MountError

RAW_FORMATS = frozenset({"f32", "f16", "bf16", "f64"})


class ExportError(MountError):
    """A version cannot be exported as a faithful checkpoint."""


def export(
    store: StoreInterface, ref: str | Selector, out_dir: str | os.PathLike[str]
) -> list[Path]:
    """Write the model version ``ref`` as a checkpoint directory ``out_dir``.

    Parameters
    ----------
    store
        An open :class:`store.Store`.
    ref
        ``NAME@VERSION``, 64-hex selector or :class:`Selector`.
    out_dir
        Created if absent; files of the same names are overwritten.

    Returns
    -------
    list of Path
        The files written.

    Raises
    ------
    ExportError
        A quantized version, a replaced tensor whose format differs from the
        source's, or source bytes no record covers.
    """
    space = ModelSpace(store, ref)
    fmt = space.root["expert"]["format"]
    if fmt not in RAW_FORMATS:
        raise ExportError(f"expert format {fmt!r} is quantized; export writes only raw formats")
    if space.root.get("quant"):  # trunk tensors may be packed even when experts are raw
        raise ExportError(
            f"version is quantized (policy {space.root['quant'].get('policy')!r}); "
            "export writes only raw formats"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root_sel = space.chain[0][0]
    files = space.root["source"]["files"]
    layout = _file_layout(files)
    handles = {name: _create(out / name, text, layout[name][1]) for name, text in files.items()}
    where = {t: (name, off) for name, (offs, _) in layout.items() for t, off in offs.items()}
    covered = dict.fromkeys(files, 0)
    try:
        _export_trunk(space, where, handles, covered)
        _export_experts(space, root_sel, where, handles, covered)
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


def _export_trunk(space: ModelSpace, where: dict, handles: dict, covered: dict) -> None:
    root_trunk = Selector.from_hex(space.root["trunk"]) if space.root["trunk"] else None
    roots = (
        {}
        if root_trunk is None
        else {(r["role"], r["layer"]): r for _, r in space.store.scan(root_trunk)}
    )
    for key, ref in space.trunk.items():
        if key[0] == TOKENIZER_ROLE:  # not a tensor: written beside the files by export
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


def _export_experts(
    space: ModelSpace, root_sel: Selector, where: dict, handles: dict, covered: dict
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
                raw = from_contract(buf[: space.nbytes], ex["inter"], ex["hidden"], item)
            pos = 0
            for _, tensor, start, nbytes in src:
                fname, at = _where(where, tensor)
                os.pwrite(handles[fname].fileno(), raw[pos : pos + nbytes], at + start)
                covered[fname] += nbytes
                pos += nbytes
    finally:
        for r in readers:
            r.close()
