"""``czyx mount ORG/NAME``: a repository in the local Hugging Face cache, laid out as the hub
library lays it out (blobs, symlinked snapshots, refs), mounted without any download."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from czyx.cli import main
from czyx.inference.assets import bundled_model_dir
from czyx.store import Store
from czyx.store.models.hf_cache import hub_cache_dir, looks_like_repo_id, snapshot_dir
from czyx.store.models.mount import mount, resolve
from czyx.store.models.mount_errors import CheckpointError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _cache_repo(cache: Path, repo_id: str, src: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """``src``'s files as the hub cache holds a snapshot: content-named blobs, the
    snapshot's files symlinks to them (relative), ``refs/REF`` holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


def test_the_cache_root_follows_the_hub_environment(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "old"))
    assert hub_cache_dir() == tmp_path / "old"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hub_cache_dir() == tmp_path / "new"


def test_repo_ids_and_paths_are_told_apart():
    for text in ("Qwen/Qwen3-30B-A3B", "allenai/OLMoE-1B-7B-0924", "a/b.c_d"):
        assert looks_like_repo_id(text)
    for text in ("model", "./x/y", "/abs/x", "a/b/c", "../a/b", "a/..", "a b/c", "a/"):
        assert not looks_like_repo_id(text)


def test_snapshot_of_a_ref_or_a_commit(tmp_path):
    snap = _cache_repo(tmp_path, "org/m", bundled_model_dir(), COMMIT, ("main", "v1"))
    assert snapshot_dir("org/m", cache=tmp_path) == snap
    assert snapshot_dir("org/m", "v1", cache=tmp_path) == snap
    assert snapshot_dir("org/m", COMMIT, cache=tmp_path) == snap
    with pytest.raises(CheckpointError, match="huggingface-cli download org/m --revision v2"):
        snapshot_dir("org/m", "v2", cache=tmp_path)
    with pytest.raises(CheckpointError, match=f"no snapshot {OTHER}"):
        snapshot_dir("org/m", OTHER, cache=tmp_path)
    with pytest.raises(CheckpointError, match=r"huggingface-cli download org/other$"):
        snapshot_dir("org/other", cache=tmp_path)
    (tmp_path / "models--org--m" / "refs" / "main").write_text("not a commit\n")
    with pytest.raises(CheckpointError, match="not a commit hash"):
        snapshot_dir("org/m", cache=tmp_path)
    with pytest.raises(CheckpointError, match="not a Hugging Face repository id"):
        snapshot_dir("../etc", cache=tmp_path)
    for bad in ("../../../etc/hostname", "/etc/hostname", ""):
        with pytest.raises(CheckpointError, match="not a branch, tag or commit"):
            snapshot_dir("org/m", bad, cache=tmp_path)


def test_czyx_mount_org_name_mounts_the_cached_snapshot(monkeypatch, tmp_path, capsys):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    _cache_repo(cache, "czyx/stdlib", bundled_model_dir(), COMMIT, ("main",))
    sd = str(tmp_path / "s")
    assert main(["mount", "czyx/stdlib", "--as", "hub@1", "--store", sd]) == 0
    assert f"from the Hugging Face cache: {cache}" in capsys.readouterr().err
    assert main(["mount", "czyx/stdlib", "--revision", COMMIT, "--as", "hub@2", "--store", sd]) == 0
    with Store.open(sd) as st:
        direct = mount(st, bundled_model_dir(), "direct@1").selector
        assert resolve(st, "hub@1") == direct == resolve(st, "hub@2")  # the same content
    assert main(["mount", "czyx/missing", "--as", "x@1", "--store", sd]) == 1
    err = capsys.readouterr().err
    assert "no file or directory 'czyx/missing'" in err and "huggingface-cli download" in err
