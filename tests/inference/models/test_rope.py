"""Rope scalings against transformers' own rope functions and models.

The inverse frequencies and attention factor of every supported rope type
match ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` on the same
config (dynamic NTK at a grown length, LongRoPE's long factors past the
original length); a tiny Qwen3-MoE with each scaling gives transformers'
logits and greedy tokens (dynamic and LongRoPE cross their switch length
while decoding); an unsupported rope type is refused at mount.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.models.rope import inv_freq_and_scaling
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.store.models.rope import UnsupportedRopeError, rope_params
from czyx.testing.refmodels import StateDictConsumer, hf_greedy, tiny_model
from czyx.testing.tiny_models import make_tiny_checkpoint

HEAD_DIM = 16
MAX_POS = 24
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 12,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 12,
        "mscale": 0.9,
        "mscale_all_dim": 0.5,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "longrope": {
        "rope_type": "longrope",
        "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": 20,
    },
}
PROMPT = np.random.default_rng(5).integers(0, 256, 14)
STEPS = 24


def _params(name: str) -> dict:
    return {"rope_theta": 500.0, **ROPES[name]}


def _config(name: str):
    import transformers as T

    return T.Qwen3MoeConfig(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=_params(name),
    )


@pytest.mark.parametrize("name", sorted(ROPES))
def test_inv_freq_and_attention_factor_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _config(name)
    fn = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]]
    p = rope_params(config.to_dict(), HEAD_DIM)
    lengths = {"dynamic": [None, 40], "longrope": [None, 21]}.get(name, [None])
    for seq_len in lengths:
        want, want_att = fn(config, "cpu", seq_len=seq_len)
        got, att = inv_freq_and_scaling(p, seq_len)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)
        assert att == pytest.approx(want_att, rel=1e-12)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_scaled_rope_models_match_transformers(name):
    model = tiny_model(
        "qwen3_moe",
        seed=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=_params(name),
    )
    with torch.no_grad():
        want = model(torch.tensor(PROMPT)[None]).logits[0].numpy()
    got = Engine(StateDictConsumer(model)).prefill(PROMPT, all_logits=True)
    assert np.abs(got - want).max() < 1e-5
    tokens, _ = generate_ids(Engine(StateDictConsumer(model)), PROMPT.tolist(), STEPS)
    assert tokens == hf_greedy(model, PROMPT, STEPS)


def test_unsupported_rope_is_refused_at_mount(tmp_path):
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    store = Store.open(tmp_path / "store")
    try:
        with pytest.raises(UnsupportedRopeError, match="'proportional' is not supported"):
            mount(store, ckpt, "q@1")
    finally:
        store.close()


def test_rope_parameters_missing_a_field_are_refused():
    with pytest.raises(UnsupportedRopeError, match="low_freq_factor"):
        rope_params(
            {"rope_scaling": {"type": "llama3", "factor": 8.0}, "max_position_embeddings": 64}, 8
        )
    with pytest.raises(UnsupportedRopeError, match="long_factor"):
        rope_params(
            {
                "rope_parameters": {"rope_type": "longrope", "long_factor": [1.0]},
                "max_position_embeddings": 9,
            },
            8,
        )


def test_stored_freq_factors_divide_the_default_frequencies_as_llama3_scales_them():
    """The rope type ``freq_factors`` (a GGUF's rope_freqs): each default frequency over
    its factor. With the converter's llama3 factors, transformers' llama3 frequencies to
    float32 rounding; factors of another count are refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from czyx.inference.errors import UnsupportedModelError
    from czyx.inference.models.rope import RopeConfig, with_freq_factors
    from czyx.store.models.gguf import llama3_rope_freqs

    config = _config("llama3")
    want = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].numpy()
    ff = llama3_rope_freqs({**config.to_dict(), "original_max_position_embeddings": 16})
    assert (ff == 8).any() and ((ff > 1) & (ff < 8)).any()  # (the band's inside and above)
    p = rope_params({"rope_parameters": {"rope_type": "freq_factors", "rope_theta": 500.0}}, 16)
    rope = RopeConfig(p.theta, p.rotary_dim, 1.0, p)
    got, att = inv_freq_and_scaling(with_freq_factors(rope, ff).params)
    assert att == 1.0 and got.dtype == np.float32
    default, _ = inv_freq_and_scaling(rope_params({"rope_theta": 500.0}, 16))
    np.testing.assert_array_equal(got, (default / ff).astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    with pytest.raises(UnsupportedModelError, match="rope_freqs: 7 factors"):
        with_freq_factors(rope, ff[:7])
