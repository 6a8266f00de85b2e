"""Saved sessions in a store: save, load, list, fork, diff, and prefix look-up.

Scope: turning :class:`~inference.sessions.format.SessionState` values into
sealed session spaces and back, naming them, and their lineage. The engine
side (capturing and restoring an :class:`~inference.engine.Engine`) is
:mod:`inference.sessions.live`.

Design, and why:

- **One saved state = one small sealed space.** Spaces are immutable once
  published, so a session is not updated in place: each save publishes a new
  space holding one SES record (class ``SES``, coordinate 0) whose extent is
  the whole state (:mod:`inference.sessions.format`), read back in one read.
  The space's selector is derived from its content (tenant, model version and
  a 128-bit hash of the extent), so saving the same state twice is the same
  space and an interrupted save can be retried.
- **A session name is a sequence of version tags**, ``session:NAME@00000007``
  (the store's ``name@version`` tags, which are never re-pointed). The head is
  the highest version. The tag is set in one LMDB transaction *after* the
  space is published and its edges written, so that transaction is the
  instant a save happens: a crash at any earlier point leaves the previous
  head untouched (and at worst an untagged, sealed space). Two writers racing
  for the same version: the second one's tag is refused
  (:class:`SessionConflictError`).
- **Lineage** is an association edge in the 0xFF edge space: a fork writes
  ``EDG || b"ses.fork\\0" || child name`` -> parent name, version and space,
  before the child's first tag. A fork at the parent's full length is zero-copy
  (the child's version 1 tags the parent's own sealed space); a fork at an
  earlier position writes the truncated state, reading only the blocks it keeps.
- **Tenants and portals.** A :class:`SessionStore` is opened with a portal
  token (``portals``) and acts for the portal's tenant. Every read of a
  session's bytes opens its space through the portal (``open_space``,
  ``read`` right: verified, scope-checked, audited), exactly like any other
  space. Since every save is a new space, a session portal names no spaces
  (or the store's owner acts for a tenant): what keeps tenants apart is that
  every state records its tenant, and loading, saving over, forking or
  diffing another tenant's session is refused (``WrongTenantError``,
  audited as ``session.denied``): checked on the catalog record before the
  portal is opened, then on the record read through the portal, then on the
  extent's own header. Portals have no write right yet: a save re-verifies
  the portal and stamps the state with its tenant.
- **Model versions.** A state records the 32-byte selector of the model
  version that computed its KV; loading for another selector (or other KV
  shapes) raises ``ModelVersionMismatchError``.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

from czyx.inference.sessions.errors import (
    ModelVersionMismatchError,
    SessionConflictError,
    SessionExistsError,
    SessionFormatError,
    SessionNotFoundError,
    WrongTenantError,
)
from czyx.inference.sessions.format import (
    BLOCK,
    FORMATS,
    Layout,
    ParsedExtent,
    SessionState,
    encode,
)
from czyx.inference.sessions.prefix import PrefixHit, PrefixIndex
from czyx.key import EDG, SES, Key
from czyx.space import Selector
from czyx.store.errors import SealedSpaceError, StoreError, TagConflictError
from czyx.store.interfaces import StoreInterface
from czyx.store.io.reader import aligned_empty

TAG_PREFIX = "session:"
RECORD_KEY = Key(SES).pack()
FORK_EDGE = bytes((EDG,)) + b"ses.fork\x00"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
_TAG = re.compile(r"session:(?P<name>[^@]+)@(?P<version>\d{8})")


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid session name (1-200 of ``[A-Za-z0-9._/-]``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"session name {name!r}: use 1-200 characters of A-Z a-z 0-9 . _ / - "
            "(starting with a letter or digit)"
        )
    return name


def version_tag(name: str, version: int) -> str:
    """The tag of version ``version`` of session ``name``."""
    return f"{TAG_PREFIX}{name}@{version:08d}"


@dataclass(frozen=True)
class SessionInfo:
    """One saved state of a named session, as listed (no extent bytes read)."""

    name: str
    version: int
    space: Selector
    tenant: str
    model: bytes
    length: int
    nbytes: int
    parent: str | None  # "name@version" of the fork parent, on every version of a fork
    fork_at: int | None  # tokens inherited from the parent


@dataclass(frozen=True)
class SessionDiff:
    """Where two histories diverge."""

    a: str
    b: str
    a_length: int
    b_length: int
    common: int  # length of the common token prefix
    a_next: tuple[int, ...]  # a's tokens from the divergence on (a few)
    b_next: tuple[int, ...]

    @property
    def identical(self) -> bool:
        """Whether the two histories are the same tokens (all common, same length)."""
        return self.common == self.a_length == self.b_length


def _layout(rec: dict) -> Layout:
    return Layout(
        rec["n_layers"],
        rec["n_kv_heads"],
        rec["head_dim"],
        rec["length"],
        rec["vocab"],
        rec["meta_len"],
        rec["block"],
        int(rec.get("rec_len", 0)),  # format 2 (a hybrid model's recurrent state) only
    )


def list_sessions(store: StoreInterface, tenant: str | None = None) -> list[SessionInfo]:
    """The head (latest version) of every named session, optionally of one tenant only.

    Reads tags, one record per session and the fork edges; never an extent.
    """
    heads: dict[str, tuple[int, Selector]] = {}
    for tag, sel in store.tags().items():
        m = _TAG.fullmatch(tag)
        if m:
            v = int(m["version"])
            if v > heads.get(m["name"], (0, sel))[0]:
                heads[m["name"]] = (v, sel)
    forks = {k[len(FORK_EDGE) :].decode(): rec for k, rec in store.edges(FORK_EDGE)}
    out = []
    for name in sorted(heads):
        v, sel = heads[name]
        rec = store.get(sel, RECORD_KEY)
        if rec is None or (tenant is not None and rec.get("tenant") != tenant):
            continue
        fk = forks.get(name)
        out.append(
            SessionInfo(
                name=name,
                version=v,
                space=sel,
                tenant=rec["tenant"],
                model=bytes(rec["model"]),
                length=rec["length"],
                nbytes=rec["len"],
                parent=None if fk is None else f"{fk['parent']}@{fk['parent_version']}",
                fork_at=None if fk is None else fk["at"],
            )
        )
    return out


class SessionStore:
    """Named, versioned session states of one tenant in a store (see module docstring).

    Parameters
    ----------
    store
        The store holding session spaces, tags and edges.
    portal
        A portal token of the store (``portals``), verified here for the
        ``read`` right; every read of a session's bytes opens its space
        through it (``portals.open_space``: checked and audited).
    tenant
        The tenant to act for. A tenant-bound portal fixes it (a different
        value is refused by the portal); the owner's root portal may act for
        any tenant it names (by default the owner's own, tenant ``"owner"``).
    direct
        Read extents with ``O_DIRECT`` (bypassing the page cache).

    Raises
    ------
    portals.PortalDenied
        The portal is invalid, expired, revoked, or not for ``tenant``.
    """

    def __init__(
        self,
        store: StoreInterface,
        portal: str,
        *,
        tenant: str | None = None,
        direct: bool = False,
    ) -> None:
        from czyx.portals import READ
        from czyx.portals.authority import OWNER, open_authority

        self.store = store
        self.portal = portal
        self.direct = direct
        self.prefixes = PrefixIndex(store)
        self._auth = open_authority(store)
        self._read_right = READ
        perm = self._auth.verify(portal, right=READ, tenant=tenant)
        # An unbound portal is the owner's: it acts for the tenant it names, else
        # for the owner's own sessions (tenant "owner", as portals audits it).
        self.tenant: str = perm.tenant or tenant or OWNER

    @classmethod
    def open(
        cls, store: StoreInterface, portal: str | None = None, *, tenant: str | None = None
    ) -> SessionStore:
        """A handle through ``portal``, or, when ``None``, the store owner's root portal
        (for a process that owns the store directory and its portal secret)."""
        if not portal:
            from czyx.portals import root_token

            portal = root_token(store)
        return cls(store, portal, tenant=tenant)

    # -- names -------------------------------------------------------------------------
    def versions(self, name: str) -> list[tuple[int, Selector]]:
        """Every saved ``(version, space)`` of ``name``, oldest first (any tenant)."""
        check_name(name)
        out = []
        for tag, sel in self.store.tags().items():
            m = _TAG.fullmatch(tag)
            if m and m["name"] == name:
                out.append((int(m["version"]), sel))
        return sorted(out, key=lambda t: t[0])

    def _resolve(self, name: str, version: int | None) -> tuple[int, Selector, dict]:
        vs = self.versions(name)
        if not vs:
            raise SessionNotFoundError(f"session {name!r} not found")
        if version is None:
            v, sel = vs[-1]
        else:
            hits = [t for t in vs if t[0] == version]
            if not hits:
                raise SessionNotFoundError(f"session {name!r} has no version {version}")
            v, sel = hits[0]
        rec = self.store.get(sel, RECORD_KEY)
        if rec is None or rec.get("kind") != "ses":
            raise SessionFormatError(f"session {name}@{v}: space {sel.hex()} holds no SES record")
        self._check_tenant(rec.get("tenant"), f"session {name}@{v}")
        return v, sel, rec

    def _check_tenant(self, tenant: object, what: str) -> None:
        if tenant != self.tenant:
            # Best effort: a read-only store cannot log, and must refuse all the same.
            with contextlib.suppress(StoreError):
                self.store.audit("session.denied", what=what, tenant=self.tenant)
            raise WrongTenantError(f"{what} belongs to another tenant, not {self.tenant!r}")

    def info(self, name: str, version: int | None = None) -> SessionInfo:
        """The listing entry of ``name`` (its head, or ``version``)."""
        v, sel, rec = self._resolve(name, version)
        fk = self.store.get_edge(FORK_EDGE + name.encode())
        return SessionInfo(
            name,
            v,
            sel,
            rec["tenant"],
            bytes(rec["model"]),
            rec["length"],
            rec["len"],
            None if fk is None else f"{fk['parent']}@{fk['parent_version']}",
            None if fk is None else fk["at"],
        )

    def list(self) -> list[SessionInfo]:
        """This tenant's sessions (their heads), by name."""
        return list_sessions(self.store, self.tenant)

    # -- save --------------------------------------------------------------------------
    def _publish(self, state: SessionState) -> tuple[Selector, dict]:
        """Publish ``state`` as a sealed space (or find it already published)."""
        enc = encode(state)
        digest = xxhash.xxh3_128_digest(memoryview(enc.payload))
        identity = msgpack.packb(
            ["czyx-session", state.format, state.tenant, state.model, digest], use_bin_type=True
        )
        space = Selector.from_content(identity)
        lay = enc.layout
        if self.store.has_space(space):
            rec = self.store.get(space, RECORD_KEY)
            if rec is not None:
                return space, rec
        record = {
            "kind": "ses",
            "format": state.format,
            "tenant": state.tenant,
            "model": state.model,
            "length": lay.length,
            "n_layers": lay.n_layers,
            "n_kv_heads": lay.n_kv_heads,
            "head_dim": lay.head_dim,
            "vocab": lay.vocab,
            "block": lay.block,
            "meta_len": lay.meta_len,
            "kv_off": lay.kv_off,
            "head_sum": enc.head_sum,
            "block_sums": list(enc.block_sums),
        }
        if lay.rec_len:  # format 2: format-1 records keep exactly their fields
            record["rec_len"] = lay.rec_len
        manifest = {
            "kind": "session",
            "tenant": state.tenant,
            "model": state.model.hex(),
            "tokens": lay.length,
        }
        try:
            with self.store.begin_space(space, manifest) as w:
                ext = w.write_extent(enc.payload)
                record.update(ext.record())
                w.put(RECORD_KEY, record)
        except SealedSpaceError:  # an identical state published concurrently: the same bytes
            rec = self.store.get(space, RECORD_KEY)
            if rec is None:
                raise
            return space, rec
        return space, record

    def save(
        self, name: str, state: SessionState, *, expect_version: int | None = None
    ) -> SessionInfo:
        """Save ``state`` as the next version of session ``name``.

        Parameters
        ----------
        name
            The session name (created by its first save).
        state
            The state; its tenant must be this handle's.
        expect_version
            If given, the current head version the caller loaded (0: none);
            anything else raises ``SessionConflictError`` (optimistic locking).

        Raises
        ------
        WrongTenantError
            The state or the existing session belongs to another tenant.
        SessionConflictError
            Another writer saved this version first (or ``expect_version`` is stale).
        """
        check_name(name)
        self._auth.verify(self.portal, right=self._read_right, tenant=self.tenant)
        if state.tenant != self.tenant:
            raise WrongTenantError(f"state of tenant {state.tenant!r} saved by {self.tenant!r}")
        vs = self.versions(name)
        head = vs[-1][0] if vs else 0
        if vs:
            self._resolve(name, head)  # tenant check of the existing session
        if expect_version is not None and expect_version != head:
            raise SessionConflictError(
                f"session {name!r} is at version {head}, not {expect_version}"
            )
        space, _ = self._publish(state)
        # Prefix edges before the tag: the tag is the instant of the save.
        self.prefixes.add(space, state.tokens, state.model, state.tenant, name)
        version = head + 1
        self._tag(name, version, space)
        self.store.audit(
            "session.save", name=name, version=version, space=space.hex(), tokens=state.length
        )
        return self.info(name, version)

    def _tag(self, name: str, version: int, space: Selector) -> None:
        try:
            self.store.set_tag(version_tag(name, version), space)
        except TagConflictError as exc:
            raise SessionConflictError(
                f"session {name!r}: version {version} was saved concurrently ({exc})"
            ) from exc

    # -- load --------------------------------------------------------------------------
    def read(
        self,
        name: str,
        version: int | None = None,
        *,
        model: bytes | None = None,
        rows: int | None = None,
    ) -> ParsedExtent:
        """Read and verify a saved state in one read (only its first ``rows`` positions' blocks).

        Parameters
        ----------
        name, version
            The session and version (``None``: the head).
        model
            The selector of the model version that will use the KV; refused if
            the state was saved against another (``None``: no check).
        rows
            Read only the blocks holding the first ``rows`` positions.

        Raises
        ------
        SessionNotFoundError, WrongTenantError, ModelVersionMismatchError
            Missing session, another tenant's session, another model version.
        SessionFormatError, store errors
            Corrupt or truncated extent, checksum mismatch, short read.
        """
        v, sel, rec = self._resolve(name, version)
        return self._read_space(sel, rec, f"session {name}@{v}", model, rows)

    def read_space(
        self, space: Selector, *, model: bytes | None = None, rows: int | None = None
    ) -> ParsedExtent:
        """Like :meth:`read` for a state known by its space (e.g. a prefix hit)."""
        rec = self.store.get(space, RECORD_KEY)
        if rec is None or rec.get("kind") != "ses":
            raise SessionNotFoundError(f"space {space.hex()} holds no saved session")
        self._check_tenant(rec.get("tenant"), f"session space {space.hex()[:16]}")
        return self._read_space(space, rec, f"session space {space.hex()[:16]}", model, rows)

    def _read_space(
        self, sel: Selector, rec: dict, what: str, model: bytes | None, rows: int | None
    ) -> ParsedExtent:
        # Through the portal: verified, scope-checked and audited at open.
        view = self._auth.open_space(self.portal, sel, right=self._read_right, tenant=self.tenant)
        try:
            rec = view.get(Key(SES))  # the record as the portal shows it
            if rec is None or rec.get("kind") != "ses":
                raise SessionNotFoundError(f"{what}: space {sel.hex()} holds no SES record")
            self._check_tenant(rec.get("tenant"), what)
            if rec.get("format") not in FORMATS:
                raise SessionFormatError(f"{what}: format {rec.get('format')}, expected {FORMATS}")
            if model is not None and bytes(rec["model"]) != bytes(model):
                raise ModelVersionMismatchError(
                    f"{what} was saved against model version {bytes(rec['model']).hex()[:16]}..., "
                    f"not {bytes(model).hex()[:16]}...; its KV cache is only valid on that version"
                )
            lay = _layout(rec)
            whole = rows is None or rows == lay.length
            n = lay.prefix_nbytes(lay.length if rows is None else rows)
            if whole and not self.direct:
                buf = aligned_empty(max(n, 1))
                view.read_extent(Key(SES), buf)  # the one read, whole-extent checksum verified
                parsed = ParsedExtent(buf[:n], rows, what)
            else:
                parsed = self._read_prefix(sel, rec, n, rows, what)
        finally:
            view.close()
        if parsed.tenant != self.tenant:
            raise WrongTenantError(f"{what}: extent belongs to another tenant")
        if parsed.model != bytes(rec["model"]) or parsed.layout.length != rec["length"]:
            raise SessionFormatError(f"{what}: extent header disagrees with its record")
        return parsed

    def _read_prefix(
        self, sel: Selector, rec: dict, n: int, rows: int | None, what: str
    ) -> ParsedExtent:
        """Read the first ``n`` bytes of the extent in one read; verify head and blocks."""
        with self.store.open_reader(sel, direct=self.direct) as reader:
            # Block files pad every extent to the alignment, so an O_DIRECT read
            # may round its length up and stay one aligned request.
            nread = -(-n // reader.align) * reader.align if self.direct else n
            buf = aligned_empty(max(nread, 1), reader.align)
            reader.read_into(int(rec["off"]), buf[:nread])  # the one read
        parsed = ParsedExtent(buf[:n], rows, what)
        parsed.verify(rec["head_sum"], rec["block_sums"])
        return parsed

    def load(
        self, name: str, version: int | None = None, *, model: bytes | None = None
    ) -> SessionState:
        """The whole saved state as a self-contained :class:`SessionState` (copies)."""
        return self.read(name, version, model=model).to_state()

    # -- fork, diff, prefixes --------------------------------------------------------
    def fork(self, parent: str, child: str, *, at: int | None = None) -> SessionInfo:
        """Start session ``child`` from ``parent``'s head, optionally cut to ``at`` tokens.

        The child's parent is recorded as an association edge (0xFF space)
        before the child's first version is tagged.

        Raises
        ------
        SessionExistsError
            ``child`` already has saved states.
        """
        check_name(child)
        self._auth.verify(self.portal, right=self._read_right, tenant=self.tenant)
        if self.versions(child):
            raise SessionExistsError(f"session {child!r} already exists")
        pv, psel, prec = self._resolve(parent, None)
        length = prec["length"]
        if at is not None and not 0 < at <= length:
            raise ValueError(f"fork at {at}: outside 1..{length} tokens of {parent!r}")
        if at is None or at == length:
            space = psel  # zero-copy: the child's first state is the parent's sealed space
        else:
            state = self._read_space(psel, prec, f"session {parent}@{pv}", None, at).to_state()
            space, _ = self._publish(state)
            self.prefixes.add(space, state.tokens, state.model, state.tenant, child)
        self.store.put_edge(
            FORK_EDGE + child.encode(),
            {
                "kind": "ses.fork",
                "child": child,
                "parent": parent,
                "parent_version": pv,
                "parent_space": psel.hex(),
                "child_space": space.hex(),
                "at": length if at is None else at,
                "time": time.time(),
            },
        )
        self._tag(child, 1, space)
        self.store.audit("session.fork", parent=f"{parent}@{pv}", child=child, space=space.hex())
        return self.info(child, 1)

    def lineage(self, name: str) -> list[str]:
        """``name`` and its fork ancestors, nearest first (``["c", "b@2", "a@5"]``)."""
        out, cur, seen = [name], name, {name}
        while True:
            fk = self.store.get_edge(FORK_EDGE + cur.encode())
            if fk is None or fk["parent"] in seen:
                return out
            out.append(f"{fk['parent']}@{fk['parent_version']}")
            cur = fk["parent"]
            seen.add(cur)

    def tokens(self, name: str, version: int | None = None) -> np.ndarray:
        """A session's token history, reading only the extent's head (no KV)."""
        return self.read(name, version, rows=0).tokens.copy()

    def diff(self, a: str, b: str, context: int = 8) -> SessionDiff:
        """Where the histories of sessions ``a`` and ``b`` (their heads) diverge."""
        ta, tb = self.tokens(a), self.tokens(b)
        n = min(ta.size, tb.size)
        neq = np.flatnonzero(ta[:n] != tb[:n])
        common = int(neq[0]) if neq.size else n
        return SessionDiff(
            a,
            b,
            int(ta.size),
            int(tb.size),
            common,
            tuple(int(t) for t in ta[common : common + context]),
            tuple(int(t) for t in tb[common : common + context]),
        )

    def find_prefix(self, tokens: np.ndarray | list[int], model: bytes) -> PrefixHit | None:
        """The saved state of this tenant holding the longest block prefix of ``tokens``."""
        return self.prefixes.longest(tokens, model, self.tenant)


__all__ = [
    "BLOCK",
    "FORK_EDGE",
    "RECORD_KEY",
    "SessionDiff",
    "SessionInfo",
    "SessionStore",
    "check_name",
    "list_sessions",
    "version_tag",
]
