from __future__ import annotations

import pytest

import portals
from czyx.key import Key
from czyx.space import Selector
from store import Store


def test_store_open_space_delegates_to_portals(tmp_path):
    store = Store.open(tmp_path / "s")
    sel = Selector.from_name("open-space-test")
    key = Key(3, 1)
    with store.begin_space(sel, {"kind": "test"}) as w:
        w.put(key.pack(), {"v": 1})
    root = portals.root_token(store)
    view = store.open_space(root, sel)
    assert view.get(key) == {"v": 1}
    with pytest.raises(portals.PortalDenied):
        store.open_space(root[:-4] + "AAAA", sel)
    store.close()
