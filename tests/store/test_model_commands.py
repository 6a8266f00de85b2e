"""The model CLI: ``czyx mount``, ``ls``, ``show``, ``export`` end to end, errors as one line."""

from __future__ import annotations

import hashlib

import pytest

from czyx.cli import main
from tests.store.tiny_models import make_tiny_checkpoint


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("CZYX_STORE", str(tmp_path / "store"))
    return tmp_path, make_tiny_checkpoint("olmoe", tmp_path / "ck")


def test_mount_ls_show_export(env, capsys):
    tmp, ck = env
    assert main(["mount", str(ck), "--as", "o@1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mounted: o@1") and out.count("\n") == 1 and "GB/s" in out
    assert main(["mount", str(ck), "--as", "o@1"]) == 0
    assert capsys.readouterr().out.startswith("already present: o@1")
    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "TAG" and lines[1].split()[:4][::2] == ["o@1", "model"]
    assert main(["show", "o@1"]) == 0
    shown = capsys.readouterr().out
    assert "arch olmoe" in shown and "16 expert extents" in shown and "0 shared" in shown
    assert main(["export", "o@1", str(tmp / "out")]) == 0
    capsys.readouterr()
    src, out_file = ck / "model.safetensors", tmp / "out" / "model.safetensors"
    assert (
        hashlib.sha256(src.read_bytes()).digest() == hashlib.sha256(out_file.read_bytes()).digest()
    )


def test_explicit_store_flag_and_layout(env, capsys):
    tmp, ck = env
    assert (
        main(
            ["mount", str(ck), "--as", "o@1", "--store", str(tmp / "other"), "--layout", "rowmajor"]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["show", "o@1", "--store", str(tmp / "other"), "--json"]) == 0
    assert '"layout": "rowmajor"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["mount", "{ck}", "--as", "nameonly"], "NAME@VERSION"),
        (["mount", "{tmp}/missing", "--as", "o@1"], "not a checkpoint directory"),
        (["show", "o@9"], "o@9"),
        (["export", "o@9", "{tmp}/x"], "o@9"),
    ],
)
def test_errors_are_one_line(env, capsys, argv, needle):
    tmp, ck = env
    main(["mount", str(ck), "--as", "o@1"])
    capsys.readouterr()
    argv = [a.format(ck=ck, tmp=tmp) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("czyx: error:") and needle in err and err.count("\n") == 1
