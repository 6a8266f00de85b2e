"""Re-mounting a damaged version repairs it from the source (store.models.repair)."""

from __future__ import annotations

import pytest

from czyx.store import Store
from czyx.store.core.fsck import fsck
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import MountError
from czyx.testing.tiny_models import make_tiny_checkpoint


@pytest.fixture
def mounted(tmp_path):
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "c", num_hidden_layers=2)
    with Store.open(tmp_path / "s") as st:
        res = mount(st, ckpt, "m@1")
    return ckpt, tmp_path / "s", res


def _flip(path, off) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flip-expert", "flip-trunk", "truncate", "delete"])
def test_remount_repairs_a_damaged_version(mounted, damage) -> None:
    ckpt, path, res = mounted
    with Store.open(path) as st:
        sp = res.selector if damage != "flip-trunk" else res.trunk_selector
        blk = st.block_path(sp)
        rec = next(r for _, r in st.scan(sp) if "off" in r)
        if damage.startswith("flip"):
            _flip(blk, rec["off"] + 3)
        elif damage == "truncate":
            with open(blk, "r+b") as f:
                f.truncate(rec["off"] + 10)
        else:
            blk.unlink()
        assert not fsck(st).ok
        again = mount(st, ckpt, "m@1")
        assert again.repaired >= 1 and "repaired" in again.summary()
        assert fsck(st).ok
        assert mount(st, ckpt, "m@1").repaired == 0  # whole again: nothing to do
        assert any(e["event"] == "model.repair" for e in st.audit_log())


def test_repair_refuses_a_different_source(mounted, tmp_path) -> None:
    _ckpt, path, res = mounted
    with Store.open(path) as st:
        _flip(st.block_path(res.selector), next(r for _, r in st.scan(res.selector))["off"])
        # the same tensors but other weights cannot restore the published bytes; and a
        # different checkpoint is a different content, so a different selector anyway
        other = make_tiny_checkpoint("mixtral", tmp_path / "o", seed=1, num_hidden_layers=2)
        assert mount(st, other, "m@2").selector != res.selector
        from czyx.store.models.checkpoint import Checkpoint
        from czyx.store.models.mount_plan import plan_checkpoint
        from czyx.store.models.mount_source import MountSource
        from czyx.store.models.repair import repair_version

        with Checkpoint(other) as c:
            src = MountSource(c, plan_checkpoint(c))
            with pytest.raises(MountError, match="differ from the published"):
                repair_version(st, src, [res.selector])
        assert not fsck(st).ok  # nothing was replaced
