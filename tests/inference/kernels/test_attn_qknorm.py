"""Qwen3-MoE's per-head q/k RMS norms (and its o_proj bias) in the C attention call.

``czk_attn_decode`` mode 2 normalises each query and key head on its own
with ``head_dim``-wide weights, as Qwen3-MoE does; the o_proj bias is added
after the output projection, before the residual add. Checked against the
decoder's numpy attention (same model, same everything else) and against
transformers. Bounds, not bit-equality: the C norms sum squares in order,
numpy's mean sums pairwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.kernels import fused
from czyx.testing.refmodels import StateDictConsumer, tiny_model

pytestmark = pytest.mark.skipif(not fused.have_czk(), reason="decode kernels not built")

VARIANTS = [
    {},
    dict(attention_bias=True),
    dict(use_sliding_window=True, sliding_window=5),
    dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8),
]


def _model(seed: int, **overrides):
    """A tiny Qwen3-MoE; with attention_bias its biases are made nonzero (they start at 0)."""
    import torch

    model = tiny_model("qwen3_moe", seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            for proj in (att.q_proj, att.k_proj, att.v_proj, att.o_proj):
                if proj.bias is not None:
                    proj.bias.copy_(0.5 * torch.randn(proj.bias.shape, generator=gen))
            # Non-trivial norm weights, so a norm over the wrong span shows.
            for norm in (att.q_norm, att.k_norm):
                norm.weight.copy_(1.0 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    return model


def _run(eng: Engine, prompt: np.ndarray, n_prefill: int) -> np.ndarray:
    out = [eng.prefill(prompt[:n_prefill])]
    out += [eng.decode(int(t)) for t in prompt[n_prefill:]]
    return np.stack(out)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_qwen3_decodes_in_c_as_its_numpy_attention(overrides):
    model = _model(7, **overrides)
    prompt = np.random.default_rng(13).integers(0, 256, 11)
    runs = []
    for fast in (True, False):
        eng = Engine(StateDictConsumer(model), threads=1)
        assert eng.model.decode_in_c() and eng.model._c_qkv == (2, None)
        eng.model._fast_attn = fast  # False: numpy attention, the rest unchanged
        runs.append(_run(eng, prompt, 3))
        eng.close()
    c, ref = runs
    assert np.abs(c - ref).max() <= 1e-5 * float(ref.max() - ref.min())


@pytest.mark.parametrize("overrides", [*VARIANTS, dict(mlp_only_layers=[1])])
def test_qwen3_c_decode_matches_transformers(overrides):
    import torch

    model = _model(5, **overrides)
    prompt = np.random.default_rng(11).integers(0, 256, 12)
    with torch.no_grad():
        want = model(torch.tensor(prompt)[None]).logits[0].numpy()
    eng = Engine(StateDictConsumer(model), threads=1)
    # A dense layer keeps its MLP in numpy; the attention is the C call either way.
    assert eng.model._fast_attn
    assert eng.model.decode_in_c() == ("mlp_only_layers" not in overrides)
    got = _run(eng, prompt, 4)
    eng.close()
    tol = 1e-4 * float(want.max() - want.min())
    assert np.abs(got - want[3:]).max() <= tol


def test_the_o_bias_is_applied_by_the_c_call():
    """The same prefill, then one decode step with and without the bias in the layer
    descriptors (made again for the step): the outputs differ, so the call adds it."""
    model = _model(3, attention_bias=True)
    prompt = np.random.default_rng(2).integers(0, 256, 6)
    outs = []
    for keep in (True, False):
        eng = Engine(StateDictConsumer(model), threads=1)
        assert all(lw.o_bias is not None for lw in eng.model.layers)
        eng.prefill(prompt[:5])  # with the biases
        if not keep:
            for lw in eng.model.layers:
                lw.o_bias = None
            eng.model.kernels()._attn.clear()  # the descriptors the prompt's calls made
        outs.append(eng.decode(int(prompt[5])))
        eng.close()
    assert not np.allclose(outs[0], outs[1])


def test_a_subclass_overriding_the_attention_again_decodes_in_numpy():
    from czyx.inference.models.qwen3_moe import Qwen3MoeDecoder

    class Other(Qwen3MoeDecoder):
        def _attention(self, i, lw, x, kv, start, positions):
            return super()._attention(i, lw, x, kv, start, positions)

    eng = Engine(StateDictConsumer(_model(1)), threads=1)
    other = Other(eng.consumer, eng.cache)
    assert not other._fast_attn and not other.decode_in_c()
    eng.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 3.0},
        {
            "rope_type": "longrope",
            "long_factor": [1.0 + 0.5 * i for i in range(8)],
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "original_max_position_embeddings": 10,
        },
    ],
)
def test_c_attention_follows_length_dependent_rope(arch, rope):
    """Dynamic NTK and LongRoPE change their tables with the length reached: decoding
    across the switch, the C attention call gives the numpy attention's logits."""
    model = tiny_model(arch, seed=4, head_dim=16, max_position_embeddings=12,
                       rope_parameters={"rope_theta": 1e4, **rope})  # fmt: skip
    prompt = np.random.default_rng(3).integers(0, 256, 20)
    runs = []
    for fast in (True, False):
        eng = Engine(StateDictConsumer(model), threads=1)
        assert eng.model._fast_attn
        eng.model._fast_attn = fast
        runs.append(_run(eng, prompt, 4))
        eng.close()
    c, ref = runs
    assert np.abs(c - ref).max() <= 1e-5 * float(ref.max() - ref.min())
