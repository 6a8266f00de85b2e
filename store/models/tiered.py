"""Two versions of one model opened as one consumer: every expert at one of two precisions.

Scope: :class:`TieredModel`, a ``ModelConsumer`` over a high-precision and a
low-precision version of the same model (for example ``NAME@q4`` and
``NAME@q2``, mounted from one checkpoint with the same trunk). The trunk and
everything but the routed experts are the high version's; expert ``(layer,
router byte)`` resolves to the version its entry in :attr:`TieredModel.tier`
names (:data:`HIGH` or :data:`LOW`), so an expert read is one extent of one
version, read and verified as that version's consumer reads it. Which experts
are high is the engine's choice (:mod:`czyx.inference.tiers`); this module only
resolves, and refuses a pair that is not one model at two precisions.

A slot must fit either precision: :attr:`TieredModel.info` is the high
version's, with ``expert_slot_nbytes`` the larger of the two strides.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import numpy as np

from czyx.store.consumer import GLOBAL_ROLES, LAYER_ROLES, ExpertExtent, ModelConsumer
from czyx.store.errors import StoreError
from czyx.store.io.experts import ExpertReads
from czyx.store.quant.errors import FormatError
from czyx.store.quant.formats import QuantFormat, get_format

#: :attr:`TieredModel.tier` values: the expert is read from the high or the low version.
HIGH, LOW = 0, 1


class TierError(StoreError, ValueError):
    """Two versions cannot be tiers of one model (another model, another trunk, the same
    precision, or a format without packed kernels)."""


def trunk_digest(consumer: ModelConsumer) -> str:
    """A digest of ``consumer``'s trunk: equal for two versions whose trunk tensors are equal.

    A consumer with its own ``trunk_digest()`` (a stored version: the trunk records'
    checksums, nothing read) answers itself; any other is hashed tensor by tensor
    (packed bytes where it has them, else the float32 values).
    """
    own = getattr(consumer, "trunk_digest", None)
    if own is not None:
        return str(own())
    h = hashlib.sha256()
    packed = getattr(consumer, "trunk_quantized", None)
    n_layers = int(consumer.info.n_layers)
    keys = [(r, None) for r in GLOBAL_ROLES]
    keys += [(r, i) for i in range(n_layers) for r in LAYER_ROLES]
    for role, layer in keys:
        if not consumer.has_trunk(role, layer):
            continue
        q = packed(role, layer) if packed is not None else None
        data = q[0] if q is not None else np.asarray(consumer.trunk(role, layer), np.float32)
        h.update(f"{role}/{layer}/{'' if q is None else q[1].name}:".encode())
        h.update(np.ascontiguousarray(data).tobytes())
    return h.hexdigest()


def _packed_format(name: str, version: str) -> QuantFormat:
    try:
        return get_format(name)
    except FormatError:
        raise TierError(
            f"tiers: {version} stores its experts as {name}, not a packed format (q2..q8)"
        ) from None


class TieredModel:
    """A high- and a low-precision version of one model as one ``ModelConsumer``.

    Parameters
    ----------
    high, low
        The opened versions (each through its portal). This object owns
        neither: :meth:`close` closes both, as the opener asked.
    names
        The versions' names for messages and reports (``("NAME@q4", "NAME@q2")``).

    Attributes
    ----------
    tier
        ``int8 [n_layers, n_experts]``: the version each expert is read from
        (:data:`HIGH` or :data:`LOW`); every expert starts high. The engine
        sets it (:meth:`set_high`); an expert already in a slot keeps the bytes
        it was read with until it is evicted.
    formats, nbytes, strides
        Per tier: the expert format, an expert's extent bytes and its slot stride.

    Raises
    ------
    TierError
        The versions differ in architecture, config, shape or trunk, or their
        experts are not packed formats of different bit widths with the high
        one wider.
    """

    def __init__(self, high: ModelConsumer, low: ModelConsumer, names: tuple[str, str]) -> None:
        hi, lo = high.info, low.info
        what = f"tiers {names[0]},{names[1]}"
        if (hi.arch, hi.n_layers, hi.n_experts) != (lo.arch, lo.n_layers, lo.n_experts):
            raise TierError(
                f"{what}: not one model ({hi.arch} {hi.n_layers}x{hi.n_experts} experts "
                f"against {lo.arch} {lo.n_layers}x{lo.n_experts})"
            )
        if hi.config != lo.config:
            raise TierError(f"{what}: not one model (their configs differ)")
        fh = _packed_format(hi.expert_format, names[0])
        fl = _packed_format(lo.expert_format, names[1])
        if fh.bits == fl.bits:
            raise TierError(f"{what}: both store {fh.bits}-bit experts (the same precision)")
        if fh.bits < fl.bits:
            raise TierError(
                f"{what}: the first tier is the high precision ({fh.name} is below {fl.name})"
            )
        if trunk_digest(high) != trunk_digest(low):
            raise TierError(f"{what}: not one model (their trunks differ)")
        self.high, self.low = high, low
        self.names = (str(names[0]), str(names[1]))
        self.formats = (fh.name, fl.name)
        self.nbytes = (int(hi.expert_nbytes), int(lo.expert_nbytes))
        self.strides = (int(hi.expert_slot_nbytes), int(lo.expert_slot_nbytes))
        self.info = replace(hi, expert_slot_nbytes=max(self.strides))
        self.tier = np.full((hi.n_layers, hi.n_experts), HIGH, np.int8)
        self._versions = (high, low)
        # Where the low version's block indices start among both versions' files (those
        # handed to the store's reads, expert_fds, expert_block_paths): one addition per
        # low fetch, no lookup.
        fds = self._fds()
        self._low_block0 = fds[1] if fds is not None else 0

    # ------------------------------------------------------------------ the tier map

    def set_high(self, high: np.ndarray) -> None:
        """Read the experts where ``high`` (``bool [n_layers, n_experts]``) is True from the
        high version, the others from the low one (from the next read on)."""
        mask = np.asarray(high, bool)
        if mask.shape != self.tier.shape:
            raise TierError(
                f"tiers: a high set of shape {mask.shape}, the model is {self.tier.shape}"
            )
        self.tier[...] = np.where(mask, HIGH, LOW)

    # ------------------------------------------------------------------ trunk and the rest

    def __getattr__(self, name: str) -> Any:
        # The trunk, tokenizer and every other optional extension are the high version's.
        if name.startswith("__") or name in ("high", "_versions"):
            raise AttributeError(name)
        return getattr(self.high, name)

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        """Whether the model has ``role`` (at ``layer``)."""
        return self.high.has_trunk(role, layer)

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        """The high version's trunk tensor (the low version's is the same)."""
        return self.high.trunk(role, layer)

    # ------------------------------------------------------------------ experts

    def _fds(self) -> tuple[list[int], int] | None:
        """Both versions' block descriptors (the low version's after the high's) and how
        many are the high's; None when either has no block files."""
        try:
            hi, lo = self.high.expert_fds(), self.low.expert_fds()  # type: ignore[attr-defined]
        except (AttributeError, NotImplementedError):
            return None
        return list(hi) + list(lo), len(hi)

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        """The extent of ``(layer, router_byte)`` in the version its tier names (block
        indices of the low version follow the high version's)."""
        t = int(self.tier[layer, router_byte])
        ext = self._versions[t].expert_extent(layer, router_byte)
        if t == LOW and ext.block >= 0:
            ext = replace(ext, block=ext.block + self._low_block0)
        return ext

    def expert_fds(self) -> list[int]:
        """Both versions' block descriptors, the low version's after the high's."""
        fds = self._fds()
        if fds is None:
            raise NotImplementedError("a tier version has no block files")
        return fds[0]

    def expert_block_paths(self) -> list[str]:
        """Both versions' block files, indexed as :meth:`expert_fds` (the low version's
        after the high's)."""
        paths = [v.expert_block_paths() for v in self._versions]  # type: ignore[attr-defined]
        return paths[0] + paths[1]

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        """Read one expert, verified, from the version its tier names."""
        t = int(self.tier[layer, router_byte])
        self._versions[t].read_expert(layer, router_byte, slot[: self.strides[t]])

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The packed parts of a slot holding a high-precision expert."""
        return self.high.expert_views(slot)

    def expert_views_at(
        self, slot: np.ndarray, tier: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The packed parts of a slot holding an expert read at ``tier``."""
        return self._versions[tier].expert_views(slot[: self.strides[tier]])

    def open_expert_reads(
        self, slots, *, readers: int = 2, native: bool | None = None, io: str | None = None
    ) -> ExpertReads:
        """The store's expert reads over both versions' block files (or, where a version
        has none, through :meth:`read_expert`)."""
        fds = self._fds()
        return ExpertReads(
            slots,
            self.expert_extent,
            files=fds[0] if fds is not None else (),
            read_expert=self.read_expert,
            readers=readers,
            native=native,
            io=io,
        )

    def close(self) -> None:
        """Close both versions (the low one even if the high one fails to close)."""
        try:
            self.high.close()
        finally:
            self.low.close()
