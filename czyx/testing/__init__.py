"""Shared test support: tiny reference models, fake consumers and the store conformance suite.

Imported by the tests and the benchmarks alike; the reference models need the ``test``
extra (torch, transformers).
"""
