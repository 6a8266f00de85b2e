"""One options value: the same defaults from the engine, ``czyx run`` and the demo; old
spellings still work, with a DeprecationWarning."""

from __future__ import annotations

import pytest

from czyx.cli import build_parser
from czyx.cli.commands.run import engine_options
from czyx.inference.engine import Engine
from czyx.inference.options import DEFAULT_OPTIONS, EngineOptions
from czyx.inference.streaming import StreamingExpertCache, StreamOptions
from czyx.inference.xray import XRay
from czyx.testing.filemodel import FileConsumer, SyntheticExperts
from czyx.testing.refmodels import StateDictConsumer, tiny_model


def test_the_cli_flags_default_to_the_engine_options():
    args = build_parser().parse_args(["run", "m@1", "--prompt", "x"])
    # (--io auto is the field's None: the engine's cache picks the path for its budget)
    assert engine_options(args) == DEFAULT_OPTIONS
    assert EngineOptions() == DEFAULT_OPTIONS


def test_the_engine_takes_the_options_unchanged():
    eng = Engine(StateDictConsumer(tiny_model("mixtral", seed=0)), cache_fraction=0.5)
    try:
        assert eng.options == DEFAULT_OPTIONS
        assert isinstance(eng.cache, StreamingExpertCache)
        assert eng.cache.policy.name == DEFAULT_OPTIONS.policy
        assert eng.cache.prefetch_enabled == DEFAULT_OPTIONS.prefetch
        assert eng.cache.depth == DEFAULT_OPTIONS.lookahead
    finally:
        eng.close()
    sync = Engine(
        StateDictConsumer(tiny_model("mixtral", seed=0)),
        options=EngineOptions(policy="lru", stream=False),
    )
    try:
        assert not isinstance(sync.cache, StreamingExpertCache)
        assert sync.cache.policy.name == "lru"
    finally:
        sync.close()


def test_options_are_validated():
    with pytest.raises(ValueError, match="readers"):
        EngineOptions(readers=0)
    with pytest.raises(ValueError, match="lookahead"):
        EngineOptions(lookahead=0, early=False)
    with pytest.raises(ValueError, match="width"):
        EngineOptions(width=0)
    # `threads` is the engine's kernel thread count, never silently the reader count
    with pytest.raises(TypeError, match="readers"):
        DEFAULT_OPTIONS.with_(threads=4)


def test_old_spellings_still_work_and_warn(tmp_path):
    with pytest.warns(DeprecationWarning, match="'prefetch_width' is deprecated"):
        assert DEFAULT_OPTIONS.with_(prefetch_width=1).width == 1
    with pytest.raises(TypeError, match="only"):
        DEFAULT_OPTIONS.with_(width=1, prefetch_width=1)
    with pytest.warns(DeprecationWarning, match="'threads' is deprecated"):
        assert XRay(io_path="pread", threads=3).readers == 3
    fc = FileConsumer(SyntheticExperts(), tmp_path)
    try:
        with pytest.warns(DeprecationWarning) as caught:
            c = StreamingExpertCache(fc, 4 * 4096 * 3, 2, threads=1, lookahead_depth=2)
        old_names = sorted(str(w.message).split("'")[1] for w in caught)
        assert old_names == ["lookahead_depth", "threads"]
        assert c.depth == 2 and c.planner.reads.readers == 1
        c.close()
    finally:
        fc.close()
    consumer = StateDictConsumer(tiny_model("mixtral", seed=0))
    with pytest.warns(DeprecationWarning, match="Engine"):
        eng = Engine(consumer, policy="lfu", stream=StreamOptions(readers=1))
    assert eng.options.policy == "lfu" and eng.options.readers == 1 and not eng.options.prefetch
    eng.close()
    # The old CLI spelling of --width still parses.
    args = build_parser().parse_args(["run", "m@1", "--prompt", "x", "--prefetch-width", "1"])
    assert engine_options(args).width == 1
