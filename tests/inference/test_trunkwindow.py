"""The trunk window: a model's layers held K at a time, the next read while one computes.

On a tiny mounted Qwen2-MoE (a sparse, a dense and a sparse layer, with a
shared expert; float and quantized trunks) opened with ``lazy_trunk``, the
windowed engine's logits are bit-identical to the resident trunk's for
windows 1, 2 and n_layers, and the window's counters show it never held more
than K layers. The window itself (with a fake loader) keeps its bound and no
references for every access pattern, and a failed load reaches the consumer
as a typed error, never an older layer.
"""

from __future__ import annotations

import json
import threading
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.cli import main
from czyx.inference.engine import Engine
from czyx.inference.options import EngineOptions
from czyx.inference.trunkwindow import TrunkLoadError, TrunkWindow, TrunkWindowError
from czyx.portals import open_consumer
from czyx.store import ChecksumError, Store
from czyx.store.models.model import ModelSpace
from czyx.store.models.mount import mount
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.policy import POLICIES
from czyx.testing.refmodels import tiny_model

PROMPT = np.random.default_rng(5).integers(0, 256, 9)
STEPS = [7, 200, 31, 64, 5]


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    """``q@1`` (float) and ``q@sel`` (quantized trunk) of a 3-layer Qwen2-MoE."""
    root = tmp_path_factory.mktemp("trunkwin")
    tiny_model("qwen2_moe", seed=4).save_pretrained(root / "ck")
    with Store.open(root / "store") as store:
        mount(store, root / "ck", "q@1")
        mount(store, root / "ck", "q@sel", quant=QuantCodec(POLICIES["selective"]))
    return root / "store"


@pytest.fixture()
def store(mounted):
    with Store.open(mounted, create=False) as st:
        yield st


def _run(consumer, **kw) -> tuple[list[np.ndarray], Engine]:
    eng = Engine(consumer, **kw)
    out = [eng.prefill(PROMPT, all_logits=True)]
    out += [eng.decode(t) for t in STEPS]
    eng.close()
    return out, eng


def _window_bytes(consumer, eng: Engine) -> list[int]:
    m = eng.model
    return [
        sum(consumer.trunk(r, i).nbytes for r in m.window_roles if consumer.has_trunk(r, i))
        for i in range(m.cfg.n_layers)
    ]


@pytest.mark.parametrize("tag", ["q@1", "q@sel"])
def test_windowed_logits_are_bit_identical_to_the_resident_trunk(store, tag):
    with open_consumer(store, None, tag) as eager:
        want, res = _run(eager, cache_fraction=0.5)
    n = res.cfg.n_layers
    assert n == 3 and res.trunk_window_stats() is None
    with open_consumer(store, None, tag, lazy_trunk=True) as lazy:
        for k, stream in ((1, True), (2, True), (n, True), (2, False)):
            kw = {} if stream else {"options": EngineOptions(stream=False)}
            got, eng = _run(lazy, cache_fraction=0.5, trunk_window=k, **kw)
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), k
            s = eng.trunk_window_stats()
            passes = 1 + len(STEPS)
            assert s.window == k and s.peak_layers == k  # never more than K held or loading
            if k == 1:  # nothing prefetched: every layer of every pass read in line
                assert s.loads == passes * n and s.background_loads == 0
            elif k == 2:  # only the very first layer is read in line
                assert s.loads - s.background_loads == 1 and s.background_loads >= passes * n - 1
            else:  # the whole trunk, read once
                assert s.loads == n and s.hits == (passes - 1) * n
            if tag == "q@1":  # float matrices: bytes are exactly computable here
                per = sorted(_window_bytes(lazy, eng))
                assert per[-1] <= s.peak_bytes <= sum(per[-k:])
            assert eng.model.trunk_nbytes() < res.model.trunk_nbytes() or k == n


def test_window_mode_keeps_routers_and_names_inputs_like_resident(store):
    """Routers and norms stay resident (the streaming look-ahead reads them); the
    calibration observer sees the same inputs, shared expert included."""
    names = {}
    with open_consumer(store, None, "q@1", lazy_trunk=True) as m:
        for k in (None, 2):
            eng = Engine(m, trunk_window=k)
            seen = []
            eng.model.observer = lambda name, a, seen=seen: seen.append((name, a.copy()))
            eng.prefill(PROMPT)
            names[k] = seen
            sk = eng.model.layers
            assert sk[0].router is not None and sk[0].post_attn_norm is not None
            assert (sk[0].q_proj is None) == (k is not None)
            eng.close()
    assert [n for n, _ in names[2]] == [n for n, _ in names[None]]
    assert any(n == "L0.shared.down_in" for n, _ in names[2])
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(names[2], names[None], strict=True))


def test_a_corrupt_trunk_matrix_is_a_checksum_error_at_use(tmp_path):
    tiny_model("qwen2_moe", seed=1).save_pretrained(tmp_path / "ck")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ck", "q@1")
        ref = ModelSpace(store, "q@1").trunk[("mlp_down_proj", 1)]
        with open(store.block_path(ref.space), "r+b") as fh:
            fh.seek(ref.record["off"] + 3)
            b = fh.read(1)
            fh.seek(ref.record["off"] + 3)
            fh.write(bytes([b[0] ^ 0x04]))
        with open_consumer(store, None, "q@1", lazy_trunk=True) as m:
            for k in (1, 2):
                eng = Engine(m, trunk_window=k)  # layer 1's matrices are not read yet
                for _ in range(2):  # and never served later from a stale copy
                    with pytest.raises(ChecksumError, match="mlp_down_proj layer 1"):
                        eng.prefill(PROMPT)
                    eng.reset()
                eng.close()


# ---------------------------------------------------------------------- the window alone


class _Obj:
    def __init__(self, i: int, gen: int) -> None:
        self.i, self.gen = i, gen


class _Loader:
    """Makes layer objects, tracks the live ones, fails on request."""

    def __init__(self, fail: dict[int, BaseException] | None = None) -> None:
        self.live: weakref.WeakSet[_Obj] = weakref.WeakSet()
        self.gen = 0
        self.fail = dict(fail or {})
        self.lock = threading.Lock()

    def __call__(self, i: int) -> _Obj:
        with self.lock:
            exc = self.fail.pop(i, None)
            if exc is not None:
                raise exc
            self.gen += 1
            obj = _Obj(i, self.gen)
            self.live.add(obj)
            return obj


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    k=st.integers(1, 8),
    cyclic=st.booleans(),
    seq=st.lists(st.integers(0, 5), min_size=1, max_size=30),
)
def test_window_bound_and_no_references_for_every_access_pattern(n, k, cyclic, seq):
    load = _Loader()
    win = TrunkWindow(n, k, load, lambda o: 10 + o.i)
    order = [j % n for j in range(len(seq))] if cyclic else [j % n for j in seq]
    for i in order:
        got = win.layer(i)
        assert got.i == i
        del got
        assert len(load.live) <= min(k, n)  # the window keeps at most K layers alive
        assert len(win.resident()) <= min(k, n)
    s = win.stats()
    assert s.peak_layers <= min(k, n) and s.peak_bytes <= sum(range(10 + n - min(k, n), 10 + n))
    win.close()
    assert len(load.live) == 0  # closed: no layer is referenced any more
    with pytest.raises(TrunkWindowError, match="closed"):
        win.layer(0)


def test_a_failed_load_is_raised_typed_at_use_and_then_reloaded():
    load = _Loader({1: RuntimeError("disk on fire"), 2: ChecksumError("layer 2: bad sum")})
    win = TrunkWindow(3, 2, load, lambda o: 1)
    assert win.layer(0).i == 0  # schedules layer 1 in background: it fails there
    with pytest.raises(TrunkLoadError, match="disk on fire") as info:
        win.layer(1)
    assert isinstance(info.value.__cause__, RuntimeError)
    fresh = win.layer(1)  # loaded again, in line: a new object, never an older copy
    assert fresh.i == 1 and fresh.gen == 2
    with pytest.raises(ChecksumError, match="layer 2"):  # typed errors pass as raised
        win.layer(2)
    assert win.layer(2).i == 2
    win.close()
    for bad in (0, -1):
        with pytest.raises(TrunkWindowError):
            TrunkWindow(3, bad, load, len)
    with pytest.raises(TrunkWindowError, match="outside"):
        TrunkWindow(3, 1, load, lambda o: 1).layer(3)


# ---------------------------------------------------------------------- czyx run


def test_czyx_run_trunk_window_flag(mounted, tmp_path, capsys):
    base = ["run", "q@1", "--store", str(mounted), "--prompt", "def f(x):"]
    base += ["--max-tokens", "6", "--cache-fraction", "0.5"]
    assert main(base) == 0
    want = capsys.readouterr()
    assert "trunk window" not in want.err
    xray = tmp_path / "x.json"
    assert main([*base, "--trunk-window", "1", "--xray", str(xray)]) == 0
    got = capsys.readouterr()
    assert got.out == want.out and "trunk window: 1 of 3 layers" in got.err
    window = json.loads(xray.read_text())["run"]["extra"]["trunk_window"]
    assert window["peak_layers"] == 1 and window["loads"] > 3
    assert main([*base, "--trunk-window", "0"]) == 1
    assert "--trunk-window 0" in capsys.readouterr().err
    # A saved session runs through the same windowed forward pass.
    session = ["--session", "s", "--tenant", "alice", "--trunk-window", "2"]
    assert main([*base, *session]) == 0
    err = capsys.readouterr().err
    assert "session s@1 (started)" in err and "trunk window: 2 of 3 layers" in err
