"""GGUF for the architectures llama.cpp converts beyond the first four: PhiMoE.

A PhiMoE model written the way llama.cpp's converter lays it out
(``PhiMoeModel``: the ``phimoe`` arch, experts stacked as
``ffn_{gate,up,down}_exps``, LayerNorm, attention and head biases kept,
NEOX rope unpermuted) mounts and runs with transformers' logits and greedy
tokens (the file is read as the HF checkpoint it was converted from, so
czyx runs its sparsemixer routing); ``export --format gguf`` writes it back
tensor for tensor; a safetensors PhiMoE exports to a GGUF that mounts again
with the same logits. What GGUF cannot hold (PhiMoE's longrope mscales, a
non-default ``router_jitter_noise``) is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx import portals
from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.kernels.linear import float_inputs
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.gguf import ARCHS as GGUF_ARCHS
from czyx.store.models.gguf import UnsupportedGGUFError, config_from_gguf
from czyx.store.models.gguf_export import export_gguf
from czyx.store.models.mount import mount
from czyx.testing.archparity import reference
from czyx.testing.gguf_writer import reference_model, write_gguf
from czyx.testing.tiny_models import build_tiny_model

PROMPT = np.random.default_rng(5).integers(0, 96, 12)
# GGUF quant blocks are 32 wide along rows: every row length a multiple of 32.
DIMS = dict(hidden_size=64, intermediate_size=64, initializer_range=0.2, router_jitter_noise=0.01)


def phimoe(**kw):
    return build_tiny_model("phimoe", 3, **{**DIMS, **kw})


def _run(store_dir, tag, steps=12):
    with Store.open(store_dir) as store:
        token = portals.root_token(store)
    with OpenedModel(str(store_dir), tag, token) as opened, float_inputs():
        logits = Engine(opened.consumer).prefill(PROMPT, all_logits=True)
        tokens, _ = generate_ids(Engine(opened.consumer), PROMPT.tolist(), steps)
    return logits, tokens


@pytest.mark.parametrize(("qtype", "window"), [("f32", None), ("f16", 5), ("q8_0", None)])
def test_phimoe_gguf_runs_as_transformers(tmp_path, qtype, window):
    model = phimoe(sliding_window=window)
    write_gguf(model, tmp_path / "m.gguf", qtype)
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
    got, tokens = _run(tmp_path / "s", "m@1")
    want, want_tokens = reference(reference_model(model, qtype), PROMPT, 12)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens


def test_phimoe_gguf_exports_back_tensor_for_tensor(tmp_path):
    import gguf

    write_gguf(phimoe(), tmp_path / "in.gguf", "q8_0")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "in.gguf", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    src = {t.name: t for t in gguf.GGUFReader(tmp_path / "in.gguf").tensors}
    out = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert set(src) == set(out) and "blk.0.attn_norm.bias" in out and "output.bias" in out
    for name, t in src.items():
        assert out[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(out[name].data), np.asarray(t.data)), name
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "phimoe"


def test_safetensors_phimoe_exports_to_a_gguf_that_runs_the_same(tmp_path):
    model = phimoe(sliding_window=7)
    model.save_pretrained(tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    with Store.open(tmp_path / "s2") as store:
        mount(store, path, "g@1")
    got, tokens = _run(tmp_path / "s2", "g@1")
    want, want_tokens = reference(model, PROMPT, 12)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens


def test_what_gguf_cannot_hold_is_refused(tmp_path):
    model = phimoe(router_jitter_noise=0.3)
    model.save_pretrained(tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1")
        with pytest.raises(UnsupportedGGUFError, match="router_jitter_noise"):
            export_gguf(store, "m@1", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    # a converter's longrope file: an attention factor and rope factor tensors
    meta = {f"phimoe.{k}": 4 for k in ("embedding_length", "attention.head_count")}
    meta |= {"phimoe.block_count": 1, "phimoe.expert_count": 4, "phimoe.expert_used_count": 2}
    with pytest.raises(UnsupportedGGUFError, match="longrope"):
        config_from_gguf(
            {**meta, "phimoe.rope.scaling.attn_factor": 1.19}, GGUF_ARCHS["phimoe"], 8, True
        )
    with pytest.raises(UnsupportedGGUFError, match="longrope"):
        config_from_gguf(meta, GGUF_ARCHS["phimoe"], 8, True, ["rope_factors_long.weight"])
