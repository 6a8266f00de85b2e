"""QuantCodec: the mount's and the model reader's view of quantization."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.store.quant.codec import QuantCodec, expert_parts, trunk_tensor
from czyx.store.quant.errors import QuantError
from czyx.store.quant.formats import dequantize, quantize
from czyx.store.quant.policy import POLICIES


def test_trunk_round_trip_and_policy():
    rng = np.random.default_rng(0)
    codec = QuantCodec(POLICIES["selective"])
    q = rng.standard_normal((32, 64)).astype(np.float16)  # a source stored in fp16
    buf, name = codec.encode_trunk("q_proj", 0, q)
    assert name == "q4" and np.array_equal(buf, quantize(q.astype(np.float32), "q4"))
    rec = {"qfmt": name, "shape": [32, 64], "dtype": "F16"}
    flt, packed = trunk_tensor(rec, buf)
    assert np.array_equal(flt, dequantize(buf, "q4", (32, 64)))
    assert packed[1].name == "q4" and packed[2] == (32, 64)
    assert codec.encode_trunk("router", 0, q)[1] is None
    assert codec.encode_trunk("input_norm", 0, q[0])[1] is None
    with pytest.raises(QuantError):
        trunk_tensor({"shape": [32, 64]}, buf)
    with pytest.raises(QuantError):
        trunk_tensor({"qfmt": "q4", "shape": [2048]}, buf)


def test_experts_use_their_own_importance():
    rng = np.random.default_rng(1)
    gate, up = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((64, 64)).astype(np.float32)
    imp = {"L1.E3.in": rng.exponential(size=64).astype(np.float32) ** 4}
    codec = QuantCodec(POLICIES["selective"], imp, {"text_sha256": "ab", "n_tokens": 5})
    lay = codec.expert_layout(64, 64)
    assert lay.fmt.name == "q2"
    with_imp = codec.encode_expert(lay, 1, 3, gate, up, down)
    without = codec.encode_expert(lay, 1, 4, gate, up, down)  # E4 has no map
    g1, _, d1 = expert_parts("q2", 64, 64, with_imp)
    g0, _, d0 = expert_parts("q2", 64, 64, without)
    assert not np.array_equal(g1, g0)
    assert np.array_equal(d1, d0)  # no down_in map for either
    assert codec.manifest()["policy"] == "selective"
    assert codec.manifest()["importance"]["n_tokens"] == 5
    assert QuantCodec(POLICIES["none"]).expert_layout(64, 64) is None


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
def test_raw_source_bytes_decode_like_the_float_tensors(dtype):
    from czyx.store.models.checkpoint import to_float32

    rng = np.random.default_rng(2)
    f = rng.standard_normal(3 * 32 * 64).astype(np.float32)
    if dtype == "F16":
        raw = f.astype(np.float16).view(np.uint8)
    elif dtype == "BF16":
        raw = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = f.view(np.uint8)
    wide = to_float32(
        raw.view({"F16": np.float16, "BF16": np.uint16, "F32": np.float32}[dtype]), dtype
    )
    codec = QuantCodec(POLICIES["q4-all"])
    lay = codec.expert_layout(32, 64)
    n = 32 * 64
    want = codec.encode_expert(
        lay,
        0,
        0,
        wide[:n].reshape(32, 64),
        wide[n : 2 * n].reshape(32, 64),
        wide[2 * n :].reshape(64, 32),
    )
    assert np.array_equal(codec.encode_expert_raw(lay, 0, 0, raw, dtype), want)
    item = 4 if dtype == "F32" else 2
    tbuf, q = codec.encode_trunk_raw("o_proj", 0, raw[: n * item], dtype, (32, 64))
    assert q == "q4" and tbuf.size == lay.fmt.nbytes(32, 64)
    same, none = codec.encode_trunk_raw("input_norm", 0, raw[: 64 * item], dtype, (64,))
    assert none is None and np.array_equal(same, raw[: 64 * item])  # float: bytes as given
