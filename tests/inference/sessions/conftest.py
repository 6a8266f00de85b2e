"""Fixtures the session tests share."""

from __future__ import annotations

import pytest

from czyx.store import Store
from tests.inference.sessions.helpers import sessions_for


@pytest.fixture
def sessions(tmp_path):
    """Alice's :class:`SessionStore` on a fresh store (closed after the test)."""
    st = Store.open(tmp_path / "st")
    yield sessions_for(st, "alice")
    st.close()
