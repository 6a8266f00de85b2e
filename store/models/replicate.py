"""Replicating a model version between stores: what to offer, what to move, and moving it.

Scope: the store side of ``czyx pull``, independent of the network. The
source builds an *offer* (:func:`build_offer`): every space the version
spans (its trunk, the chain of bases of an adapter, the version), each with
its manifest and records, optionally cut to a class range and a layer range.
The destination plans (:func:`plan_pull`): a space it already holds (same
selector, i.e. the same content) is skipped whole; every other extent is
looked up by its content hash among the extents the destination already
holds (any mounted version of any model), and only the ones it lacks are
fetched. :func:`run_pull` then fetches those through a caller-supplied
``fetch_range`` (the HTTP client passes an HTTP range read), verifies every
extent on arrival (its XXH3 checksum, and the BLAKE3 content hash the
manifest names for it; a bad one is refused and fetched again),
stages it durably (:mod:`store.core.staging`, so an interrupted copy resumes
without moving again what arrived) and publishes each space atomically only
when complete, the version last, then sets the tag.

Why content addressing makes this safe: a selector is the hash of its
manifest (:func:`czyx.space.Selector.from_content`), and the manifest lists
the content hash of every expert. The destination recomputes each
selector from the manifest it received (a manifest that does not hash to
its selector is refused), and an extent it reuses instead of fetching is one
whose content hash the manifest names.

A *subset* (a class range and/or a layer range of the experts; the trunk is
always whole, every node needs it to run the model) is published as its own
space: the full manifest plus ``"subset": {"of", "classes", "layers"}``, so
its selector is content-derived and differs from the full version's. It
opens like any version; its consumer refuses experts outside the subset.

Where extents land: an expert the destination fetches is written at its
layout position (``data_start + ordinal * stride``), as a mount writes it,
so the block file obeys the layout arithmetic readers check; one it already
holds elsewhere becomes a ``blk``/``blk_off`` reference (how versions share
extents); trunk tensors are written in their source order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from czyx.key import Key
from czyx.space import Selector, canonical_manifest
from czyx.store.core.staging import PlannedExtent, StagedSpace, StagingError
from czyx.store.errors import StoreError, TagConflictError, TagNotFoundError
from czyx.store.models.expert_layout import layout_from_manifest
from czyx.store.models.mount import ADAPTER_KIND, MODEL_KIND, TRUNK_KIND, resolve
from czyx.store.models.mount_source import content_hash

OFFER_VERSION = 1
MAX_RANGE = 16 << 20  # bytes of one coalesced range read
# Received bytes (or seconds) between two fdatasync + journal appends: what a crash
# may make the next pull fetch again.
SYNC_BYTES = 64 << 20
SYNC_S = 0.5
_ALIGN = 4096


class ReplicationError(StoreError):
    """A replication cannot proceed: a bad offer, a refused subset, or extents that stay bad."""


class SubsetNotAllowed(ReplicationError):
    """The asked-for experts include some the caller may not read."""


@dataclass(frozen=True)
class Range:
    """An inclusive integer range ``lo..hi`` (classes or layers)."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str | None, limit: int, what: str) -> Range | None:
        """``"LO-HI"`` or ``"N"`` -> Range (``None`` for ``None``); ``ValueError`` if malformed."""
        if text is None:
            return None
        parts = str(text).split("-")
        try:
            lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
        except ValueError:
            lo = hi = None
        if lo is None or hi is None or not 0 <= lo <= hi < limit:
            raise ValueError(f"{what} range {text!r} is not LO-HI within 0..{limit - 1}")
        return cls(lo, hi)

    def __contains__(self, v: object) -> bool:
        return isinstance(v, int) and self.lo <= v <= self.hi

    def as_list(self) -> list[int]:
        """``[lo, hi]`` (the manifest form)."""
        return [self.lo, self.hi]


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _location(sel_hex: str, rec: dict) -> tuple[str, int]:
    """Where a record's extent lives in the store that wrote it: (block space, offset)."""
    if "blk" in rec:
        return rec["blk"], int(rec["blk_off"])
    return sel_hex, int(rec["off"])


def version_chain(store: Any, sel: Selector) -> list[Selector]:
    """The version's spaces in publish order: trunks, then the base chain root first."""
    chain: list[Selector] = []
    cur: Selector | None = sel
    while cur is not None:
        if cur in chain or len(chain) > 64:
            raise ReplicationError(f"version {sel.hex()}: base chain loops or is too deep")
        manifest = store.manifest(cur)
        if manifest.get("kind") not in (MODEL_KIND, ADAPTER_KIND):
            raise ReplicationError(f"space {cur.hex()} is not a mounted model version")
        chain.append(cur)
        base = manifest.get("base")
        cur = Selector.from_hex(base) if base else None
    chain.reverse()
    trunks: list[Selector] = []
    for s in chain:
        t = store.manifest(s).get("trunk")
        if t and Selector.from_hex(t) not in trunks:
            trunks.append(Selector.from_hex(t))
    return trunks + chain


def build_offer(
    store: Any,
    ref: str | Selector,
    *,
    classes: Range | None = None,
    layers: Range | None = None,
    allows: Callable[[int, int], bool] | None = None,
) -> dict[str, Any]:
    """What the source sends: the version's spaces with manifests and (selected) records.

    Parameters
    ----------
    store
        The source store.
    ref
        ``NAME@VERSION``, 64 hex digits or a selector.
    classes, layers
        Cut the version's experts to these classes (key class bytes) and layers.
        Only for a full model (not an adapter): the base chain would need cutting too.
    allows
        ``allows(cls, layer)``: whether the caller may read that expert (a
        portal view's check); an offered expert it refuses raises.

    Raises
    ------
    SubsetNotAllowed
        An expert of the offer is outside what ``allows`` permits.
    ReplicationError
        A subset of an adapter, or a space that is not a model version.
    """
    sel = resolve(store, ref)
    spaces = version_chain(store, sel)
    subset = classes is not None or layers is not None
    if subset and store.manifest(sel).get("kind") != MODEL_KIND:
        raise ReplicationError("a class/layer subset can only be pulled of a full model version")
    out = []
    blocks: dict[str, int] = {}
    for s in spaces:
        manifest = store.manifest(s)
        expert = manifest.get("kind") in (MODEL_KIND, ADAPTER_KIND)
        records = []
        lo, hi = (classes.lo, classes.hi) if classes is not None and s == sel else (0, 255)
        for key, rec in store.scan(s, lo, hi):
            if expert:
                k = Key.unpack(key)
                if s == sel and layers is not None and k.z not in layers:
                    continue
                if allows is not None and not allows(k.cls, k.z):
                    raise SubsetNotAllowed(
                        f"the portal does not allow class {k.cls} of layer {k.z}; "
                        "pull a subset it covers (--classes / --layers)"
                    )
            records.append([key, rec])
            if "len" in rec:
                blk, _ = _location(s.hex(), rec)
                blocks.setdefault(blk, 0)
        out.append({"selector": s.hex(), "manifest": manifest, "records": records})
    for blk in blocks:
        blocks[blk] = store.block_identity(Selector.from_hex(blk)).align
    return {
        "offer": OFFER_VERSION,
        "version": sel.hex(),
        "subset": (
            None
            if not subset
            else {
                "classes": (classes or Range(0, 255)).as_list(),
                "layers": layers.as_list() if layers else None,
            }
        ),
        "spaces": out,
        "blocks": blocks,
    }


def offer_intervals(offer: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """Per source block space, the merged byte intervals the offer's extents cover.

    Two extents merge when only the block's alignment padding separates them,
    so a range read spanning consecutive offered extents is allowed and one
    that reaches into an extent not offered is not (the server's check).
    """
    spans: dict[str, list[tuple[int, int]]] = {}
    for sp in offer["spaces"]:
        for _, rec in sp["records"]:
            if "len" in rec:
                blk, off = _location(sp["selector"], rec)
                spans.setdefault(blk, []).append((off, off + int(rec["len"])))
    merged: dict[str, list[tuple[int, int]]] = {}
    for blk, iv in spans.items():
        align = int(offer["blocks"].get(blk, _ALIGN))
        out: list[tuple[int, int]] = []
        for a, b in sorted(iv):
            if out and a <= _round_up(out[-1][1], align):
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        merged[blk] = out
    return merged


def range_allowed(intervals: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies inside one of the merged ``intervals``."""
    import bisect

    i = bisect.bisect_right(intervals, (start, float("inf"))) - 1
    return i >= 0 and intervals[i][0] <= start and end <= intervals[i][1]


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Fetch:
    """One extent to move: from a source block file to a destination offset."""

    src_block: str
    src_off: int
    length: int
    checksum: int
    dest_off: int
    content: str | None = None  # the BLAKE3 content hash the manifest names, when it does


@dataclass(frozen=True)
class SpacePlan:
    """One space of a pull: skipped (``present``) or staged from ``fetches``."""

    selector: Selector
    manifest: dict
    present: bool
    size: int
    records: tuple[tuple[bytes, dict], ...]
    fetches: tuple[Fetch, ...]
    bytes_total: int
    bytes_reused: int


@dataclass(frozen=True)
class PullPlan:
    """Every space of a pull in publish order; the version's selector last."""

    version: Selector
    spaces: tuple[SpacePlan, ...]

    @property
    def bytes_total(self) -> int:
        """Extent bytes the version spans (what a full copy would move)."""
        return sum(s.bytes_total for s in self.spaces)

    @property
    def bytes_to_fetch(self) -> int:
        """Extent bytes the destination lacks."""
        return sum(f.length for s in self.spaces for f in s.fetches)


def _dest_index(dest: Any) -> dict[str, dict]:
    """Content hash -> extent location over every model version the destination holds."""
    index: dict[str, dict] = {}
    for sel in dest.spaces():
        if dest.manifest(sel).get("kind") not in (MODEL_KIND, ADAPTER_KIND):
            continue
        for _, rec in dest.scan(sel):
            h = rec.get("hash")
            if h and "len" in rec and h not in index:
                blk, off = _location(sel.hex(), rec)
                index[h] = {"blk": blk, "blk_off": off, "len": rec["len"], "sum": rec["sum"]}
    return index


def subset_manifest(manifest: dict, of: str, subset: dict) -> dict:
    """The manifest a subset is published with (its selector is derived from it)."""
    return {**manifest, "subset": {"of": of, **subset}}


def plan_pull(dest: Any, offer: dict[str, Any]) -> PullPlan:
    """Plan what moves: verify the offer's manifests, skip what ``dest`` holds.

    Reads ``dest``'s index only (no extent bytes). Deterministic for a given
    offer and destination, so an interrupted pull replans to the same staging.

    Raises
    ------
    ReplicationError
        A manifest does not hash to its selector, an expert's record names
        another content hash than its manifest, or the offer is malformed.
    """
    if offer.get("offer") != OFFER_VERSION:
        raise ReplicationError(f"unknown offer format {offer.get('offer')!r}")
    version_hex = offer["version"]
    index = _dest_index(dest)
    manifests: dict[str, dict] = {}
    data_start = StagedSpace.data_start_for(dest)
    plans = []
    for sp in offer["spaces"]:
        manifest = sp["manifest"]
        sel = Selector.from_content(canonical_manifest(manifest))
        if sel.hex() != sp["selector"]:
            raise ReplicationError(
                f"space {sp['selector'][:16]}: its manifest hashes to {sel.hex()[:16]}; refused"
            )
        manifests[sel.hex()] = manifest
        is_version = sel.hex() == version_hex
        if is_version and offer.get("subset"):
            manifest = subset_manifest(manifest, version_hex, offer["subset"])
            sel = Selector.from_content(canonical_manifest(manifest))
        kind = manifest.get("kind")
        records = [(bytes(k), dict(r)) for k, r in sp["records"]]
        total = sum(int(r.get("len", 0)) for _, r in records)
        if dest.has_space(sel):
            plans.append(SpacePlan(sel, manifest, True, 0, (), (), total, total))
            continue
        expert = kind in (MODEL_KIND, ADAPTER_KIND)
        # Content hashes the (selector-verified) manifest names: every fetched extent
        # with one is checked against it on arrival, anchoring its bytes to the selector.
        anchored = {str(t[5]) for t in manifest.get("tensors", []) if len(t) > 5}
        if manifest.get("tokenizer"):
            anchored.add(str(manifest["tokenizer"]))
        side = manifest.get("side_files")
        if isinstance(side, dict):
            anchored.update(str(h) for h in side.values())
        if expert:
            root = _root_manifest(dest, manifests, manifest)
            layout = layout_from_manifest(root)
            stride = int(root["expert"]["stride"])
            named = {(int(l), int(e)): h for l, e, h in manifest.get("experts", [])}
            if stride % data_start:
                raise ReplicationError(f"stride {stride} is not a multiple of {data_start}")
        out_records, fetches, reused = [], [], 0
        pos = data_start
        # Source order: trunk tensors keep their relative placement, reads stay sequential.
        order = sorted(
            records, key=lambda kr: _location(sp["selector"], kr[1]) if "len" in kr[1] else ("", -1)
        )
        for key, rec in order:
            if "len" not in rec:
                out_records.append((key, rec))
                continue
            src_block, src_off = _location(sp["selector"], rec)
            base = {k: v for k, v in rec.items() if k not in ("off", "blk", "blk_off")}
            if expert:
                le = (int(rec["layer"]), int(rec["expert"]))
                if named.get(le) != rec.get("hash"):
                    raise ReplicationError(
                        f"space {sel.hex()[:16]}: expert {le} record hash differs from manifest"
                    )
            elif kind == TRUNK_KIND and rec.get("hash") not in anchored:
                raise ReplicationError(
                    f"space {sel.hex()[:16]}: trunk record {bytes(key).hex()} names a content "
                    "hash its manifest does not"
                )
            hit = index.get(rec.get("hash")) if expert else None
            if hit is not None and hit["len"] == rec["len"] and hit["sum"] == rec["sum"]:
                out_records.append((key, {**base, "blk": hit["blk"], "blk_off": hit["blk_off"]}))
                reused += int(rec["len"])
                continue
            if expert:
                dest_off = data_start + layout.ordinal(*le) * stride
            else:
                dest_off = pos
            pos = max(pos, _round_up(dest_off + int(rec["len"]), data_start))
            content = rec.get("hash") if (expert or kind == TRUNK_KIND) else None
            fetches.append(
                Fetch(src_block, src_off, int(rec["len"]), int(rec["sum"]), dest_off, content)
            )
            out_records.append((key, {**base, "off": dest_off}))
            if expert and rec.get("hash"):
                index.setdefault(
                    rec["hash"],
                    {"blk": sel.hex(), "blk_off": dest_off, "len": rec["len"], "sum": rec["sum"]},
                )
        out_records.sort(key=lambda kr: kr[0])
        plans.append(
            SpacePlan(sel, manifest, False, pos, tuple(out_records), tuple(fetches), total, reused)
        )
    if not plans or plans[-1].manifest.get("kind") not in (MODEL_KIND, ADAPTER_KIND):
        raise ReplicationError("the offer does not end with the model version")
    return PullPlan(plans[-1].selector, tuple(plans))


def _root_manifest(dest: Any, offered: dict[str, dict], manifest: dict) -> dict:
    """The full model's manifest at the root of ``manifest``'s base chain (offer or dest)."""
    cur = manifest
    for _ in range(65):
        if cur.get("kind") == MODEL_KIND:
            return cur
        base = cur.get("base")
        cur = offered.get(base) or dest.manifest(Selector.from_hex(base))
    raise ReplicationError("base chain too deep")


# --------------------------------------------------------------------------- moving


@dataclass
class PullResult:
    """What a pull did (bytes are extent payload bytes)."""

    selector: Selector
    tag: str | None
    spaces_published: int = 0
    spaces_present: int = 0
    bytes_total: int = 0
    bytes_reused: int = 0
    bytes_resumed: int = 0
    bytes_fetched: int = 0
    refetched: int = 0
    requests: int = 0
    seconds: float = 0.0
    published: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the CLI."""
        mb = 1e6
        rate = self.bytes_fetched / self.seconds / mb if self.seconds > 0 else 0.0
        return (
            f"pulled {self.tag or self.selector.hex()[:16]} -> {self.selector.hex()[:16]}: "
            f"{self.bytes_total / mb:.1f} MB in the version, {self.bytes_fetched / mb:.1f} MB "
            f"fetched ({self.requests} requests, {rate:.0f} MB/s), "
            f"{self.bytes_reused / mb:.1f} MB already here, "
            f"{self.bytes_resumed / mb:.1f} MB resumed, {self.refetched} refetched; "
            f"{self.spaces_published} spaces published, {self.spaces_present} present"
        )


FetchRange = Callable[[str, int, int], bytes]


def _coalesce(fetches: Iterable[Fetch], max_range: int) -> list[list[Fetch]]:
    """Group fetches into runs contiguous in their source block (padding apart)."""
    runs: list[list[Fetch]] = []
    for f in sorted(fetches, key=lambda f: (f.src_block, f.src_off)):
        if runs:
            last = runs[-1]
            p = last[-1]
            end = f.src_off + f.length
            if (
                p.src_block == f.src_block
                and f.src_off <= _round_up(p.src_off + p.length, _ALIGN)
                and f.src_off >= p.src_off + p.length
                and end - last[0].src_off <= max_range
            ):
                last.append(f)
                continue
        runs.append([f])
    return runs


def run_pull(
    dest: Any,
    plan: PullPlan,
    fetch_range: FetchRange,
    *,
    tag: str | None = None,
    workers: int = 4,
    retries: int = 3,
    max_range: int = MAX_RANGE,
    progress: Callable[[int, int], None] | None = None,
) -> PullResult:
    """Move the planned extents, verify, stage and publish; then set ``tag``.

    Parameters
    ----------
    dest
        The destination store (open for writing).
    plan
        From :func:`plan_pull`.
    fetch_range
        ``fetch_range(block space hex, start, end) -> bytes`` of the source
        block file ``[start, end)``; called from ``workers`` threads.
    tag
        Point this tag at the version once it is published.
    retries
        Fetches of one extent that may fail their checksum before giving up.
    progress
        Called with (bytes here, bytes of the version) as extents arrive verified
        (what was already here or staged counts as here).

    Raises
    ------
    ReplicationError
        An extent failed its checksum ``retries`` times (nothing of its space
        is published; what arrived stays staged for a later resume).
    """
    t0 = time.perf_counter()
    res = PullResult(plan.version, tag)
    if tag is not None:  # refuse a taken tag before moving a byte
        try:
            old = dest.resolve_tag(tag)
        except TagNotFoundError:
            old = None
        if old is not None and old != plan.version:
            raise TagConflictError(
                f"tag {tag!r} here points at {old.hex()[:16]}, not at the pulled "
                f"{plan.version.hex()[:16]}; remove it or pull with another tag"
            )
    for sp in plan.spaces:
        res.bytes_total += sp.bytes_total
        if sp.present:
            res.spaces_present += 1
            res.bytes_reused += sp.bytes_total
            continue
        res.bytes_reused += sp.bytes_reused
        staged = StagedSpace.open(
            dest,
            sp.selector,
            sp.manifest,
            sp.size,
            sp.records,
            [PlannedExtent(f.dest_off, f.length, f.checksum) for f in sp.fetches],
        )
        try:
            res.bytes_resumed += staged.bytes_arrived
            todo = [f for f in sp.fetches if f.dest_off not in staged.arrived]
            _move(
                staged, todo, fetch_range, res, workers, retries, max_range,
                progress, plan.bytes_total,
            )  # fmt: skip
            staged.publish()
        finally:
            staged.close()
        res.spaces_published += 1
        res.published.append(sp.selector.hex())
    if tag is not None:
        dest.set_tag(tag, plan.version)
    res.seconds = time.perf_counter() - t0
    return res


def _move(
    staged: StagedSpace,
    todo: list[Fetch],
    fetch_range: FetchRange,
    res: PullResult,
    workers: int,
    retries: int,
    max_range: int,
    progress: Callable[[int, int], None] | None = None,
    total: int = 0,
) -> None:
    attempts: dict[int, int] = {}

    def get(run: list[Fetch]) -> tuple[list[Fetch], bytes]:
        start, end = run[0].src_off, run[-1].src_off + run[-1].length
        data = fetch_range(run[0].src_block, start, end)
        if len(data) != end - start:
            raise ReplicationError(
                f"range {start}-{end} of {run[0].src_block[:16]}: got {len(data)} bytes"
            )
        return run, data

    pending = _coalesce(todo, max_range)
    last_sync = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        while pending:
            again: list[Fetch] = []
            for run, data in pool.map(get, pending):
                res.requests += 1
                mv = memoryview(data)
                base = run[0].src_off
                items, forged = [], set()
                for f in run:
                    piece = mv[f.src_off - base : f.src_off - base + f.length]
                    if f.content is not None and content_hash(piece) != f.content:
                        forged.add(f.dest_off)  # refused like a checksum failure
                    else:
                        items.append((f.dest_off, piece))
                bad = forged | {e.offset for e in staged.receive(items, durable=False)}
                now = time.monotonic()
                if staged.pending_bytes >= SYNC_BYTES or now - last_sync >= SYNC_S:
                    staged.flush()
                    last_sync = now
                res.bytes_fetched += sum(f.length for f in run if f.dest_off not in bad)
                if progress is not None:
                    here = res.bytes_fetched + res.bytes_reused + res.bytes_resumed
                    progress(min(here, total), total)
                for f in run:
                    if f.dest_off in bad:
                        attempts[f.dest_off] = attempts.get(f.dest_off, 0) + 1
                        if attempts[f.dest_off] >= retries:
                            raise ReplicationError(
                                f"extent of {f.src_block[:16]} at {f.src_off} failed its "
                                f"checksum {retries} times; giving up (what arrived stays staged)"
                            )
                        res.refetched += 1
                        again.append(f)
            pending = [[f] for f in again]
    staged.flush()
    if staged.missing:
        raise StagingError(f"{len(staged.missing)} extents still missing after the transfer")
