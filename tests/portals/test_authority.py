"""Grant, open, revoke and audit against a real store, and every adversarial
case of the portals issue: each refused with a typed error and an audit
entry, and no byte of the space returned."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat

import numpy as np
import pytest

from czyx.key import Key
from czyx.portals import attenuate
from czyx.portals.authority import PortalAuthority, open_space, root_token
from czyx.portals.caveats import (
    ClassRange,
    Expires,
    LayerRange,
    Rights,
    Spaces,
    parse_classes,
)
from czyx.portals.errors import (
    ForeignPortal,
    InvalidSignature,
    OutOfScope,
    PortalDenied,
    PortalError,
    PortalExpired,
    PortalRevoked,
    RecordNotFoundError,
    RootRevocationError,
    TokenFormatError,
    UnknownPortal,
    WideningError,
)
from czyx.portals.secret import SECRET_FILE
from czyx.portals.token import Token
from tests.portals.conftest import EXTENT, audit_events, payload

SENTINEL = 0xEE


def _buf() -> np.ndarray:
    return np.full(EXTENT + 4096, SENTINEL, dtype=np.uint8)


def _tenant_grant(auth, a, **extra):
    cavs = [Spaces(frozenset({a.raw})), ClassRange(0, 3), LayerRange(0, 1)]
    cavs += extra.pop("more", [])
    return auth.grant(cavs, tenant="acme", **extra)


def _assert_denied(auth, fn, exc_type, reason):
    before = len(audit_events(auth, "portal.deny"))
    with pytest.raises(exc_type) as info:
        fn()
    assert isinstance(info.value, PortalDenied)
    denials = audit_events(auth, "portal.deny")
    assert len(denials) == before + 1
    assert denials[-1]["reason"] == reason == info.value.reason
    assert "time" in denials[-1]
    return denials[-1]


# --- the happy path ---------------------------------------------------------------------


def test_owner_root_portal_opens_everything(world):
    auth, _, b, _ = world
    view = auth.open_space(auth.root_token(), "a@1")
    buf = _buf()
    rec = view.read_extent(Key(7, 3), buf)
    assert bytes(buf[: rec["len"]]) == payload(7, 3)
    assert view.allowed_classes.all() and view.tenant == "owner"
    assert len(list(view.scan())) == 32
    assert auth.open_space(auth.root_token(), b).get(Key(0, 0)) is not None
    with pytest.raises(RecordNotFoundError, match="no record") as err:
        view.read_extent(Key(9, 0), buf)  # covered, but never written
    assert isinstance(err.value, KeyError) and str(err.value).startswith("no record")


def test_grant_open_read_within_caveats(world):
    auth, a, _, _ = world
    g = _tenant_grant(auth, a)
    view = open_space(auth.store, g.token)  # the portal names one space: no need to say it
    assert view.space == a and view.tenant == "acme"
    assert view.allowed_classes.sum() == 4 and (view.layer_lo, view.layer_hi) == (0, 1)
    buf = _buf()
    view.read_extent(Key(2, 1), buf)
    assert bytes(buf[:EXTENT]) == payload(2, 1)
    got = {(k.cls, k.z) for k, _ in view.scan()}
    assert got == {(c, z) for c in range(4) for z in range(2)}
    opens = audit_events(auth, "portal.open")
    assert opens[-1]["tenant"] == "acme" and opens[-1]["portal"] == g.id_hex


def test_descriptor_records_issuer_tenant_caveats_parent_time(world):
    auth, a, _, clock = world
    g = _tenant_grant(auth, a, more=[Expires(int(clock.now) + 60)])
    d = auth.store.get_portal_descriptor(g.portal_id)
    assert d["tenant"] == "acme" and d["issuer"] == "owner"
    assert d["parent"] == auth.root_id.hex() and d["created"] == clock.now
    assert d["expires"] == int(clock.now) + 60 and d["revoked"] is None
    kinds = {c["kind"] for c in d["caveats"]}
    assert {"Spaces", "ClassRange", "LayerRange", "Expires", "Tenant"} <= kinds
    listed = {x["id"]: x for x in auth.descriptors()}
    assert listed[g.id_hex]["status"] == "active" and listed[auth.root_id.hex()]["kind"] == "root"


def test_scan_outside_and_partial(world):
    auth, a, _, _ = world
    view = auth.open_space(_tenant_grant(auth, a).token)
    assert {k.cls for k, _ in view.scan(2, 7)} == {2, 3}
    _assert_denied(auth, lambda: list(view.scan(4, 7)), OutOfScope, "out-of-scope")


# --- the adversarial cases (each one a test) ----------------------------------------------


def test_forged_token_is_refused(world):
    auth, a, _, _ = world
    tok = Token.from_text(_tenant_grant(auth, a).token)
    forged = dataclasses.replace(tok, signature=os.urandom(32)).to_text()
    _assert_denied(auth, lambda: auth.open_space(forged, a), InvalidSignature, "signature")


def test_tampered_caveat_is_refused(world):
    auth, a, _, _ = world
    tok = Token.from_text(_tenant_grant(auth, a).token)
    cavs = tuple(ClassRange(0, 255) if isinstance(c, ClassRange) else c for c in tok.caveats)
    bad = dataclasses.replace(tok, caveats=cavs).to_text()
    _assert_denied(auth, lambda: auth.open_space(bad, a), InvalidSignature, "signature")


@pytest.mark.parametrize("mangle", ["truncate", "garble", "empty", "prefix"])
def test_truncated_or_garbled_token_is_refused(world, mangle):
    auth, a, _, _ = world
    text = _tenant_grant(auth, a).token
    bad = {
        "truncate": text[:-7],
        "garble": text[:20] + "!!" + text[22:],
        "empty": "",
        "prefix": "xyz" + text,
    }[mangle]
    entry = _assert_denied(auth, lambda: auth.open_space(bad, a), TokenFormatError, "malformed")
    assert entry["portal"] is None


def test_widened_attenuation_is_refused(world):
    auth, a, _, _ = world
    text = _tenant_grant(auth, a).token
    with pytest.raises(WideningError):
        attenuate(text, [ClassRange(0, 7)])
    # Forcing the caveat in anyway does not widen: the read is still refused.
    loose = attenuate(text, [ClassRange(0, 7), LayerRange(0, 3)], strict=False)
    view = auth.open_space(loose, a)
    buf = _buf()
    _assert_denied(auth, lambda: view.read_extent(Key(5, 0), buf), OutOfScope, "out-of-scope")
    _assert_denied(auth, lambda: view.read_extent(Key(0, 2), buf), OutOfScope, "out-of-scope")
    assert (buf == SENTINEL).all()
    # A grant asking for more than its parent is refused by the authority too.
    parent = _tenant_grant(auth, a, more=[Rights(frozenset({"read", "grant"}))])
    _assert_denied(
        auth,
        lambda: auth.grant([ClassRange(0, 7)], tenant="acme", parent=parent.token),
        WideningError,
        "widening",
    )


def test_expired_portal_is_refused(world):
    auth, a, _, clock = world
    g = _tenant_grant(auth, a, more=[Expires(int(clock.now) + 10)])
    auth.open_space(g.token).close()
    clock.now += 10
    entry = _assert_denied(auth, lambda: auth.open_space(g.token), PortalExpired, "expired")
    assert entry["portal"] == g.id_hex and entry["tenant"] == "acme"
    assert {d["id"]: d["status"] for d in auth.descriptors()}[g.id_hex] == "expired"


def test_revoked_parent_revokes_descendants(world):
    auth, a, _, _ = world
    parent = _tenant_grant(auth, a, more=[Rights(frozenset({"read", "infer", "grant"}))])
    child = auth.grant(
        [ClassRange(1, 2), Rights(frozenset({"read", "grant"}))], tenant="acme", parent=parent.token
    )
    grandchild = auth.grant([LayerRange(1, 1)], tenant="acme", parent=child.token)
    offline = attenuate(child.token, [ClassRange(2, 2)])  # never registered
    other = _tenant_grant(auth, a)
    for t in (child.token, grandchild.token, offline):
        auth.open_space(t).close()
    marked = auth.revoke(parent.id_hex[:10], reason="contract ended")
    assert set(marked) == {parent.portal_id, child.portal_id, grandchild.portal_id}
    for t in (parent.token, child.token, grandchild.token, offline):
        _assert_denied(auth, lambda t=t: auth.open_space(t), PortalRevoked, "revoked")
    auth.open_space(other.token).close()  # a sibling is untouched
    revs = audit_events(auth, "portal.revoke")
    assert {r["portal"] for r in revs} == {m.hex() for m in marked}
    assert all(r["reason"] == "contract ended" for r in revs)
    status = {d["id"]: d["status"] for d in auth.descriptors()}
    assert status[grandchild.id_hex] == "revoked" and status[other.id_hex] == "active"


def test_revoking_the_root_or_an_unknown_id_is_refused(world):
    auth, _, _, _ = world
    with pytest.raises(RootRevocationError):
        auth.revoke(auth.root_id)
    with pytest.raises(UnknownPortal):
        auth.revoke("00112233445566")


def test_portal_for_space_a_used_on_space_b_is_refused(world):
    auth, a, b, _ = world
    text = _tenant_grant(auth, a).token
    entry = _assert_denied(auth, lambda: auth.open_space(text, b), OutOfScope, "out-of-scope")
    assert entry["space"] == b.hex()
    _assert_denied(auth, lambda: auth.open_space(text, "b@1"), OutOfScope, "out-of-scope")


@pytest.mark.parametrize("cls, layer", [(4, 0), (0, 2), (7, 3), (255, 0), (3, 2**40)])
def test_read_outside_class_or_layer_range_is_refused(world, cls, layer):
    auth, a, _, _ = world
    view = auth.open_space(_tenant_grant(auth, a).token)
    buf = _buf()
    key = Key(cls, layer)
    _assert_denied(auth, lambda: view.read_extent(key, buf), OutOfScope, "out-of-scope")
    _assert_denied(auth, lambda: view.get(key), OutOfScope, "out-of-scope")
    assert (buf == SENTINEL).all()
    assert not view.allows(cls, layer)


def test_token_from_another_store_is_refused(world, tmp_path):
    auth, a, _, _ = world
    from czyx.store import Store

    with Store.open(tmp_path / "other") as other:
        foreign = PortalAuthority(other).root_token()
    _assert_denied(auth, lambda: auth.open_space(foreign, a), ForeignPortal, "foreign-store")


def test_descriptor_must_exist_in_this_store(world, tmp_path):
    """Same secret, different descriptors (a copied secret): unregistered ids are refused."""
    auth, a, _, _ = world
    from czyx.store import Store

    g = _tenant_grant(auth, a)
    (tmp_path / "clone").mkdir()
    shutil.copy2(auth.store.path / SECRET_FILE, tmp_path / "clone" / SECRET_FILE)
    with Store.open(tmp_path / "clone") as clone:
        clone_auth = PortalAuthority(clone)
        with pytest.raises(UnknownPortal):
            clone_auth.verify(g.token)


def test_missing_rights_and_wrong_tenant_are_refused(world):
    auth, a, _, _ = world
    infer_only = _tenant_grant(auth, a, more=[Rights(frozenset({"infer"}))])
    _assert_denied(auth, lambda: auth.open_space(infer_only.token), OutOfScope, "out-of-scope")
    auth.open_space(infer_only.token, right="infer").close()
    g = _tenant_grant(auth, a)
    _assert_denied(
        auth, lambda: auth.open_space(g.token, tenant="globex"), OutOfScope, "out-of-scope"
    )
    # Without the grant right a portal cannot issue portals.
    _assert_denied(
        auth,
        lambda: auth.grant([ClassRange(0, 1)], tenant="acme", parent=g.token),
        OutOfScope,
        "out-of-scope",
    )


# --- the secret --------------------------------------------------------------------------


def test_secret_file_is_private_and_never_leaks(world):
    auth, a, _, _ = world
    path = auth.store.path / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_bytes()
    g = _tenant_grant(auth, a)
    with pytest.raises(PortalDenied):
        auth.open_space(g.token[:-3], a)
    leaked = [secret.hex(), secret.hex().upper(), g.token, auth.root_token()]
    sig_hex = Token.from_text(g.token).signature.hex()
    blobs = [repr(e) for e in auth.store.audit_log()]
    blobs += [repr(d) for _, d in auth.store.portal_descriptors()]
    for blob in blobs:
        assert not any(x in blob for x in leaked) and sig_hex not in blob
    assert secret not in repr(auth.__dict__).encode()


def test_permissive_secret_file_is_refused(tmp_path):
    from czyx.portals.errors import SecretError
    from czyx.portals.secret import load_or_create_secret

    load_or_create_secret(tmp_path)
    os.chmod(tmp_path / SECRET_FILE, 0o644)
    with pytest.raises(SecretError, match="readable by others") as info:
        load_or_create_secret(tmp_path)
    assert (tmp_path / SECRET_FILE).read_bytes().hex() not in str(info.value)
    assert "hidden" in repr(load_or_create_secret.__globals__["StoreSecret"](b"x" * 32))


def test_root_token_is_stable_per_store(world):
    auth, _, _, _ = world
    assert root_token(auth.store) == auth.root_token()
    assert PortalAuthority(auth.store).root_token() == auth.root_token()


def test_class_set_grant(world):
    auth, a, _, _ = world
    g = auth.grant([Spaces(frozenset({a.raw})), parse_classes("1,5")], tenant="acme")
    view = auth.open_space(g.token)
    assert {k.cls for k, _ in view.scan()} == {1, 5}
    view.check_many(np.array([1, 5, 5]), np.array([0, 1, 3]))
    with pytest.raises(OutOfScope):
        view.check_many(np.array([1, 2]), 0)


def test_read_only_store_fails_closed(world):
    auth, a, _, _ = world
    from czyx.store import Store

    g = _tenant_grant(auth, a)
    path = auth.store.path
    auth.store.close()  # LMDB allows one environment per path and process
    with Store.open(path, readonly=True) as ro:
        ro_auth = PortalAuthority(ro)
        with pytest.raises(PortalError, match="read-only"):
            ro_auth.open_space(g.token)
