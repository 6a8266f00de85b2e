from __future__ import annotations

import pytest

from czyx import portals
from czyx.key import Key
from czyx.space import Selector
from czyx.store import Store


def test_open_space_checks_the_portal(tmp_path):
    store = Store.open(tmp_path / "s")
    sel = Selector.from_name("open-space-test")
    key = Key(3, 1)
    with store.begin_space(sel, {"kind": "test"}) as w:
        w.put(key.pack(), {"v": 1})
    root = portals.root_token(store)
    view = portals.open_space(store, root, sel)
    assert view.get(key) == {"v": 1}
    with pytest.raises(portals.PortalDenied):
        portals.open_space(store, root[:-4] + "AAAA", sel)
    store.close()


def test_sessions_open_after_portals_authority_module_is_imported(tmp_path):
    """Regression: ``from portals import authority`` once returned the submodule
    (same name as the function) when ``portals.authority`` was imported first."""
    import importlib

    import czyx.portals.authority as mod
    from czyx.inference.sessions.store import SessionStore

    importlib.reload(mod)
    store = Store.open(tmp_path / "s")
    SessionStore.open(store)  # must not raise TypeError: 'module' object is not callable
    store.close()
