"""SpaceView: the read-only window a portal opens onto one space.

Everything a portal allows inside a space is computed once, at open: an
allowed-class mask (a 256-bit int, also exposed as ``numpy.bool_[256]``) and
an inclusive layer range. The per-read check is then two comparisons and a
shift, O(1), with no lookup. A read outside them raises
:class:`~portals.errors.OutOfScope` and is audited; no byte is returned.

The layer of a record is its key's ``z`` coordinate (in an expert space
``z`` is the layer, the class is the expert). The view has no write method.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from czyx.curves.base import Curve
from czyx.key import DEFAULT_CURVE, Key
from czyx.portals.caveats import N_CLASSES
from czyx.portals.errors import OutOfScope, PortalError, RecordNotFoundError
from czyx.space import Selector

if TYPE_CHECKING:
    from czyx.portals.authority import PortalAuthority
    from czyx.portals.permission import Permission, Scope


def curve_of(manifest: dict) -> Curve:
    """The key curve a space records in its manifest (Morton when it records none).

    Fails closed on a curve it does not know: decoding keys with the wrong
    curve would check the wrong layer.
    """
    # Only "key_curve" is read: "curve"/"layout" fields of model manifests
    # describe the block-file layout, not how keys are packed.
    spec = manifest.get("key_curve")
    name = spec.get("name") if isinstance(spec, dict) else spec
    if name in (None, "morton", DEFAULT_CURVE.name):
        return DEFAULT_CURVE
    raise PortalError(f"space manifest: unknown key curve {name!r}")


class SpaceView:
    """Read-only access to one space, within a verified portal's caveats.

    Create through :func:`portals.open_space` (or ``Store.open_space``), never
    directly.

    Attributes
    ----------
    space:
        The space's selector.
    permission:
        The portal's verified permission.
    tenant, right:
        Who opened it and for what (``read`` or ``infer``).
    allowed_classes:
        ``numpy.bool_[256]``, read-only: ``allowed_classes[c]`` for class ``c``
        (for vectorised checks of many classes at once).
    layer_lo, layer_hi:
        Inclusive layer range.
    """

    def __init__(
        self,
        authority: PortalAuthority,
        space: Selector,
        permission: Permission,
        scope: Scope,
        *,
        right: str,
        tenant: str,
        manifest: dict,
    ) -> None:
        self._auth = authority
        self._store = authority.store
        self.space = space
        self.permission = permission
        self.right = right
        self.tenant = tenant
        self._manifest = manifest
        self._curve = curve_of(manifest)
        self._mask = scope.classes
        self.layer_lo = scope.layer_lo
        self.layer_hi = scope.layer_hi
        bits = np.unpackbits(
            np.frombuffer(scope.classes.to_bytes(N_CLASSES // 8, "little"), dtype=np.uint8),
            bitorder="little",
        ).astype(bool)
        bits.flags.writeable = False
        self.allowed_classes = bits
        self._classes = frozenset(np.flatnonzero(bits).tolist())
        self._reader: Any = None
        self._closed = False

    # --- the O(1) check ------------------------------------------------------------

    def allows(self, cls: int, layer: int) -> bool:
        """Whether class ``cls`` at layer ``layer`` may be read (no audit, no raise).

        One hash-set membership and two comparisons. The set holds exactly
        the allowed ints 0..255, so any other value (negative, >= 256, not an
        int) is simply absent: fail closed without a separate range check.
        """
        return cls in self._classes and self.layer_lo <= layer <= self.layer_hi

    def check(self, cls: int, layer: int) -> None:
        """Raise :class:`OutOfScope` (audited) unless ``(cls, layer)`` is readable."""
        # Fast path inlined (no second call); a closed view has no classes.
        if cls in self._classes and self.layer_lo <= layer <= self.layer_hi:
            return
        if self._closed:
            raise PortalError("space view is closed")
        self._deny(f"class {cls!r}, layer {layer!r} outside the portal", cls=cls, layer=layer)

    def check_many(self, classes: np.ndarray | int, layers: np.ndarray | int) -> None:
        """Vectorised :meth:`check`: ``classes`` and ``layers`` broadcast together.

        Raises :class:`OutOfScope` (audited, naming the first offender) if any
        pair is outside the portal.
        """
        c, z = np.broadcast_arrays(np.asarray(classes), np.asarray(layers))
        c, z = c.ravel(), z.ravel()
        in_range = (c >= 0) & (c < N_CLASSES) & (z >= self.layer_lo) & (z <= self.layer_hi)
        ok = in_range & self.allowed_classes[np.where(in_range, c, 0).astype(np.intp)]
        if self._closed:
            raise PortalError("space view is closed")
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            self._deny(
                f"class {int(c[i])}, layer {int(z[i])} outside the portal",
                cls=int(c[i]),
                layer=int(z[i]),
            )

    def _deny(self, message: str, **fields: Any) -> None:
        exc = OutOfScope(message)
        self._auth.deny(exc, perm=self.permission, space=self.space.raw, right=self.right, **fields)
        raise exc

    # --- reads -------------------------------------------------------------------------

    @property
    def manifest(self) -> dict:
        """The space's manifest (opening the portal already allowed this)."""
        return self._manifest

    def get(self, key: Key) -> dict | None:
        """The record at ``key`` if the portal covers it (``None`` if there is none)."""
        self.check(key.cls, key.z)
        return self._store.get(self.space, key.pack(self._curve))

    def scan(self, lo_cls: int = 0, hi_cls: int = N_CLASSES - 1) -> Iterator[tuple[Key, dict]]:
        """Records of classes ``lo_cls..hi_cls`` that the portal covers, in key order.

        Classes and layers outside the portal are skipped, not returned; a
        range that holds no allowed class at all is refused (audited).
        """
        if self._closed:
            raise PortalError("space view is closed")
        if not 0 <= lo_cls <= hi_cls < N_CLASSES:
            raise ValueError(f"scan: bad class range {lo_cls}..{hi_cls}")
        window = ((1 << (hi_cls + 1)) - 1) ^ ((1 << lo_cls) - 1)
        visible = self._mask & window
        if not visible:
            self._deny(f"classes {lo_cls}-{hi_cls} outside the portal", cls=lo_cls)
        # Scan each maximal run of allowed classes, so disallowed classes'
        # records are never even decoded.
        c = 0
        while c < N_CLASSES:
            if not visible >> c & 1:
                c += 1
                continue
            start = c
            while c + 1 < N_CLASSES and visible >> (c + 1) & 1:
                c += 1
            for raw, rec in self._store.scan(self.space, start, c):
                key = Key.unpack(raw, self._curve)
                if self.layer_lo <= key.z <= self.layer_hi:
                    yield key, rec
            c += 1

    def read_extent(self, key: Key, buf: np.ndarray | memoryview) -> dict:
        """Read the extent of the record at ``key`` into ``buf`` (checksum verified).

        Returns the record. Raises :class:`OutOfScope` before any I/O if the
        portal does not cover ``key``, and :class:`RecordNotFoundError` (a
        ``KeyError``) if there is no record.
        """
        self.check(key.cls, key.z)
        rec = self._store.get(self.space, key.pack(self._curve))
        if rec is None:
            raise RecordNotFoundError(f"no record at {key} in space {self.space.hex()[:16]}..")
        if self._reader is None:
            # open_reader checks the block file is the published one first.
            self._reader = self._store.open_reader(self.space)
        from czyx.store.io.reader import read_extent_verified

        read_extent_verified(self._reader, rec, buf)
        return rec

    def close(self) -> None:
        """Release the block-file reader; the view refuses reads afterwards."""
        self._closed = True
        self._classes = frozenset()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def __enter__(self) -> SpaceView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SpaceView(space={self.space.hex()[:16]}.., tenant={self.tenant!r}, "
            f"right={self.right!r}, classes={int(self.allowed_classes.sum())}, "
            f"layers={self.layer_lo}-{self.layer_hi})"
        )
