"""Per-expert precision tiers: a q4/q2 pair computes each expert at its tier, fails closed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.options import EngineOptions
from czyx.inference.tiers import TierSpec, TierSpecError, open_tiered
from czyx.inference.xray import XRay, load_schema
from czyx.store import Store
from czyx.store.consumer import gate_up_down_views
from czyx.store.errors import TagNotFoundError
from czyx.store.models.mount import mount
from czyx.store.models.tiered import HIGH, TieredModel, TierError
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.formats import dequantize, get_format
from czyx.store.quant.memory import QuantizedConsumer
from czyx.store.quant.policy import parse_policy
from czyx.testing.refmodels import StateDictConsumer, tiny_model
from czyx.testing.tiny_models import make_tiny_checkpoint

# hidden 128 and expert intermediate 64: q2's groups of 64 divide both, so a mixed layer
# holds experts of two group sizes (q4: 32), the case the kernels must handle.
SIZES = {"hidden_size": 128, "intermediate_size": 64, "sliding_window": None}
# Float trunk, packed experts: the engine's only rounding is then the experts' (the
# reference's differences are the tiers', not the trunk kernels').
Q4, Q2 = "none,expert=q4", "none,expert=q2"
PROMPT = [3, 17, 5, 60, 1, 88, 3, 17]


@pytest.fixture(scope="module")
def versions():
    base = StateDictConsumer(tiny_model("mixtral", seed=3, **SIZES))
    return (
        base,
        QuantizedConsumer(base, parse_policy(Q4)),
        QuantizedConsumer(base, parse_policy(Q2)),
    )


def _hot(info) -> list[tuple[int, int]]:
    """Every expert, expert-major (experts 0.. of each layer first)."""
    return [(layer, e) for e in range(info.n_experts) for layer in range(info.n_layers)]


def _run(consumer, options: EngineOptions, hot=None, steps: int = 6, xray=None, **kw):
    """Prefill then greedy decode: ``(tokens, logits [steps + 1, V], engine)``."""
    eng = Engine(consumer, options=options, hot=hot, threads=1, xray=xray, **kw)
    logits = [eng.prefill(PROMPT)]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits.append(eng.decode(tokens[-1]))
        tokens.append(int(logits[-1].argmax()))
    return tokens, np.stack(logits), eng


def _tiered(q4, q2) -> TieredModel:
    return TieredModel(q4, q2, ("m@q4", "m@q2"))


@pytest.mark.parametrize("stream", [True, False])
def test_every_expert_high_is_the_high_version(versions, stream) -> None:
    _, q4, q2 = versions
    want, wl, e0 = _run(q4, EngineOptions(stream=stream))
    got, gl, e1 = _run(
        _tiered(q4, q2), EngineOptions(stream=stream, tiers="q4,q2:1"), _hot(q4.info)
    )
    assert got == want and np.array_equal(gl, wl)
    assert e1.cache.tier_reads[1] == 0 and e1.cache.tier_reads[0] > 0
    e0.close(), e1.close()


@pytest.mark.parametrize("stream", [True, False])
def test_every_expert_low_is_the_low_version(versions, stream) -> None:
    _, q4, q2 = versions
    want, wl, e0 = _run(q2, EngineOptions(stream=stream), _hot(q2.info))
    # A fraction of the budget below one slot: no expert is high.
    got, gl, e1 = _run(
        _tiered(q4, q2), EngineOptions(stream=stream, tiers="q4,q2:0.001"), _hot(q4.info)
    )
    assert got == want and np.array_equal(gl, wl)
    assert e1.cache.tier_reads[0] == 0
    # A low read counts the low version's bytes: the pure q2 engine's.
    assert e1.stats().bytes_read == e0.stats().bytes_read
    e0.close(), e1.close()


class DequantizedMix:
    """The reference: float experts dequantized from the version each expert's tier names
    (trunk: the high version's, dequantized), computed by the float engine."""

    def __init__(self, tiered: TieredModel, base) -> None:
        self.tiered, self.base = tiered, base
        self.info = base.info
        self._hidden = int(base.info.config["hidden_size"])

    def __getattr__(self, name: str):
        # The trunk is the tiered pair's (the high version's); extents the float base's.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.tiered if name in ("has_trunk", "trunk") else self.base, name)

    def read_expert(self, layer, e, slot) -> None:
        t = int(self.tiered.tier[layer, e])
        packed = np.zeros(self.tiered.strides[t], np.uint8)
        self.tiered.read_expert(layer, e, packed)
        fmt = get_format(self.tiered.formats[t])
        parts = self.tiered.expert_views_at(packed, t)
        inter = self.info.config["intermediate_size"]
        shapes = ((inter, self._hidden), (inter, self._hidden), (self._hidden, inter))
        gate, up, down = self.expert_views(slot)
        for dst, part, shape in zip((gate, up, down), parts, shapes, strict=True):
            dst[...] = dequantize(np.asarray(part).reshape(-1), fmt, shape)

    def expert_views(self, slot):
        h, i = self._hidden, self.info.config["intermediate_size"]
        return gate_up_down_views(slot, self.info.expert_nbytes, i, h)

    def close(self) -> None:
        pass


def test_a_mixed_run_computes_each_expert_at_its_tier(versions) -> None:
    base, q4, q2 = versions
    tiered = _tiered(q4, q2)
    hot = _hot(q4.info)
    # Half the experts (0..3 of each layer) high: every step mixes q4 and q2 experts.
    got, _, eng = _run(tiered, EngineOptions(tiers="q4,q2:0.5"), hot)
    assert (tiered.tier[:, :4] == HIGH).all() and (tiered.tier[:, 4:] != HIGH).all()
    assert eng.cache.tier_reads.min() > 0
    eng.close()
    forced = [int(t) for t in got[:-1]]  # teacher-forced: every run sees the same tokens
    opts = EngineOptions(tiers="q4,q2:0.5")
    mixed, ref = _forced(tiered, forced, opts, hot), _forced(DequantizedMix(tiered, base), forced)
    # The noise floor: each pure version's engine against its own dequantized reference
    # (the kernels round their inputs to int8; the reference computes in float32).
    floor = 0.0
    for pure, tier in ((q4, HIGH), (q2, 1)):
        floor = max(floor, np.abs(_forced(pure, forced) - _forced(
            DequantizedMix(_all(q4, q2, tier), base), forced)).max())  # fmt: skip
    err = np.abs(mixed - ref).max()
    assert err <= 1.5 * floor
    # ... and far from the reference with every expert at one precision.
    for tier in (HIGH, 1):
        other = _forced(DequantizedMix(_all(q4, q2, tier), base), forced)
        assert np.abs(mixed - other).max() > 2 * err
    assert (mixed.argmax(-1) == ref.argmax(-1)).all()


def _all(q4, q2, tier: int) -> TieredModel:
    t = _tiered(q4, q2)
    t.tier[...] = tier
    return t


def _forced(consumer, tokens: list[int], options: EngineOptions | None = None, hot=None):
    eng = Engine(consumer, options=options or EngineOptions(), hot=hot, threads=1)
    out = [eng.prefill(PROMPT)] + [eng.decode(t) for t in tokens]
    eng.close()
    return np.stack(out)


def test_mixed_steps_compute_in_the_batched_kernel_as_one_by_one(versions) -> None:
    _, q4, q2 = versions
    opts = EngineOptions(tiers="q4,q2:0.5")
    _, one, e1 = _run(_tiered(q4, q2), opts, _hot(q4.info))
    eng = Engine(_tiered(q4, q2), options=opts, hot=_hot(q4.info), threads=1)
    eng.prefill(PROMPT)
    toks = [int(one[0].argmax())] + [int(x.argmax()) for x in one[1:-1]]
    batched = eng.verify(toks)  # the batched C step over several positions
    assert np.array_equal(batched, one[1:])
    e1.close(), eng.close()


def test_a_tight_budget_reads_fewer_bytes_than_the_high_version(versions) -> None:
    _, q4, q2 = versions
    slot = q4.info.expert_slot_nbytes
    _, _, e0 = _run(q4, EngineOptions(), cache_bytes=3 * slot, steps=12)
    _, _, e1 = _run(_tiered(q4, q2), EngineOptions(tiers="q4,q2:0.34"), _hot(q4.info),
                    cache_bytes=3 * slot, steps=12)  # fmt: skip
    assert e1.cache.n_slots == e0.cache.n_slots
    assert e1.stats().bytes_read < e0.stats().bytes_read
    # Without an X-Ray no per-step record grows with the generation.
    assert e1.cache.tier_steps == [] and e1.cache.tier_reads.sum() > 0
    e0.close(), e1.close()


def test_xray_records_the_tier_of_every_read(versions) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    _, q4, q2 = versions
    xray = XRay()
    _, _, eng = _run(_tiered(q4, q2), EngineOptions(tiers="q4,q2:0.5"), _hot(q4.info), xray=xray,
                     cache_bytes=4 * q4.info.expert_slot_nbytes)  # fmt: skip
    report = xray.report(eng.cache, tokens=len(PROMPT) + 6)
    jsonschema.validate(report, load_schema())
    tiers = report["run"]["tiers"]
    assert tiers["versions"] == ["m@q4", "m@q2"] and tiers["formats"] == ["q4", "q2"]
    assert tiers["high_experts"] == 2 and tiers["experts"] == 16
    per_transfer = [sum(1 for r in report["transfers"] if r["tier"] == t) for t in (0, 1)]
    assert per_transfer == tiers["reads"]
    # Seven forward steps; the prewarm (experts (0, 0), (1, 0) high, (0, 1), (1, 1) low)
    # belongs to none.
    assert len(tiers["steps"]) == 7
    assert [sum(c) + 2 for c in zip(*tiers["steps"])] == tiers["reads"]
    assert json.dumps(report)
    eng.close()


def test_a_malformed_spec_or_a_run_without_a_profile_is_refused(versions) -> None:
    _, q4, q2 = versions
    for bad in ("q4", "q4,q4", "q4,q2:0", "q4,q2:x", "m@q4,q2", "q4,q2,q1"):
        with pytest.raises(TierSpecError, match="tiers"):
            EngineOptions(tiers=bad)
    with pytest.raises(TierSpecError, match="profile"):
        Engine(_tiered(q4, q2), options=EngineOptions(tiers="q4,q2"))
    with pytest.raises(TierSpecError, match="one version"):
        Engine(q4, options=EngineOptions(tiers="q4,q2"), hot=_hot(q4.info))
    with pytest.raises(TierError, match="same precision"):
        TieredModel(q2, QuantizedConsumer(q2.base, parse_policy("none,expert=q2g32")), ("a", "b"))
    with pytest.raises(TierError, match="high precision"):
        TieredModel(q2, q4, ("m@q2", "m@q4"))
    with pytest.raises(TierError, match="trunks differ"):
        TieredModel(
            q4, QuantizedConsumer(q4.base, parse_policy("q4-all,expert=q2")), ("m@q4", "m@q2")
        )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    cfg = dict(hidden_size=128, intermediate_size=64, vocab_size=256, eos_token_id=None)
    ckpt = make_tiny_checkpoint("mixtral", root / "ckpt", **cfg)
    other = make_tiny_checkpoint("mixtral", root / "other", seed=1, **cfg)
    with Store.open(root / "store") as st:
        mount(st, ckpt, "m@q4", quant=QuantCodec(parse_policy(Q4)))
        mount(st, ckpt, "m@q2", quant=QuantCodec(parse_policy(Q2)))
        mount(st, other, "m@o2", quant=QuantCodec(parse_policy(Q2)))
    return root / "store"


def test_stored_versions_open_as_tiers_and_refuse_other_pairs(store, monkeypatch) -> None:
    from czyx.store.models import model as model_mod

    opened: list = []
    real_close = model_mod.StoreModel.close
    orig_init = model_mod.StoreModel.__init__

    def track(self, *a, **k):
        orig_init(self, *a, **k)
        opened.append(self)

    monkeypatch.setattr(model_mod.StoreModel, "__init__", track)
    with Store.open(store, create=False) as st:
        tiered = open_tiered(st, None, "m@q4", "q4,q2:0.5")
        assert tiered.formats == ("q4", "q2") and tiered.names == ("m@q4", "m@q2")
        # The low version serves experts alone: its trunk is neither read nor held.
        high, low = opened[-2:]
        assert high.has_trunk("embed") and not low.has_trunk("embed")
        assert not low._trunk and not low._packed and not low._lazy
        assert low.trunk_digest() == high.trunk_digest()
        info = tiered.info
        # Each expert's extent, read from the file its block index names, is the bytes its
        # tier's version reads (the low version's blocks after the high version's).
        paths = tiered.expert_block_paths()
        assert len(paths) == len(tiered.expert_fds()) == len(set(paths))
        tiered.tier[0, 1] = 1 - HIGH
        for e in (0, 1):
            ext = tiered.expert_extent(0, e)
            with open(paths[ext.block], "rb") as fh:
                fh.seek(ext.offset)
                raw = np.frombuffer(fh.read(ext.length), np.uint8)
            slot = np.zeros(info.expert_slot_nbytes, np.uint8)
            tiered.read_expert(0, e, slot)
            assert np.array_equal(slot[: ext.length], raw), e
        tiered.tier[0, 1] = HIGH
        _, _, eng = _run(tiered, EngineOptions(tiers="q4,q2:0.5"), _hot(info),
                         cache_bytes=4 * info.expert_slot_nbytes)  # fmt: skip
        assert eng.cache.tier_reads.min() > 0
        eng.close()
        tiered.close()
        cases = [
            ("m@q4", "q4,q9", TagNotFoundError, "q9"),  # no such version
            ("m@q4", "q4,o2", TierError, "trunks differ"),  # another model's version
            ("m@q2", "q4,q2", TierSpecError, "the run's version"),
        ]
        for ref, spec, err, msg in cases:
            opened.clear()
            with pytest.raises(err, match=msg) as exc:
                open_tiered(st, None, ref, spec)
            assert "\n" not in str(exc.value)
            assert all(not m._readers for m in opened)  # whatever opened was closed
    assert real_close is model_mod.StoreModel.close


def test_spec_refs() -> None:
    spec = TierSpec.parse("q4,q2:0.25")
    assert spec == TierSpec("q4", "q2", 0.25)
    assert spec.refs("org/m@q4") == ("org/m@q4", "org/m@q2")


def test_czyx_run_tiers_needs_a_profile_and_records_the_tiers(store, tmp_path, capsys) -> None:
    from czyx.cli import main
    from czyx.inference.profile import RoutingProfile

    base = ["run", "m@q4", "--store", str(store), "-p", "def f(x):", "-n", "4", "--tiers", "q4,q2"]
    assert main(base) != 0  # refused before anything is opened, in one line
    err = capsys.readouterr().err
    assert "--tiers q4,q2: needs --hot PROFILE" in err and err.count("\n") == 1
    counts = np.zeros((2, 4), np.int64)
    counts[:, :2] = 5
    RoutingProfile(counts).save(tmp_path / "p.json")
    xr = tmp_path / "x.json"
    args = ["--hot", str(tmp_path / "p.json"), "--cache-mb", "0.05", "--xray", str(xr)]
    assert main(base + args) == 0
    run = json.loads(xr.read_text())["run"]
    assert run["extra"]["tiers"] == "q4,q2"
    assert run["tiers"]["versions"] == ["m@q4", "m@q2"] and run["tiers"]["high_experts"] > 0
