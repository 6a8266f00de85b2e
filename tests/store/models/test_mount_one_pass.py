"""The quantizing mount in one pass: extents written while they are hashed.

A quantizing mount into an LMDB store writes each packed tensor into a pending
block file (``PendingSpace``) as soon as it is made, and only the header and
records wait for the content-derived selector. It must be the two-pass mount
in every observable way: the same selectors, records and block-file bytes; the
same mount twice is the same version (nothing new published, nothing left
behind); and it stays crash-safe: a failure or a SIGKILL at any point leaves no
new version visible, only a ``.part`` file that gc removes, after which the
mount succeeds.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import czyx.store.models.mount as mount_mod
from czyx.store import Store, aligned_empty, collect_garbage, read_extent_verified
from czyx.store.core.writer import PendingSpace
from czyx.store.errors import TagConflictError
from czyx.store.models.mount import mount
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.policy import POLICIES
from czyx.testing.tiny_models import make_tiny_checkpoint

SIZES = dict(hidden_size=64, intermediate_size=64, vocab_size=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "m"
    return make_tiny_checkpoint("mixtral", path, dtype="bfloat16", **SIZES)


def codec() -> QuantCodec:
    return QuantCodec(POLICIES["selective"])


def snapshot(store: Store, sels) -> dict:
    """Every record and every extent's bytes of ``sels`` (verified), and the file tails."""
    out = {}
    for sel in sels:
        store.verify_space(sel)
        recs = dict(store.scan(sel))
        data = {}
        with store.open_reader(sel) as rd:
            for k, rec in recs.items():
                if "off" in rec:
                    buf = aligned_empty(rec["len"])
                    read_extent_verified(rd, rec, buf)
                    data[k] = buf.tobytes()
        ident = store.block_identity(sel)
        body = (store.path / "blocks" / ident.name).read_bytes()[ident.align :]
        out[sel] = (store.manifest(sel), recs, data, ident.size, body)
    return out


def block_names(store: Store) -> set[str]:
    return {p.name for p in (store.path / "blocks").iterdir()}


def published_names(store: Store) -> set[str]:
    return {store.block_identity(s).name for s in store.spaces()}


def test_one_pass_is_the_two_pass_mount(ckpt, tmp_path, monkeypatch):
    with Store.open(tmp_path / "one") as a:
        r1 = mount(a, ckpt, "m@q", quant=codec())
        assert r1.created and r1.bytes_written == r1.bytes_total
        one = snapshot(a, [r1.selector, r1.trunk_selector])
        assert block_names(a) == published_names(a)  # no pending file left
    monkeypatch.setattr(mount_mod, "_can_write_pending", lambda store: False)
    with Store.open(tmp_path / "two") as b:
        r2 = mount(b, ckpt, "m@q", quant=codec())
        two = snapshot(b, [r2.selector, r2.trunk_selector])
    assert (r1.selector, r1.trunk_selector) == (r2.selector, r2.trunk_selector)
    assert (r1.bytes_total, r1.bytes_written) == (r2.bytes_total, r2.bytes_written)
    assert one == two  # manifests, records, extent bytes, block sizes and bodies


def test_the_same_mount_twice_is_the_same_version(ckpt, tmp_path):
    sels = []
    for name in ("a", "b"):
        with Store.open(tmp_path / name) as store:
            sels.append(mount(store, ckpt, "m@q", quant=codec()).selector)
    assert sels[0] == sels[1]  # a deterministic function of the checkpoint
    with Store.open(tmp_path / "a") as store:
        before = block_names(store)
        again = mount(store, ckpt, "m@q", quant=codec())
        assert not again.created and again.selector == sels[0] and again.bytes_written == 0
        assert mount(store, ckpt, "m@q2", quant=codec()).selector == sels[0]
        assert block_names(store) == before  # the pending copies were deleted


def test_a_failure_mid_mount_leaves_nothing(ckpt, tmp_path, monkeypatch):
    real = QuantCodec.encode_expert_raw
    calls = []

    def fail_on_fifth(self, *a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected quantizer failure")
        return real(self, *a, **k)

    monkeypatch.setattr(QuantCodec, "encode_expert_raw", fail_on_fifth)
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(RuntimeError, match="injected"):
            mount(store, ckpt, "m@q", quant=codec())
        assert store.spaces() == [] and store.tags() == {}
        assert block_names(store) == set()
        monkeypatch.setattr(QuantCodec, "encode_expert_raw", real)
        assert mount(store, ckpt, "m@q", quant=codec()).created


def test_a_tag_conflict_publishes_nothing(ckpt, tmp_path):
    with Store.open(tmp_path / "s") as store:
        mount(store, ckpt, "m@q", quant=codec())
        before, spaces = block_names(store), store.spaces()
        with pytest.raises(TagConflictError):
            mount(store, ckpt, "m@q", quant=QuantCodec(POLICIES["q4-all"]))
        assert block_names(store) == before and store.spaces() == spaces


def _killed_child(path, ckpt, when: str) -> int:
    """Fork a child that mounts and SIGKILLs itself at ``when``; return its wait status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 0
        try:

            def die(*_a, **_k):
                os.kill(os.getpid(), signal.SIGKILL)

            if when == "mid_write":
                real_write, n = PendingSpace.write_at, []

                def write_at(self, *a, **k):
                    n.append(1)
                    if len(n) == 4:
                        die()
                    return real_write(self, *a, **k)

                PendingSpace.write_at = write_at
            elif when == "before_publish":
                PendingSpace.publish = die
            elif when == "after_trunk":
                real_publish, n = PendingSpace.publish, []

                def publish(self, *a, **k):
                    n.append(1)
                    if len(n) == 2:
                        die()
                    return real_publish(self, *a, **k)

                PendingSpace.publish = publish
            with Store.open(path) as store:
                mount(store, ckpt, "m@q", quant=codec())
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


@pytest.mark.parametrize("when", ["mid_write", "before_publish", "after_trunk"])
def test_a_killed_mount_leaves_no_version(ckpt, tmp_path, when):
    path = tmp_path / "s"
    status = _killed_child(path, ckpt, when)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with Store.open(path) as store:
        assert store.tags() == {}  # no version is visible
        for sel in store.spaces():  # at most the untagged trunk, complete
            assert when == "after_trunk" and store.manifest(sel)["kind"] == "czyx.trunk"
            snapshot(store, [sel])
        assert any(p.suffix == ".part" for p in (path / "blocks").iterdir())
        collect_garbage(store, grace_s=0)
        assert block_names(store) == published_names(store)
        res = mount(store, ckpt, "m@q", quant=codec())
        assert res.created
        snapshot(store, [res.selector, res.trunk_selector])
        assert block_names(store) == published_names(store)


def test_remount_repairs_a_damaged_extent(ckpt, tmp_path):
    with Store.open(tmp_path / "s") as store:
        res = mount(store, ckpt, "m@q", quant=codec())
        want = snapshot(store, [res.selector])
        _, rec = next(iter(store.scan(res.selector)))
        blk = store.path / "blocks" / store.block_identity(res.selector).name
        with open(blk, "r+b") as fh:  # flip one byte inside an expert extent
            fh.seek(rec["off"] + 7)
            b = fh.read(1)
            fh.seek(rec["off"] + 7)
            fh.write(bytes([b[0] ^ 0xFF]))
        again = mount(store, ckpt, "m@q", quant=codec())
        assert not again.created and again.repaired == 1
        assert snapshot(store, [res.selector]) == want
        assert block_names(store) == published_names(store)


def test_pending_space_writes_any_extent_and_publishes(tmp_path, monkeypatch):
    """Aligned padded buffers, odd sizes and appends; O_DIRECT or not, the same bytes."""
    from czyx.key import Key
    from czyx.space import Selector
    from czyx.store.core import writer

    rng = np.random.default_rng(3)
    sizes = [1, 4095, 4096, 4097, 3 * 4096 + 17, 12345, (8 << 20) + 5]
    blobs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    results = []
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(p, flags, *a)

    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(writer.os, "open", no_direct)
        with Store.open(tmp_path / f"s{direct}") as store:
            ps = PendingSpace(store)
            assert ps.direct == direct
            at = ps.data_start + 5 * ps.alignment  # a hole before the first extent
            padded = aligned_empty(2 * ps.alignment, ps.alignment)
            padded[:] = 0
            padded[:5000] = blobs[-2][:5000]
            exts = [ps.write_at(at, padded[:5000], padded)]
            exts += [ps.append(b) for b in blobs]
            sel = Selector.from_name(f"pending-{direct}")
            with ps.publish(sel, {"kind": "test"}) as w:
                for i, ext in enumerate(exts):
                    w.put(Key(i).pack(), ext.record())
            assert not ps.path.exists()
            got = snapshot(store, [sel])[sel]
            assert got[2] == {
                Key(i).pack(): bytes(b) for i, b in enumerate([padded[:5000], *blobs])
            }
            results.append(got[1:])
            ps2 = PendingSpace(store)
            ps2.append(b"x")
            ps2.abort()
            assert not ps2.path.exists()
            assert block_names(store) == published_names(store)
    assert results[0] == results[1]


def test_pending_space_falls_back_when_direct_writes_are_refused(tmp_path, monkeypatch):
    """A file system that opens O_DIRECT but refuses the writes (EINVAL): buffered, same bytes."""
    from czyx.key import Key
    from czyx.space import Selector
    from czyx.store.core import writer

    real_pwrite = os.pwrite
    direct_fds = set()
    real_open = os.open

    def track_open(p, flags, *a):
        fd = real_open(p, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refuse(fd, data, offset):
        if fd in direct_fds:
            raise OSError(22, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(writer.os, "open", track_open)
    monkeypatch.setattr(writer.os, "pwrite", refuse)
    blob = np.random.default_rng(5).integers(0, 256, 10000, dtype=np.uint8)
    with Store.open(tmp_path / "s") as store:
        ps = PendingSpace(store)
        assert not ps.direct  # the header's write already fell back
        ext = ps.append(blob)
        sel = Selector.from_name("refused")
        with ps.publish(sel, {"kind": "test"}) as w:
            w.put(Key(0).pack(), ext.record())
        assert snapshot(store, [sel])[sel][2] == {Key(0).pack(): blob.tobytes()}
