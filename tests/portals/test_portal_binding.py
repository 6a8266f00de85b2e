"""A portal id binds to the caveats it was issued with.

The attack (issue 19): the holder of a grant-right portal appends a child's
``PortalId`` caveat to its own, wider token by hand (the chain needs no secret to
extend). Before the fix that token verified with the holder's wider scope while
the audit log named the child.
"""

from __future__ import annotations

import pytest

from czyx.portals import ClassRange, PortalDenied, Rights
from czyx.portals.authority import PortalAuthority
from czyx.portals.caveats import PortalId
from czyx.portals.chain import _extend
from czyx.portals.token import Token
from czyx.space import Selector
from czyx.store import Store


def _forge(holder: str, child_id: bytes, extra: tuple = ()) -> str:
    t = Token.from_text(holder)
    cavs, sig = list(t.caveats), t.signature
    for c in (PortalId(child_id), *extra):
        sig = _extend(sig, c.encode())
        cavs.append(c)
    return Token(t.store_id, t.root_id, tuple(cavs), sig).to_text()


@pytest.fixture
def auth(tmp_path):
    with Store.open(tmp_path / "s") as st:
        sp = Selector.from_name("m")
        with st.begin_space(sp, {"x": 1}):
            pass
        yield PortalAuthority(st), sp


def test_hand_appended_child_id_is_refused_and_audited_as_the_holder(auth) -> None:
    a, sp = auth
    holder = a.grant([Rights({"read", "grant"})], tenant="alice")
    child = a.grant([ClassRange(0, 7), Rights({"read"})], tenant="alice", parent=holder.token)
    assert a.verify(child.token, space=sp).portal_id == child.portal_id
    for forged in (
        _forge(holder.token, child.portal_id),
        _forge(holder.token, child.portal_id, (ClassRange(0, 255),)),
        _forge(holder.token, child.portal_id, (Rights({"read"}),)),
    ):
        with pytest.raises(PortalDenied, match="not followed by the caveats"):
            a.verify(forged, space=sp)
    # the refusal names the holder's portal chain, never an open as bob
    opens = [e for e in a.store.audit_log() if e["event"] == "portal.open"]
    assert not opens
    # the real child still works and is still revocable
    a.revoke(child.portal_id)
    with pytest.raises(PortalDenied):
        a.verify(child.token, space=sp)
    assert a.verify(holder.token, space=sp).portal_id == holder.portal_id


def test_attenuating_a_bound_portal_still_verifies(auth) -> None:
    from czyx.portals import attenuate

    a, sp = auth
    g = a.grant([ClassRange(0, 63), Rights({"read", "grant"})], tenant="alice")
    narrower = attenuate(g.token, [ClassRange(0, 7)])
    assert a.verify(narrower, space=sp).portal_id == g.portal_id
    grand = a.grant([Rights({"read"})], tenant="alice", parent=narrower)
    assert a.verify(grand.token, space=sp).portal_id == grand.portal_id


def test_every_hand_built_lineage_is_refused(tmp_path) -> None:
    from czyx.testing.attacks import portal_attacks

    _, cases = portal_attacks(tmp_path)
    outcomes = [(c.name, c.run()) for c in cases]
    assert len(outcomes) >= 8
    bad = [(n, o) for n, o in outcomes if o.kind != "refused"]
    assert not bad, bad
