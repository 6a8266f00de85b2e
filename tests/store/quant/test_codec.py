"""QuantCodec: the mount's and the model reader's view of quantization."""

from __future__ import annotations

import numpy as np
import pytest

from store.quant.codec import QuantCodec, expert_parts, trunk_tensor
from store.quant.errors import QuantError
from store.quant.formats import dequantize, quantize
from store.quant.policy import POLICIES


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
