"""The decode kernels (inference/kernels/czk.c) against numpy references of the same format.

* Quantized rows: a numpy reference that performs the kernel's stated
  operations (8-bit input blocks, exact integer dot products in sixteen lanes
  of four per pair of blocks, float32 fused multiply-add accumulation per lane
  in pair order, the fixed lane tree, the m-term in sixteen lanes) reproduces
  every SIMD path bit for bit; its fused multiply-add is checked against exact
  rational arithmetic.
* Float rows (f32, f16, bf16), the MoE layer and the attention block: against
  float64 references, within float32 rounding bounds stated per test.
* Thread counts: every kernel and a whole engine give bit-identical results
  for 1, 2 and 3 threads (loops forced to split with set_min_work(1)).
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.kernels import fused
from czyx.inference.kernels.ops import prepare
from czyx.store.quant.formats import dequantize, get_format, quantize, unpack_codes

pytestmark = pytest.mark.skipif(not fused.have_czk(), reason="inference._czk not built")
F32 = np.float32
FORMATS = ("q2", "q3", "q4", "q8", "q4g64", "q8g64", "q3g32", "q2g32")


def ref_quantize_input(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of 32: sx = max|x| / 127, q = rint(x / sx) (via 1/sx), sequential float sums."""
    xb = x.reshape(-1, 32).astype(F32)
    d = (np.abs(xb).max(axis=1) / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, F32(1) / d, F32(0)).astype(F32)
    q = np.clip(np.rint(xb * inv[:, None]), -127, 127).astype(np.int8)
    bsum = np.cumsum(xb, axis=1, dtype=F32)[:, -1]
    return q.reshape(-1), d, bsum


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a * b + c`` rounded once to float32, as a fused multiply-add, for float32 inputs.

    The float64 product of two float32 is exact; TwoSum gives the float64 sum
    ``s`` and its exact error ``e``. Rounding ``s`` to float32 is then correct
    unless ``s`` lies exactly halfway between two float32 and ``e`` is not
    zero: then the exact value lies on ``e``'s side of the tie.
    """
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = np.broadcast_to(c, p.shape).astype(np.float64)
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    r64 = r.astype(np.float64)
    toward = np.where(s > r64, F32(np.inf), F32(-np.inf)).astype(F32)
    other = np.nextafter(r, toward)
    tie = (r64 != s) & ((r64 + other.astype(np.float64)) / 2 == s) & (e != 0)
    pick_other = tie & (np.sign(e) == np.sign(other.astype(np.float64) - s))
    return np.where(pick_other, other, r).astype(F32)


def tree16(acc: np.ndarray) -> np.ndarray:
    """The kernels' fixed sum of sixteen lanes: lane k with lane k + 8, then a tree of eight."""
    t = acc[:, :8] + acc[:, 8:]
    return ((t[:, 0] + t[:, 4]) + (t[:, 2] + t[:, 6])) + ((t[:, 1] + t[:, 5]) + (t[:, 3] + t[:, 7]))


def ref_rows_q(buf: np.ndarray, fmt, shape, x: np.ndarray) -> np.ndarray:
    """The quantized matvec exactly as czk.c states it, in numpy float32 operations."""
    rows, cols = shape
    pm = prepare(buf, fmt, shape)
    nb, bpg = cols // 32, fmt.group_size // 32
    npair = (nb + 1) // 2
    codes = np.zeros((rows, 64 * npair), np.int32)
    codes[:, :cols] = unpack_codes(pm.codes, fmt.bits, cols)
    q, sx, bsum = ref_quantize_input(x)
    qp = np.zeros(64 * npair, np.int32)
    qp[:cols] = q
    if fmt.bits == 4:  # pair order: even codes of both blocks, then odd codes of both
        order = np.r_[0:32:2, 32:64:2, 1:32:2, 33:64:2]
        blk = (np.arange(16) >> 2) & 1
    else:
        order = np.arange(64)
        blk = np.arange(16) >> 3
    scales = pm.scales.astype(F32)
    mins = pm.mins.astype(F32)
    acc = np.zeros((rows, 16), F32)
    for p in range(npair):
        c = codes[:, 64 * p : 64 * p + 64][:, order]
        xq = qp[64 * p : 64 * p + 64][order]
        lanes = (c * xq[None]).reshape(rows, 16, 4).sum(axis=-1).astype(F32)  # exact integers
        s = np.zeros((rows, 2), F32)
        for j in range(2):
            b = 2 * p + j
            if b < nb:
                s[:, j] = scales[:, b // bpg] * sx[b]
        acc = fma32(lanes, s[:, blk], acc)
    mt = np.zeros((rows, 16), F32)
    for g in range(cols // fmt.group_size):
        gs = F32(0)
        for b in range(g * bpg, (g + 1) * bpg):
            gs = F32(gs + bsum[b])
        mt[:, g % 16] = fma32(mins[:, g], np.full(rows, gs, F32), mt[:, g % 16])
    return tree16(acc) + tree16(mt)


def test_fma32_is_a_fused_multiply_add():
    """The reference's emulation against exact rational arithmetic, ties included."""
    from fractions import Fraction

    rng = np.random.default_rng(5)
    a = rng.integers(-(2**17), 2**17, 4000).astype(F32)
    b = (rng.standard_normal(4000) * 2.0 ** rng.integers(-20, 5, 4000)).astype(F32)
    c = (rng.standard_normal(4000) * 2.0 ** rng.integers(-20, 20, 4000)).astype(F32)
    # ties: c + a*b exactly halfway between two float32 (a*b half an ulp of c)
    a[:50], b[:50] = F32(1), F32(1)
    ulp = np.spacing(np.abs(c[:50])).astype(np.float64)
    b[:50] = (ulp / 2).astype(F32)
    got = fma32(a, b, c)
    for i in range(4000):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))  # float() rounds to nearest double, then to float32
        cands = [lo, np.nextafter(lo, F32(np.inf)), np.nextafter(lo, F32(-np.inf))]
        errs = [abs(Fraction(float(v)) - exact) for v in cands]
        best = min(errs)
        ok = [v for v, e in zip(cands, errs, strict=True) if e == best]
        if len(ok) > 1:  # a tie: round half to even
            ok = [v for v in ok if int(np.array(v).view(np.uint32)) % 2 == 0]
        assert got[i] == ok[0], (i, a[i], b[i], c[i])


def _kern(threads: int = 1, hidden: int = 64) -> fused.DecodeKernels:
    return fused.DecodeKernels(hidden, 16, 4, threads)


def test_input_quantization_matches_numpy(level):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(256) * rng.uniform(0.01, 10, 256)).astype(F32)
    x[32:64] = 0.0  # an all-zero block: scale 0, codes 0
    q = np.zeros(256, np.int8)
    sx = np.zeros(8, F32)
    bs = np.zeros(8, F32)
    ffi = fused._ffi
    fused._lib.czk_quantize_input(
        ffi.cast("float *", ffi.from_buffer(x)), 256, ffi.cast("int8_t *", ffi.from_buffer(q)),
        ffi.cast("float *", ffi.from_buffer(sx)), ffi.cast("float *", ffi.from_buffer(bs)),
    )  # fmt: skip
    wq, wsx, wbs = ref_quantize_input(x)
    assert np.array_equal(q, wq) and np.array_equal(sx, wsx) and np.array_equal(bs, wbs)
    assert np.abs(q).max() == 127 and not q[32:64].any()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("wide", [False, True])
def test_quantized_matvec_is_exactly_its_numpy_reference(level, name, wide):
    fmt = get_format(name)
    rng = np.random.default_rng(1)
    # wide: an odd block count for 32-column groups (a pair's second block missing),
    # more than one input padding unit (512 columns) and a row count below four
    rows, cols = (9, 21 * fmt.group_size) if wide else (37, 3 * max(fmt.group_size, 64))
    w = rng.standard_normal((rows, cols)).astype(F32)
    buf = quantize(w, fmt, method="minmax")
    x = rng.standard_normal(cols).astype(F32)
    k = _kern()
    y = np.zeros(rows, F32)
    k.matvec(prepare(buf, fmt, (rows, cols)), x, y)
    want = ref_rows_q(buf, fmt, (rows, cols), x)
    assert np.array_equal(y, want), np.abs(y - want).max()
    # and close to the float product with the dequantized weights (8-bit input)
    wd = dequantize(buf, fmt, (rows, cols)).astype(np.float64)
    bound = (np.abs(wd) @ np.abs(x.astype(np.float64))) / 127 + 1e-5
    assert (np.abs(y - wd @ x.astype(np.float64)) <= bound).all()
    k.close()


@pytest.mark.parametrize("name", ["q8", "q4", "q4g64", "q2", "q2g32"])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5, 8, 9, 12, 16, 17])
def test_short_rows_are_exactly_their_numpy_reference(level, name, groups):
    """Rows of fewer blocks than a SIMD step (a small model's): the scales and mins of
    every count load exactly, for the decode product and for a prompt's tokens."""
    fmt = get_format(name)
    rng = np.random.default_rng(groups)
    rows, cols = 6, groups * fmt.group_size
    buf = quantize(rng.standard_normal((rows, cols)).astype(F32), fmt, method="minmax")
    w = prepare(buf, fmt, (rows, cols))
    x = rng.standard_normal((3, cols)).astype(F32)
    k = _kern()
    y = np.zeros((3, rows), F32)
    for t in range(3):
        k.matvec(w, x[t], y[t])
        assert np.array_equal(y[t], ref_rows_q(buf, fmt, (rows, cols), x[t]))
    assert np.array_equal(fused.quant_matmul(w, x), y)
    k.close()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_float_matvec_within_float32_rounding(level, dtype):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((33, 200)).astype(F32)
    if dtype == "f16":
        stored = w.astype(np.float16)
        wf = stored.astype(np.float64)
    elif dtype == "bf16":
        stored = (w.view(np.uint32) >> 16).astype(np.uint16)
        wf = (stored.astype(np.uint32) << 16).view(F32).astype(np.float64)
    else:
        stored, wf = w, w.astype(np.float64)
    x = rng.standard_normal(200).astype(F32)
    k = _kern()
    m = fused._ffi.new("czk_mat *")
    keep = fused.describe(stored, m, bf16=dtype == "bf16")
    y = np.zeros(33, F32)
    k._matvec(m, fused._fptr(x), fused._fptr(y))
    want = wf @ x.astype(np.float64)
    assert np.abs(y - want).max() <= 1e-6 * (np.abs(wf) @ np.abs(x)).max() + 1e-6
    del keep
    k.close()


def test_describe_refuses_unknown_weights():
    m = fused._ffi.new("czk_mat *")
    with pytest.raises(fused.KernelError):
        fused.describe(np.zeros((4, 32), np.int32), m)
    with pytest.raises(fused.KernelError):
        fused.describe(np.zeros((32, 4), F32).T, m)


class _Slots:
    """The three members of an ExpertTable a MoE call needs, from arrays."""

    def __init__(self, experts, fmt=None):
        self.table = fused._ffi.new("czk_mat[]", 3 * len(experts))
        self.keep = []
        for s, parts in enumerate(experts):
            for j, p in enumerate(parts):
                w = p if fmt is None else prepare(quantize(p, fmt, method="minmax"), fmt, p.shape)
                self.keep += fused.describe(w, self.table[3 * s + j])


def _moe(kern, table, slots, w, x):
    np.copyto(kern.x, x)
    kern._experts = (table, table, 0, 64, 96)  # (cache, table, n_experts, H, I)
    slots = np.asarray(slots, np.int64)
    kern._reserve(int(fused._lib.czk_moe_work_bytes(len(slots), 64, 96)))
    kern.moe(table, slots, np.asarray(w, F32))
    return kern.y.copy()


def _experts(seed, n=5, hidden=64, inter=96):
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.standard_normal((inter, hidden)) / 8).astype(F32),
            (rng.standard_normal((inter, hidden)) / 8).astype(F32),
            (rng.standard_normal((hidden, inter)) / 8).astype(F32),
        )
        for _ in range(n)
    ]


def _moe_ref(experts, slots, w, x):
    x = x.astype(np.float64)
    y = np.zeros(x.size)
    for s, wj in zip(slots, w):
        g, u, d = (a.astype(np.float64) for a in experts[s])
        gx = g @ x
        y += wj * (d @ (gx / (1 + np.exp(-gx)) * (u @ x)))
    return y


@pytest.mark.parametrize("fmt", [None, "q8", "q4"])
def test_moe_layer_matches_float64_reference(level, fmt):
    experts = _experts(4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(64).astype(F32)
    slots, w = [3, 0, 4], [0.5, 0.3, 0.2]
    table = _Slots(experts, None if fmt is None else get_format(fmt))
    kern = _kern()
    got = _moe(kern, table, slots, w, x)
    if fmt is None:
        want = _moe_ref(experts, slots, w, x)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    else:  # the dequantized weights in float64; the 8-bit inputs bound the error
        f = get_format(fmt)
        deq = [
            tuple(dequantize(quantize(p, f, method="minmax"), f, p.shape) for p in e)
            for e in experts
        ]
        want = _moe_ref(deq, slots, w, x)
        assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()
    kern.close()


@pytest.mark.parametrize("fmt", [None, "q8", "q4"])
def test_one_expert_at_a_time_in_any_arrival_order_is_bit_identical(level, fmt):
    # The pipelined decode computes resident experts first and each read as it lands;
    # the sum stays in top-k order, so the output is czk_moe's to the bit.
    experts = _experts(9)
    x = np.random.default_rng(10).standard_normal(64).astype(F32)
    slots, w = np.array([3, 0, 4, 1], np.int64), np.array([0.4, 0.3, 0.2, 0.1], F32)
    table = _Slots(experts, None if fmt is None else get_format(fmt))
    kern = _kern()
    want = _moe(kern, table, slots, w, x)
    kern._reserve(int(fused._lib.czk_moe_one_work_bytes(len(slots), 64, 96)))
    for pending in ([], [0], [2, 0], [3, 2, 1, 0]):
        waited: list[int] = []
        kern.y[:] = np.nan
        kern.moe_streamed(table, slots, w, pending, waited.append)
        assert waited == pending
        assert np.array_equal(kern.y, want), pending
    kern.close()


def test_one_expert_at_a_time_mixes_formats_in_one_sum(level):
    # A tiered layer holds some experts at q8 and others at q4: each expert's own format.
    experts = _experts(11, n=4)
    fmts = [get_format("q8"), get_format("q4"), get_format("q4"), get_format("q8")]
    table = fused._ffi.new("czk_mat[]", 12)
    keep = []
    for s, (parts, f) in enumerate(zip(experts, fmts, strict=True)):
        for j, p in enumerate(parts):
            packed = prepare(quantize(p, f, method="minmax"), f, p.shape)
            keep += fused.describe(packed, table[3 * s + j])
    deq = [
        tuple(dequantize(quantize(p, f, method="minmax"), f, p.shape) for p in e)
        for e, f in zip(experts, fmts, strict=True)
    ]
    x = np.random.default_rng(12).standard_normal(64).astype(F32)
    slots, w = np.array([1, 0, 2, 3], np.int64), np.array([0.4, 0.3, 0.2, 0.1], F32)
    kern = _kern()
    holder = type("T", (), {"table": table})()
    whole = _moe(kern, holder, slots, w, x)
    kern._reserve(int(fused._lib.czk_moe_one_work_bytes(4, 64, 96)))
    kern.moe_streamed(holder, slots, w, [2], lambda j: None)
    assert np.array_equal(kern.y, whole)
    want = _moe_ref(deq, slots, w, x)
    assert np.abs(kern.y - want).max() <= 0.03 * np.abs(want).max()
    del keep
    kern.close()


@pytest.mark.parametrize("fmt", [None, "q4"])
def test_kernels_are_bit_identical_for_every_thread_count(split_loops, fmt):
    experts = _experts(6)
    x = np.random.default_rng(7).standard_normal(64).astype(F32)
    table = _Slots(experts, None if fmt is None else get_format(fmt))
    w = np.random.default_rng(8).standard_normal((67, 64)).astype(F32)
    mat = w if fmt is None else prepare(quantize(w, get_format(fmt), method="minmax"), fmt, w.shape)
    outs = []
    for threads in (1, 2, 3):
        kern = _kern(threads)
        y = np.zeros(67, F32)
        kern.matvec(mat, x, y)
        outs.append(np.concatenate([y, _moe(kern, table, [2, 4, 1], [0.6, 0.3, 0.1], x)]))
        kern.close()
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_engine_output_is_bit_identical_for_every_thread_count(split_loops):
    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    model = tiny_model("mixtral", hidden_size=64, intermediate_size=64)
    runs = []
    for threads in (1, 2, 3):
        eng = Engine(StateDictConsumer(model), threads=threads)
        assert eng.threads == threads and eng.model.decode_in_c()
        logits = [eng.prefill([5, 9, 200, 17])]
        for _ in range(6):
            logits.append(eng.decode(int(np.argmax(logits[-1]))))
        eng.close()
        runs.append(np.stack(logits))
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])


def test_engine_threads_default_to_the_affinity():
    import os

    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    eng = Engine(StateDictConsumer(tiny_model("mixtral", hidden_size=64, intermediate_size=64)))
    assert eng.threads == len(os.sched_getaffinity(0))
    eng.close()
    with pytest.raises(ValueError):
        Engine(StateDictConsumer(tiny_model("mixtral")), threads=0)


def test_run_cli_threads_flag_gives_the_same_text(tmp_path, capsys, split_loops):
    from czyx.cli import main
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.testing.tiny_models import make_tiny_checkpoint

    cfg = dict(vocab_size=256, max_position_embeddings=512, eos_token_id=None, bos_token_id=None)
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=0, **cfg)
    with Store.open(tmp_path / "st") as st:
        mount(st, ckpt, "tiny@1")
    texts = []
    for threads in ("1", "2"):
        argv = ["run", "tiny@1", "--store", str(tmp_path / "st"), "--prompt", "def f(x):"]
        assert main([*argv, "--max-tokens", "8", "--threads", threads]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0]
    bad = ["run", "tiny@1", "--store", str(tmp_path / "st"), "--prompt", "x", "--threads", "0"]
    assert main(bad) != 0 and "--threads 0" in capsys.readouterr().err


@pytest.mark.parametrize("name", FORMATS)
def test_embedding_row_is_exactly_dequantize(name):
    fmt = get_format(name)
    w = np.random.default_rng(9).standard_normal((11, 2 * fmt.group_size)).astype(F32)
    buf = quantize(w, fmt, method="minmax")
    k = _kern(hidden=w.shape[1])
    k.embed(prepare(buf, fmt, w.shape), 7)
    assert np.array_equal(k.h, dequantize(buf, fmt, w.shape, rows=np.array([7]))[0])
    k.embed(w, 3)
    assert np.array_equal(k.h, w[3])
    k.close()


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("mixtral", dict(sliding_window=5)),
        ("mixtral", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
        ("qwen2_moe", dict(use_sliding_window=True, sliding_window=5, max_window_layers=3)),
        ("mixtral", dict(num_attention_heads=6, num_key_value_heads=3)),
        ("olmoe", {}),
        ("olmoe", dict(clip_qkv=0.5, num_attention_heads=4, num_key_value_heads=2)),
    ],
)
def test_decode_block_matches_transformers_on_config_variants(arch, overrides):
    """The C attention block (sliding window, linear RoPE, biases, GQA, OLMoE's
    full-width q/k norms and clamp) vs transformers."""
    import torch

    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    prompt = np.random.default_rng(11).integers(0, 256, 12)
    model = tiny_model(arch, seed=5, **overrides)
    with torch.no_grad():
        want = model(torch.tensor(prompt)[None]).logits[0].numpy()
    eng = Engine(StateDictConsumer(model), threads=1)
    assert eng.model._all_c or arch == "qwen2_moe"  # qwen2: numpy shared expert, C attention
    got = [eng.prefill(prompt[:4])]
    got += [eng.decode(int(t)) for t in prompt[4:]]
    tol = 1e-4 * float(want.max() - want.min())
    assert np.abs(np.stack(got) - want[3:]).max() <= tol


@pytest.mark.parametrize(
    "dtype, kind", [("bfloat16", fused.KIND_BF16), ("float16", fused.KIND_F16)]
)
def test_half_precision_slots_are_computed_as_stored(tmp_path, dtype, kind):
    """A bf16/f16 store: the decode kernels read the slots' half words (no float32 copy)
    and give the logits of the numpy path that widens each expert first."""
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.testing.tiny_models import make_tiny_checkpoint

    cfg = dict(vocab_size=256, max_position_embeddings=512, eos_token_id=None, bos_token_id=None)
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=0, dtype=dtype, **cfg)
    with Store.open(tmp_path / "st") as st:
        mount(st, ckpt, "tiny@1")
    runs = []
    for use_c in (True, False):
        opened = OpenedModel(tmp_path / "st", "tiny@1", None)
        eng = Engine(opened.consumer, threads=1, stream=None)
        assert eng.cache.format == ("bf16" if dtype == "bfloat16" else "f16")
        eng.model._czk = use_c
        logits = [eng.prefill([3, 1, 4, 1, 5])]
        logits += [eng.decode(t) for t in (9, 2, 6)]
        if use_c:
            kinds = {eng.model._kernels._experts[1].table[j].kind for j in range(3)}
            assert kinds == {kind}
        eng.close()
        opened.close()
        runs.append(np.stack(logits))
    want = runs[1]
    assert np.abs(runs[0] - want).max() <= 1e-4 * float(want.max() - want.min())


@pytest.mark.parametrize("clip", [None, 0.5])
def test_olmoe_decodes_in_c_as_its_numpy_attention(clip):
    """OLMoE's q/k norms in czk_attn_decode against the decoder's numpy attention."""
    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    prompt = np.random.default_rng(12).integers(0, 256, 10)
    model = tiny_model("olmoe", seed=6, clip_qkv=clip)
    logits = []
    for fast in (True, False):
        eng = Engine(StateDictConsumer(model), threads=1)
        assert eng.model.decode_in_c()
        eng.model._fast_attn = fast  # False: numpy attention, the rest unchanged
        out = [eng.prefill(prompt[:3])]
        out += [eng.decode(int(t)) for t in prompt[3:]]
        logits.append(np.stack(out))
    c, ref = logits
    assert np.abs(c - ref).max() <= 1e-5 * float(ref.max() - ref.min())


@pytest.mark.parametrize("window", [None, 20])
def test_attention_over_spans_of_every_length_is_the_numpy_attention(level, window):
    """The SIMD paths' heads (eight scores at a time, their softmax's exp a polynomial,
    the last few positions in a padded block) against the decoder's numpy attention:
    spans of 1 to 70 positions (every remainder mod 8, several blocks), from position
    0 and, in a sliding window, from positions no block boundary lines up with."""
    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    prompt = np.random.default_rng(3).integers(0, 256, 70)
    model = tiny_model("mixtral", seed=4, hidden_size=64, sliding_window=window)
    assert model.config.hidden_size // model.config.num_attention_heads % 8 == 0
    logits = []
    for fast in (True, False):
        eng = Engine(StateDictConsumer(model), threads=1)
        assert eng.model.decode_in_c()
        eng.model._fast_attn = fast  # False: numpy attention, the rest unchanged
        out = [eng.decode(int(t)) for t in prompt]  # the token at position p: p + 1 keys
        eng.reset()
        out.append(eng.prefill(prompt))  # the batched step's prompt path, the same heads
        logits.append(np.stack(out))
        eng.close()
    c, ref = logits
    assert np.abs(c - ref).max() <= 1e-5 * float(ref.max() - ref.min())


@pytest.mark.parametrize("heads, kv_heads", [(16, 2), (32, 1)])
def test_query_heads_sharing_a_kv_head_run_together_as_alone(level, split_loops, heads, kv_heads):
    """The SIMD heads go through a key-value head's rows once for the query heads that
    share it (up to 16 at a time, values in blocks of 32 positions): against the numpy
    attention, and bit for bit whatever the thread split cuts a group into (one
    thread, and three, which split the heads mid-group)."""
    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    prompt = np.random.default_rng(9).integers(0, 256, 75)
    model = tiny_model(
        "qwen3_moe", seed=5, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=16 if heads == 32 else 32,
    )  # fmt: skip
    runs = []
    for fast, threads in ((True, 1), (True, 3), (False, 1)):
        eng = Engine(StateDictConsumer(model), threads=threads)
        eng.model._fast_attn = fast  # False: numpy attention, the rest unchanged
        out = [eng.prefill(prompt[:40])] + [eng.decode(int(t)) for t in prompt[40:]]
        runs.append(np.stack(out))
        eng.close()
    one, three, ref = runs
    assert np.array_equal(one, three)
    assert np.abs(one - ref).max() <= 1e-5 * float(ref.max() - ref.min())


def test_attention_refuses_a_bad_qk_norm_mode():
    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    eng = Engine(StateDictConsumer(tiny_model("olmoe", seed=6)), threads=1)
    m, kern = eng.model, eng.model.kernels()
    cfg = m.cfg
    kv = np.zeros((cfg.n_kv_heads, 8, cfg.head_dim), F32)
    with pytest.raises(fused.KernelError, match="qk_norm"):
        kern.attention(
            m.layers[0], kv, kv.copy(), 0, None, m.rotary, cfg.rms_eps,
            cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 3,
        )  # fmt: skip


@pytest.mark.parametrize("name", ["q8", "q4", "q2", "q4g64", "q8g64"])
def test_quantized_matmul_rows_are_exactly_the_matvec(level, split_loops, name):
    """czk_matmul (a prefill's tokens) gives each token exactly czk_matvec's result."""
    fmt = get_format(name)
    rng = np.random.default_rng(3)
    rows, cols = 13, 7 * fmt.group_size
    buf = quantize(rng.standard_normal((rows, cols)).astype(F32), fmt, method="minmax")
    w = prepare(buf, fmt, (rows, cols))
    x = rng.standard_normal((7, cols)).astype(F32)  # a chunk of four, then three
    k = _kern(threads=2)
    want = np.zeros((7, rows), F32)
    for t in range(7):
        k.matvec(w, x[t], want[t])
    got = fused.quant_matmul(w, x)
    assert np.array_equal(got, want)
    assert np.array_equal(fused.quant_matmul(w, x[4:5]), want[4:5])  # one
    assert np.array_equal(fused.quant_matmul(w, x[5:7]), want[5:7])  # two
    k.close()


def test_quant_matmul_refuses_float_weights():
    with pytest.raises(fused.KernelError):
        fused.quant_matmul(np.zeros((4, 32), F32), np.zeros((1, 32), F32))


@pytest.mark.parametrize("name", ["q8", "q4", "q3"])
def test_quant_matmul_on_a_pool_is_bit_identical_for_every_thread_count(split_loops, name):
    """A prompt's products split over the engine's threads (pool_scope) give the same bits."""
    fmt = get_format(name)
    rng = np.random.default_rng(11)
    rows, cols = 29, 5 * fmt.group_size
    buf = quantize(rng.standard_normal((rows, cols)).astype(F32), fmt, method="minmax")
    w = prepare(buf, fmt, (rows, cols))
    x = rng.standard_normal((7, cols)).astype(F32)
    want = fused.quant_matmul(w, x)  # no scope: the calling thread alone
    for threads in (1, 2, 3):
        pool = fused.Pool(threads)
        with fused.pool_scope(pool):
            got = fused.quant_matmul(w, x)
        assert np.array_equal(fused.quant_matmul(w, x), want)  # the scope has ended
        pool.close()
        assert np.array_equal(got, want)


def test_a_pool_shared_by_two_threads_gives_each_its_own_results(split_loops):
    """Two Python threads using one pool at once: one runs its loop alone, results unchanged."""
    import threading

    fmt = get_format("q4")
    rng = np.random.default_rng(12)
    ws = [
        prepare(quantize(rng.standard_normal((37, 256)).astype(F32), fmt, method="minmax"),
                fmt, (37, 256))
        for _ in range(2)
    ]  # fmt: skip
    xs = [rng.standard_normal((5, 256)).astype(F32) for _ in range(2)]
    wants = [fused.quant_matmul(w, x) for w, x in zip(ws, xs)]
    pool = fused.Pool(2)
    bad = []

    def work(j: int) -> None:
        with fused.pool_scope(pool):
            for _ in range(200):
                if not np.array_equal(fused.quant_matmul(ws[j], xs[j]), wants[j]):
                    bad.append(j)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.close()
    assert bad == []


def test_a_parked_pool_runs_the_next_loops_with_the_same_results(split_loops):
    """``Pool.park`` between loops (the batched step parks the pool after its kernels):
    every later loop still runs, split over the woken workers, with the same bits; parking
    a closed pool does nothing."""
    fmt = get_format("q8")
    rng = np.random.default_rng(14)
    w = prepare(quantize(rng.standard_normal((41, 256)).astype(F32), fmt, method="minmax"),
                fmt, (41, 256))  # fmt: skip
    x = rng.standard_normal((6, 256)).astype(F32)
    want = fused.quant_matmul(w, x)
    pool = fused.Pool(3)
    with fused.pool_scope(pool):
        for i in range(200):
            assert np.array_equal(fused.quant_matmul(w, x), want)
            if i % 3:
                pool.park()
            if i % 7 == 0:
                pool.park()  # twice in a row: still the same
    pool.close()
    pool.park()


@pytest.mark.parametrize("cols", [608, 1024])
def test_q8_prompt_kernel_is_exactly_the_matvec_on_wide_rows(level, cols):
    """Rows of several scale chunks and m-term lane groups (an odd block count at 608):
    the 8-bit prompt kernel's outputs are the decode kernel's, bit for bit."""
    fmt = get_format("q8")
    rng = np.random.default_rng(13)
    w = prepare(quantize(rng.standard_normal((21, cols)).astype(F32), fmt, method="minmax"),
                fmt, (21, cols))  # fmt: skip
    x = rng.standard_normal((5, cols)).astype(F32)
    k = _kern(threads=1)
    want = np.zeros((5, 21), F32)
    for t in range(5):
        k.matvec(w, x[t], want[t])
    k.close()
    assert np.array_equal(fused.quant_matmul(w, x), want)
