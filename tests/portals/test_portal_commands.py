"""The portal commands: grant, attenuate, portals, revoke, audit (in-process)."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.cli import main
from czyx.cli.commands._portalargs import parse_expiry
from czyx.key import Key
from czyx.portals.caveats import Rights
from czyx.portals.errors import CaveatError
from czyx.portals.model import model_spaces
from czyx.portals.token import Token
from czyx.space import Selector
from czyx.store import Store


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    path = tmp_path / "st"
    experts = Selector.from_name("cli-experts")
    trunk = Selector.from_name("cli-trunk")
    with Store.open(path) as st:
        with st.begin_space(trunk, {"kind": "trunk"}) as w:
            w.put(Key(0x50, 0).pack(), {"role": "embed"})
        with st.begin_space(experts, {"kind": "experts", "trunk": trunk.hex()}) as w:
            for c in range(4):
                ext = w.write_extent(np.full(64, c, dtype=np.uint8))
                w.put(Key(c, 0).pack(), ext.record())
        st.set_tag("m@1", experts)
    monkeypatch.setenv("CZYX_STORE", str(path))
    return path, experts, trunk


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_grant_attenuate_list_revoke_audit(store_dir, capsys):
    path, experts, trunk = store_dir
    rc, out, err = _run(
        capsys, "grant", "m@1", "--tenant", "acme", "--classes", "0-1", "--expires", "1h"
    )
    assert rc == 0 and "granted portal" in err and "2 spaces" in err
    token = out.strip()
    perm = Token.from_text(token).permission()
    assert perm.spaces == {experts.raw, trunk.raw}  # the trunk comes with the version
    assert perm.scope_for(experts.raw).classes == 0b11 and not perm.scope_for(trunk.raw).empty
    assert perm.rights == {"read", "infer"} and perm.tenant == "acme"
    pid = perm.portal_id.hex()

    rc, out, _ = _run(capsys, "attenuate", token, "--classes", "1", "--space", experts.hex())
    narrow = Token.from_text(out.strip()).permission()
    assert rc == 0 and narrow.scope_for(experts.raw).classes == 0b10

    rc, out, _ = _run(capsys, "portals", "--root-token")
    root = Token.from_text(out.strip()).permission()
    assert rc == 0 and root.spaces is None and root.portal_id.hex() == perm.ids[0].hex()
    rc, out, _ = _run(capsys, "portals")
    assert rc == 0 and pid in out and "m@1" in out and "classes=0-1" in out

    rc, out, _ = _run(capsys, "revoke", pid[:10], "--reason", "done", "--store", str(path))
    assert rc == 0 and f"revoked {pid}" in out
    rc, out, _ = _run(capsys, "portals", "--active")
    assert pid not in out

    rc, out, _ = _run(capsys, "audit", "--tenant", "acme")
    assert rc == 0 and "portal.grant" in out and "portal.revoke" in out and "done" in out
    assert token not in out


def test_cli_errors_are_one_line(store_dir, capsys):
    rc, _, err = _run(capsys, "grant", "m@1", "--tenant", "acme", "--classes", "0-300")
    assert rc == 1 and err.count("\n") == 1 and "classes" in err
    rc, _, err = _run(capsys, "attenuate", "czp1_garbage", "--classes", "0")
    assert rc == 1 and "token" in err and "garbage" not in err
    rc, _, err = _run(capsys, "attenuate", "czp1_x")
    assert rc == 1
    rc, _, err = _run(capsys, "revoke", "ffffffffff")
    assert rc == 1 and "no portal" in err
    rc, _, err = _run(capsys, "grant", "nope@1", "--tenant", "acme")
    assert rc == 1 and "nope@1" in err


def test_attenuate_refuses_to_widen(store_dir, capsys):
    _, out, _ = _run(capsys, "grant", "m@1", "--tenant", "acme", "--rights", "read")
    rc, _, err = _run(capsys, "attenuate", out.strip(), "--rights", "read,grant")
    assert rc == 1 and "widen" in err


def test_parse_expiry():
    assert parse_expiry("24h", 1000.5) == 1000 + 86400
    assert parse_expiry("@123", 0) == 123
    assert parse_expiry("2026-01-01T00:00:00Z", 0) == 1767225600
    with pytest.raises(CaveatError, match="expires"):
        parse_expiry("soon", 0)


def test_model_spaces_follow_trunk_and_base_chain(store_dir):
    path, experts, trunk = store_dir
    adapter = Selector.from_name("cli-adapter")
    other = Selector.from_name("cli-other")
    with Store.open(path) as st:
        with st.begin_space(
            adapter, {"kind": "adapter", "base": experts.hex(), "spaces": {"x": other.raw}}
        ):
            pass
        assert model_spaces(st, adapter) == ([adapter, experts], [other, trunk])
        assert model_spaces(st, trunk) == ([trunk], [])


def test_grant_on_adapter_narrows_every_expert_space(store_dir, capsys):
    path, experts, trunk = store_dir
    adapter = Selector.from_name("cli-adapter2")
    with Store.open(path) as st:
        with st.begin_space(adapter, {"kind": "adapter", "base": experts.hex()}):
            pass
        st.set_tag("m@2", adapter)
    rc, out, _ = _run(capsys, "grant", "m@2", "--tenant", "t", "--classes", "1", "--layers", "0")
    assert rc == 0
    perm = Token.from_text(out.strip()).permission()
    assert perm.spaces == {adapter.raw, experts.raw, trunk.raw}
    for s in (adapter.raw, experts.raw):
        sc = perm.scope_for(s)
        assert sc.classes == 0b10 and (sc.layer_lo, sc.layer_hi) == (0, 0)
    assert perm.scope_for(trunk.raw).classes == (1 << 256) - 1


def test_open_model_covers_the_whole_version(store_dir, capsys):
    path, experts, trunk = store_dir
    from czyx.portals import attenuate, open_model
    from czyx.portals.caveats import Spaces
    from czyx.portals.errors import OutOfScope

    _, out, _ = _run(capsys, "grant", "m@1", "--tenant", "acme", "--classes", "1-2")
    token = out.strip()
    with Store.open(path) as st:
        view = open_model(st, token, "m@1")
        assert view.right == "infer" and view.space == experts
        assert view.allows(1, 0) and not view.allows(0, 0)
        # Dropping the trunk from the portal makes the model unopenable.
        no_trunk = attenuate(token, [Spaces(frozenset({experts.raw}))])
        with pytest.raises(OutOfScope):
            open_model(st, no_trunk, "m@1")
        last = list(st.audit_log())[-1]
        assert last["event"] == "portal.deny" and last["space"] == trunk.hex()
        with pytest.raises(OutOfScope):
            open_model(st, attenuate(token, [Rights(frozenset({"read"}))]), "m@1")


def test_open_model_intersects_the_chain_scopes(store_dir):
    path, experts, trunk = store_dir
    from czyx.portals import open_model
    from czyx.portals.authority import PortalAuthority
    from czyx.portals.caveats import ClassRange, Spaces

    adapter = Selector.from_name("cli-adapter3")
    with Store.open(path) as st:
        with st.begin_space(adapter, {"kind": "adapter", "base": experts.hex()}):
            pass
        g = PortalAuthority(st).grant(
            [
                Spaces(frozenset({adapter.raw, experts.raw, trunk.raw})),
                ClassRange(0, 3, adapter.raw),
                ClassRange(2, 5, experts.raw),
            ],
            tenant="acme",
        )
        view = open_model(st, g.token, adapter)
        assert [c for c in range(8) if view.allows(c, 0)] == [2, 3]
