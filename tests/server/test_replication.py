"""Replication between two stores over loopback HTTP (``czyx pull`` against the
replication endpoints): full copy, subset, resume after SIGKILL, corruption in
transit, portals without ``read``, and versions sharing experts."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from czyx.cli.commands.pull import PullError, pull  # noqa: E402
from czyx.portals import open_consumer  # noqa: E402
from czyx.portals.model import grant_model  # noqa: E402
from czyx.server.replication import create_replication_app  # noqa: E402
from czyx.store import Store, TagConflictError  # noqa: E402
from czyx.store.models.mount import mount  # noqa: E402
from czyx.store.models.mount_errors import ModelSpaceError  # noqa: E402
from czyx.testing.loopback import serve_in_thread  # noqa: E402

ASSET = Path(__file__).resolve().parents[2] / "inference" / "assets" / "czyx-moe-stdlib"
EXPERT = "model.layers.{l}.block_sparse_moe.experts.{e}.{p}.weight"


class Tap:
    """ASGI wrapper over the block endpoint: counts bytes served, delays, corrupts."""

    def __init__(self, app, delay: float = 0.0, corrupt: int = 0) -> None:
        self.app, self.delay, self.corrupt, self.served = app, delay, corrupt, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "/block/" not in scope["path"]:
            return await self.app(scope, receive, send)
        if self.delay:
            await asyncio.sleep(self.delay)
        status = {}

        async def tapped(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            elif msg["type"] == "http.response.body" and msg.get("body"):
                body = msg["body"]
                if status.get("code") == 206 and self.corrupt > 0:
                    self.corrupt -= 1
                    b = bytearray(body)
                    b[len(b) // 2] ^= 0x40
                    msg = {**msg, "body": bytes(b)}
                if status.get("code") == 206:
                    self.served += len(body)
            await send(msg)

        await self.app(scope, receive, tapped)


def _second_version(dst: Path, changed=((1, 3), (2, 9))) -> Path:
    """The bundled model with two experts changed (a new version sharing the rest)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(ASSET, dst)
    st = load_file(str(ASSET / "model.safetensors"))
    for l, e in changed:
        for p in ("w1", "w2", "w3"):
            name = EXPERT.format(l=l, e=e, p=p)
            st[name] = (st[name] * 2).astype(st[name].dtype)
    save_file(st, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    with Store.open(root / "store") as s:
        mount(s, ASSET, "m@1")
        mount(s, _second_version(root / "v2"), "m@2")
        read = grant_model(s, "m@2", tenant="puller", rights="read").token
        grant_model(s, "m@1", tenant="puller", rights="read", parent=None)
        read1 = grant_model(s, "m@1", tenant="puller", rights="read").token
        infer = grant_model(s, "m@1", tenant="user", rights="infer").token
        scoped = grant_model(s, "m@1", tenant="p2", rights="read", classes="0-7").token
        sel1, sel2 = s.resolve_tag("m@1"), s.resolve_tag("m@2")
        facts = {
            "sel1": sel1,
            "trunk": s.manifest(sel1)["trunk"],
            "nbytes": s.manifest(sel2)["expert"]["nbytes"],
        }
    # Read before the server opens the store (LMDB: one environment per process).
    facts["logits1"] = _logits(str(root / "store"), "m@1")
    facts["logits2"] = _logits(str(root / "store"), "m@2")
    return {
        "dir": str(root / "store"),
        "read1": read1,
        "read2": read,
        "infer": infer,
        "scoped": scoped,
        **facts,
    }


@pytest.fixture(scope="module")
def server(source):
    tap = Tap(create_replication_app(source["dir"]))
    with serve_in_thread(tap) as url:
        yield url, tap


def _logits(store_dir: str, ref: str) -> np.ndarray:
    from czyx.inference.engine import Engine
    from czyx.inference.options import EngineOptions

    with Store.open(store_dir, create=False) as s:
        c = open_consumer(s, None, ref)
        try:
            e = Engine(c, options=EngineOptions(stream=False))
            try:
                return e.prefill([3, 1, 4, 1, 5, 9, 2, 6])
            finally:
                e.close()
        finally:
            c.close()


def test_full_copy_then_nothing_moves(source, server, tmp_path):
    url, _ = server
    dest = str(tmp_path / "dest")
    res = pull(url, "m@1", source["read1"], dest)
    assert res.spaces_published == 2 and res.bytes_fetched == res.bytes_total > 0
    with Store.open(dest, create=False) as b:
        assert b.resolve_tag("m@1") == source["sel1"]  # same content, same selector
        for s in b.spaces():
            b.verify_space(s)
    np.testing.assert_array_equal(_logits(dest, "m@1"), source["logits1"])
    again = pull(url, "m@1", source["read1"], dest)
    assert again.bytes_fetched == 0 and again.spaces_present == 2


def test_second_version_moves_only_missing_experts(source, server, tmp_path):
    url, _ = server
    dest = str(tmp_path / "dest")
    pull(url, "m@1", source["read1"], dest)
    res = pull(url, "m@2", source["read2"], dest)
    # the two changed experts; the trunk and the other experts are reused
    assert res.bytes_fetched == 2 * source["nbytes"]
    assert res.spaces_present == 1  # the shared trunk space
    np.testing.assert_array_equal(_logits(dest, "m@2"), source["logits2"])


def test_shared_extents_come_from_the_earlier_versions_block(source, server, tmp_path):
    url, _ = server
    dest = str(tmp_path / "dest")
    res = pull(url, "m@2", source["read2"], dest)  # m@2 shares most experts with m@1
    assert res.bytes_fetched == res.bytes_total and res.spaces_published == 2
    np.testing.assert_array_equal(_logits(dest, "m@2"), source["logits2"])


def test_taken_tag_is_refused_before_moving_bytes(source, server, tmp_path):
    url, tap = server
    dest = str(tmp_path / "dest")
    pull(url, "m@1", source["read1"], dest, tag="x@1")
    before = tap.served
    with pytest.raises(TagConflictError):
        pull(url, "m@2", source["read2"], dest, tag="x@1")
    assert tap.served == before


def test_subset_holds_only_its_experts(source, server, tmp_path):
    url, _ = server
    dest = str(tmp_path / "dest")
    res = pull(url, "m@1", source["read1"], dest, classes="0-7", layers="1-2")
    with Store.open(dest, create=False) as s:
        sel = s.resolve_tag("m@1")
        m = s.manifest(sel)
        assert m["subset"]["classes"] == [0, 7] and m["subset"]["layers"] == [1, 2]
        keys = [(k[0], rec["layer"]) for k, rec in s.scan(sel)]
        assert len(keys) == 8 * 2 and all(c <= 7 and 1 <= z <= 2 for c, z in keys)
        c = open_consumer(s, None, "m@1")
        try:
            slot = np.empty(c.info.expert_slot_nbytes, np.uint8)
            c.read_expert(1, 3, slot)  # inside: reads and verifies
            with pytest.raises(ModelSpaceError):
                c.read_expert(1, 12, slot)  # outside the subset: refused
            with pytest.raises(ModelSpaceError):
                c.read_expert(0, 3, slot)
        finally:
            c.close()
    assert res.bytes_fetched == res.bytes_total  # only the subset's extents (and trunk)


def test_corrupted_byte_in_transit_is_refused_and_refetched(source, server, tmp_path):
    url, tap = server
    tap.corrupt = 1
    try:
        res = pull(url, "m@1", source["read1"], str(tmp_path / "dest"))
    finally:
        tap.corrupt = 0
    assert res.refetched == 1
    np.testing.assert_array_equal(_logits(str(tmp_path / "dest"), "m@1"), source["logits1"])


def test_portal_without_read_is_403_and_no_token_401(source, server, tmp_path):
    url, _ = server
    with pytest.raises(PullError, match="HTTP 403"):
        pull(url, "m@1", source["infer"], str(tmp_path / "d1"))
    with pytest.raises(PullError, match="HTTP 403"):  # class-scoped portal, full pull
        pull(url, "m@1", source["scoped"], str(tmp_path / "d2"))
    r = httpx.get(f"{url}/v1/replicate/offer", params={"ref": "m@1"}, timeout=10)
    assert r.status_code == 401
    r = httpx.get(
        f"{url}/v1/replicate/block/{source['trunk']}",
        params={"ref": "m@1"},
        headers={"Authorization": f"Bearer {source['infer']}", "Range": "bytes=0-99"},
        timeout=10,
    )
    assert r.status_code == 403
    r = httpx.get(
        f"{url}/v1/replicate/offer",
        params={"ref": "nope@1"},
        headers={"Authorization": f"Bearer {source['read1']}"},
        timeout=10,
    )
    assert r.status_code in (403, 404)  # an unknown tag is never served
    r = httpx.get(
        f"{url}/v1/replicate/block/{source['trunk']}",
        params={"ref": "m@1"},
        headers={"Authorization": f"Bearer {source['read1']}", "Range": "bytes=0-99"},
        timeout=10,
    )
    assert r.status_code == 403  # the header is no extent of the offer
    from czyx.cli import main

    assert (
        main(
            [
                "pull",
                url,
                "m@1",
                "--portal",
                "t",
                "--store",
                str(tmp_path / "d4"),
                "--classes",
                "9-3",
            ]
        )
        == 1
    )  # malformed range: one-line error, no request
    # the scoped portal may pull what it covers
    res = pull(url, "m@1", source["scoped"], str(tmp_path / "d3"), classes="0-7")
    assert res.spaces_published == 2


def test_resume_after_sigkill_does_not_resend(source, server, tmp_path):
    url, tap = server
    dest = tmp_path / "dest"
    cmd = [
        sys.executable,
        "-m",
        "czyx",
        "pull",
        url,
        "m@1",
        "--portal",
        source["read1"],
        "--store",
        str(dest),
        "--workers",
        "1",
        "--max-range",
        "200000",
    ]
    tap.delay = 0.15
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        journals: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None:
            # the version's own staging (the trunk space is staged and published first)
            journal = dest / "staging" / source["sel1"].hex() / "arrived"
            journals = [journal] if journal.exists() and journal.stat().st_size >= 32 else []
            if journals:
                break
            time.sleep(0.02)
        assert journals and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
        tap.delay = 0.0
    with Store.open(dest, create=False) as d:
        assert not d.has_space(source["sel1"])  # killed before the version was published
    before = tap.served
    res = pull(url, "m@1", source["read1"], str(dest), max_range=200000)
    assert res.bytes_resumed > 0
    # nothing sent twice: what the killed pull staged (or already published, e.g. the
    # trunk space) is resumed or reused, the rest fetched
    assert res.bytes_fetched + res.bytes_resumed + res.bytes_reused == res.bytes_total
    # what the server sent on resume is what the client fetched: no journaled extent twice
    # (a coalesced range carries the padding between its extents, hence >=)
    assert tap.served - before >= res.bytes_fetched
    np.testing.assert_array_equal(_logits(str(dest), "m@1"), source["logits1"])


def test_sync_from_url_and_from_directory_share_the_pull(source, server, tmp_path, capsys):
    """``czyx sync``: from the server (a pull) and from a store directory (the same
    ReplicationSource without HTTP) give the same verified version; the second
    version moves only its missing experts; a re-sync moves nothing."""
    from czyx.cli import main
    from czyx.cli.commands.pull import sync

    url, tap = server
    over_http = str(tmp_path / "a")
    before = tap.served
    assert main(["sync", url, over_http, "m@1", "--portal", source["read1"]]) == 0
    assert "pulled m@1" in capsys.readouterr().out and tap.served > before
    local = str(tmp_path / "b")
    before = tap.served
    res = sync(source["dir"], local, "m@1", source["read1"])
    assert tap.served == before  # no HTTP: read from the directory
    assert res.spaces_published == 2 and res.bytes_fetched == res.bytes_total > 0
    res2 = sync(source["dir"], local, "m@2", source["read2"])
    assert res2.bytes_fetched == 2 * source["nbytes"] and res2.spaces_present == 1
    # the copy is itself a source: directory to directory again
    third = str(tmp_path / "c")
    with Store.open(local, create=False) as s:
        tok = grant_model(s, "m@2", tenant="t", rights="read").token
    assert sync(local, third, "m@2", tok).bytes_fetched > 0
    assert sync(local, third, "m@2", tok).bytes_fetched == 0
    for d, ref, key in ((over_http, "m@1", "logits1"), (local, "m@1", "logits1"),
                        (local, "m@2", "logits2"), (third, "m@2", "logits2")):  # fmt: skip
        with Store.open(d, create=False) as b:
            for sp in b.spaces():
                b.verify_space(sp)
        np.testing.assert_array_equal(_logits(d, ref), source[key])


def test_sync_fails_closed(source, server, tmp_path):
    from czyx.cli import main
    from czyx.cli.commands.pull import sync
    from czyx.portals.errors import PortalDenied

    url, _ = server
    dest = str(tmp_path / "d")
    with pytest.raises(PortalDenied):  # an infer portal cannot copy weights out
        sync(source["dir"], dest, "m@1", source["infer"])
    with pytest.raises(PullError, match="cannot receive a push"):
        sync(source["dir"], url, "m@1", source["read1"])
    with pytest.raises(PullError, match="same store"):
        sync(source["dir"], source["dir"], "m@1", source["read1"])
    with pytest.raises(PullError, match="HTTP 403"):
        sync(url, dest, "m@1", source["infer"])
    assert main(["sync", source["dir"], dest, "m@1", "--portal", "t", "--classes", "9-3"]) == 1
    assert not os.path.exists(dest)  # nothing created by a refused copy
