"""Torch on one thread for the architecture parity tests.

The references are tiny transformers models run token by token: on a shared
2-core machine torch's default thread pool spends far more time synchronising
than computing on them, and one thread gives the same numbers.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
