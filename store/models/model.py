"""The store-backed :class:`store.consumer.ModelConsumer`: a mounted model version, opened.

Scope: resolving a model version (a tag, hex selector or selector; adapters
over their base) once at open into flat numpy tables, then serving trunk
tensors (resident, float32; or, with ``lazy_trunk``, per-layer tensors read
and verified on each call) and expert extents (raw reads into caller slots,
checksum verified). Everything that needs a dict, an LMDB transaction or the
manifest happens in :func:`open_version`; per fetch there is only arithmetic on
``int64`` tables indexed ``[layer, router index]`` (the class permutation and
the layout's curve ordinal are already folded in), one ``pread`` and one
checksum. A router index is a byte up to 256 experts a layer and wider above
(:mod:`czyx.expert_key`); the tables are ``max(256, n_experts)`` wide.

``open_version`` also checks that every extent a space owns sits at
``data_start + ordinal * stride`` of its block file (the layout's contract),
that each record's key is the layout's class value of its router index (class
byte and ``y``), and that
every block file is the one its space published (``Store.open_reader``
verifies identity and size), so a drifted manifest or a stale block file is
an error at open, not a wrong expert at run time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from czyx.expert_key import MAX_EXPERTS, class_shift, expert_key, key_classes
from czyx.key import Key
from czyx.space import Selector
from czyx.store.consumer import ExpertExtent, ModelInfo
from czyx.store.core.checksum import checksum
from czyx.store.errors import ChecksumError
from czyx.store.interfaces import ClassView, StoreInterface
from czyx.store.io.experts import BlockFileExperts
from czyx.store.io.reader import RawReader
from czyx.store.io.widen import widen
from czyx.store.models.archs import (
    ALL_GLOBAL_ROLES,
    ALL_ROLES,
    FILE_ROLES,
    MTP_ROLE,
    SIDE_FILES,
    TOKENIZER_ROLE,
)
from czyx.store.models.checkpoint import DTYPES
from czyx.store.models.expert_layout import layout_from_manifest
from czyx.store.models.mount import ADAPTER_KIND, MODEL_KIND, TRUNK_KIND, resolve
from czyx.store.models.mount_errors import ExpertIndexError, MissingTrunkRoleError, ModelSpaceError
from czyx.store.quant.codec import expert_parts, packed_trunk, trunk_tensor
from czyx.store.quant.errors import QuantError
from czyx.store.quant.formats import dequantize, get_format, is_quant_format

_NO_BLOCK = -1


@dataclass(frozen=True)
class TrunkRef:
    """Where a trunk tensor's bytes are (its space's block file, extent, format)."""

    space: Selector
    record: dict

    @property
    def dtype(self) -> str:
        """The source dtype name (``F32``, ``F16``, ``BF16``...)."""
        return self.record["dtype"]

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape in the checkpoint."""
        return tuple(self.record["shape"])


def _check_extent_fields(rec: dict, sel: Selector, key: bytes, off: str = "off") -> None:
    """``off``/``len``/``sum`` present, integers, in range (before anything is sized by them)."""
    for name, hi in ((off, 1 << 62), ("len", 1 << 40), ("sum", 1 << 64)):
        v = rec.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < hi:
            raise ModelSpaceError(
                f"space {sel.hex()}: record {bytes(key).hex()} field {name}={v!r:.40} invalid"
            )


class ModelSpace:
    """A model version resolved to tables: the part of opening shared by the
    consumer and by export.

    Attributes
    ----------
    selector, manifest
        The opened version (``manifest`` is its own; ``root`` the full model's).
    chain
        ``[(selector, manifest), ...]`` from the full model to the opened version.
    blocks
        Selectors of the block files the expert tables point into.
    blk, off, sums
        ``int64 [n_layers, width]`` tables by router index (``width`` is
        ``max(256, n_experts)``; ``blk == -1``: no expert), ``uint64`` checksums.
    class_shift
        Bits of a class value held in the key's ``y`` (:mod:`czyx.expert_key`).
    records
        ``{(layer, router byte): record}`` of the most derived version (for export).
    trunk
        ``{(role, layer): TrunkRef}``, adapters overlaid on the base.
    """

    def __init__(self, store: StoreInterface, ref: str | Selector) -> None:
        self.store = store
        self.selector = resolve(store, ref)
        self.chain = self._chain(self.selector)
        self.root = self.chain[0][1]
        self.manifest = self.chain[-1][1]
        self._check_manifest()
        ex = self.root["expert"]
        self.n_layers, self.n_experts = int(ex["n_layers"]), int(ex["n_experts"])
        self.nbytes, self.stride = int(ex["nbytes"]), int(ex["stride"])
        self.layout = layout_from_manifest(self.root)
        if (self.layout.n_layers, self.layout.n_classes) != (self.n_layers, self.n_experts):
            raise ModelSpaceError(
                f"space {self.selector.hex()}: layout is {self.layout.n_layers} x "
                f"{self.layout.n_classes}, manifest says {self.n_layers} x {self.n_experts}"
            )
        self.class_shift = class_shift(self.n_experts)
        self.width = max(256, self.n_experts)
        shape = (self.n_layers, self.width)
        self.blk = np.full(shape, _NO_BLOCK, np.int64)
        self.off = np.zeros(shape, np.int64)
        self.sums = np.zeros(shape, np.uint64)
        self.blocks: list[Selector] = []
        self.records: dict[tuple[int, int], dict] = {}
        self.trunk: dict[tuple[str, int | None], TrunkRef] = {}
        for sel, manifest in self.chain:
            self._load_experts(sel)
            if manifest.get("trunk"):
                self._load_trunk(Selector.from_hex(manifest["trunk"]))
        self._check_complete()

    def _check_manifest(self) -> None:
        """Types and bounds of the manifest fields sized from, before any allocation.

        The index is checksummed, so this guards against a writer's bug or a
        crafted store rather than bit rot: a missing field or a value no model has
        is a :class:`ModelSpaceError`, never a ``KeyError`` or a petabyte array.
        """
        from czyx.store.models.mount_plan import validate_config

        where = f"space {self.selector.hex()}"
        ex = self.root.get("expert")
        if not isinstance(ex, dict):
            raise ModelSpaceError(f"{where}: manifest has no expert table")
        bounds = {"n_layers": (1, 1024), "n_experts": (1, MAX_EXPERTS), "nbytes": (1, 1 << 36)}
        bounds["stride"] = (1, 1 << 36)
        for key, (lo, hi) in bounds.items():
            v = ex.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ModelSpaceError(f"{where}: manifest expert.{key}={v!r:.40} invalid")
        if ex["stride"] < ex["nbytes"]:
            raise ModelSpaceError(f"{where}: manifest expert stride below its size")
        validate_config(self.root.get("config"), ex["n_experts"])

    def _chain(self, sel: Selector) -> list[tuple[Selector, dict]]:
        chain: list[tuple[Selector, dict]] = []
        while True:
            manifest = self.store.manifest(sel)
            kind = manifest.get("kind")
            if kind not in (MODEL_KIND, ADAPTER_KIND):
                raise ModelSpaceError(f"space {sel.hex()} is not a mounted model (kind {kind!r})")
            chain.append((sel, manifest))
            if kind == MODEL_KIND:
                return chain[::-1]
            if len(chain) > 64:
                raise ModelSpaceError(f"adapter chain of {self.selector.hex()} is too deep")
            sel = Selector.from_hex(manifest["base"])

    def _block_index(self, sel: Selector) -> int:
        if sel not in self.blocks:
            self.blocks.append(sel)
        return self.blocks.index(sel)

    def _load_experts(self, sel: Selector) -> None:
        try:
            self._load_experts_checked(sel)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            # A record missing a field or holding the wrong type: typed, naming the space.
            raise ModelSpaceError(
                f"space {sel.hex()}: malformed expert record ({type(exc).__name__}: {exc})"
            ) from exc

    def _load_experts_checked(self, sel: Selector) -> None:
        data_start: dict[int, int] = {}
        for key, rec in self.store.scan(sel):
            _check_extent_fields(rec, sel, key, "off" if "blk" not in rec else "blk_off")
            k = Key.unpack(key)
            layer, byte = k.z, int(rec.get("expert", -1))
            if not (0 <= layer < self.n_layers and 0 <= byte < self.n_experts):
                raise ModelSpaceError(
                    f"space {sel.hex()}: record {key.hex()} is outside "
                    f"{self.n_layers} layers x {self.n_experts} experts"
                )
            want = expert_key(self.layout.class_of(layer, byte), layer, self.class_shift)
            if want != k or rec.get("layer") != layer:
                raise ModelSpaceError(
                    f"space {sel.hex()}: record of layer {layer} expert "
                    f"{byte} sits at class {k.cls} y {k.y}, layout says "
                    f"class {want.cls} y {want.y}"
                )
            if rec["len"] != self.nbytes:
                raise ModelSpaceError(
                    f"space {sel.hex()}: expert ({layer}, {byte}) has "
                    f"{rec['len']} bytes, manifest says {self.nbytes}"
                )
            own = "blk" not in rec
            blk = self._block_index(sel if own else Selector.from_hex(rec["blk"]))
            if own:
                start = rec["off"] - self.layout.ordinal(layer, byte) * self.stride
                if data_start.setdefault(blk, start) != start:
                    raise ModelSpaceError(
                        f"space {sel.hex()}: expert ({layer}, {byte}) at "
                        f"offset {rec['off']} breaks the layout arithmetic"
                    )
            self.blk[layer, byte] = blk
            self.off[layer, byte] = rec["off"] if own else rec["blk_off"]
            self.sums[layer, byte] = rec["sum"]
            self.records[(layer, byte)] = rec

    def _load_trunk(self, sel: Selector) -> None:
        if self.store.manifest(sel).get("kind") != TRUNK_KIND:
            raise ModelSpaceError(f"space {sel.hex()} is not a trunk")
        size = self.store.block_identity(sel).size
        for key, rec in self.store.scan(sel):
            role, layer = rec.get("role"), rec.get("layer")
            if not isinstance(role, str) or not (layer is None or isinstance(layer, int)):
                raise ModelSpaceError(f"space {sel.hex()}: trunk record {key.hex()} malformed")
            if not {"off", "len", "sum"} & rec.keys():
                self.trunk[(role, layer)] = TrunkRef(sel, rec)  # no extent (metadata only)
                continue
            _check_extent_fields(rec, sel, key)
            if rec["off"] + rec["len"] > size:
                raise ModelSpaceError(
                    f"space {sel.hex()}: trunk record {key.hex()} runs past its block file"
                )
            self.trunk[(role, layer)] = TrunkRef(sel, rec)

    def _check_complete(self) -> None:
        sparse = self.root["expert"]["sparse_layers"]
        have = self.blk[sparse, : self.n_experts] != _NO_BLOCK
        subset = self.root.get("subset")  # a replicated subset (store.models.replicate)
        if subset:
            want = np.zeros_like(have)
            lo, hi = subset["classes"]
            layers = subset.get("layers") or [0, self.n_layers - 1]
            for row, layer in enumerate(sparse):
                if layers[0] <= layer <= layers[1]:
                    for e in range(self.n_experts):
                        cls = self.layout.class_of(layer, e) >> self.class_shift
                        want[row, e] = lo <= cls <= hi
            have |= ~want
        if not have.all():
            layer, byte = np.argwhere(~have)[0]
            raise ModelSpaceError(
                f"model {self.selector.hex()}: no extent for layer {sparse[layer]} expert {byte}"
            )

    def read_trunk_raw(self, ref: TrunkRef, reader: RawReader | None = None) -> np.ndarray:
        """The verified bytes of one trunk tensor (``uint8``).

        ``reader``: an open reader on ``ref.space``'s block file (the lazy
        trunk keeps one per space); ``None`` opens (and verifies) one for this
        read. Either way the bytes are checked against the record's checksum.
        """
        if reader is None:
            with self.store.open_reader(ref.space) as opened:
                return self.read_trunk_raw(ref, opened)
        rec = ref.record
        buf = np.empty(rec["len"], np.uint8)
        if rec["len"]:
            reader.read_into(rec["off"], buf)
        if checksum(buf) != rec["sum"]:
            raise ChecksumError(
                f"trunk {rec['role']} layer {rec['layer']}: checksum mismatch "
                f"in space {ref.space.hex()}"
            )
        return buf


class StoreModel(BlockFileExperts):
    """A mounted model version as an engine sees it (implements ``ModelConsumer``).

    Obtain with :func:`open_version`. Trunk tensors are read, verified and
    widened to float32 at open; expert reads go straight from block files into
    the caller's slots.

    With ``lazy_trunk`` the per-layer trunk tensors (roles with a layer index)
    are not read at open: :meth:`trunk` and :meth:`trunk_quantized` read,
    verify and convert them on every call, and the caller owns (and frees) the
    result. That is for engines whose trunk does not fit their memory budget
    (``inference.trunkwindow``); the global roles and the tokenizer stay as in
    the eager mode. With ``trunk=False`` no trunk tensor is read or held at all:
    the version's experts alone (the low tier of :mod:`store.models.tiered`,
    whose trunk is the high version's); :meth:`has_trunk` is then False for
    every role.
    """

    def __init__(
        self,
        store: StoreInterface,
        ref: str | Selector,
        *,
        view: ClassView | None = None,
        direct: bool = False,
        lazy_trunk: bool = False,
        trunk: bool = True,
    ) -> None:
        space = ModelSpace(store, ref)
        self._space = space
        ex = space.root["expert"]
        self.info = ModelInfo(
            arch=space.root["arch"],
            config=space.root["config"],
            n_layers=space.n_layers,
            n_experts=space.n_experts,
            expert_nbytes=space.nbytes,
            expert_slot_nbytes=space.stride,
            expert_format=ex["format"],
            selector=space.selector.raw,
        )
        self._readers = [store.open_reader(sel, direct=direct) for sel in space.blocks]
        self._blk, self._off, self._sums = space.blk, space.off, space.sums
        self._direct = direct
        # Key class byte of every (layer, router index): the portal checks classes.
        n = space.n_experts
        self._width = space.width
        self._cls = np.zeros((space.n_layers, space.width), np.int64)
        self._cls[:, :n] = key_classes(
            space.layout.class_array(np.arange(space.n_layers)[:, None], np.arange(n)[None, :]),
            space.class_shift,
        )
        self._view = view
        self._allowed = np.ones((space.n_layers, space.width), bool)
        if view is not None:
            layers = np.arange(space.n_layers)
            in_range = (layers >= view.layer_lo) & (layers <= view.layer_hi)
            self._allowed = np.asarray(view.allowed_classes)[self._cls] & in_range[:, None]
        self._trunk = {}
        # Quantized trunk tensors (record "qfmt"): only their packed bytes stay
        # resident (what the kernels use); trunk() dequantizes a fresh float32
        # copy for callers that know nothing of formats, so a quantized version
        # holds its stored bytes, not a float32 trunk beside them.
        self._packed: dict[tuple[str, int | None], tuple] = {}
        self._tokenizer_ref = space.trunk.get((TOKENIZER_ROLE, None))
        # Kept multi-token-prediction tensors by checkpoint name (read on demand: mtp_tensor).
        self._mtp = {r.record["src"][1]: r for k, r in space.trunk.items() if k[0] == MTP_ROLE}
        # Lazy mode: per-layer refs, read on demand through one reader per trunk
        # space (opened and identity-checked here, so a replaced block file is an
        # error at open, and later reads need no LMDB transaction: they may run on
        # a loader thread).
        self._lazy: dict[tuple[str, int | None], TrunkRef] = {}
        self._trunk_readers: dict[bytes, RawReader] = {}
        self._layer_nbytes = np.zeros(space.n_layers, np.int64)
        for k, r in space.trunk.items():
            if k[0] not in FILE_ROLES and k[0] != MTP_ROLE and k[1] is not None:
                self._layer_nbytes[k[1]] += r.record["len"]
        for k, r in space.trunk.items():
            if not trunk or k[0] in FILE_ROLES or k[0] == MTP_ROLE:  # (FILE, MTP: export only)
                continue
            if lazy_trunk and k[1] is not None:
                self._lazy[k] = r
                if r.space.raw not in self._trunk_readers:
                    self._trunk_readers[r.space.raw] = store.open_reader(r.space)
                continue
            raw = space.read_trunk_raw(r)
            if "qfmt" in r.record:
                self._packed[k] = packed_trunk(r.record, raw)
            else:
                self._trunk[k] = _float32(raw, r)
        for arr in self._trunk.values():
            arr.setflags(write=False)  # shared by every caller: nobody may edit weights
        for packed in self._packed.values():
            packed[0].setflags(write=False)
        self._qfmt = ex["format"] if is_quant_format(ex["format"]) else None
        self._inter, self._hidden = int(ex["inter"]), int(ex["hidden"])
        gate = (ex["inter"], ex["hidden"])
        item = DTYPES[ex["dtype"]][1]
        self._view_dtype = DTYPES[ex["dtype"]][0]
        self._shapes = (gate, gate, gate[::-1])
        self._matrix_bytes = ex["inter"] * ex["hidden"] * item

    # -- trunk -------------------------------------------------------------------------
    def tokenizer_json(self) -> str | None:
        """The checkpoint's ``tokenizer.json`` text as mounted (verified), or ``None``."""
        if self._tokenizer_ref is None:
            return None
        return self._space.read_trunk_raw(self._tokenizer_ref).tobytes().decode("utf-8")

    def side_file(self, name: str) -> bytes | None:
        """A kept checkpoint file (``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json``) as mounted (verified), or ``None`` when the
        checkpoint had none.

        Raises
        ------
        KeyError
            ``name`` is not one of :data:`~czyx.store.models.archs.SIDE_FILES`.
        """
        role = SIDE_FILES[name][0]
        ref = self._space.trunk.get((role, None))
        return None if ref is None else self._space.read_trunk_raw(ref).tobytes()

    def gguf_chat_template(self) -> str | None:
        """The chat template a GGUF source carried in its metadata
        (``tokenizer.chat_template``), or ``None``."""
        meta = (self._space.root.get("source") or {}).get("metadata") or {}
        value = meta.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def lazy_trunk(self) -> bool:
        """Whether per-layer trunk tensors are read on each call (not resident)."""
        return bool(self._lazy)

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        """Whether the model has ``role`` (at ``layer``); reads nothing."""
        k = (role, layer)
        return k in self._trunk or k in self._packed or k in self._lazy

    def trunk_layer_nbytes(self, layer: int) -> int:
        """Stored bytes of ``layer``'s trunk tensors (all its roles, as mounted).

        What one layer's trunk costs to read; the float32 resident form of an
        f16/bf16 checkpoint is twice that.
        """
        if not 0 <= layer < self.info.n_layers:
            raise ExpertIndexError(f"layer {layer} outside {self.info.n_layers} layers")
        return int(self._layer_nbytes[layer])

    def _read_lazy(self, ref: TrunkRef) -> np.ndarray:
        reader = self._trunk_readers.get(ref.space.raw)
        if reader is None:
            raise ModelSpaceError("the model is closed: its trunk cannot be read")
        return self._space.read_trunk_raw(ref, reader)

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        """The float32 tensor of ``role`` at ``layer`` (``None`` for global roles).

        Eager mode: the resident, read-only array (a quantized tensor: a new
        float32 array dequantized from its resident packed bytes). Lazy mode, per-layer roles:
        a new array read and verified now (``ChecksumError``,
        ``ShortReadError``, ``ReadIOError`` on a bad read, never other bytes).
        """
        try:
            return self._trunk[(role, layer)]
        except KeyError:
            packed = self._packed.get((role, layer))
            if packed is not None:
                return dequantize(*packed)
            ref = self._lazy.get((role, layer))
            if ref is not None:
                raw = self._read_lazy(ref)
                if "qfmt" in ref.record:
                    return trunk_tensor(ref.record, raw)[0]
                return _float32(raw, ref)
            if role not in ALL_ROLES:
                raise ValueError(f"trunk role {role!r} is not one of {ALL_ROLES}") from None
            where = "" if role in ALL_GLOBAL_ROLES else f" at layer {layer}"
            raise MissingTrunkRoleError(f"{self.info.arch} model has no {role}{where}") from None

    def mtp_names(self) -> list[str]:
        """The checkpoint names of the kept multi-token-prediction tensors (trunk role
        ``"mtp"``, ``num_nextn_predict_layers`` layers), in name order; empty without them."""
        return sorted(self._mtp)

    def mtp_tensor(self, name: str) -> np.ndarray:
        """The float32 values of kept multi-token-prediction tensor ``name``, read and
        verified now (not held: the caller owns the array).

        Raises
        ------
        MissingTrunkRoleError
            The model keeps no such tensor.
        ChecksumError, ShortReadError, ReadIOError
            A bad read (never other bytes).
        """
        ref = self._mtp.get(name)
        if ref is None:
            raise MissingTrunkRoleError(f"{self.info.arch} model keeps no MTP tensor {name!r}")
        return _float32(self._space.read_trunk_raw(ref), ref)

    def trunk_quantized(self, role: str, layer: int | None = None) -> tuple | None:
        """``(packed uint8 buffer, QuantFormat, shape)`` of a quantized trunk tensor, else None.

        The optional consumer extension the engine uses to run its kernels on
        the packed bytes (``store/quant/README.md``). In lazy mode a per-layer
        quantized tensor is read and verified on each call (not dequantized).
        """
        ref = self._lazy.get((role, layer))
        if ref is None or "qfmt" not in ref.record:
            return self._packed.get((role, layer))
        shape = ref.shape
        if len(shape) != 2:
            raise QuantError(f"quantized trunk tensor of shape {shape}: only matrices are")
        return self._read_lazy(ref), get_format(str(ref.record["qfmt"])), (shape[0], shape[1])

    @property
    def allowed_experts(self) -> np.ndarray:
        """``bool [n_layers, n_experts]``: the experts (by router index) the portal permits.

        All true without a portal. The engine masks routing with it, so a scoped
        portal constrains which experts are chosen, not only which may be read.
        """
        out = self._allowed[:, : self.info.n_experts].copy()
        out.flags.writeable = False
        return out

    # -- experts -----------------------------------------------------------------------
    def _check(self, layer: int, router_byte: int) -> int:
        if not (0 <= layer < self.info.n_layers and 0 <= router_byte < self._width):
            raise ExpertIndexError(
                f"expert (layer {layer}, index {router_byte}) outside "
                f"{self.info.n_layers} layers x {self._width} router indices"
            )
        if not self._allowed[layer, router_byte]:
            cls = int(self._cls[layer, router_byte])
            self._view.check(cls, layer)  # raises the portal's error and audits it
            # Fail closed even if a view's check disagrees with its own mask.
            raise ModelSpaceError(f"the portal does not cover class {cls} at layer {layer}")
        blk = int(self._blk[layer, router_byte])
        if blk == _NO_BLOCK:
            raise ModelSpaceError(f"layer {layer} has no routed expert {router_byte}")
        return blk

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        """Resolve ``(layer, router byte)`` to ``ExpertExtent`` (block, offset, length, sum).

        ``block`` indexes :meth:`expert_block_paths`; the portal's view checks
        the class and layer first (a denial raises, audited).
        """
        blk = self._check(layer, router_byte)
        return ExpertExtent(
            blk,
            int(self._off[layer, router_byte]),
            self.info.expert_nbytes,
            int(self._sums[layer, router_byte]),
        )

    def trunk_digest(self) -> str:
        """A digest of the trunk records (role, layer, format, length, checksum): equal for
        two versions whose trunk tensors are byte for byte the same; reads nothing."""
        h = hashlib.sha256()
        for (role, layer), ref in sorted(
            self._space.trunk.items(),
            key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1]),
        ):
            rec = ref.record
            fields = (
                role,
                layer,
                rec.get("qfmt"),
                rec.get("dtype"),
                rec.get("len"),
                rec.get("sum"),
            )
            h.update(repr(fields).encode())
        return h.hexdigest()

    def expert_block_paths(self) -> list[str]:
        """The block files behind the expert extents, indexed by ``ExpertExtent.block``."""
        return [str(r.path) for r in self._readers]

    def expert_fds(self) -> list[int]:
        """The descriptors this model verified at open, indexed by ``ExpertExtent.block``.

        The store's expert reads (``open_expert_reads``, from
        :class:`~czyx.store.io.experts.BlockFileExperts`) go through these (the
        published block files, even if a path is replaced later: that is refused
        per read as stale) and through :meth:`expert_extent`, so the portal's
        view checks every expert they touch.
        """
        if not self._readers and self._space.blocks:
            raise ModelSpaceError("the model is closed: its experts cannot be read")
        return [r.fd for r in self._readers]

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        """Read one expert into ``slot`` (uint8, >= ``expert_nbytes``), verified.

        Raises ``ShortReadError``/``ReadIOError`` on I/O failure and
        ``ChecksumError`` on a mismatch; the slot's content is then undefined
        and must not be used.
        """
        blk = self._check(layer, router_byte)
        n = self.info.expert_nbytes
        if slot.nbytes < n:
            raise ValueError(f"slot of {slot.nbytes} bytes; an expert needs {n}")
        # In direct mode read the padded stride when the slot has room: block
        # files are padded, so the request stays aligned end to end.
        m = (
            self.info.expert_slot_nbytes
            if self._direct and slot.nbytes >= self.info.expert_slot_nbytes
            else n
        )
        off = int(self._off[layer, router_byte])
        self._readers[blk].read_into(off, slot[:m])
        if checksum(slot[:n]) != int(self._sums[layer, router_byte]):
            raise ChecksumError(
                f"expert (layer {layer}, byte {router_byte}) at offset {off} "
                f"of {self._readers[blk].path}: checksum mismatch"
            )

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Zero-copy ``(gate [I,H], up [I,H], down [H,I])`` of a filled slot.

        f32/f16 views have their numpy dtype; bf16 views are ``uint16`` bit
        patterns (numpy has no bfloat16; widen with ``store.checkpoint.to_float32``).
        A quantized version returns the three packed ``uint8`` parts.
        """
        if self._qfmt is not None:
            return expert_parts(self._qfmt, self._inter, self._hidden, slot)
        m, dt = self._matrix_bytes, self._view_dtype
        return tuple(  # type: ignore[return-value]
            np.frombuffer(slot, dt, m // dt.itemsize, i * m).reshape(s)
            for i, s in enumerate(self._shapes)
        )

    def close(self) -> None:
        """Close the block file readers (the lazy trunk's too)."""
        for r in self._readers:
            r.close()
        self._readers = []
        for r in self._trunk_readers.values():
            r.close()
        self._trunk_readers = {}

    def __enter__(self) -> StoreModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _float32(raw: np.ndarray, ref: TrunkRef) -> np.ndarray:
    """A float32 tensor from its freshly read bytes (eager and lazy trunk alike).

    F32 is the read buffer itself (no copy); other dtypes are widened by
    :func:`store.widen.widen` (``to_float32``'s bits, in C for f16/bf16).
    """
    if ref.dtype == "F32":
        return _as_dtype(raw, ref)
    return widen(_as_dtype(raw, ref), ref.dtype)


def _as_dtype(buf: np.ndarray, ref: TrunkRef) -> np.ndarray:
    return buf.view(DTYPES[ref.dtype][0]).reshape(ref.shape)


def open_version(
    store: StoreInterface,
    tag_or_selector: str | Selector,
    *,
    view: ClassView,
    direct: bool = False,
    lazy_trunk: bool = False,
    trunk: bool = True,
) -> StoreModel:
    """Open a mounted model version for inference.

    Parameters
    ----------
    store
        An open :class:`store.Store`.
    tag_or_selector
        ``NAME@VERSION``, a 64-hex selector, or a :class:`Selector`.
    view
        A portal's ``SpaceView`` onto the version's expert space (from
        :func:`czyx.portals.open_model`); expert reads outside its classes or
        layers are refused (and audited) by the view. It is required: there is
        no path to a model's experts that bypasses the portals
        (:func:`czyx.portals.open_consumer` opens both in one call).
    direct
        Read experts with ``O_DIRECT`` (slots must then be 4096-aligned).
    lazy_trunk
        Do not read per-layer trunk tensors at open: each ``trunk`` /
        ``trunk_quantized`` call reads and verifies one (for a trunk that does
        not fit the memory budget, see ``inference.trunkwindow``).
    trunk
        False: read and hold no trunk tensor, only the experts are served (a
        tier's low version).
    """
    if view is None:
        raise ModelSpaceError("a model version opens only through a portal's view")
    model = StoreModel(
        store, tag_or_selector, view=view, direct=direct, lazy_trunk=lazy_trunk, trunk=trunk
    )
    if view is not None and getattr(view, "space", model._space.selector) != model._space.selector:
        model.close()
        raise ModelSpaceError("the portal's view is onto another space than this model")
    return model
