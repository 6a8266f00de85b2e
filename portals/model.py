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

from typing import TYPE_CHECKING, Any

from czyx.portals.caveats import INFER
from czyx.portals.view import SpaceView
from czyx.space import SELECTOR_SIZE, Selector
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
        extra = manifest.get("spaces")
        values = list(extra.values()) if isinstance(extra, dict) else list(extra or [])
        for v in (manifest.get("trunk"), manifest.get("trunk_space"), *values):
            s = _as_selector(v)
            if s is not None and s not in whole:
                whole.append(s)
        cur = _as_selector(manifest.get("base"))
    return scoped, [s for s in whole if s not in scoped]


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
    direct, lazy_trunk:
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
    return open_version(store, ref, view=view, direct=direct, lazy_trunk=lazy_trunk)


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
