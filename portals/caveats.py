"""Caveats: the restrictions a portal carries, and their canonical byte encoding.

A caveat only ever narrows. The permission of a token is the intersection of
all its caveats (see :mod:`portals.permission`), so appending any caveat,
however it is spelled, can never grant more than the token had.

Every caveat encodes as ``tag (1 byte) || varint length || body``; bodies are
canonical (a decoded caveat re-encodes to the same bytes) and decoding is
strict: an unknown tag, a bad length or an out-of-range value is a
:class:`TokenFormatError`, never ignored (an ignored caveat would widen).

Class and layer caveats may name one space: they then restrict only that
space (so a grant on a model version can narrow the routed experts of its
expert space while leaving its trunk readable). Without a space they restrict
every space the portal names.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import ClassVar

from czyx.portals._wire import Reader, encode_varint
from czyx.portals.errors import CaveatError, TokenFormatError

READ = "read"
INFER = "infer"
GRANT = "grant"
RIGHT_BITS: dict[str, int] = {READ: 1, INFER: 2, GRANT: 4}
ALL_RIGHTS: frozenset[str] = frozenset(RIGHT_BITS)

N_CLASSES = 256
FULL_CLASS_MASK = (1 << N_CLASSES) - 1
MAX_LAYER = (1 << 61) - 1  # the z coordinate of a key is below 2**61
SELECTOR_SIZE = 32
PORTAL_ID_SIZE = 16
MAX_TENANT_BYTES = 128
_TENANT_CHARS = frozenset(string.ascii_letters + string.digits + "._-@+:")


def _check_space(space: bytes | None) -> None:
    if space is not None and (not isinstance(space, bytes) or len(space) != SELECTOR_SIZE):
        raise CaveatError(f"space: expected a {SELECTOR_SIZE}-byte selector")


def _check_layers(lo: int, hi: int) -> None:
    if not (0 <= lo <= hi <= MAX_LAYER):
        raise CaveatError(f"layers: need 0 <= lo <= hi <= 2**61-1, got {lo}..{hi}")


def check_tenant(name: str) -> str:
    """Validate a tenant name (1-128 chars of ``[A-Za-z0-9._-@+:]``) and return it."""
    if not isinstance(name, str) or not name:
        raise CaveatError("tenant: empty name")
    if len(name.encode()) > MAX_TENANT_BYTES or not set(name) <= _TENANT_CHARS:
        raise CaveatError(
            f"tenant: {name[:40]!r} must be 1-{MAX_TENANT_BYTES} characters of "
            "letters, digits and . _ - @ + :"
        )
    return name


class Caveat:
    """Base of the caveat value types; subclasses are frozen dataclasses."""

    TAG: ClassVar[int]

    def body(self) -> bytes:  # pragma: no cover - abstract
        """The caveat's canonical body bytes (after its tag byte in a token)."""
        raise NotImplementedError

    @classmethod
    def from_body(cls, body: bytes) -> Caveat:  # pragma: no cover - abstract
        """Parse :meth:`body` bytes; :class:`TokenFormatError` unless canonical."""
        raise NotImplementedError

    def encode(self) -> bytes:
        """``tag || varint(len(body)) || body``: the bytes chained into the signature."""
        body = self.body()
        return bytes((self.TAG,)) + encode_varint(len(body)) + body


@dataclass(frozen=True)
class PortalId(Caveat):
    """The id of a portal registered by the store (a descriptor in the 0xFE space).

    A token carries the ids of its whole lineage: the root id in its header,
    then one ``PortalId`` per registered grant. Revoking any of them revokes
    the token.
    """

    TAG: ClassVar[int] = 0x01
    portal_id: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.portal_id, bytes) or len(self.portal_id) != PORTAL_ID_SIZE:
            raise CaveatError(f"portal id: expected {PORTAL_ID_SIZE} bytes")

    def body(self) -> bytes:
        return self.portal_id

    @classmethod
    def from_body(cls, body: bytes) -> PortalId:
        if len(body) != PORTAL_ID_SIZE:
            raise TokenFormatError(f"caveat portal-id: body of {len(body)} bytes")
        return cls(body)


@dataclass(frozen=True)
class Spaces(Caveat):
    """Only these spaces (32-byte selectors) may be opened."""

    TAG: ClassVar[int] = 0x02
    selectors: frozenset[bytes]

    def __post_init__(self) -> None:
        object.__setattr__(self, "selectors", frozenset(self.selectors))
        if not self.selectors:
            raise CaveatError("spaces: empty set (a portal must name at least one space)")
        for s in self.selectors:
            _check_space(s)

    def body(self) -> bytes:
        return b"".join(sorted(self.selectors))

    @classmethod
    def from_body(cls, body: bytes) -> Spaces:
        if not body or len(body) % SELECTOR_SIZE:
            raise TokenFormatError(f"caveat spaces: body of {len(body)} bytes")
        sels = [body[i : i + SELECTOR_SIZE] for i in range(0, len(body), SELECTOR_SIZE)]
        if sels != sorted(set(sels)):
            raise TokenFormatError("caveat spaces: selectors not sorted and unique")
        return cls(frozenset(sels))


@dataclass(frozen=True)
class Rights(Caveat):
    """Only these rights (``read``, ``infer``, ``grant``)."""

    TAG: ClassVar[int] = 0x03
    rights: frozenset[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "rights", frozenset(self.rights))
        unknown = self.rights - ALL_RIGHTS
        if unknown:
            raise CaveatError(f"rights: unknown {sorted(unknown)} (known: read, infer, grant)")

    def body(self) -> bytes:
        return bytes((sum(RIGHT_BITS[r] for r in self.rights),))

    @classmethod
    def from_body(cls, body: bytes) -> Rights:
        if len(body) != 1 or body[0] & ~0x07:
            raise TokenFormatError("caveat rights: bad body")
        return cls(frozenset(r for r, bit in RIGHT_BITS.items() if body[0] & bit))


def _space_suffix(space: bytes | None) -> bytes:
    return b"" if space is None else space


def _read_space_suffix(r: Reader, what: str) -> bytes | None:
    left = r.remaining()
    if left == 0:
        return None
    if left != SELECTOR_SIZE:
        raise TokenFormatError(f"caveat {what}: {left} trailing bytes (want 0 or 32)")
    return r.take(SELECTOR_SIZE, "space")


@dataclass(frozen=True)
class ClassRange(Caveat):
    """Only classes ``lo..hi`` (inclusive), in ``space`` or in every space."""

    TAG: ClassVar[int] = 0x04
    lo: int
    hi: int
    space: bytes | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.lo <= self.hi <= 0xFF):
            raise CaveatError(f"classes: need 0 <= lo <= hi <= 255, got {self.lo}..{self.hi}")
        _check_space(self.space)

    @property
    def mask(self) -> int:
        """The allowed classes as a 256-bit mask (bit ``c`` for class ``c``)."""
        return ((1 << (self.hi + 1)) - 1) ^ ((1 << self.lo) - 1)

    def body(self) -> bytes:
        return bytes((self.lo, self.hi)) + _space_suffix(self.space)

    @classmethod
    def from_body(cls, body: bytes) -> ClassRange:
        r = Reader(body, "caveat class-range")
        lo, hi = r.byte("lo"), r.byte("hi")
        space = _read_space_suffix(r, "class-range")
        if lo > hi:
            raise TokenFormatError("caveat class-range: lo > hi")
        return cls(lo, hi, space)


@dataclass(frozen=True)
class ClassSet(Caveat):
    """Only the classes whose bit is set in the 256-bit ``mask`` (bit i = class i)."""

    TAG: ClassVar[int] = 0x05
    mask: int
    space: bytes | None = None

    def __post_init__(self) -> None:
        if not (0 < self.mask <= FULL_CLASS_MASK):
            raise CaveatError("classes: the set must hold at least one class in 0..255")
        _check_space(self.space)

    def body(self) -> bytes:
        return self.mask.to_bytes(N_CLASSES // 8, "big") + _space_suffix(self.space)

    @classmethod
    def from_body(cls, body: bytes) -> ClassSet:
        r = Reader(body, "caveat class-set")
        mask = int.from_bytes(r.take(N_CLASSES // 8, "mask"), "big")
        space = _read_space_suffix(r, "class-set")
        if mask == 0:
            raise TokenFormatError("caveat class-set: empty mask")
        return cls(mask, space)


@dataclass(frozen=True)
class LayerRange(Caveat):
    """Only layers (the key's z coordinate) ``lo..hi`` inclusive."""

    TAG: ClassVar[int] = 0x06
    lo: int
    hi: int
    space: bytes | None = None

    def __post_init__(self) -> None:
        _check_layers(self.lo, self.hi)
        _check_space(self.space)

    def body(self) -> bytes:
        return encode_varint(self.lo) + encode_varint(self.hi) + _space_suffix(self.space)

    @classmethod
    def from_body(cls, body: bytes) -> LayerRange:
        r = Reader(body, "caveat layer-range")
        lo, hi = r.varint("lo"), r.varint("hi")
        space = _read_space_suffix(r, "layer-range")
        if not lo <= hi <= MAX_LAYER:
            raise TokenFormatError("caveat layer-range: bad bounds")
        return cls(lo, hi, space)


@dataclass(frozen=True)
class Expires(Caveat):
    """Valid strictly before ``at`` (Unix seconds, UTC)."""

    TAG: ClassVar[int] = 0x07
    at: int

    def __post_init__(self) -> None:
        if not (0 <= self.at < 1 << 63):
            raise CaveatError(f"expires: {self.at} is not a Unix time in seconds")

    def body(self) -> bytes:
        return self.at.to_bytes(8, "big")

    @classmethod
    def from_body(cls, body: bytes) -> Expires:
        if len(body) != 8 or body[0] & 0x80:
            raise TokenFormatError("caveat expires: bad body")
        return cls(int.from_bytes(body, "big"))


@dataclass(frozen=True)
class Tenant(Caveat):
    """Only for this tenant. Two different tenant caveats permit nobody."""

    TAG: ClassVar[int] = 0x08
    name: str

    def __post_init__(self) -> None:
        check_tenant(self.name)

    def body(self) -> bytes:
        return self.name.encode()

    @classmethod
    def from_body(cls, body: bytes) -> Tenant:
        try:
            name = body.decode("ascii")
            return cls(name)
        except (UnicodeDecodeError, CaveatError) as exc:
            raise TokenFormatError("caveat tenant: bad name") from exc


CAVEAT_TYPES: dict[int, type[Caveat]] = {
    c.TAG: c for c in (PortalId, Spaces, Rights, ClassRange, ClassSet, LayerRange, Expires, Tenant)
}


def decode_caveat(r: Reader) -> tuple[Caveat, bytes]:
    """Read one caveat from ``r``; returns it and its exact encoded bytes."""
    start = r.pos
    tag = r.byte("caveat tag")
    kind = CAVEAT_TYPES.get(tag)
    if kind is None:
        # Fail closed: a verifier that skipped an unknown caveat would widen.
        raise TokenFormatError(f"token: unknown caveat tag 0x{tag:02X} at byte {start}")
    n = r.varint("caveat length")
    body = r.take(n, f"caveat 0x{tag:02X} body")
    try:
        cav = kind.from_body(body)
    except CaveatError as exc:
        raise TokenFormatError(f"token: invalid caveat 0x{tag:02X}: {exc}") from exc
    return cav, r.data[start : r.pos]


# --- parsing human specs (CLI and API) -------------------------------------------------


def parse_classes(spec: str, space: bytes | None = None) -> ClassRange | ClassSet:
    """Parse ``"0-63"`` or ``"1,5,7-9"`` (decimal or 0x hex) into a class caveat.

    A single contiguous range becomes a compact :class:`ClassRange`,
    anything else a :class:`ClassSet`.
    """
    mask = 0
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise CaveatError(f"classes: empty spec {spec!r}")
    for part in parts:
        lo_s, _, hi_s = part.partition("-")
        try:
            lo = int(lo_s, 0)
            hi = int(hi_s, 0) if hi_s else lo
        except ValueError as exc:
            raise CaveatError(f"classes: {part!r} is not N or N-M") from exc
        if not 0 <= lo <= hi <= 0xFF:
            raise CaveatError(f"classes: {part!r} outside 0..255 or reversed")
        mask |= ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)
    lo = (mask & -mask).bit_length() - 1
    hi = mask.bit_length() - 1
    if mask == ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1):
        return ClassRange(lo, hi, space)
    return ClassSet(mask, space)


def parse_layers(spec: str, space: bytes | None = None) -> LayerRange:
    """Parse ``"0-3"`` or ``"5"`` into a :class:`LayerRange`."""
    lo_s, _, hi_s = spec.strip().partition("-")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if hi_s else lo
    except ValueError as exc:
        raise CaveatError(f"layers: {spec!r} is not N or N-M") from exc
    return LayerRange(lo, hi, space)


def parse_rights(spec: str) -> Rights:
    """Parse ``"read,infer"`` into a :class:`Rights` caveat."""
    names = frozenset(p.strip().lower() for p in spec.split(",") if p.strip())
    if not names:
        raise CaveatError("rights: empty spec")
    return Rights(names)


def describe(cav: Caveat) -> dict:
    """A JSON/msgpack-friendly description of a caveat (for descriptors and listings)."""
    d: dict = {"kind": type(cav).__name__}
    if isinstance(cav, PortalId):
        d["id"] = cav.portal_id.hex()
    elif isinstance(cav, Spaces):
        d["spaces"] = sorted(s.hex() for s in cav.selectors)
    elif isinstance(cav, Rights):
        d["rights"] = sorted(cav.rights)
    elif isinstance(cav, ClassRange):
        d["classes"] = f"{cav.lo}-{cav.hi}"
    elif isinstance(cav, ClassSet):
        d["classes"] = format_mask(cav.mask)
    elif isinstance(cav, LayerRange):
        d["layers"] = f"{cav.lo}-{cav.hi}"
    elif isinstance(cav, Expires):
        d["expires"] = cav.at
    elif isinstance(cav, Tenant):
        d["tenant"] = cav.name
    space = getattr(cav, "space", None)
    if space is not None:
        d["space"] = space.hex()
    return d


def format_mask(mask: int) -> str:
    """``"0-3,7,9-10"`` for a class mask (``""`` for the empty set)."""
    out: list[str] = []
    c = 0
    while c < N_CLASSES:
        if mask >> c & 1:
            start = c
            while c + 1 < N_CLASSES and mask >> (c + 1) & 1:
                c += 1
            out.append(str(start) if start == c else f"{start}-{c}")
        c += 1
    return ",".join(out)
