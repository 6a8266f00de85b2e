"""Two-level layout of an expert space's block file.

Level 1 (outer): a curve over ``(layer, class value)`` orders the experts, so
experts close in (layer, class) are close in the file. Level 2 (inner): inside
its slot an expert's matrices are row-major, so a matrix multiply walks
contiguous rows. The store computes
``offset = data_start + layout.ordinal(layer, expert) * expert_stride``.

Compaction: a Morton or Hilbert curve over a ``2**b x 2**b`` square has holes
when ``n_layers`` or ``n_classes`` is not a power of two (or they differ). The
layout therefore numbers the *valid* cells by the rank of their curve ordinal:
slot ``i`` is the ``i``-th valid cell in curve order. The ranks are precomputed
once into an ``(n_layers, n_classes)`` table (and its inverse), so
``n_slots == n_layers * n_classes``, the block file has no holes, and a lookup
is one array index, not a curve evaluation. Curve order is preserved: if
``curve(a) < curve(b)`` then ``ordinal(a) < ordinal(b)``. For ``rowmajor``
the slot is exactly ``layer * n_classes + class``.

Class permutation: ``class_perm[layer][expert]`` is the class value of the
expert the router calls ``expert`` (its output byte) in that layer, e.g. a
co-activation order learned from routing traces. The curve runs over class
values, so the permutation is applied before the curve. Every method here takes
the router's expert index; :meth:`ExpertLayout.class_of` gives the class value
that goes into the expert's key (the class byte itself with at most 256 experts a
layer; ``czyx.expert_key`` splits larger values between class byte and ``y``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from czyx.curves.errors import CurveError
from czyx.curves.registry import make_curve

LAYOUT_VERSION = 1
OUTER_CURVES = ("morton", "hilbert", "rowmajor")
MAX_CLASSES = 1 << 16  # class values; the key splits those above 255 (czyx.expert_key)
MAX_LAYERS = 1 << 24  # keeps the curve ordinal in one word and the tables small


def _check_int(name: str, v: Any, lo: int, hi: int) -> int:
    if not isinstance(v, int | np.integer) or isinstance(v, bool):
        raise CurveError(f"{name}: {v!r} is not an integer")
    if not lo <= v <= hi:
        raise CurveError(f"{name}: {v} outside [{lo}, {hi}]")
    return int(v)


def _norm_perm(perm: Any, n_layers: int, n_classes: int) -> tuple[tuple[int, ...], ...] | None:
    if perm is None:
        return None
    arr = np.asarray(perm)
    if arr.dtype.kind not in "ui":
        raise CurveError(f"class_perm: expected integers, got dtype {arr.dtype}")
    if arr.ndim == 1:  # one order shared by every layer
        arr = np.broadcast_to(arr, (n_layers, arr.shape[0]))
    if arr.shape != (n_layers, n_classes):
        raise CurveError(
            f"class_perm: expected shape ({n_layers}, {n_classes}) or ({n_classes},), "
            f"got {np.asarray(perm).shape}"
        )
    ref = np.arange(n_classes)
    for layer in range(n_layers):
        if not np.array_equal(np.sort(arr[layer]), ref):
            raise CurveError(f"class_perm[{layer}]: not a permutation of range({n_classes})")
    if (arr == ref).all():  # the identity is recorded as None, so equal layouts compare equal
        return None
    return tuple(tuple(int(v) for v in row) for row in arr)


@dataclass(frozen=True)
class ExpertLayout:
    """Slot numbering of the experts ``(layer, expert)`` of a MoE model.

    Parameters
    ----------
    n_layers : int
        Number of MoE layers (the key's ``z``).
    n_classes : int
        Routed experts per layer (class values), at most ``MAX_CLASSES``.
    outer : {"morton", "hilbert", "rowmajor"}
        Curve over ``(layer, class value)``, layer as axis 0.
    class_perm : array_like, optional
        ``(n_layers, n_classes)`` (or ``(n_classes,)`` for all layers)
        permutations: router byte -> class value. ``None`` is the identity.
    """

    n_layers: int
    n_classes: int
    outer: str = "morton"
    class_perm: Any = None
    _slot: np.ndarray = field(init=False, repr=False, compare=False)
    _cell: np.ndarray = field(init=False, repr=False, compare=False)
    _cls: np.ndarray = field(init=False, repr=False, compare=False)
    _expert: np.ndarray = field(init=False, repr=False, compare=False)
    _bits: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        nl = _check_int("n_layers", self.n_layers, 1, MAX_LAYERS)
        nc = _check_int("n_classes", self.n_classes, 1, MAX_CLASSES)
        if self.outer not in OUTER_CURVES:
            raise CurveError(f"outer: {self.outer!r} is not one of {list(OUTER_CURVES)}")
        perm = _norm_perm(self.class_perm, nl, nc)
        cls = (
            np.tile(np.arange(nc, dtype=np.int64), (nl, 1))
            if perm is None
            else np.array(perm, dtype=np.int64)
        )
        expert = np.empty_like(cls)  # inverse permutation: class value -> router byte
        np.put_along_axis(expert, cls, np.arange(nc, dtype=np.int64)[None, :], axis=1)
        bits = max(1, (max(nl, nc) - 1).bit_length())
        curve = make_curve(self.outer, 2, bits)
        layers = np.repeat(np.arange(nl, dtype=np.uint64), nc)
        raw = curve.encode_array(np.stack([layers, cls.reshape(-1).astype(np.uint64)], axis=1))
        order = np.argsort(raw[:, 0], kind="stable")  # cell index (layer*nc + expert) by slot
        slot = np.empty(nl * nc, dtype=np.int64)
        slot[order] = np.arange(nl * nc, dtype=np.int64)
        cell = np.stack([order // nc, order % nc], axis=1).astype(np.int64)
        for name, arr in (
            ("_slot", slot.reshape(nl, nc)),
            ("_cell", cell),
            ("_cls", cls),
            ("_expert", expert),
        ):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "n_layers", nl)
        object.__setattr__(self, "n_classes", nc)
        object.__setattr__(self, "class_perm", perm)
        object.__setattr__(self, "_bits", bits)

    # ----------------------------------------------------------------- sizes

    @property
    def n_slots(self) -> int:
        """Slots in the block file: ``n_layers * n_classes`` (compacted, no holes)."""
        return self.n_layers * self.n_classes

    @property
    def curve_span(self) -> int:
        """Size of the raw outer-curve range ``2**(2*bits)`` before compaction."""
        return 1 << (2 * self._bits)

    @property
    def slot_table(self) -> np.ndarray:
        """Read-only ``(n_layers, n_classes)`` ``int64`` table: ``[layer, expert] -> slot``.

        For hot paths that have already validated their indices:
        ``layout.slot_table[layer, experts]`` is one fancy index, no checks.
        """
        return self._slot

    @property
    def cell_table(self) -> np.ndarray:
        """Read-only ``(n_slots, 2)`` ``int64`` table: ``slot -> (layer, expert)``."""
        return self._cell

    # ----------------------------------------------------------------- scalar

    def _check_cell(self, layer: Any, expert: Any) -> tuple[int, int]:
        return (
            _check_int("layer", layer, 0, self.n_layers - 1),
            _check_int("expert", expert, 0, self.n_classes - 1),
        )

    def ordinal(self, layer: int, expert: int) -> int:
        """Slot of the expert the router calls ``expert`` in ``layer``."""
        layer, expert = self._check_cell(layer, expert)
        return int(self._slot[layer, expert])

    def cell(self, ordinal: int) -> tuple[int, int]:
        """Inverse of :meth:`ordinal`: ``(layer, expert)`` in slot ``ordinal``."""
        o = _check_int("ordinal", ordinal, 0, self.n_slots - 1)
        layer, expert = self._cell[o]
        return int(layer), int(expert)

    def class_of(self, layer: int, expert: int) -> int:
        """Class value of router index ``expert`` in ``layer`` (the key class byte up to 256)."""
        layer, expert = self._check_cell(layer, expert)
        return int(self._cls[layer, expert])

    def expert_of(self, layer: int, cls: int) -> int:
        """Router byte whose class value in ``layer`` is ``cls``; inverse of :meth:`class_of`."""
        layer = _check_int("layer", layer, 0, self.n_layers - 1)
        cls = _check_int("class", cls, 0, self.n_classes - 1)
        return int(self._expert[layer, cls])

    def curve_ordinal(self, layer: int, expert: int) -> int:
        """The raw outer-curve ordinal of a cell (before compaction)."""
        layer, expert = self._check_cell(layer, expert)
        curve = make_curve(self.outer, 2, self._bits)
        return curve.encode((layer, int(self._cls[layer, expert])))

    # ----------------------------------------------------------------- vectorised

    def _check_arrays(self, layers: Any, experts: Any) -> tuple[np.ndarray, np.ndarray]:
        la, ea = np.broadcast_arrays(np.asarray(layers), np.asarray(experts))
        for name, arr, n in (("layer", la, self.n_layers), ("expert", ea, self.n_classes)):
            if arr.dtype.kind not in "ui":
                raise CurveError(f"{name}: expected integers, got dtype {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() >= n):
                bad = int(np.flatnonzero((arr.reshape(-1) < 0) | (arr.reshape(-1) >= n))[0])
                raise CurveError(f"{name}[{bad}]: {int(arr.reshape(-1)[bad])} outside [0, {n})")
        return la.astype(np.intp, copy=False), ea.astype(np.intp, copy=False)

    def ordinal_array(self, layers: Any, experts: Any) -> np.ndarray:
        """Vectorised :meth:`ordinal` (broadcasting); ``int64`` slots."""
        la, ea = self._check_arrays(layers, experts)
        return self._slot[la, ea]

    def cell_array(self, ordinals: Any) -> np.ndarray:
        """Vectorised :meth:`cell`: ``(N,)`` slots -> ``(N, 2)`` ``int64`` ``(layer, expert)``."""
        o = np.asarray(ordinals)
        if o.dtype.kind not in "ui":
            raise CurveError(f"ordinal: expected integers, got dtype {o.dtype}")
        if o.size and (o.min() < 0 or o.max() >= self.n_slots):
            bad = int(np.flatnonzero((o.reshape(-1) < 0) | (o.reshape(-1) >= self.n_slots))[0])
            raise CurveError(
                f"ordinal[{bad}]: {int(o.reshape(-1)[bad])} outside [0, {self.n_slots})"
            )
        return self._cell[o.astype(np.intp, copy=False)]

    def class_array(self, layers: Any, experts: Any) -> np.ndarray:
        """Vectorised :meth:`class_of`."""
        la, ea = self._check_arrays(layers, experts)
        return self._cls[la, ea]

    def runs(self, experts: Iterable[Sequence[int]] | np.ndarray) -> list[tuple[int, int]]:
        """Contiguous slot runs covering a set of experts.

        Parameters
        ----------
        experts : iterable of (layer, expert) or array of shape (N, 2)
            Duplicates are allowed.

        Returns
        -------
        list of (start, length)
            Disjoint, sorted, maximal runs: each one extent read of
            ``length * stride`` bytes at slot ``start``.
        """
        arr = np.asarray(experts if isinstance(experts, np.ndarray) else list(experts))
        if arr.size == 0:
            return []
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise CurveError(f"experts: expected (layer, expert) pairs, got shape {arr.shape}")
        slots = np.unique(self.ordinal_array(arr[:, 0], arr[:, 1]))
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [slots.size]])
        return [(int(slots[s]), int(e - s)) for s, e in zip(starts, ends)]

    # ----------------------------------------------------------------- manifest

    def to_dict(self) -> dict[str, Any]:
        """JSON/msgpack-able description for a space manifest."""
        return {
            "version": LAYOUT_VERSION,
            "n_layers": self.n_layers,
            "n_classes": self.n_classes,
            "outer": self.outer,
            "inner": "rowmajor",
            "compaction": "rank",
            "class_perm": None if self.class_perm is None else [list(r) for r in self.class_perm],
        }

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> ExpertLayout:
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        CurveError
            On an unknown version, inner order or compaction, or a missing field.
        """
        if not isinstance(spec, dict):
            raise CurveError(f"layout: expected a dict, got {type(spec).__name__}")
        if spec.get("version") != LAYOUT_VERSION:
            raise CurveError(f"layout version: {spec.get('version')!r} is not {LAYOUT_VERSION}")
        if spec.get("inner", "rowmajor") != "rowmajor":
            raise CurveError(f"layout inner: {spec['inner']!r} is not 'rowmajor'")
        if spec.get("compaction", "rank") != "rank":
            raise CurveError(f"layout compaction: {spec['compaction']!r} is not 'rank'")
        try:
            return cls(spec["n_layers"], spec["n_classes"], spec["outer"], spec.get("class_perm"))
        except KeyError as exc:
            raise CurveError(f"layout: missing {exc.args[0]!r}") from None
