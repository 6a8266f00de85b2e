"""``czyx sessions``: listing with lineage, diff, fork, show, and one-line refusals."""

from __future__ import annotations

import numpy as np

from czyx.cli import main
from czyx.inference.sessions.format import BLOCK
from czyx.portals.authority import open_authority
from czyx.store import Store
from tests.inference.sessions.helpers import random_state, sessions_for


def _populate(path):
    with Store.open(path) as st:
        ss = sessions_for(st, "alice")
        base = random_state(np.random.default_rng(1), length=BLOCK + 10)
        ss.save("main", base)
        ss.fork("main", "side", at=BLOCK)
        toks = np.concatenate([base.tokens[:BLOCK], np.array([7, 7, 7], np.int32)])
        ss.save("side", random_state(np.random.default_rng(2), length=toks.size, tokens=toks))
        sessions_for(st, "bob").save(
            "other", random_state(np.random.default_rng(3), length=5, tenant="bob")
        )
        return base


def test_list_shows_lineage(tmp_path, capsys):
    _populate(tmp_path)
    assert main(["sessions", "--store", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in out[1:]]
    assert names == ["main", "└─", "other"]
    side = next(line for line in out if "side" in line)
    assert "fork of main@1 at 64" in side and " v2 " in side and "alice" in side
    assert main(["sessions", "list", "--store", str(tmp_path), "--tenant", "bob"]) == 0
    out = capsys.readouterr().out
    assert "other" in out and "main" not in out


def test_store_from_the_environment(tmp_path, capsys, monkeypatch):
    _populate(tmp_path)
    monkeypatch.setenv("CZYX_STORE", str(tmp_path))  # read when the command runs
    assert main(["sessions", "show", "main", "--tenant", "alice"]) == 0
    assert "main" in capsys.readouterr().out


def test_diff_fork_show(tmp_path, capsys):
    base = _populate(tmp_path)
    args = ["--store", str(tmp_path), "--tenant", "alice"]
    assert main(["sessions", "diff", "main", "side", *args]) == 0
    out = capsys.readouterr().out
    assert f"common prefix: {BLOCK} tokens" in out
    assert "b continues: 7 7 7" in out
    assert f"a continues: {' '.join(str(t) for t in base.tokens[BLOCK : BLOCK + 8])} ..." in out
    assert main(["sessions", "fork", "side", "third", *args]) == 0
    assert "third@1: fork of side@2" in capsys.readouterr().out
    assert main(["sessions", "show", "third", *args]) == 0
    out = capsys.readouterr().out
    assert "third <- side@2 <- main@1" in out and "v1: 67 tokens" in out
    assert main(["sessions", "diff", "side", "third", *args]) == 0
    assert "identical histories (67 tokens)" in capsys.readouterr().out


def test_refusals_are_one_line(tmp_path, capsys):
    _populate(tmp_path)
    store = ["--store", str(tmp_path)]
    # The owner's root portal acting for bob may not read alice's session.
    assert main(["sessions", "diff", "main", "other", *store, "--tenant", "bob"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("czyx: error:") and "another tenant" in err and err.count("\n") == 1
    # The root portal without --tenant acts for the owner, who does not own alice's.
    assert main(["sessions", "diff", "main", "side", *store]) == 1
    assert "not 'owner'" in capsys.readouterr().err
    # A portal bound to bob cannot act for alice.
    with Store.open(tmp_path) as st:
        bob = open_authority(st).grant([], tenant="bob").token
    args = [*store, "--portal", bob, "--tenant", "alice"]
    assert main(["sessions", "diff", "main", "side", *args]) == 1
    assert "not for tenant 'alice'" in capsys.readouterr().err
    assert main(["sessions", "diff", "main", "side", *store, "--portal", bob]) == 1
    assert "another tenant" in capsys.readouterr().err
    assert main(["sessions", "--store", str(tmp_path / "missing")]) == 1
    assert "no store here" in capsys.readouterr().err
