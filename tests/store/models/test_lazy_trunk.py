"""The lazy trunk mode of ``store.model.open_model``: per-layer tensors read and verified per call.

Lazy and eager opens serve the same tensors (float and quantized); nothing
per-layer is read at open, so a corrupted layer tensor opens fine lazily and
raises the store's typed ``ChecksumError`` only where it is used, while the
eager open refuses it at once.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.portals import open_consumer
from czyx.store import ChecksumError, Store
from czyx.store.models.archs import FILE_ROLES
from czyx.store.models.model import ModelSpace
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import ExpertIndexError, MissingTrunkRoleError, ModelSpaceError
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.policy import POLICIES
from czyx.testing.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy")
    ckpt = make_tiny_checkpoint("qwen2_moe", root / "ck", hidden_size=64, vocab_size=128)
    store = Store.open(root / "store")
    mount(store, ckpt, "q@f32")
    mount(store, ckpt, "q@sel", quant=QuantCodec(POLICIES["selective"]))
    yield store
    store.close()


@pytest.mark.parametrize("tag", ["q@f32", "q@sel"])
def test_lazy_serves_what_eager_serves(mounted, tag):
    space = ModelSpace(mounted, tag)
    with (
        open_consumer(mounted, None, tag) as eager,
        open_consumer(mounted, None, tag, lazy_trunk=True) as lazy,
    ):
        assert lazy.lazy_trunk and not eager.lazy_trunk
        assert lazy.tokenizer_json() == eager.tokenizer_json()
        for role, layer in space.trunk:
            if role in FILE_ROLES:  # kept files (tokenizer, configs), not tensors
                continue
            assert lazy.has_trunk(role, layer) and eager.has_trunk(role, layer)
            assert np.array_equal(lazy.trunk(role, layer), eager.trunk(role, layer))
            qe, ql = eager.trunk_quantized(role, layer), lazy.trunk_quantized(role, layer)
            assert (qe is None) == (ql is None)
            if qe is not None:
                assert np.array_equal(qe[0], ql[0]) and qe[1:] == ql[1:]
            if layer is not None:  # a fresh array per call: the caller owns it
                assert lazy.trunk(role, layer) is not lazy.trunk(role, layer)
        assert not lazy.has_trunk("mlp_up_proj", 1) and not lazy.has_trunk("nonsense", 0)
        with pytest.raises(MissingTrunkRoleError):
            lazy.trunk("mlp_up_proj", 1)
        with pytest.raises(ValueError):
            lazy.trunk("nonsense", 0)
        for layer in range(lazy.info.n_layers):
            want = sum(r.record["len"] for (role, la), r in space.trunk.items() if la == layer)
            assert lazy.trunk_layer_nbytes(layer) == eager.trunk_layer_nbytes(layer) == want > 0
        with pytest.raises(ExpertIndexError):
            lazy.trunk_layer_nbytes(lazy.info.n_layers)
    with pytest.raises(ModelSpaceError, match="closed"):
        lazy.trunk("q_proj", 0)


def _corrupt(store, tag: str, role: str, layer: int | None) -> None:
    ref = ModelSpace(store, tag).trunk[(role, layer)]
    with open(store.block_path(ref.space), "r+b") as fh:
        fh.seek(ref.record["off"] + 5)
        byte = fh.read(1)
        fh.seek(ref.record["off"] + 5)
        fh.write(bytes([byte[0] ^ 0x10]))


def test_a_corrupt_layer_tensor_fails_at_use_lazily_and_at_open_eagerly(tmp_path):
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ck")
    with Store.open(tmp_path / "s") as s:
        mount(s, ckpt, "m@1")
        _corrupt(s, "m@1", "o_proj", 1)
        with pytest.raises(ChecksumError, match="o_proj layer 1"):
            open_consumer(s, None, "m@1")
        with open_consumer(s, None, "m@1", lazy_trunk=True) as m:
            assert m.has_trunk("o_proj", 1)  # answered without reading
            assert m.trunk("o_proj", 0).shape == m.trunk("q_proj", 1).shape[::-1]
            for _ in range(2):  # every call verifies: no bad bytes are ever cached
                with pytest.raises(ChecksumError, match="o_proj layer 1"):
                    m.trunk("o_proj", 1)
