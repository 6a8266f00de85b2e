"""Session states in a store: versions, refusals, forks, diffs and interrupted saves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from czyx.inference.sessions.errors import (
    ModelVersionMismatchError,
    SessionConflictError,
    SessionExistsError,
    SessionFormatError,
    SessionNotFoundError,
    WrongTenantError,
)
from czyx.inference.sessions.format import BLOCK
from czyx.inference.sessions.store import FORK_EDGE, RECORD_KEY, SessionStore, list_sessions
from czyx.portals import PortalDenied, Spaces
from czyx.portals.authority import open_authority
from czyx.space import Selector
from czyx.store import ChecksumError, Store
from czyx.store.core.writer import SpaceWriter
from tests.inference.sessions._crash_child import state_for
from tests.inference.sessions.helpers import (
    MODEL_A,
    MODEL_B,
    random_state,
    sessions_for,
    states_equal,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def store(tmp_path):
    st = Store.open(tmp_path / "st")
    yield st
    st.close()


def test_save_load_versions_and_one_read(store, monkeypatch):
    ss = sessions_for(store, "alice")
    s1, s2 = state_for(1), state_for(2)
    i1 = ss.save("chat", s1)
    i2 = ss.save("chat", s2)
    assert (i1.version, i2.version) == (1, 2) and i2.length == s2.length
    assert [v for v, _ in ss.versions("chat")] == [1, 2]
    reads = []
    from czyx.store.io.reader import RawReader

    orig = RawReader.read_into
    monkeypatch.setattr(
        RawReader,
        "read_into",
        lambda self, off, buf: reads.append(len(buf)) or orig(self, off, buf),
    )
    assert states_equal(ss.load("chat"), s2)
    assert states_equal(ss.load("chat", 1), s1)
    rec = store.get(i2.space, RECORD_KEY)
    assert reads == [rec["len"], store.get(i1.space, RECORD_KEY)["len"]]  # one read each
    assert store.manifest(i2.space)["kind"] == "session"
    with pytest.raises(SessionNotFoundError):
        ss.load("nope")
    with pytest.raises(SessionNotFoundError):
        ss.load("chat", 3)


def test_saving_the_same_state_twice_reuses_its_space(store):
    ss = sessions_for(store, "alice")
    a = ss.save("x", state_for(1))
    b = ss.save("y", state_for(1))
    assert a.space == b.space and len(store.spaces()) == 1


def test_direct_io_read_matches(store):
    ss = sessions_for(store, "alice")
    ss.save("chat", state_for(3))
    assert states_equal(sessions_for(store, "alice", direct=True).load("chat"), state_for(3))


def test_prefix_read_reads_only_needed_bytes(store, monkeypatch):
    ss = sessions_for(store, "alice")
    s = random_state(np.random.default_rng(0), length=3 * BLOCK + 5)
    ss.save("chat", s)
    parsed = ss.read("chat", rows=BLOCK)
    assert parsed.rows == BLOCK and parsed.layout.prefix_nbytes(BLOCK) < parsed.layout.total
    st = parsed.to_state()
    assert np.array_equal(st.k[1], s.k[1][:, :BLOCK]) and st.logits is None
    assert np.array_equal(ss.tokens("chat"), s.tokens)


def test_model_version_is_checked(store):
    ss = sessions_for(store, "alice")
    ss.save("chat", state_for(1))
    ss.read("chat", model=MODEL_A)
    with pytest.raises(ModelVersionMismatchError, match="model version"):
        ss.read("chat", model=MODEL_B)


def test_wrong_tenant_is_refused_everywhere(store):
    alice, bob = sessions_for(store, "alice"), sessions_for(store, "bob")
    info = alice.save("chat", state_for(3))
    with pytest.raises(WrongTenantError):
        bob.load("chat")
    with pytest.raises(WrongTenantError):
        bob.read_space(info.space)
    with pytest.raises(WrongTenantError):
        bob.save("chat", random_state(np.random.default_rng(1), tenant="bob"))
    with pytest.raises(WrongTenantError):
        bob.save("mine", state_for(2))  # a state of alice's, saved by bob
    with pytest.raises(WrongTenantError):
        bob.fork("chat", "stolen")
    with pytest.raises(WrongTenantError):
        bob.diff("chat", "chat")
    assert bob.list() == [] and [i.name for i in alice.list()] == ["chat"]
    assert any(e["event"] == "session.denied" for e in store.audit_log())
    # bob's prefix look-ups never see alice's histories.
    assert bob.find_prefix(state_for(3).tokens, MODEL_A) is None
    assert alice.find_prefix(state_for(3).tokens, MODEL_A) is not None


def test_conflicting_saves(store):
    ss = sessions_for(store, "alice")
    ss.save("chat", state_for(1), expect_version=0)
    with pytest.raises(SessionConflictError, match="version 1, not 0"):
        ss.save("chat", state_for(2), expect_version=0)
    # A writer that lost the race for version 2 is told so.
    store.set_tag("session:chat@00000002", Selector.from_name("elsewhere"))
    with pytest.raises(SessionConflictError, match="concurrently"):
        sessions_for(store, "alice")._tag("chat", 2, Selector.from_name("mine"))


def test_fork_lineage_and_diff(store):
    ss = sessions_for(store, "alice")
    base = random_state(np.random.default_rng(5), length=2 * BLOCK + 9)
    ss.save("a", base)
    whole = ss.fork("a", "b")  # zero copy
    assert whole.space == ss.info("a").space and whole.parent == "a@1"
    cut = ss.fork("b", "c", at=BLOCK + 3)
    assert cut.length == BLOCK + 3 and cut.parent == "b@1" and cut.fork_at == BLOCK + 3
    got = ss.load("c")
    assert np.array_equal(got.tokens, base.tokens[: BLOCK + 3])
    assert np.array_equal(got.v[0], base.v[0][:, : BLOCK + 3])
    # c diverges: append different tokens and save a version 2.
    toks = np.concatenate([got.tokens, np.array([1, 2, 3], np.int32)])
    longer = random_state(np.random.default_rng(6), length=toks.size, tokens=toks)
    ss.save("c", longer)
    d = ss.diff("a", "c")
    assert d.common == BLOCK + 3 and d.a_next[:3] == tuple(base.tokens[BLOCK + 3 : BLOCK + 6])
    assert d.b_next == (1, 2, 3) and not d.identical
    assert ss.diff("a", "b").identical
    assert ss.lineage("c") == ["c", "b@1", "a@1"]
    rows = {i.name: i for i in list_sessions(store)}
    assert rows["c"].version == 2 and rows["c"].parent == "b@1" and rows["a"].parent is None
    assert len(list(store.edges(FORK_EDGE))) == 2
    with pytest.raises(SessionExistsError):
        ss.fork("a", "c")
    with pytest.raises(ValueError, match="outside"):
        ss.fork("a", "d", at=10_000)


def test_names_are_validated(store):
    ss = sessions_for(store, "alice")
    for bad in ("", "a@b", " x", "-x", "x" * 201, "a\x00"):
        with pytest.raises(ValueError, match="session name"):
            ss.save(bad, state_for(1))


def test_corrupt_extent_is_refused(store):
    ss = sessions_for(store, "alice")
    info = ss.save("chat", state_for(2))
    rec = store.get(info.space, RECORD_KEY)
    path = store.block_path(info.space)
    with open(path, "r+b") as f:
        f.seek(rec["off"] + rec["kv_off"] + 3)
        b = f.read(1)
        f.seek(rec["off"] + rec["kv_off"] + 3)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumError):  # a whole read: the store's extent checksum
        ss.load("chat")
    with pytest.raises(SessionFormatError, match="KV block 0"):  # a prefix: per-block sums
        ss.read("chat", rows=1)
    ss.read("chat", rows=0)  # the head alone is intact


# -- interrupted saves -------------------------------------------------------------------


def test_exception_between_extent_write_and_commit_keeps_previous_state(store, monkeypatch):
    ss = sessions_for(store, "alice")
    ss.save("chat", state_for(1))
    orig = SpaceWriter.commit

    def boom(self):
        self._block.sync()  # the extent is written and durable...
        raise OSError("injected crash before publication")  # ...but never published

    monkeypatch.setattr(SpaceWriter, "commit", boom)
    with pytest.raises(OSError, match="injected"):
        ss.save("chat", state_for(2))
    monkeypatch.setattr(SpaceWriter, "commit", orig)
    assert [v for v, _ in ss.versions("chat")] == [1]
    assert states_equal(ss.load("chat"), state_for(1))
    assert ss.save("chat", state_for(2)).version == 2


def test_exception_between_publication_and_tag_keeps_previous_state(store, monkeypatch):
    ss = sessions_for(store, "alice")
    ss.save("chat", state_for(1))

    def boom(*a, **k):
        raise OSError("injected crash before the tag")

    monkeypatch.setattr(type(store), "set_tag", boom)
    with pytest.raises(OSError, match="injected"):
        ss.save("chat", state_for(2))
    monkeypatch.undo()
    assert states_equal(ss.load("chat"), state_for(1))
    n_spaces = len(store.spaces())
    assert ss.save("chat", state_for(2)).version == 2  # the retry reuses the sealed space
    assert len(store.spaces()) == n_spaces
    assert states_equal(ss.load("chat"), state_for(2))


def _child(path: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.inference.sessions._crash_child", str(path), mode],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("mode", ["before-publish", "before-tag"])
def test_sigkill_mid_save_keeps_previous_state(tmp_path, mode):
    path = tmp_path / "st"
    with Store.open(path) as st:
        sessions_for(st, "alice").save("s", state_for(1))
    p = _child(path, mode)
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, err
    with Store.open(path) as st:
        ss = sessions_for(st, "alice")
        assert [v for v, _ in ss.versions("s")] == [1]
        assert states_equal(ss.load("s"), state_for(1))
        assert ss.save("s", state_for(2)).version == 2
        assert states_equal(ss.load("s"), state_for(2))


def test_sigkill_at_random_instants(tmp_path):
    path = tmp_path / "st"
    rng = np.random.default_rng(7)
    last = 0
    for _ in range(4):
        p = _child(path, "loop")
        # Wait for the child to have saved at least once, then kill it at a random instant.
        line = p.stdout.readline()
        assert line.strip(), p.stderr.read()
        time.sleep(float(rng.uniform(0.0, 0.15)))
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
        done = [int(x) for x in (line + out).split()]
        with Store.open(path) as st:
            ss = sessions_for(st, "alice")
            head = ss.info("s").version
            # Every reported save is durable; at most one more (killed after its tag) exists.
            assert done[-1] <= head <= done[-1] + 1
            assert head > last
            assert states_equal(ss.load("s"), state_for(head))
            # The index is written before the tag: a tagged head is findable by its
            # history, once that history holds a full block (version 1's 63 tokens do
            # not: shorter histories are never prefix-indexed, by design).
            hit = ss.find_prefix(state_for(head).tokens, MODEL_A)
            if len(state_for(head).tokens) >= BLOCK:
                assert hit is not None and hit.space == ss.info("s").space
            else:
                assert hit is None
            last = head


# -- portals -----------------------------------------------------------------------------


def test_sessions_are_opened_through_the_portal(store):
    auth = open_authority(store)
    g = auth.grant([], tenant="alice")
    ss = SessionStore(store, g.token)
    assert ss.tenant == "alice"
    info = ss.save("chat", state_for(2))
    ss.load("chat")
    opens = [e for e in store.audit_log() if e["event"] == "portal.open"]
    assert opens and opens[-1]["space"] == info.space.hex() and opens[-1]["right"] == "read"
    # A portal confined to other spaces cannot open the session's space.
    other = auth.grant([Spaces(frozenset({Selector.from_name("x").raw}))], tenant="alice")
    with pytest.raises(PortalDenied):
        SessionStore(store, other.token).load("chat")
    # The owner's root portal acts for the tenant it names, else for the owner.
    assert SessionStore(store, auth.root_token()).tenant == "owner"
    with pytest.raises(WrongTenantError):
        SessionStore(store, auth.root_token()).load("chat")
    assert np.array_equal(
        SessionStore(store, auth.root_token(), tenant="alice").tokens("chat"), state_for(2).tokens
    )
    # A tenant-bound portal cannot be used for another tenant.
    with pytest.raises(PortalDenied):
        SessionStore(store, g.token, tenant="bob")
    # Revocation: the next save and the next read are refused.
    auth.revoke(g.portal_id, reason="test")
    with pytest.raises(PortalDenied):
        ss.save("chat", state_for(3))
    with pytest.raises(PortalDenied):
        ss.load("chat")
    assert [v for v, _ in sessions_for(store).versions("chat")] == [1]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    length=hst.integers(1, 3 * BLOCK + 3),
    cut=hst.integers(0, 3 * BLOCK + 3),
    other=hst.lists(hst.integers(0, 999), max_size=20),
)
def test_for_all_histories_read_and_diff_agree_with_the_tokens(
    length, cut, other, tmp_path_factory
):
    with Store.open(tmp_path_factory.mktemp("rt")) as st_:
        ss = sessions_for(st_)
        a = random_state(np.random.default_rng(length), length=length)
        ss.save("a", a)
        toks = np.concatenate([a.tokens[: min(cut, length)], np.asarray(other, np.int32)])
        if toks.size:
            ss.save("b", random_state(np.random.default_rng(cut), length=toks.size, tokens=toks))
            d = ss.diff("a", "b")
            n = min(length, toks.size)
            want = next((i for i in range(n) if a.tokens[i] != toks[i]), n)
            assert (d.common, d.a_length, d.b_length) == (want, length, toks.size)
        rows = min(cut, length)
        got = ss.read("a", rows=rows).to_state()
        assert np.array_equal(got.tokens, a.tokens[:rows])
        assert all(np.array_equal(x, y[:, :rows]) for x, y in zip(got.k, a.k))
        assert states_equal(ss.load("a"), a)
