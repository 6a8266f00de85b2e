"""Fixtures: a real store with two small published spaces, and a settable clock."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.key import Key
from czyx.space import Selector
from czyx.store import Store

N_CLASSES_A = 8
N_LAYERS_A = 4
EXTENT = 256


def payload(cls: int, layer: int) -> bytes:
    """The distinct bytes stored at (cls, layer) of space A."""
    return bytes([cls, layer, 0xA5]) * (EXTENT // 3) + b"\x00" * (EXTENT % 3)


class Clock:
    """A settable clock for expiry tests."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _publish(store, sel: Selector, cells: list[tuple[int, int]]) -> None:
    with store.begin_space(sel, {"kind": "test", "key_curve": "morton"}) as w:
        for cls, layer in cells:
            ext = w.write_extent(np.frombuffer(payload(cls, layer), dtype=np.uint8))
            w.put(Key(cls, layer).pack(), {**ext.record(), "cls": cls, "layer": layer})


@pytest.fixture
def world(tmp_path):
    """An open store with spaces A (8 classes x 4 layers, tag a@1) and B (tag b@1)."""
    from czyx.portals.authority import PortalAuthority

    st = Store.open(tmp_path / "store")
    a = Selector.from_name("space-a")
    b = Selector.from_name("space-b")
    _publish(st, a, [(c, z) for c in range(N_CLASSES_A) for z in range(N_LAYERS_A)])
    _publish(st, b, [(0, 0)])
    st.set_tag("a@1", a)
    st.set_tag("b@1", b)
    clock = Clock()
    auth = PortalAuthority(st, clock=clock)
    yield auth, a, b, clock
    st.close()


def audit_events(auth, event: str | None = None) -> list[dict]:
    return [e for e in auth.store.audit_log() if event is None or e["event"] == event]
