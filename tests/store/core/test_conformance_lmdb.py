"""Runs the store conformance suite against the LMDB backend."""

from __future__ import annotations

import pathlib

from czyx.store import Store
from czyx.testing.store_conformance import StoreConformance


class TestLMDBStore(StoreConformance):
    def open_store(self, path: pathlib.Path) -> Store:
        return Store.open(path)
