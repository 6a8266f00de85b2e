"""remove_version: a version's spaces go unless another tag or space still reaches them."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.key import Key
from czyx.portals.model import remove_version
from czyx.space import Selector
from czyx.store import SpaceInUseError, Store, TagNotFoundError


def _space(st: Store, name: str, manifest: dict) -> Selector:
    sel = Selector.from_name(name)
    with st.begin_space(sel, {"kind": "model", **manifest}) as w:
        ext = w.write_extent(np.full(100, len(name), dtype=np.uint8))
        w.put(Key(1, 0).pack(), ext.record())
    return sel


@pytest.fixture
def st(tmp_path):
    with Store.open(tmp_path / "store") as s:
        yield s


def test_shared_trunk_and_base_stay(st) -> None:
    trunk = _space(st, "trunk", {})
    a = _space(st, "a", {"trunk": trunk.hex()})
    b = _space(st, "b", {"trunk": trunk.hex()})
    adapter = _space(st, "adapter", {"base": a.hex()})
    for tag, sel in (("a@1", a), ("b@1", b), ("ad@1", adapter)):
        st.set_tag(tag, sel)
    a_block = st.block_path(a)

    r = remove_version(st, "a@1")  # the adapter still builds on a, b on the trunk
    assert r.deleted == () and set(r.kept) == {a, trunk}
    assert st.has_space(a) and a_block.exists()

    r = remove_version(st, "ad@1")  # now a is unused; the trunk is still b's
    assert set(r.deleted) == {adapter, a} and r.kept == (trunk,)
    assert not st.has_space(a) and not a_block.exists()
    assert st.has_space(trunk) and st.has_space(b)

    r = remove_version(st, "b@1")
    assert set(r.deleted) == {b, trunk} and len(r.freed) == 2
    assert st.spaces() == [] and st.tags() == {}
    assert not any((st.path / "blocks").glob("*.blk"))


def test_other_tag_and_keep_spaces(st) -> None:
    a = _space(st, "a", {})
    st.set_tag("a@1", a)
    st.set_tag("alias@1", a)
    r = remove_version(st, "a@1")
    assert r.still_tagged == ("alias@1",) and r.deleted == () and st.has_space(a)
    r = remove_version(st, "alias@1", keep_spaces=True)
    assert r.deleted == () and st.has_space(a) and st.tags() == {}
    with pytest.raises(TagNotFoundError):
        remove_version(st, "alias@1")


def test_damaged_version_can_be_removed(st) -> None:
    a = _space(st, "a", {"trunk": Selector.from_name("gone").hex(), "base": "ff" * 32})
    st.set_tag("a@1", a)
    r = remove_version(st, "a@1")
    assert r.deleted == (a,) and not st.has_space(a)


def test_store_refuses_removing_a_tagged_space(st) -> None:
    a = _space(st, "a", {})
    st.set_tag("a@1", a)
    with pytest.raises(SpaceInUseError, match="a@1"):
        st.remove_space(a)
    assert st.has_space(a) and st.get(a, Key(1, 0).pack()) is not None
