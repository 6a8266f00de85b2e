"""Fixtures the inference tests share: the C kernels' SIMD paths and thread splits, the
bundled model mounted in a store, and an engine whose rope depends on the length reached."""

from __future__ import annotations

import pytest

from czyx.inference.kernels import fused


@pytest.fixture(params=fused.LEVELS)
def level(request):
    """The kernels capped at each SIMD path the machine has (the others are skipped)."""
    if not fused.have_czk():
        pytest.skip("the C kernels are not built")
    if fused.LEVELS.index(request.param) > fused._lib.czk_level():
        pytest.skip(f"no {request.param} on this machine")
    fused.set_level_cap(request.param)
    yield request.param
    fused.set_level_cap("avx512vnni")


@pytest.fixture
def split_loops():
    """Every pool loop of more than one task splits over the pool's threads."""
    fused.set_min_work(1)
    yield
    fused.set_min_work(1 << 16)


@pytest.fixture
def longrope_engine():
    """An engine (one thread) on a tiny Mixtral with LongRoPE, whose tables switch from
    the short to the long factors past 10 positions: a rope that depends on the length
    reached."""
    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    rope = {
        "rope_theta": 1e4,
        "rope_type": "longrope",
        "long_factor": [1.0 + 0.5 * i for i in range(8)],
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "original_max_position_embeddings": 10,
    }
    tm = tiny_model("mixtral", seed=4, head_dim=16, max_position_embeddings=12,
                    rope_parameters=rope)  # fmt: skip
    eng = Engine(StateDictConsumer(tm), threads=1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def bundled_consumer(tmp_path_factory):
    """A consumer of the bundled model, mounted as ``stdlib@1`` in a store of the test
    module's own (closed, with the store, after the module)."""
    from czyx.inference.assets import bundled_model_dir
    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.store.models.mount import mount

    store = Store.open(tmp_path_factory.mktemp("bundled") / "store")
    mount(store, bundled_model_dir(), "stdlib@1")
    consumer = open_consumer(store, None, "stdlib@1")
    yield consumer
    consumer.close()
    store.close()
