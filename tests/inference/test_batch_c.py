"""The batched C decode step (inference.batch._forward_c on kernels.fused.DecodeKernels).

A step's decode tokens run as one C call per layer for every sequence (each
sequence a task of the engine's pool, computed by the one-token kernels), so
each sequence's logits must be bit-identical to the same token decoded alone
by the engine (``MoEDecoder.forward`` of one token: the engine's C decode),
whatever the batch size, the other sequences' lengths, the weight format
(float32, float16 store, q8, q4) and the pool's thread count (with loops
forced to split over two threads). Covered: Mixtral with a sliding window
shorter than the sequences, Qwen3-MoE (per-head q/k norms), OLMoE (q/k norms
over all heads). The KV each step writes is the solo decode's too, and the
kernels refuse a route to an expert the step does not hold. The batched
attention shares each weight row between a group of tokens (and the MoE each
expert's rows between the tokens that chose it): checked per SIMD path too.
A step's prompt chunks run on the same path, their tokens in waves: each
prompt's KV and logits are its tokens decoded one at a time, however it is
chunked and batched.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from czyx.inference.batch import _copy_kv, decodes_in_c, forward_batch
from czyx.inference.engine import Engine
from czyx.inference.kernels import fused
from czyx.inference.kernels.fused import KernelError
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.store.quant.memory import QuantizedConsumer
from czyx.store.quant.policy import POLICIES, parse_policy
from czyx.testing.refmodels import StateDictConsumer, tiny_model
from czyx.testing.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not fused.have_czk(), reason="the C kernels are not built")

Q8 = "none,expert=q8,attention=q8,router=q8,embed=q8,lm_head=q8"
SIZES = {
    "mixtral": dict(hidden_size=64, intermediate_size=64),  # sliding_window=9
    "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=32),
    "olmoe": dict(hidden_size=64, intermediate_size=32),
}
# Per case: architecture, then None (float32), "q8" or "q4" (quantized in memory),
# or "f16-store" / "bf16-store" (a float16 / bfloat16 checkpoint mounted in a store:
# experts read as stored).
CASES = [
    ("mixtral", None),
    ("qwen3_moe", None),
    ("olmoe", "q8"),
    ("mixtral", "q4"),
    ("qwen3_moe", "q8"),
    ("mixtral", "f16-store"),
    ("qwen3_moe", "bf16-store"),
]
# Prompt lengths of eight sequences: all different, some past the sliding window.
LENGTHS = [1, 12, 5, 17, 3, 9, 2, 14]


def _consumer(arch: str, fmt: str | None, tmp_path):
    if fmt in ("f16-store", "bf16-store"):
        sizes = {"moe_intermediate_size": 32} if arch == "qwen3_moe" else {"sliding_window": 9}
        ckpt = make_tiny_checkpoint(
            arch, tmp_path / "ckpt", dtype="float16" if fmt == "f16-store" else "bfloat16",
            hidden_size=64, intermediate_size=64, **sizes,
        )  # fmt: skip
        with Store.open(tmp_path / "store") as st:
            mount(st, ckpt, "m@1")
        return OpenedModel(str(tmp_path / "store"), "m@1", None)
    base = StateDictConsumer(tiny_model(arch, **SIZES[arch]))
    if fmt is None:
        return base
    return QuantizedConsumer(base, POLICIES["q4-all"] if fmt == "q4" else parse_policy(Q8))


def _mixtral(threads: int) -> Engine:
    """An engine on the tiny float32 Mixtral (sliding window 9) with ``threads`` threads."""
    return Engine(StateDictConsumer(tiny_model("mixtral", **SIZES["mixtral"])), threads=threads)


def _copy(model, kv):
    out = model.new_kv(kv.capacity)
    _copy_kv(out, kv, kv.length)  # the scheduler's own copy (sessions, prefix reuse)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("arch", "fmt"), CASES)
def test_batched_decode_is_each_sequence_decoded_alone(tmp_path, split_loops, arch, fmt, threads):
    opened = _consumer(arch, fmt, tmp_path)
    consumer = opened.consumer if isinstance(opened, OpenedModel) else opened
    eng = Engine(consumer, threads=threads)
    model = eng.model
    try:
        assert decodes_in_c(model), (arch, fmt)
        if fmt in ("f16-store", "bf16-store"):
            assert str(model.experts.format) == fmt.split("-")[0]
        rng = np.random.default_rng(7)
        vocab = model.cfg.vocab_size
        kvs = [model.new_kv() for _ in LENGTHS]
        forward_batch(model, [rng.integers(0, vocab, n) for n in LENGTHS], kvs)
        for b in (1, 2, 5, 8):
            for _ in range(2):  # two steps: every sequence at a new length each time
                toks = [int(t) for t in rng.integers(0, vocab, b)]
                alone = [_copy(model, kv) for kv in kvs[:b]]
                want = [model.forward(np.array([t]), kv) for t, kv in zip(toks, alone)]
                got = forward_batch(model, [np.array([t]) for t in toks], kvs[:b])
                for s in range(b):
                    assert np.array_equal(got[s], want[s]), (arch, fmt, threads, b, s)
                    assert kvs[s].length == alone[s].length
                    for i in range(model.cfg.n_layers):
                        n = kvs[s].length
                        assert np.array_equal(kvs[s].k[i][:, :n], alone[s].k[i][:, :n])
                        assert np.array_equal(kvs[s].v[i][:, :n], alone[s].v[i][:, :n])
        if model.cfg.sliding_windows[0]:
            assert max(kv.length for kv in kvs) > model.cfg.sliding_windows[0]  # exceeded
    finally:
        eng.close()
        if isinstance(opened, OpenedModel):
            opened.close()


def _decoded_alone(model, tokens):
    """A prompt fed to the engine's C decode one token at a time: its KV and last logits."""
    kv = model.new_kv()
    for t in tokens:
        logits = model.forward(np.array([int(t)]), kv)
    return kv, logits


@pytest.mark.parametrize(("threads", "fraction"), [(1, None), (2, None), (2, 0.25)])
@pytest.mark.parametrize(("arch", "fmt"), [c for c in CASES if c[1] != "bf16-store"])
def test_prompt_chunks_are_the_prompt_decoded_token_by_token(
    tmp_path, split_loops, arch, fmt, threads, fraction
):
    """A step's prompt chunks take the C path too (their tokens in waves, one position
    after another, beside other sequences' decode tokens): each prompt's KV and logits
    are exactly its tokens decoded one at a time by the engine, however the prompt is
    cut into chunks and whatever it is batched with; with the experts over a quarter of
    their bytes too (a step's union then acquired in groups of rows)."""
    opened = _consumer(arch, fmt, tmp_path)
    consumer = opened.consumer if isinstance(opened, OpenedModel) else opened
    eng = Engine(consumer, threads=threads, cache_fraction=fraction)
    model = eng.model
    try:
        assert decodes_in_c(model), (arch, fmt)
        rng = np.random.default_rng(11)
        vocab = model.cfg.vocab_size
        prompts = [rng.integers(0, vocab, n) for n in (13, 1, 6, 20)]
        alone = [_decoded_alone(model, p) for p in prompts]
        # Two others already decoding; the prompts arrive in chunks of 5 and 7 beside them.
        others = [model.new_kv() for _ in range(2)]
        forward_batch(model, [rng.integers(0, vocab, 4), rng.integers(0, vocab, 9)], others)
        kvs = [model.new_kv() for _ in prompts]
        got: list = [None] * len(prompts)
        done = [0] * len(prompts)
        for _ in range(4):
            chunks, seqs, who = [], [], []
            for s, p in enumerate(prompts):
                size = 5 if s % 2 == 0 else 7
                if done[s] < p.size:
                    chunks.append(p[done[s] : done[s] + size])
                    seqs.append(kvs[s])
                    who.append(s)
                    done[s] = min(p.size, done[s] + size)
            if not who:
                break
            toks = [np.array([int(t)]) for t in rng.integers(0, vocab, 2)]
            out = forward_batch(model, toks + chunks, others + seqs)
            for s, lg in zip(who, out[2:], strict=True):
                got[s] = lg
        for s, (kv, logits) in enumerate(alone):
            assert np.array_equal(got[s], logits), (arch, fmt, threads, fraction, s)
            assert kvs[s].length == kv.length == prompts[s].size
            n = kv.length
            for i in range(model.cfg.n_layers):
                assert np.array_equal(kvs[s].k[i][:, :n], kv.k[i][:, :n])
                assert np.array_equal(kvs[s].v[i][:, :n], kv.v[i][:, :n])
    finally:
        eng.close()
        if isinstance(opened, OpenedModel):
            opened.close()


@pytest.fixture(scope="module")
def mixtral_engine():
    eng = _mixtral(2)
    yield eng
    eng.close()


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompts=st.lists(st.integers(1, 14), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 6), min_size=3, max_size=3),
    decoding=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_for_all_chunkings_and_batches_a_prompt_is_its_tokens_decoded(
    split_loops, mixtral_engine, prompts, sizes, decoding, seed
):
    """For every set of prompts, every chunk size per prompt and every number of other
    sequences decoding beside them: each prompt's last logits and KV are its tokens
    decoded one at a time by the engine."""
    model = mixtral_engine.model
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, 256, n) for n in prompts]
    alone = [_decoded_alone(model, p) for p in toks]
    others = [model.new_kv() for _ in range(decoding)]
    if others:
        forward_batch(model, [rng.integers(0, 256, 3) for _ in others], others)
    kvs = [model.new_kv() for _ in toks]
    done = [0] * len(toks)
    got: list = [None] * len(toks)
    while any(d < p.size for d, p in zip(done, toks, strict=True)):
        who = [s for s, p in enumerate(toks) if done[s] < p.size]
        chunks = [toks[s][done[s] : done[s] + sizes[s]] for s in who]
        step = [np.array([int(t)]) for t in rng.integers(0, 256, len(others))]
        out = forward_batch(model, step + chunks, others + [kvs[s] for s in who])
        for s, lg in zip(who, out[len(others) :], strict=True):
            got[s] = lg
            done[s] = min(toks[s].size, done[s] + sizes[s])
    for s, (kv, logits) in enumerate(alone):
        assert np.array_equal(got[s], logits)
        n = kv.length
        for i in range(model.cfg.n_layers):
            assert np.array_equal(kvs[s].k[i][:, :n], kv.k[i][:, :n])
            assert np.array_equal(kvs[s].v[i][:, :n], kv.v[i][:, :n])


@pytest.mark.parametrize("fmt", [None, "q8", "q4"])
def test_every_simd_path_batches_as_it_decodes_alone(split_loops, level, fmt):
    """The batched MoE shares each expert's rows between the tokens that chose it
    (czk_matmul's kernels for packed experts, a two-input row kernel for float
    ones), the batched attention each q/k/v, o and router row between a group's
    tokens (the same kernels, groups of 2 to 4): per SIMD path, still each
    token's solo decode bit for bit."""
    base = StateDictConsumer(tiny_model("mixtral", **SIZES["mixtral"]))
    consumer = base if fmt is None else QuantizedConsumer(
        base, POLICIES["q4-all"] if fmt == "q4" else parse_policy(Q8)
    )  # fmt: skip
    eng = Engine(consumer, threads=2)
    model = eng.model
    try:
        rng = np.random.default_rng(5)
        kvs = [model.new_kv() for _ in range(8)]
        forward_batch(model, [rng.integers(0, 256, n) for n in LENGTHS], kvs)
        for b in (8, 5):  # attention groups of 4 + 4, then 3 + 2 (two threads)
            toks = [int(t) for t in rng.integers(0, 4, b)]  # few distinct: experts shared
            want = [model.forward(np.array([t]), _copy(model, kv)) for t, kv in zip(toks, kvs)]
            got = forward_batch(model, [np.array([t]) for t in toks], kvs[:b])
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), (level, b)
    finally:
        eng.close()


def test_a_batch_larger_than_the_buffers_grows_them(split_loops):
    eng = _mixtral(2)
    model = eng.model
    try:
        rng = np.random.default_rng(1)
        for b in (3, 12, 20):  # past the first buffers (8 rows), then past their doubling
            kvs = [model.new_kv() for _ in range(b)]
            forward_batch(model, [rng.integers(0, 256, 1 + s % 7) for s in range(b)], kvs)
            toks = [int(t) for t in rng.integers(0, 256, b)]
            want = [model.forward(np.array([t]), _copy(model, kv)) for t, kv in zip(toks, kvs)]
            got = forward_batch(model, [np.array([t]) for t in toks], kvs)
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
            assert model.kernels()._batch.cap >= b
    finally:
        eng.close()


def test_union_is_the_distinct_experts_residents_first():
    eng = _mixtral(1)
    model = eng.model
    try:
        kern = model.kernels()
        kv = model.new_kv()
        bt = kern.begin_batch([kv] * 6, model.cfg.n_layers, model.cfg.n_kv_heads,
                              model.cfg.head_dim, model.rotary)  # fmt: skip
        bt.idx[:6] = [[5, 1], [1, 7], [6, 0], [5, 7], [2, 3], [0, 6]]
        resident = np.array([-1, 4, -1, 0, -1, 2, 7, -1], np.int32)
        got = kern.union(6, resident)
        assert got.tolist() == [1, 3, 5, 6, 0, 2, 7]
        bt.idx[0, 0] = 8  # outside the layer's experts
        with pytest.raises(KernelError):
            kern.union(6, resident)
    finally:
        eng.close()


def _two_rows(model):
    """A batched step begun for two sequences whose rows route to experts (0, 1) and
    (1, 2), weights 0.5: the buffers a MoE call reads."""
    kern = model.kernels()
    kvs = [model.new_kv() for _ in range(2)]
    forward_batch(model, [np.array([3, 4]), np.array([5])], kvs)
    bt = kern.begin_batch(kvs, model.cfg.n_layers, model.cfg.n_kv_heads,
                          model.cfg.head_dim, model.rotary)  # fmt: skip
    bt.idx[:2] = [[0, 1], [1, 2]]
    bt.w[:2] = 0.5
    return kern, bt


def test_a_route_to_an_expert_not_held_is_refused():
    eng = _mixtral(1)
    model = eng.model
    try:
        kern, _ = _two_rows(model)
        cache = model.experts
        held = np.array([0, 1], np.int64)  # expert 2 is not held
        slots = cache.acquire(0, held).copy()
        try:
            with pytest.raises(KernelError):
                kern.moe_batch(cache, 0, 2, held, slots, False)
            kern.moe_batch(cache, 0, 1, held, slots, False)  # the first row's are held
            with pytest.raises(KernelError):  # a slot outside the cache
                kern.moe_batch(cache, 0, 1, held, np.array([0, 10**6], np.int64), False)
        finally:
            cache.release()
    finally:
        eng.close()


def test_parts_that_leave_a_pair_uncomputed_are_refused():
    """A layer in parts (its experts over several acquires): the last part refuses
    unless every (row, expert) pair was computed since the first, rather than summing
    a product left over from an earlier layer; with every pair, one call's result."""
    eng = _mixtral(1)
    model = eng.model
    try:
        kern, bt = _two_rows(model)
        bt.x[:2] = np.random.default_rng(0).standard_normal(bt.x[:2].shape)
        cache = model.experts

        def run(parts, part_names):
            bt.h[:2] = 1.0
            for experts, name in zip(parts, part_names, strict=True):
                held = np.array(experts, np.int64)
                slots = cache.acquire(0, held).copy()
                try:
                    kern.moe_batch(cache, 0, 2, held, slots, True, name)
                finally:
                    cache.release()
            return bt.h[:2].copy()

        whole = run([[0, 1, 2]], [None])
        assert np.array_equal(run([[0], [1], [2]], ["first", "part", "last"]), whole)
        assert np.array_equal(run([[1, 2], [0]], ["first", "last"]), whole)
        # expert 2's pair was computed by the layer before, not since this "first"
        run([[2], [0, 1]], ["first", "last"])
        with pytest.raises(KernelError):
            run([[0], [1]], ["first", "last"])
        assert (bt.h[:2] == 1.0).all()  # refused: the residual is untouched
        with pytest.raises(KernelError):
            kern.moe_batch(cache, 0, 2, np.array([0], np.int64), np.array([0], np.int64),
                           True, "middle")  # fmt: skip
    finally:
        eng.close()


def test_waves_the_kernel_cannot_run_are_refused():
    """Groups of more than four rows, empty waves or groups, offsets that do not end at
    the rows, a position past a cache: refused, nothing written."""
    eng = _mixtral(1)
    model = eng.model
    cfg = model.cfg
    try:
        kern = model.kernels()
        kv = model.new_kv()
        kv.reserve(8)
        bt = kern.begin_batch([kv] * 6, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                              model.rotary, list(range(6)))  # fmt: skip
        kern.embed_batch(model.embed, [1, 2, 3, 4, 5, 6])
        lw = model.layers[0]
        args = (None, model.rotary, cfg.rms_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                *model._c_qkv, cfg.top_k, cfg.renormalize)  # fmt: skip

        def waves(w, g):
            return np.array(w, np.int64), np.array(g, np.int64)

        h0, k0 = bt.h[:6].copy(), kv.k[0].copy()
        bad = [
            waves([0, 1], [0, 6]),  # a group of six rows
            waves([0, 1, 1], [0, 3, 6]),  # an empty wave
            waves([0, 2], [0, 3, 3]),  # an empty group (and not ending at the rows)
            waves([0, 2], [0, 3, 5]),  # the groups end before the rows
        ]
        for wv in bad:
            with pytest.raises(KernelError):
                kern.attention_batch(lw, 0, 6, *args, wv)
        bt.pos[5] = kv.k[0].shape[1]  # past the cache
        with pytest.raises(KernelError):
            kern.attention_batch(lw, 0, 6, *args, waves([0, 1, 2], [0, 3, 6]))
        assert np.array_equal(bt.h[:6], h0) and np.array_equal(kv.k[0], k0)
    finally:
        eng.close()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("attn", ["f32", "f16"])
def test_every_simd_path_shares_the_attention_rows_as_each_decodes_alone(
    split_loops, level, attn, threads
):
    """The batched attention reads each q/k/v, o and router row once for a group
    of up to four tokens (the two-input float kernel; float16 rows widened once
    per pair): per SIMD path, thread count and batch size (groups of 1 to 4 and
    a short last group), each token's solo decode bit for bit. Float16 attention
    weights are set on the layers directly (a store's trunk is widened at load),
    so the kernels' F16 kind runs in both the solo and the batched call."""
    eng = _mixtral(threads)
    model = eng.model
    try:
        if attn == "f16":
            for lw in model.layers:
                for name in ("q_proj", "k_proj", "v_proj", "o_proj", "router"):
                    setattr(lw, name, np.ascontiguousarray(getattr(lw, name), np.float16))
        assert decodes_in_c(model)
        rng = np.random.default_rng(11)
        kvs = [model.new_kv() for _ in LENGTHS]
        forward_batch(model, [rng.integers(0, 256, n) for n in LENGTHS], kvs)
        for b in (1, 2, 5, 8):
            toks = [int(t) for t in rng.integers(0, 256, b)]
            want = [model.forward(np.array([t]), _copy(model, kv)) for t, kv in zip(toks, kvs)]
            got = forward_batch(model, [np.array([t]) for t in toks], kvs[:b])
            for s in range(b):
                assert np.array_equal(got[s], want[s]), (level, attn, threads, b, s)
        kinds = {d.struct.q.kind for d in model.kernels()._attn.values()}
        assert kinds == {fused.KIND_F16 if attn == "f16" else fused.KIND_F32}
    finally:
        eng.close()


def test_the_per_token_attention_path_still_decodes_as_alone(split_loops):
    """With sharing off (fused.set_attn_share(False), the benchmarks' baseline) each
    token runs the one-token kernel: the same logits as alone, and as shared."""
    eng = _mixtral(2)
    model = eng.model
    try:
        rng = np.random.default_rng(3)
        kvs = [model.new_kv() for _ in range(5)]
        forward_batch(model, [rng.integers(0, 256, n) for n in LENGTHS[:5]], kvs)
        toks = [int(t) for t in rng.integers(0, 256, 5)]
        want = [model.forward(np.array([t]), _copy(model, kv)) for t, kv in zip(toks, kvs)]
        chunks = [np.array([t]) for t in toks]
        shared = forward_batch(model, chunks, [_copy(model, kv) for kv in kvs])
        fused.set_attn_share(False)
        try:
            each = forward_batch(model, chunks, kvs)
        finally:
            fused.set_attn_share(True)
        for s in range(5):
            assert np.array_equal(each[s], want[s]) and np.array_equal(shared[s], want[s]), s
    finally:
        eng.close()
