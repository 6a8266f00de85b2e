"""QuantizedConsumer: a float model seen through a policy, in memory."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.store.consumer import GLOBAL_ROLES, LAYER_ROLES
from czyx.store.quant.errors import QuantError
from czyx.store.quant.extent import ExpertLayout
from czyx.store.quant.formats import dequantize, quantize
from czyx.store.quant.memory import QuantizedConsumer
from czyx.store.quant.names import input_key
from czyx.store.quant.policy import POLICIES
from czyx.testing.refmodels import StateDictConsumer, tiny_model


@pytest.fixture(scope="module")
def base() -> StateDictConsumer:
    return StateDictConsumer(
        tiny_model(
            "qwen2_moe",
            hidden_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        )
    )


def test_policy_decides_per_role(base):
    q = QuantizedConsumer(base, POLICIES["selective"])
    assert q.trunk_quantized("input_norm", 0) is None
    assert q.trunk_quantized("router", 0) is None
    assert q.trunk_quantized("q_bias", 0) is None
    buf, fmt, shape = q.trunk_quantized("q_proj", 0)
    assert fmt.name == "q4" and shape == base.trunk("q_proj", 0).shape
    assert q.trunk_quantized("embed")[1].name == "q8"
    assert q.trunk_quantized("shared_down_proj", 0)[1].name == "q4"
    # the float face is the dequantized packed tensor, bit for bit
    assert np.array_equal(q.trunk("q_proj", 0), dequantize(buf, fmt, shape))
    assert np.array_equal(q.trunk("input_norm", 0), base.trunk("input_norm", 0))


def test_experts_are_packed_extents(base):
    q = QuantizedConsumer(base, POLICIES["selective"])
    lay = q.layout
    assert isinstance(lay, ExpertLayout) and lay.fmt.name == "q2g32"
    assert q.info.expert_format == "q2g32" and q.info.expert_nbytes == lay.nbytes
    assert q.info.expert_slot_nbytes % 4096 == 0
    slot = np.zeros(q.info.expert_slot_nbytes, np.uint8)
    q.read_expert(0, 3, slot)
    fslot = np.zeros(base.info.expert_slot_nbytes, np.uint8)
    base.read_expert(0, 3, fslot)
    gate = np.array(base.expert_views(fslot)[0])
    assert np.array_equal(q.expert_views(slot)[0], quantize(gate, lay.fmt))
    with pytest.raises(QuantError):
        q.read_expert(0, 3, np.zeros(8, np.uint8))


def test_model_bytes_shrink_in_policy_order(base):
    sizes = {p: sum(QuantizedConsumer(base, POLICIES[p]).model_nbytes()) for p in POLICIES}
    assert sizes["q2-all"] < sizes["selective"] < sizes["none"]
    assert sizes["q2-all"] < sizes["q4-all"] < sizes["none"]
    trunk, experts = QuantizedConsumer(base, POLICIES["none"]).model_nbytes()
    assert experts == 16 * base.info.expert_nbytes  # 2 sparse layers x 8 experts
    want = sum(
        base.trunk(r, layer).nbytes
        for r in LAYER_ROLES
        for layer in range(3)
        if base.has_trunk(r, layer)
    ) + sum(base.trunk(r).nbytes for r in GLOBAL_ROLES if base.has_trunk(r))
    assert trunk == want


def test_importance_changes_the_bytes_and_needs_names(base):
    rng = np.random.default_rng(0)
    imp = {f"L{i}.attn_in": rng.exponential(size=64).astype(np.float32) ** 3 for i in range(3)}
    plain = QuantizedConsumer(base, POLICIES["selective"])
    calib = QuantizedConsumer(base, POLICIES["selective"], imp, input_key)
    assert not np.array_equal(
        plain.trunk_quantized("q_proj", 0)[0], calib.trunk_quantized("q_proj", 0)[0]
    )
    assert np.array_equal(
        plain.trunk_quantized("o_proj", 0)[0], calib.trunk_quantized("o_proj", 0)[0]
    )
    with pytest.raises(QuantError):
        QuantizedConsumer(base, POLICIES["selective"], imp)
    with pytest.raises(QuantError):
        QuantizedConsumer(plain, POLICIES["selective"])  # not a float base


def test_a_missing_expert_is_an_error_not_a_hole(base):
    class Holed:
        info = base.info

        def __getattr__(self, name):
            return getattr(base, name)

        def read_expert(self, layer, router_byte, slot):
            if (layer, router_byte) == (2, 5):
                raise KeyError("extent (2, 5) lost")
            base.read_expert(layer, router_byte, slot)

    with pytest.raises(KeyError, match="lost"):
        QuantizedConsumer(Holed(), POLICIES["selective"])
    q = QuantizedConsumer(base, POLICIES["selective"])
    with pytest.raises(QuantError, match="layer 1 has no routed expert"):
        q.read_expert(1, 0, np.zeros(q.info.expert_slot_nbytes, np.uint8))  # the dense layer


def test_a_mounted_model_with_a_dense_layer(tmp_path):
    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.testing.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(
        "qwen2_moe",
        tmp_path / "ckpt",
        num_hidden_layers=3,
        mlp_only_layers=[1],
        hidden_size=64,
        moe_intermediate_size=32,
    )
    with Store.open(tmp_path / "store") as st:
        mount(st, ckpt, "q@1")
        with open_consumer(st, None, "q@1") as m:
            q = QuantizedConsumer(m, POLICIES["q4-all"])
            assert q.info.expert_format == "q4"
            assert sorted({layer for layer, _ in q._extents}) == [0, 2]  # layer 1 is dense
