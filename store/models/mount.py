"""Mount a Hugging Face MoE checkpoint into the store as a model version.

Scope: turning one validated checkpoint (see :mod:`store.mount_plan`) into
published spaces and a tag. A model version is

* an **expert space** (the version's selector, what ``NAME@VERSION`` points
  at): one record per routed expert at ``Key(cls=class value, z=layer)`` (with
  more than 256 experts a layer the class value's high bits go into ``y``:
  :mod:`czyx.expert_key`); its
  extent is gate ``[I, H]`` | up ``[I, H]`` | down ``[H, I]``, row-major, in
  the checkpoint's own dtype (bytes kept exactly, so an export is
  bit-identical), placed at ``data_start + ordinal * stride`` where the
  ordinal comes from the two-level layout (``curves.layout.ExpertLayout``:
  Morton over ``(layer, class)`` by default, row-major inside the extent) and
  ``stride`` is the extent size rounded up to 4096;
* a **trunk space**: the load-bearing tensors at ``Key(cls=role index,
  z=layer)`` (role index from :data:`store.archs.ROLE_INDEX`), each its own
  extent, named by the expert space's manifest;
* the manifest: architecture config, formats, layout, class permutation,
  per-expert content hashes, the source files' headers; and, at every record,
  its checksum and provenance (source file, tensor names, byte range, BLAKE3).

Selectors are content-derived (``Selector.from_content`` over the canonical
JSON of the manifest, which holds no paths or times): the same checkpoint
mounted twice is the same space, and the second mount writes nothing. A new
version of the same NAME (or an adapter, which names its base explicitly and
holds only the tensors it replaces) shares every expert extent whose bytes
equal one in an earlier version: its record points at that space's block file
(``"blk"`` names that space, ``"blk_off"`` the offset; such a record has no
``"off"``, which always means "in this space's own block file").

Records. Expert (key ``Key(class, layer)``): ``off``, ``len``, ``sum`` (the
store's extent checksum), ``layer``, ``expert`` (router byte), ``fmt``,
``hash`` (BLAKE3 of the extent bytes) and ``src`` (``[file, tensor, start,
nbytes]`` for gate, up and down); a shared extent has ``blk``/``blk_off``
instead of ``off``. Trunk (key ``Key(role index, layer or 0)``): ``off``,
``len``, ``sum``, ``role``, ``layer``, ``dtype``, ``shape``, ``hash``,
``src`` (``[file, tensor]``).

Failure: everything is validated and hashed before the first byte is
written; a tag that already points elsewhere is refused before writing; a
failure while writing aborts the space writer, so no partial version is ever
visible. A quantizing mount into a :class:`~czyx.store.core.lmdb_store.Store`
runs in one pass instead (:func:`_mount_one_pass`: quantizing is the expensive
part, so each packed tensor is written into a pending block file as it is
hashed): there a refused tag or a failure deletes the pending files, and
still nothing new is visible. A trunk space published just before a failed expert space stays as an
untagged, content-addressed space that the next attempt reuses.

Reading and hashing the checkpoint's bytes is :mod:`store.mount_source`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from czyx.expert_key import class_shift
from czyx.key import Key
from czyx.space import Selector, canonical_manifest
from czyx.store.errors import TagConflictError, TagNotFoundError
from czyx.store.interfaces import StoreInterface
from czyx.store.models.archs import (
    FILE_ROLES,
    ROLE_INDEX,
    SIDE_FILES,
    TOKENIZER_CLASS,
    TOKENIZER_FILE,
    TOKENIZER_ROLE,
)
from czyx.store.models.checkpoint import DTYPES, Checkpoint
from czyx.store.models.expert_layout import (
    DEFAULT_OUTER,
    expert_record_key,
    layout_from_manifest,
    make_layout,
)
from czyx.store.models.mount_errors import (
    ModelSpaceError,
    MountError,
    ShapeMismatchError,
    UnexpectedTensorError,
)
from czyx.store.models.mount_plan import ModelPlan, plan_checkpoint
from czyx.store.models.mount_source import (
    CONTENT_HASH,
    MountSource,
    content_hash,
    round_up,
    source_manifest,
)
from czyx.store.models.sources import conversion_report, make_source, open_checkpoint

MODEL_KIND = "czyx.model"
ADAPTER_KIND = "czyx.adapter"
TRUNK_KIND = "czyx.trunk"
MANIFEST_VERSION = 1
EXTENT_ALIGN = 4096
_TAG_RX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/]*@[A-Za-z0-9][A-Za-z0-9._\-+]*")


@dataclass(frozen=True)
class MountResult:
    """What a mount did.

    ``created`` is False when the same content was already published (nothing
    written). ``bytes_written`` counts new extent bytes; ``bytes_shared`` the
    expert bytes that point into an earlier version's block file.
    """

    tag: str
    selector: Selector
    trunk_selector: Selector | None
    created: bool
    tensors: int
    bytes_total: int
    bytes_written: int
    bytes_shared: int
    seconds: float
    conversions: tuple[str, ...] = ()
    repaired: int = 0  # extents rewritten because the published copy was damaged

    def summary(self) -> str:
        """The one-line summary the CLI prints."""
        rate = self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else float("inf")
        state = "mounted" if self.created else "already present"
        if self.repaired:
            state = f"repaired ({self.repaired} damaged extents rewritten)"
        return (
            f"{state}: {self.tag} -> {self.selector.hex()[:16]}  {self.tensors} tensors, "
            f"{self.bytes_total / 1e6:.1f} MB ({self.bytes_written / 1e6:.1f} MB written, "
            f"{self.bytes_shared / 1e6:.1f} MB shared) in {self.seconds:.2f} s, {rate:.2f} GB/s"
        ) + "".join("\n  " + line for line in self.conversions)


def parse_tag(tag: str) -> tuple[str, str]:
    """Split ``NAME@VERSION``; ``ValueError`` naming the tag if malformed."""
    if not isinstance(tag, str) or not _TAG_RX.fullmatch(tag):
        raise ValueError(f"tag {tag!r} is not NAME@VERSION (letters, digits, . _ - /)")
    name, version = tag.split("@", 1)
    return name, version


def resolve(store: StoreInterface, ref: str | Selector) -> Selector:
    """A ``NAME@VERSION`` tag, a 64-hex selector or a :class:`Selector` -> selector."""
    if isinstance(ref, Selector):
        return ref
    if isinstance(ref, str) and re.fullmatch(r"[0-9a-fA-F]{64}", ref):
        return Selector.from_hex(ref)
    if isinstance(ref, str) and "@" not in ref:
        raise ValueError(f"{ref!r}: give NAME@VERSION (a tag) or a 64-hex selector")
    return store.resolve_tag(ref)


def mount(
    store: StoreInterface,
    path: str | os.PathLike[str],
    tag: str,
    *,
    outer: str = DEFAULT_OUTER,
    class_perm: Sequence[Sequence[int]] | None = None,
    adapter_of: str | Selector | None = None,
    progress: bool = False,
    quant: Any = None,
    convert: str | None = None,
    allow_requantize: bool = False,
) -> MountResult:
    """Publish the checkpoint at ``path`` as ``tag`` (``NAME@VERSION``).

    Parameters
    ----------
    store
        An open :class:`store.Store`.
    path
        Checkpoint directory (``config.json`` + safetensors, sharded or not).
    tag
        ``NAME@VERSION``; must be free or already point at this exact content.
    outer
        Outer curve of the expert layout (``morton``, ``hilbert``, ``rowmajor``).
    class_perm
        Optional per-layer permutation ``class_perm[layer][router byte] ->
        class value`` (e.g. learned from routing traces).
    adapter_of
        Make an adapter of this base version (tag or selector): the checkpoint
        holds only replaced tensors; layout, permutation and shapes are the base's.
    progress
        Show tqdm progress bars on stderr.
    quant
        A ``store.quant.codec.QuantCodec`` (a policy and optionally a calibration
        importance map): routed experts and trunk tensors are stored in the
        formats it chooses (``store/quant/README.md``). The version is then a
        different content, so a different selector, from the float mount.
    convert
        Conversion policy for source formats the store has no native format
        for (GGUF quant types, FP8 weights): see :mod:`store.models.sources`.
        ``path`` may also be a ``.gguf`` file or a directory of split GGUF files.
    allow_requantize
        Let ``quant`` requantize a quantized GGUF's tensors (llama-quantize's
        ``--allow-requantize``): the classes the policy names a format for are
        dequantized and quantized to it, every other tensor is stored as without
        ``quant`` (:mod:`store.models.gguf_source`). Without it such a mount is
        refused; it needs ``quant``, and any source but a GGUF refuses it.

    Returns
    -------
    MountResult

    Raises
    ------
    MountError (and subclasses), TagConflictError, StoreError
        Nothing new is visible after any of them (see the module docstring).
    """
    t0 = time.perf_counter()
    name, _ = parse_tag(tag)
    if allow_requantize and quant is None:
        raise MountError("--allow-requantize needs --quant POLICY (the classes to requantize)")
    with open_checkpoint(path, convert) as ckpt:
        plan = plan_checkpoint(ckpt, partial=adapter_of is not None)
        if quant is not None and adapter_of is not None:
            raise MountError("a quantized adapter is not supported: quantize the base instead")
        one_pass = quant is not None and _can_write_pending(store)
        src = make_source(
            ckpt,
            plan,
            quant,
            spool_dir=getattr(store, "path", None),
            spool=not one_pass,
            allow_requantize=allow_requantize,
        )
        # A requantizing GGUF source names the policy in its trunk only where it
        # changed a trunk tensor (else the trunk is the plain mount's, shared).
        quant = getattr(src, "trunk_quant", quant)
        with src:
            if one_pass:
                return _mount_one_pass(
                    store, ckpt, plan, src, tag, name, outer, class_perm, progress, quant, t0
                )
            return _mount(
                store,
                ckpt,
                plan,
                src,
                tag,
                name,
                outer,
                class_perm,
                adapter_of,
                progress,
                quant,
                t0,
            )


def _mount(
    store: Any,
    ckpt: Checkpoint,
    plan: ModelPlan,
    src: MountSource,
    tag: str,
    name: str,
    outer: str,
    class_perm: Sequence[Sequence[int]] | None,
    adapter_of: str | Selector | None,
    progress: bool,
    quant: Any,
    t0: float,
) -> MountResult:
    base_sel, base_manifest = None, None
    if adapter_of is not None:
        base_sel = resolve(store, adapter_of)
        base_manifest = _model_manifest(store, base_sel)
        _check_adapter_fits(store, base_sel, ckpt, plan, base_manifest)
        layout = layout_from_manifest(base_manifest)
    else:
        layout = make_layout(plan.n_layers, plan.n_experts, outer, class_perm)

    keys = sorted(plan.experts, key=lambda k: layout.ordinal(*k))
    bar = _bar(progress, _source_nbytes(ckpt, plan), "hash")
    expert_hash = {}
    for k, digest in src.expert_hashes(keys):
        expert_hash[k] = digest
        bar.update(plan.expert_nbytes)
    trunk_hash: dict[str, str] = {}
    trunk_qfmt: dict[str, str | None] = {}
    trunk_total = 0
    for t in plan.trunk:
        data, qfmt = src.stored_tensor(t)
        trunk_hash[t.tensor], trunk_qfmt[t.tensor] = content_hash(data), qfmt
        trunk_total += data.nbytes
        bar.update(ckpt.info(t.tensor).nbytes)
    bar.close()
    if plan.trunk:  # the kept files are trunk records too (written with it)
        trunk_total += len(src.tokenizer or b"") + sum(map(len, src.side_files.values()))
    total = trunk_total + len(keys) * src.expert_nbytes

    trunk_manifest, trunk_sel, manifest, sel = _manifests(
        ckpt, plan, src, layout, expert_hash, trunk_hash, trunk_qfmt, quant, base_sel, base_manifest
    )
    _check_tag_free(store, tag, sel)
    n_tensors = len(ckpt)
    if store.has_space(sel):
        return _tag_published(store, src, tag, sel, trunk_sel, n_tensors, total, t0)

    bar = _bar(progress, total, "write")
    written = 0
    if trunk_sel is not None and not store.has_space(trunk_sel):
        written += _write_trunk(store, trunk_sel, trunk_manifest, src, trunk_hash, bar)
    else:
        bar.update(total - len(keys) * src.expert_nbytes)
    shared_index = _shared_index(store, name, base_sel)
    new, shared = _write_experts(
        store, sel, manifest, src, layout, keys, expert_hash, shared_index, bar
    )
    bar.close()
    return _tag_new(store, src, tag, sel, trunk_sel, n_tensors, total, written + new, shared, t0)


def _tag_new(
    store: Any,
    src: MountSource,
    tag: str,
    sel: Selector,
    trunk_sel: Selector | None,
    n_tensors: int,
    total: int,
    written: int,
    shared: int,
    t0: float,
) -> MountResult:
    """Tag a version just published (``written`` new bytes, ``shared`` reused), audited."""
    store.set_tag(tag, sel)
    store.audit("model.mount", tag=tag, space=sel.hex(), written=written, shared=shared)
    return MountResult(
        tag,
        sel,
        trunk_sel,
        True,
        n_tensors,
        total,
        written,
        shared,
        time.perf_counter() - t0,
        conversions=tuple(conversion_report(src)),
    )


def _tag_published(
    store: Any,
    src: MountSource,
    tag: str,
    sel: Selector,
    trunk_sel: Selector | None,
    n_tensors: int,
    total: int,
    t0: float,
) -> MountResult:
    """Tag a version whose content is already published, after repairing it.

    Its own block files are checked and what is damaged is rewritten from this
    source (:mod:`czyx.store.models.repair`), so mounting a checkpoint again is
    also how a damaged version is mended.
    """
    from czyx.store.models.repair import repair_version

    own = [sel] + ([trunk_sel] if trunk_sel is not None and store.has_space(trunk_sel) else [])
    fixed = repair_version(store, src, own)
    store.set_tag(tag, sel)
    if fixed:
        store.audit("model.repair", tag=tag, space=sel.hex(), extents=fixed)
    return MountResult(
        tag,
        sel,
        trunk_sel,
        False,
        n_tensors,
        total,
        0,
        0,
        time.perf_counter() - t0,
        conversions=tuple(conversion_report(src)),
        repaired=fixed,
    )


def _can_write_pending(store: Any) -> bool:
    """Whether ``store`` takes a block file written before its selector is known."""
    from czyx.store.core.lmdb_store import Store

    return isinstance(store, Store)


def _mount_one_pass(
    store: Any,
    ckpt: Checkpoint,
    plan: ModelPlan,
    src: MountSource,
    tag: str,
    name: str,
    outer: str,
    class_perm: Sequence[Sequence[int]] | None,
    progress: bool,
    quant: Any,
    t0: float,
) -> MountResult:
    """A quantizing mount in one pass over the checkpoint.

    Each tensor is read, quantized, hashed and written into a pending block file
    (:class:`~czyx.store.core.writer.PendingSpace`) at the offset the layout gives
    it, in the same pass; only the space's header and records wait for the
    selector (a hash over every extent's hash). The bytes, offsets, records and
    selectors are those of the two-pass mount (:func:`_mount`), which a float
    mount still uses: there the hash pass only reads, and a mount of content
    already published writes nothing. Here the pending files of content already
    published are deleted, and the published version is repaired from this
    source as by the two-pass mount. A failure, or a kill, at any point leaves
    no new space visible: the pending files are deleted (or, after a kill,
    collected as ``.part`` files of a dead process).
    """
    from contextlib import ExitStack

    from czyx.store.core.writer import PendingSpace

    layout = make_layout(plan.n_layers, plan.n_experts, outer, class_perm)
    keys = sorted(plan.experts, key=lambda k: layout.ordinal(*k))
    stride = round_up(src.expert_nbytes, EXTENT_ALIGN)
    shared_index = _shared_index(store, name, None)
    with ExitStack() as stack:
        px = stack.enter_context(PendingSpace(store))
        pt = stack.enter_context(PendingSpace(store)) if plan.trunk else None
        if stride % px.alignment:
            raise MountError(f"block alignment {px.alignment} does not divide stride {stride}")
        bar = _bar(progress, _source_nbytes(ckpt, plan), "mount")
        expert_hash: dict[tuple[int, int], str] = {}
        expert_ext: dict[tuple[int, int], Any] = {}

        def sink(k: tuple[int, int], digest: str, data: np.ndarray, padded: Any) -> None:
            if digest in shared_index:  # an earlier version holds these bytes
                return
            at = px.data_start + layout.ordinal(*k) * stride
            expert_ext[k] = px.write_at(at, data, padded)

        for k, digest in src.expert_hashes(keys, sink=sink, align=px.alignment):
            expert_hash[k] = digest
            bar.update(plan.expert_nbytes)
        trunk_hash: dict[str, str] = {}
        trunk_qfmt: dict[str, str | None] = {}
        trunk_recs: list[tuple[bytes, dict[str, Any]]] = []
        trunk_total = 0
        for t in plan.trunk:
            assert pt is not None
            data, qfmt = src.stored_tensor(t)
            digest = content_hash(data)
            trunk_hash[t.tensor], trunk_qfmt[t.tensor] = digest, qfmt
            ext = pt.append(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            trunk_recs.append(_trunk_record(ckpt, t, ext, digest, qfmt))
            trunk_total += data.nbytes
            bar.update(ckpt.info(t.tensor).nbytes)
        bar.close()
        if pt is not None:  # the kept files are trunk records too
            for key, rec, blob in _file_records(src):
                ext = pt.append(np.frombuffer(blob, np.uint8))
                trunk_recs.append((key, {**ext.record(), **rec}))
                trunk_total += len(blob)
        total = trunk_total + len(keys) * src.expert_nbytes

        trunk_manifest, trunk_sel, manifest, sel = _manifests(
            ckpt, plan, src, layout, expert_hash, trunk_hash, trunk_qfmt, quant, None, None
        )
        _check_tag_free(store, tag, sel)
        if store.has_space(sel):
            return _tag_published(store, src, tag, sel, trunk_sel, len(ckpt), total, t0)
        written = 0
        if pt is not None and trunk_sel is not None and not store.has_space(trunk_sel):
            with pt.publish(trunk_sel, trunk_manifest) as w:
                w.put_many(trunk_recs)
            written += trunk_total
        nbytes, fmt = manifest["expert"]["nbytes"], manifest["expert"]["format"]
        new = shared = 0
        with px.publish(sel, manifest) as w:
            for layer, e in keys:
                digest = expert_hash[(layer, e)]
                rec = _expert_record(src, layer, e, digest, fmt)
                ext = expert_ext.get((layer, e))
                if ext is None:
                    rec.update(shared_index[digest])
                    shared += nbytes
                else:
                    rec.update(ext.record())
                    new += nbytes
                w.put(expert_record_key(layout, layer, e), rec)
    return _tag_new(store, src, tag, sel, trunk_sel, len(ckpt), total, written + new, shared, t0)


def _source_nbytes(ckpt: Checkpoint, plan: ModelPlan) -> int:
    """Bytes a mount reads from the checkpoint: the planned trunk tensors and experts."""
    trunk = sum(ckpt.info(t.tensor).nbytes for t in plan.trunk)
    return trunk + len(plan.experts) * plan.expert_nbytes


def _manifests(
    ckpt: Checkpoint,
    plan: ModelPlan,
    src: MountSource,
    layout: Any,
    expert_hash: dict[tuple[int, int], str],
    trunk_hash: dict[str, str],
    trunk_qfmt: dict[str, str | None],
    quant: Any,
    base_sel: Selector | None,
    base_manifest: dict[str, Any] | None,
) -> tuple[dict[str, Any], Selector | None, dict[str, Any], Selector]:
    """The trunk's and the version's manifests and the selectors derived from them (no
    trunk space, and so no trunk selector, where the plan has no trunk), as both the
    two-pass and the one-pass mount compute them from the content hashes."""
    trunk_manifest = _trunk_manifest(
        ckpt, plan, trunk_hash, src.tokenizer, trunk_qfmt, quant, src.side_files
    )
    trunk_sel = Selector.from_content(canonical_manifest(trunk_manifest)) if plan.trunk else None
    manifest = _model_manifest_for(
        ckpt, plan, layout, expert_hash, trunk_sel, base_sel, base_manifest, src
    )
    return trunk_manifest, trunk_sel, manifest, Selector.from_content(canonical_manifest(manifest))


def _trunk_record(
    ckpt: Checkpoint, t: Any, ext: Any, digest: str, qfmt: str | None
) -> tuple[bytes, dict[str, Any]]:
    """``(key, record)`` of trunk tensor ``t`` stored as extent ``ext``."""
    info = ckpt.info(t.tensor)
    rec = {
        **ext.record(),
        "role": t.role,
        "layer": t.layer,
        "dtype": info.dtype,
        "shape": list(info.shape),
        "hash": digest,
        "src": [info.file.name, t.tensor],
    }
    if qfmt is not None:  # packed in this format (store.quant); dtype is the source's
        rec["qfmt"] = qfmt
    return Key(ROLE_INDEX[t.role], 0 if t.layer is None else t.layer).pack(), rec


def _file_records(src: MountSource) -> list[tuple[bytes, dict[str, Any], bytes]]:
    """``(key, record without its extent, bytes)`` of the kept files (tokenizer, side
    files), in the order the trunk space stores them."""
    out = []
    if src.tokenizer is not None:
        out.append(
            (
                Key(TOKENIZER_CLASS).pack(),
                {
                    "role": TOKENIZER_ROLE,
                    "layer": None,
                    "hash": content_hash(np.frombuffer(src.tokenizer, np.uint8)),
                    "src": [TOKENIZER_FILE, None],
                },
                src.tokenizer,
            )
        )
    for name, blob in sorted(src.side_files.items()):
        role, cls = SIDE_FILES[name]
        rec = {
            "role": role,
            "layer": None,
            "hash": content_hash(np.frombuffer(blob, np.uint8)),
            "src": [name, None],
        }
        out.append((Key(cls).pack(), rec, blob))
    return out


def _expert_record(src: MountSource, layer: int, e: int, digest: str, fmt: str) -> dict:
    """Expert ``(layer, e)``'s record fields, without its extent's location."""
    return {
        "layer": layer,
        "expert": e,
        "hash": digest,
        "fmt": fmt,
        "src": [
            [src.ckpt.info(p.tensor).file.name, p.tensor, p.start, p.nbytes]
            for p in src.plan.experts[(layer, e)]
        ],
    }


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(enabled: bool, total: int, desc: str) -> Any:
    if not enabled:
        return _NoBar()  # and no tqdm import (~0.1 s) on quiet mounts
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, leave=False)


def _check_tag_free(store: StoreInterface, tag: str, sel: Selector) -> None:
    try:
        old = store.resolve_tag(tag)
    except TagNotFoundError:
        return
    if old != sel:
        raise TagConflictError(
            f"tag {tag!r} already points at {old.hex()}, not at this checkpoint's "
            f"{sel.hex()}; nothing was written"
        )


def _model_manifest(store: StoreInterface, sel: Selector) -> dict[str, Any]:
    manifest = store.manifest(sel)
    if manifest.get("kind") not in (MODEL_KIND, ADAPTER_KIND):
        raise ModelSpaceError(
            f"space {sel.hex()} is not a mounted model (kind {manifest.get('kind')!r})"
        )
    return manifest


def _check_adapter_fits(
    store: StoreInterface,
    base_sel: Selector,
    ckpt: Checkpoint,
    plan: ModelPlan,
    base: dict[str, Any],
) -> None:
    """An adapter may only replace tensors the base has, with the same shape and dtype
    (so the merged model, and its export into the base's file headers, stay valid)."""
    from czyx.store.models.model import ModelSpace  # model imports this module

    base_trunk = ModelSpace(store, base_sel).trunk
    for t in plan.trunk:
        info = ckpt.info(t.tensor)
        ref = base_trunk.get((t.role, t.layer))
        if ref is None:
            raise UnexpectedTensorError(
                f"the base has no {t.role} at layer {t.layer} to replace",
                file=str(info.file),
                tensor=t.tensor,
            )
        if (ref.dtype, ref.shape) != (info.dtype, info.shape):
            raise ShapeMismatchError(
                f"{info.dtype}{list(info.shape)} cannot replace the base's "
                f"{ref.dtype}{list(ref.shape)}",
                file=str(info.file),
                tensor=t.tensor,
            )
    ex = base["expert"]
    for field, mine in (("arch", plan.arch),):
        if base[field] != mine:
            raise ShapeMismatchError(f"adapter {field} {mine!r} != base {base[field]!r}")
    for field, mine in (
        ("hidden", plan.hidden),
        ("inter", plan.inter),
        ("n_experts", plan.n_experts),
        ("n_layers", plan.n_layers),
    ):
        if ex[field] != mine:
            raise ShapeMismatchError(f"adapter {field} {mine} != base {ex[field]}")
    if plan.experts and ex["dtype"] != plan.dtype:
        raise ShapeMismatchError(f"adapter expert dtype {plan.dtype} != base {ex['dtype']}")


def _trunk_manifest(
    ckpt: Checkpoint,
    plan: ModelPlan,
    hashes: dict[str, str],
    tok: bytes | None,
    qfmts: dict[str, str | None] | None = None,
    codec: Any = None,
    side_files: dict[str, bytes] | None = None,
) -> dict[str, Any]:
    qfmts = qfmts or {}
    tensors = sorted(
        [
            t.role,
            -1 if t.layer is None else t.layer,
            t.tensor,
            ckpt.info(t.tensor).dtype,
            list(ckpt.info(t.tensor).shape),
            hashes[t.tensor],
        ]
        # a quantized tensor names its stored format (float ones stay as before)
        + ([qfmts[t.tensor]] if qfmts.get(t.tensor) else [])
        for t in plan.trunk
    )
    manifest = {
        "kind": TRUNK_KIND,
        "version": MANIFEST_VERSION,
        "arch": plan.arch,
        "content_hash": CONTENT_HASH,
        "tensors": tensors,
    }
    if tok is not None:  # the checkpoint's own tokenizer travels with its trunk
        manifest["tokenizer"] = content_hash(np.frombuffer(tok, np.uint8))
    if side_files:  # generation_config.json, tokenizer_config.json: exported back as they were
        manifest["side_files"] = {
            name: content_hash(np.frombuffer(data, np.uint8))
            for name, data in sorted(side_files.items())
        }
    if codec is not None:
        manifest["quant"] = codec.manifest()
    return manifest


def _model_manifest_for(
    ckpt: Checkpoint,
    plan: ModelPlan,
    layout: Any,
    expert_hash: dict[tuple[int, int], str],
    trunk_sel: Selector | None,
    base_sel: Selector | None,
    base: dict[str, Any] | None,
    src: MountSource | None = None,
) -> dict[str, Any]:
    dtype = plan.dtype if plan.experts or base is None else base["expert"]["dtype"]
    # An adapter that replaces no expert still describes the base's experts.
    nbytes = 3 * plan.inter * plan.hidden * DTYPES[dtype][1]
    fmt = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64"}[dtype]
    qlayout = None if src is None else src.qlayout
    if qlayout is not None:  # quantized experts: packed gate | up | down
        nbytes, fmt = qlayout.nbytes, qlayout.fmt.name
    manifest = {
        "kind": MODEL_KIND if base_sel is None else ADAPTER_KIND,
        "version": MANIFEST_VERSION,
        "content_hash": CONTENT_HASH,
        "arch": plan.arch,
        "config": plan.config,
        "expert": {
            "format": fmt,
            "dtype": dtype,
            "hidden": plan.hidden,
            "inter": plan.inter,
            "n_layers": plan.n_layers,
            "n_experts": plan.n_experts,
            "sparse_layers": list(plan.sparse_layers),
            "parts": ["gate", "up", "down"],
            "nbytes": nbytes,
            "stride": round_up(nbytes, EXTENT_ALIGN),
            "source_layout": plan.expert_layout,
        },
        "layout": layout.to_dict(),
        "experts": [[l, e, expert_hash[(l, e)]] for l, e in sorted(expert_hash)],
        "trunk": None if trunk_sel is None else trunk_sel.hex(),
        "base": None if base_sel is None else base_sel.hex(),
        "source": ckpt.source_manifest()
        if hasattr(ckpt, "source_manifest")
        else source_manifest(ckpt),
    }
    if src is not None and src.codec is not None:
        manifest["quant"] = src.codec.manifest()
    if plan.expert_transform is not None:  # only then: other manifests keep their selectors
        manifest["expert"]["transform"] = plan.expert_transform
    return manifest


def _write_trunk(
    store: StoreInterface,
    sel: Selector,
    manifest: dict[str, Any],
    src: MountSource,
    hashes: dict[str, str],
    bar: Any,
) -> int:
    ckpt, plan = src.ckpt, src.plan
    written = 0
    with store.begin_space(sel, manifest) as w:
        for t in plan.trunk:
            info = ckpt.info(t.tensor)
            data, qfmt = src.stored_tensor(t)
            ext = w.write_extent(data)
            key = Key(ROLE_INDEX[t.role], 0 if t.layer is None else t.layer).pack()
            rec = {
                **ext.record(),
                "role": t.role,
                "layer": t.layer,
                "dtype": info.dtype,
                "shape": list(info.shape),
                "hash": hashes[t.tensor],
                "src": [info.file.name, t.tensor],
            }
            if qfmt is not None:  # packed in this format (store.quant); dtype is the source's
                rec["qfmt"] = qfmt
            w.put(key, rec)
            written += data.nbytes
            bar.update(info.nbytes)
        if src.tokenizer is not None:
            data = np.frombuffer(src.tokenizer, np.uint8)
            ext = w.write_extent(data)
            w.put(
                Key(TOKENIZER_CLASS).pack(),
                {
                    **ext.record(),
                    "role": TOKENIZER_ROLE,
                    "layer": None,
                    "hash": manifest["tokenizer"],
                    "src": [TOKENIZER_FILE, None],
                },
            )
            written += data.nbytes
        for name, blob in sorted(src.side_files.items()):
            role, cls = SIDE_FILES[name]
            data = np.frombuffer(blob, np.uint8)
            ext = w.write_extent(data)
            w.put(
                Key(cls).pack(),
                {
                    **ext.record(),
                    "role": role,
                    "layer": None,
                    "hash": manifest["side_files"][name],
                    "src": [name, None],
                },
            )
            written += data.nbytes
    return written


def _shared_index(store: StoreInterface, name: str, base_sel: Selector | None) -> dict[str, dict]:
    """Content hash -> extent location, over the experts of earlier versions of ``name``
    (and the explicit base of an adapter): what a new version may share."""
    candidates = {sel for tag, sel in store.tags().items() if tag.split("@", 1)[0] == name}
    if base_sel is not None:
        candidates.add(base_sel)
    index: dict[str, dict] = {}
    for sel in sorted(candidates):
        if not store.has_space(sel) or store.manifest(sel).get("kind") not in (
            MODEL_KIND,
            ADAPTER_KIND,
        ):
            continue
        for _, rec in store.scan(sel):
            if "hash" in rec and rec["hash"] not in index:
                index[rec["hash"]] = {
                    "blk": rec.get("blk", sel.hex()),
                    "blk_off": rec.get("blk_off", rec.get("off")),
                    "len": rec["len"],
                    "sum": rec["sum"],
                }
    return index


def _write_experts(
    store: StoreInterface,
    sel: Selector,
    manifest: dict[str, Any],
    src: MountSource,
    layout: Any,
    keys: list[tuple[int, int]],
    expert_hash: dict[tuple[int, int], str],
    shared_index: dict[str, dict],
    bar: Any,
) -> tuple[int, int]:
    nbytes, stride = manifest["expert"]["nbytes"], manifest["expert"]["stride"]
    fmt = manifest["expert"]["format"]
    buf = src.buf
    new = shared = 0
    with store.begin_space(sel, manifest) as w:
        if stride % w.alignment:
            raise MountError(f"block alignment {w.alignment} does not divide stride {stride}")
        for layer, e in keys:
            digest = expert_hash[(layer, e)]
            rec = {
                "layer": layer,
                "expert": e,
                "hash": digest,
                "fmt": fmt,
                "src": [
                    [src.ckpt.info(p.tensor).file.name, p.tensor, p.start, p.nbytes]
                    for p in src.plan.experts[(layer, e)]
                ],
            }
            hit = shared_index.get(digest)
            if hit is not None:
                rec.update(hit)
                shared += nbytes
            else:
                # Holes (dense layers, shared experts) stay unwritten, so every extent
                # this space owns sits exactly at data_start + ordinal * stride.
                w.skip_to(w.data_start + layout.ordinal(layer, e) * stride)
                src.assemble((layer, e), buf)
                rec.update(w.write_extent(buf).record())
                new += nbytes
            w.put(expert_record_key(layout, layer, e), rec)
            bar.update(nbytes)
    return new, shared


def summarize(store: StoreInterface, ref: str | Selector) -> dict[str, Any]:
    """What ``czyx show`` prints: layers, experts, bytes per class, formats, shared bytes."""
    sel = resolve(store, ref)
    m = _model_manifest(store, sel)
    ex = m["expert"]
    per_class = np.zeros(256, np.int64)
    shared = own = 0
    for key, rec in store.scan(sel):
        per_class[key[0]] += rec["len"]
        if "blk" in rec:
            shared += rec["len"]
        else:
            own += rec["len"]
    trunk_bytes = trunk_n = 0
    formats: dict[str, int] = {ex["format"]: len(m["experts"])}
    if m["trunk"]:
        tsel = Selector.from_hex(m["trunk"])
        trunk_n, trunk_bytes = store.aggregate(tsel)
        for _, rec in store.scan(tsel):
            if rec.get("role") in FILE_ROLES:  # not a tensor: no format
                continue
            f = rec.get("qfmt") or rec["dtype"].lower()  # packed trunk tensors name their format
            formats[f] = formats.get(f, 0) + 1
    return {
        "selector": sel.hex(),
        "kind": m["kind"],
        "arch": m["arch"],
        "base": m["base"],
        "layers": ex["n_layers"],
        "sparse_layers": ex["sparse_layers"],
        "experts_per_layer": ex["n_experts"],
        "experts": len(m["experts"]),
        "expert_format": ex["format"],
        "expert_bytes": ex["nbytes"],
        "layout": m["layout"].get("outer"),
        "bytes_per_class": {int(c): int(per_class[c]) for c in np.flatnonzero(per_class)},
        "experts_per_class": 1 << class_shift(int(ex["n_experts"])),
        "expert_bytes_own": own,
        "expert_bytes_shared": shared,
        "trunk_tensors": trunk_n,
        "trunk_bytes": trunk_bytes,
        "formats": formats,
        "tags": sorted(t for t, s in store.tags().items() if s == sel),
    }
