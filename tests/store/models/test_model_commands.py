"""The model CLI: ``czyx mount``, ``ls``, ``show``, ``export`` end to end, errors as one line."""

from __future__ import annotations

import hashlib

import pytest

from czyx.cli import main
from czyx.testing.tiny_models import make_tiny_checkpoint


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


def test_mount_class_order_from_saved_order(tmp_path):
    """``--class-order`` applies a saved [L, E] permutation; the model reads identically."""
    import numpy as np

    from czyx.cli import main
    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.testing.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    store_dir = tmp_path / "store"
    assert main(["mount", str(ckpt), "--as", "plain@v1", "--store", str(store_dir)]) == 0
    with Store.open(store_dir) as st, open_consumer(st, None, "plain@v1") as m:
        n_layers, n_exp = m.info.n_layers, m.info.n_experts
    rng = np.random.default_rng(0)
    order = np.stack([rng.permutation(n_exp) for _ in range(n_layers)])
    np.save(tmp_path / "order.npy", order)
    argv = ["mount", str(ckpt), "--as", "perm@v1", "--store", str(store_dir)]
    assert main([*argv, "--class-order", str(tmp_path / "order.npy")]) == 0
    with Store.open(store_dir) as st:
        assert st.resolve_tag("perm@v1") != st.resolve_tag("plain@v1")
        with open_consumer(st, None, "plain@v1") as a, open_consumer(st, None, "perm@v1") as b:
            sa = np.empty(a.info.expert_slot_nbytes, np.uint8)
            sb = np.empty(b.info.expert_slot_nbytes, np.uint8)
            for layer in range(n_layers):
                for byte in range(n_exp):
                    a.read_expert(layer, byte, sa)
                    b.read_expert(layer, byte, sb)
                    n = a.info.expert_nbytes
                    assert np.array_equal(sa[:n], sb[:n])
