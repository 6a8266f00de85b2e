"""Portals on model versions: which spaces a version spans, and opening one.

A mounted model version is several spaces: its expert space (class = expert,
z = layer), its trunk, and, for an adapter or derived version, the chain of
bases it names. A grant on the version names them all; its class and layer
caveats narrow the expert spaces only. :func:`open_model` is what a model
consumer (:func:`open_consumer`, the engine) calls: it refuses unless the
portal covers every space of the version for ``infer`` and returns one
:class:`~portals.view.SpaceView` whose O(1) ``check(cls, layer)`` is valid
for every expert space in the chain.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from czyx.portals.caveats import INFER
from czyx.portals.view import SpaceView
from czyx.space import SELECTOR_SIZE, Selector
from czyx.store.errors import SpaceNotFoundError
from czyx.store.interfaces import StoreInterface

if TYPE_CHECKING:
    from czyx.portals.authority import Grant
    from czyx.store.models.model import StoreModel

MAX_CHAIN = 64


def _as_selector(v: Any) -> Selector | None:
    raw = bytes.fromhex(v) if isinstance(v, str) and len(v) == 2 * SELECTOR_SIZE else v
    if isinstance(raw, bytes) and len(raw) == SELECTOR_SIZE:
        return Selector(raw)
    return None


def model_spaces(store: StoreInterface, sel: Selector) -> tuple[list[Selector], list[Selector]]:
    """The spaces a grant on ``sel`` must name: ``(scoped, whole)``.

    ``scoped`` is ``sel`` and, for an adapter or derived version, every base
    it names (manifest ``base``, followed to the full model): the expert
    spaces, where class and layer caveats apply. ``whole`` are the linked
    spaces read whole (manifest ``trunk`` of each version in the chain, and
    any ``spaces`` list or role map), where they do not: a tenant limited to
    some experts still needs the trunk to run the model. A space that is not
    a model gives ``([sel], [])``.
    """
    scoped: list[Selector] = []
    whole: list[Selector] = []
    cur: Selector | None = sel
    while cur is not None and cur not in scoped and len(scoped) < MAX_CHAIN:
        scoped.append(cur)
        manifest = store.manifest(cur)
        for s in _linked(manifest):
            if s not in whole:
                whole.append(s)
        cur = _as_selector(manifest.get("base"))
    return scoped, [s for s in whole if s not in scoped]


def _linked(manifest: dict) -> list[Selector]:
    """The spaces a manifest links to and reads whole (trunks, ``spaces``), base excluded."""
    extra = manifest.get("spaces")
    values = list(extra.values()) if isinstance(extra, dict) else list(extra or [])
    out = [_as_selector(v) for v in (manifest.get("trunk"), manifest.get("trunk_space"), *values)]
    return [s for s in out if s is not None]


@dataclass(frozen=True)
class Removal:
    """What :func:`remove_version` did.

    Attributes
    ----------
    space
        The space the tag named.
    deleted
        The version's spaces deleted (nothing else referred to them).
    kept
        The version's spaces kept because another tag or space still uses them.
    freed
        Block files removed with the deleted spaces.
    still_tagged
        Other tags naming the same space (then nothing is deleted).
    """

    space: Selector
    deleted: tuple[Selector, ...]
    kept: tuple[Selector, ...]
    freed: tuple[pathlib.Path, ...]
    still_tagged: tuple[str, ...]


def remove_version(store: StoreInterface, tag: str, *, keep_spaces: bool = False) -> Removal:
    """Remove the tag ``NAME@VERSION`` and every space of its version nothing else uses.

    A version spans several spaces (:func:`model_spaces`); content addressing
    lets versions share them (the same trunk, an adapter's base). After the
    tag is gone, each of the version's spaces is deleted unless it is reachable
    (through ``base``, trunk and ``spaces`` links) from another tag or from a
    published space outside the version. The version's own space goes first,
    so a crash part-way leaves only unreferenced spaces behind, never a
    version with a missing part. A damaged version (a part already missing)
    can be removed too.

    Raises
    ------
    TagNotFoundError
        No such tag.
    SpaceInUseError
        A tag was set on one of the spaces meanwhile (that space is kept).
    """
    sel = store.resolve_tag(tag)
    mine = [sel, *sorted(_reachable(store, {sel}) - {sel}, key=lambda s: s.raw)]
    still = tuple(sorted(t for t, s in store.tags().items() if s == sel and t != tag))
    store.remove_tag(tag)
    if still or keep_spaces:
        return Removal(sel, (), tuple(mine), (), still)
    roots = set(store.tags().values()) | {s for s in store.spaces() if s not in mine}
    used = _reachable(store, roots)
    deleted, kept, freed = [], [], []
    for s in mine:
        if s in used:
            kept.append(s)
            continue
        if not store.has_space(s):
            continue  # a part of a damaged version, already missing
        path = store.remove_space(s)
        deleted.append(s)
        if path is not None:
            freed.append(path)
    return Removal(sel, tuple(deleted), tuple(kept), tuple(freed), ())


def _reachable(store: StoreInterface, roots: set[Selector]) -> set[Selector]:
    """Every space reachable from ``roots`` through base, trunk and ``spaces`` links."""
    seen: set[Selector] = set()
    todo = list(roots)
    while todo:
        s = todo.pop()
        if s in seen:
            continue
        seen.add(s)
        try:
            manifest = store.manifest(s)
        except SpaceNotFoundError:
            continue  # a dangling tag or link: it holds nothing
        base = _as_selector(manifest.get("base"))
        todo.extend(x for x in (*_linked(manifest), base) if x is not None and x not in seen)
    return seen


def open_model(
    store: StoreInterface,
    token: str,
    ref: Selector | bytes | str,
    *,
    right: str = INFER,
    tenant: str | None = None,
) -> SpaceView:
    """Open model version ``ref`` (tag, selector or hex) through ``token``.

    Parameters
    ----------
    store:
        The open store.
    token:
        The portal; it must cover the version, its bases and its trunks for
        ``right``.
    ref:
        ``NAME@VERSION``, a :class:`Selector`, 32 bytes or 64 hex digits.
    right:
        ``"infer"`` by default (what an engine needs).
    tenant:
        The tenant the caller acts for.

    Returns
    -------
    SpaceView
        On the version's own space; its ``check(cls, layer)`` and
        ``allows`` hold for every expert space of the chain (the scopes are
        intersected), so a consumer checks each expert fetch in O(1).

    Raises
    ------
    PortalDenied
        Any refusal (audited).
    """
    from czyx.portals.authority import open_authority

    auth = open_authority(store)
    sel = auth.resolve_space(token, ref)
    scoped, whole = model_spaces(store, sel)
    return auth.open_space(
        token, sel, right=right, tenant=tenant, requires=whole, narrow_by=scoped[1:]
    )


def open_consumer(
    store: StoreInterface,
    token: str | None,
    ref: Selector | str,
    *,
    direct: bool = False,
    lazy_trunk: bool = False,
    trunk: bool = True,
    tenant: str | None = None,
) -> StoreModel:
    """Open model version ``ref`` for inference through ``token``: view and consumer.

    Parameters
    ----------
    store:
        The open store.
    token:
        A portal with the ``infer`` right; ``None`` is the store owner's root portal
        (local use still goes through a checked, audited portal open).
    ref:
        ``NAME@VERSION``, a :class:`Selector` or 64 hex digits.
    direct, lazy_trunk, trunk:
        As :func:`czyx.store.models.model.open_version`.
    tenant:
        The tenant the caller acts for.

    Returns
    -------
    StoreModel
        The store's model consumer, its expert reads checked by the portal's view.
    """
    from czyx.portals.authority import open_authority
    from czyx.store.models.model import open_version

    if token is None:
        token = open_authority(store).root_token()
    view = open_model(store, token, ref, tenant=tenant)
    return open_version(store, ref, view=view, direct=direct, lazy_trunk=lazy_trunk, trunk=trunk)


def grant_model(
    store: StoreInterface,
    ref: Selector | str,
    *,
    tenant: str,
    classes: str | None = None,
    layers: str | None = None,
    expires_at: int | None = None,
    rights: str = "read,infer",
    parent: str | None = None,
    note: str = "",
) -> Grant:
    """Issue a portal on model version ``ref`` (and the spaces it spans) to ``tenant``.

    Class and layer caveats (``"0-63"``, ``"1,5,7-9"``) narrow the routed
    experts of every expert space in the version's chain; the trunks stay
    readable so the tenant can still run the model. Returns the
    :class:`portals.authority.Grant` (its ``token`` is what the tenant holds).
    """
    from czyx.portals.authority import open_authority
    from czyx.portals.caveats import Expires, Spaces, parse_classes, parse_layers, parse_rights

    sel = resolve_space(store, ref)
    scoped, whole = model_spaces(store, sel)
    cavs: list = [Spaces(frozenset(s.raw for s in (*scoped, *whole))), parse_rights(rights)]
    targets = [None] if not whole and len(scoped) == 1 else [s.raw for s in scoped]
    for t in targets:
        if classes:
            cavs.append(parse_classes(classes, t))
        if layers:
            cavs.append(parse_layers(layers, t))
    if expires_at is not None:
        cavs.append(Expires(int(expires_at)))
    return open_authority(store).grant(cavs, tenant=tenant, parent=parent, note=note)


def resolve_space(store: StoreInterface, name: str | Selector) -> Selector:
    """A space from a tag ``NAME@VERSION``, 64 hex digits or a selector (one rule:
    :func:`store.mount.resolve`)."""
    from czyx.store.models.mount import resolve

    return resolve(store, name)
