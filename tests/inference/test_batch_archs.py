"""The batched step (inference.batch.forward_batch) for every architecture the engine runs.

The server decodes every request through ``forward_batch``; it re-implements the
base decoder's layer and must call each architecture's own hooks (attention,
routing, expert MLP, shared experts, residual and logit scales). Checked here
against the engine's own forward on tiny random checkpoints of each
architecture: the logits agree to float32 rounding, and a sequence batched
with others gets bit-identical logits to the same sequence stepped alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.batch import BatchError, Scheduler, decodes_in_c, forward_batch
from czyx.inference.engine import Engine
from czyx.inference.models.decoder import MoEDecoder
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.testing.tiny_models import ENGINE_ARCHES, make_tiny_checkpoint

SEQS = [[3, 17, 5, 60, 1, 88, 42, 9, 11, 2], [7, 7, 30], [50, 4, 19, 23, 8]]


@pytest.mark.parametrize("arch", ENGINE_ARCHES)
def test_batched_step_matches_the_engine(tmp_path, arch) -> None:
    ckpt = make_tiny_checkpoint(arch, tmp_path / "ckpt")
    with Store.open(tmp_path / "store") as st:
        mount(st, ckpt, "m@1")
    with OpenedModel(str(tmp_path / "store"), "m@1", None) as om:
        eng = Engine(om.consumer)
        model = eng.model
        want = []
        for s in SEQS:
            eng.reset()
            want.append(eng.prefill(s))
        alone = [forward_batch(model, [np.array(s)], [model.new_kv()])[0] for s in SEQS]
        kvs = [model.new_kv() for _ in SEQS]
        together = forward_batch(model, [np.array(s) for s in SEQS], kvs)
        # one decode step each, together and alone (after the same prefill)
        nxt = [int(x.argmax()) for x in together]
        step = forward_batch(model, [np.array([t]) for t in nxt], kvs)
        for s, t, got in zip(SEQS, nxt, step, strict=True):
            kv = model.new_kv()
            forward_batch(model, [np.array(s)], [kv])
            engine_kv = model.new_kv(kv.capacity)
            for i in range(len(kv.k)):
                engine_kv.k[i][:] = kv.k[i]
                engine_kv.v[i][:] = kv.v[i]
            if hasattr(kv, "recurrent_arrays"):  # a hybrid model's linear-attention state
                engine_kv.load_recurrent(kv.recurrent_arrays())
            engine_kv.length = kv.length
            assert np.array_equal(forward_batch(model, [np.array([t])], [kv])[0], got)
            # The engine's own decode of the same token after the same positions: exactly
            # it where the batch decodes in C, to float32 rounding where it runs numpy.
            one = model.forward(np.array([t]), engine_kv)
            if decodes_in_c(model):
                assert np.array_equal(one, got), arch
            else:
                assert np.abs(one - got).max() <= 1e-5 * float(one.max() - one.min()), arch
        eng.close()
    for w, a, b in zip(want, alone, together, strict=True):
        assert np.array_equal(a, b)  # independent of what it is batched with
        span = float(w.max() - w.min())
        assert np.abs(a - w).max() <= 1e-5 * span, arch
        assert int(a.argmax()) == int(w.argmax())


def test_an_override_the_batch_cannot_call_is_refused() -> None:
    class Odd(MoEDecoder):
        def _mlp(self, i, lw, x):  # a step the batched layer does not call
            return super()._mlp(i, lw, x) * 2

    model = Odd.__new__(Odd)
    with pytest.raises(BatchError, match="_mlp"):
        Scheduler(model)


def test_batched_c_decode_follows_length_dependent_rope(longrope_engine) -> None:
    """LongRoPE's tables depend on the length reached: a batched C decode step sets
    each token's own before its attention, so a short and a long sequence decoded
    together get what each gets alone."""
    model = longrope_engine.model
    assert decodes_in_c(model)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 256, 4), rng.integers(0, 256, 14)]  # below, above the switch
    kvs = [model.new_kv() for _ in seqs]
    forward_batch(model, [np.array(s) for s in seqs], kvs)
    toks = [5, 9]
    got = forward_batch(model, [np.array([t]) for t in toks], kvs)
    for s, t, g in zip(seqs, toks, got, strict=True):
        kv = model.new_kv()
        forward_batch(model, [np.array(s)], [kv])
        assert np.array_equal(model.forward(np.array([t]), kv), g)
