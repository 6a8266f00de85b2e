"""llama-cpp-python as the benches load it (bench-only; never imported by czyx).

llama.cpp's AMX repacked weight buffers ("extra buffer types") crash on q8_0 and
q4_0 on these machines, so every bench loads models without them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def without_extra_bufts() -> Iterator[None]:
    """Models loaded inside load with ``use_extra_bufts=False``; the default is restored after."""
    import llama_cpp.llama_cpp as ll

    orig = ll.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p

    ll.llama_model_default_params = params
    try:
        yield
    finally:
        ll.llama_model_default_params = orig
