"""GGUF in and out for DeepSeek-V3 (and Kimi-K2's 384 experts, and DeepSeek-V2): llama.cpp's
``deepseek2`` layout as its converter writes it (``czyx.testing.gguf_writer``).

The converter splits ``kv_b_proj`` into ``attn_k_b`` (transposed per head) and
``attn_v_b``, writes MLA as MQA of one latent head (``head_count_kv`` 1,
``key_length`` ``kv_lora_rank + qk_rope_head_dim``, the per-head widths in
``*_mla``), the selection bias as ``exp_probs_b.bias`` and the sigmoid gating as
``expert_gating_func`` 2. Mounted, the file is the transformers model it came from
(logits within 1e-5 of the range, the same greedy tokens); exported, it is the same
file tensor for tensor, with the same ``deepseek2.*`` metadata.
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
from czyx.store.models.gguf import PRE_REGEX, UnsupportedGGUFError, kv_b_join, kv_b_split
from czyx.store.models.gguf_export import export_gguf
from czyx.store.models.mount import mount
from czyx.testing.archparity import reference
from czyx.testing.gguf_writer import reference_model, write_gguf
from czyx.testing.tiny_models import build_tiny_model

# Every matrix row a multiple of 32 (GGUF's block), so q8_0 quantizes them all,
# attn_k_b's (qk_nope) and attn_v_b's (kv_lora_rank) included.
_DIMS = dict(
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    vocab_size=128,
    initializer_range=0.2,
    num_hidden_layers=2,
)
KIMI = dict(n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1)
# DeepSeek-V3's and Kimi-K2's YaRN (factor 40 and 32 over 4096 positions), scaled down.
YARN = dict(
    max_position_embeddings=256,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=8.0,
        original_max_position_embeddings=32,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
STEPS = 8


def ds_model(arch: str = "deepseek_v3", **kw):
    return build_tiny_model(arch, 3, **{**_DIMS, **kw})


def _mount(tmp_path, model, qtype: str):
    write_gguf(model, tmp_path / "m.gguf", qtype)
    with Store.open(tmp_path / "s") as store:
        result = mount(store, tmp_path / "m.gguf", "m@1")
        manifest = store.manifest(result.selector)
        token = portals.root_token(store)
    return manifest, token


def _run(tmp_path, token, prompt) -> tuple[np.ndarray, list[int]]:
    """Logits over ``prompt`` and the greedy tokens after it (the same with a quarter of
    the experts cached, or the empty list)."""
    with OpenedModel(str(tmp_path / "s"), "m@1", token) as opened:
        with float_inputs():
            logits = Engine(opened.consumer).prefill(prompt, all_logits=True)
        tokens, _ = generate_ids(Engine(opened.consumer), prompt.tolist(), STEPS)
        quarter = Engine(opened.consumer, cache_fraction=0.25)
        again, _ = generate_ids(quarter, prompt.tolist(), STEPS)
        assert quarter.stats().misses > 0
    return logits, tokens if again == tokens else []


def _same_file(a, b) -> None:
    import gguf

    src = {t.name: t for t in gguf.GGUFReader(a).tensors}
    out = {t.name: t for t in gguf.GGUFReader(b).tensors}
    assert set(src) == set(out)
    for name, t in src.items():
        assert out[name].tensor_type == t.tensor_type, name
        assert list(out[name].shape) == list(t.shape), name
        assert np.array_equal(np.asarray(out[name].data), np.asarray(t.data)), name


def _arch_metadata(path) -> dict:
    import gguf

    fields = gguf.GGUFReader(path).fields
    return {k: f.contents() for k, f in fields.items() if k.startswith("deepseek2.")}


@pytest.mark.parametrize(
    ("arch", "over", "qtype"),
    [
        ("deepseek_v3", {}, "f32"),
        ("deepseek_v3", {}, "f16"),
        ("deepseek_v3", {}, "q8_0"),
        ("deepseek_v3", {"kv_lora_rank": 16}, "q8_0"),  # attn_k_b Q8_0, attn_v_b F16
        ("deepseek_v3", KIMI, "f16"),
        ("deepseek_v3", {**KIMI, **YARN}, "q8_0"),
        ("deepseek_v2", {"n_group": None, "topk_group": None}, "f32"),
        ("deepseek_v2", {"q_lora_rank": None, "n_group": None, "topk_group": None}, "f16"),
    ],
    ids=[
        "v3-f32",
        "v3-f16",
        "v3-q8_0",
        "v3-q8_0-mixed-kv_b",
        "kimi384-f16",
        "kimi384-yarn-q8",
        "v2-f32",
        "v2-lite-f16",
    ],
)
def test_deepseek_gguf_mounts_runs_and_exports_back(tmp_path, arch, over, qtype):
    import gguf

    model = ds_model(arch, **over)
    manifest, token = _mount(tmp_path, model, qtype)
    assert manifest["source"]["metadata"]["general.architecture"] == "deepseek2"
    assert manifest["config"]["model_type"] == arch
    prompt = np.random.default_rng(4).integers(0, 128, 12)
    want, want_tokens = reference(reference_model(model, qtype), prompt, STEPS)
    got, tokens = _run(tmp_path, token, prompt)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens
    if qtype == "q8_0":  # routed experts and the other matrices stored as they are
        assert manifest["expert"]["format"] == "q8"
        assert manifest["quant"]["converted"] == {}
    with Store.open(tmp_path / "s") as store:
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    _same_file(tmp_path / "m.gguf", path)
    assert _arch_metadata(path) == _arch_metadata(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "deepseek2"
    if over.get("n_routed_experts") == 384:
        assert manifest["expert"]["n_experts"] == 384
        assert {int(t.shape[-1]) for t in reader.tensors if "_exps" in t.name} == {384}


def test_kv_b_split_and_join_are_inverse():
    rng = np.random.default_rng(0)
    heads, nope, v, rank = 3, 5, 7, 4
    kv_b = rng.standard_normal((heads * (nope + v), rank)).astype(np.float32)
    k_b, v_b = kv_b_split(kv_b, heads, nope)
    assert k_b.shape == (heads, rank, nope) and v_b.shape == (heads, v, rank)
    # head h's no-rope key rows, transposed
    assert np.array_equal(k_b[1], kv_b[(nope + v) : (nope + v) + nope].T)
    assert np.array_equal(kv_b_join(k_b, v_b), kv_b)


@pytest.mark.parametrize(
    ("arch", "over", "policy", "match"),
    [
        (
            "deepseek_v2",
            dict(n_group=2, topk_group=1, topk_method="group_limited_greedy"),
            None,
            "topk_method",
        ),
        ("deepseek_v3", dict(num_key_value_heads=1), None, "num_key_value_heads"),
        ("deepseek_v3", dict(rope_interleave=False), None, "rope_interleave"),
        ("deepseek_v3", {}, "q4-all", "kv_b_proj"),
        (
            "deepseek_v3",
            {"rope_parameters": {**YARN["rope_parameters"], "mscale": 0.5}},
            None,
            "mscale",
        ),
    ],
    ids=["v2-group-limited", "kv-heads", "rope-halves", "quantized-kv_b", "yarn-mscale"],
)
def test_deepseek_config_llama_cpp_cannot_express_is_refused_at_export(
    tmp_path, arch, over, policy, match
):
    from czyx.store.quant.codec import QuantCodec
    from czyx.store.quant.policy import parse_policy
    from czyx.testing.archparity import write_checkpoint

    write_checkpoint(ds_model(arch, **over), tmp_path / "ckpt", fused=False)
    quant = None if policy is None else QuantCodec(parse_policy(policy))
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1", quant=quant)
        with pytest.raises(UnsupportedGGUFError, match=match) as err:
            export_gguf(store, "m@1", tmp_path / "x.gguf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "x.gguf").exists()


def _rewrite(src, dst, drop=(), meta=None) -> None:
    """``src`` with tensors ``drop`` left out and metadata ``meta`` (key: (value, type)) set."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "deepseek2")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in (meta or {}):
            continue
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in (meta or {}).items():
        if value is not None:  # None: the key left out
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.asarray(t.data))  # (an f32 file: typed by the array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("drop", "meta", "match"),
    [
        ((), {"deepseek2.expert_gating_func": (3, "u32")}, "expert_gating_func 3"),
        ((), {"deepseek2.rope.scaling.type": ("linear", "str")}, "rope scaling 'linear'"),
        ((), {"deepseek2.rope.scaling.type": ("yarn", "str")}, "yarn_log_multiplier"),
        ((), {"deepseek2.expert_gating_func": (1, "u32")}, "never renormalises"),
        (
            (),
            {
                "deepseek2.expert_gating_func": (1, "u32"),
                "deepseek2.expert_weights_norm": (None, "u32"),
            },
            "group_limited_greedy",
        ),
        (("blk.1.attn_v_b.weight",), {}, "pairs"),
    ],
    ids=["gating", "linear-rope", "yarn-no-log-mul", "v2-renorm", "v2-groups", "half-missing"],
)
def test_deepseek_gguf_czyx_cannot_read_is_refused(tmp_path, drop, meta, match):
    import gguf

    from czyx.store.models.mount_errors import CheckpointError

    vt = gguf.GGUFValueType
    meta = {k: (v, vt.UINT32 if t == "u32" else vt.STRING) for k, (v, t) in meta.items()}
    write_gguf(ds_model(), tmp_path / "m.gguf", "f32")
    _rewrite(tmp_path / "m.gguf", tmp_path / "x.gguf", drop, meta)
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(CheckpointError, match=match) as err:
            mount(store, tmp_path / "x.gguf", "m@1")
        assert "\n" not in str(err.value)
        assert store.tags() == {}


def test_cli_exports_a_safetensors_deepseek_as_gguf_that_mounts_back(tmp_path, capsys):
    """A Kimi-K2-shaped checkpoint mounted from safetensors, exported by the CLI as
    deepseek2 GGUF, mounted again by the CLI: transformers' logits and greedy tokens."""
    from czyx.cli import main
    from czyx.testing.archparity import write_checkpoint

    model = ds_model(**KIMI)
    write_checkpoint(model, tmp_path / "ckpt", fused=False)
    sd = str(tmp_path / "s")
    assert main(["mount", str(tmp_path / "ckpt"), "--as", "st@1", "--store", sd]) == 0
    out = tmp_path / "k.gguf"
    assert main(["export", "st@1", str(out), "--format", "gguf", "--store", sd]) == 0
    assert main(["mount", str(out), "--as", "m@1", "--store", sd]) == 0
    assert "mounted: m@1" in capsys.readouterr().out
    meta = _arch_metadata(out)
    assert meta["deepseek2.expert_count"] == 384 and meta["deepseek2.expert_gating_func"] == 2
    assert meta["deepseek2.attention.head_count_kv"] == 1
    with Store.open(tmp_path / "s") as store:
        token = portals.root_token(store)
    prompt = np.random.default_rng(6).integers(0, 128, 10)
    want, want_tokens = reference(model, prompt, STEPS)
    got, tokens = _run(tmp_path, token, prompt)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens


def test_gguf_from_before_the_kv_b_split_mounts_the_same(tmp_path):
    """Converters before llama.cpp's absorbed MLA wrote attn_kv_b whole (and the per-head
    widths in key_length / value_length): the same model."""
    import gguf

    model = ds_model()
    write_gguf(model, tmp_path / "new.gguf", "f32")
    r = gguf.GGUFReader(tmp_path / "new.gguf")
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "deepseek2")
    old = {
        "deepseek2.attention.key_length": 32 + 16,
        "deepseek2.attention.value_length": 32,
    }
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or "_mla" in name:
            continue
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(name, old.get(name, f.contents()), f.types[0], sub_type=sub)
    tensors = {t.name: np.asarray(t.data) for t in r.tensors}
    for name, a in tensors.items():
        if name.endswith("attn_k_b.weight"):
            v_b = tensors[name.replace("attn_k_b", "attn_v_b")]
            w.add_tensor(name.replace("attn_k_b", "attn_kv_b"), kv_b_join(a, v_b))
        elif not name.endswith("attn_v_b.weight"):
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
        token = portals.root_token(store)
    prompt = np.random.default_rng(4).integers(0, 128, 12)
    want, want_tokens = reference(model, prompt, STEPS)
    got, tokens = _run(tmp_path, token, prompt)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens


# DeepSeek-V3's tokenizer.json pre-tokenizer, as published (llama.cpp: "deepseek-v3").
_DS3_SPLITS = (
    "\\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)


def _pre_tokenizer_round_trip(tmp_path, splits, pre: str, text: str):
    """Write a DeepSeek GGUF whose byte-level BPE pre-tokenizes by ``splits`` (llama.cpp's
    ``pre``), mount and export it: ``(source tokenizer, mounted tokenizer, mounted ids of
    text, exported file)``."""
    import json

    from tokenizers import Tokenizer

    from czyx.inference.tokenizer import tokenizer_for
    from czyx.testing.gguf_writer import tiny_bpe_tokenizer_json

    data = json.loads(tiny_bpe_tokenizer_json(320))
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}
            for rx in splits
        ]
        + [
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            }
        ],
    }
    tj = json.dumps(data)
    model = ds_model(vocab_size=320)  # (the byte alphabet alone is 256 tokens)
    write_gguf(model, tmp_path / "m.gguf", "f16", tokenizer_json=tj, pre=pre)
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
        token = portals.root_token(store)
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    with OpenedModel(str(tmp_path / "s"), "m@1", token) as opened:
        ids = tokenizer_for(opened.consumer, 320).encode(text)
        mounted = Tokenizer.from_str(opened.consumer.tokenizer_json())
    return Tokenizer.from_str(tj), mounted, ids, path


def test_deepseek_v3_pre_tokenizer_travels_both_ways(tmp_path):
    import gguf

    text = "the fox, 1234567 foxes!x 日本語のテキスト\n\n  jumps"
    src, mounted, ids, path = _pre_tokenizer_round_trip(tmp_path, _DS3_SPLITS, "deepseek-v3", text)
    assert ids == src.encode(text, add_special_tokens=False).ids
    want = src.pre_tokenizer.pre_tokenize_str(text)
    assert mounted.pre_tokenizer.pre_tokenize_str(text) == want
    assert ("!x", (22, 24)) in want  # punctuation before letters: one piece
    pieces = [p for p, _ in src.pre_tokenizer.pre_tokenize_str("1234567")]
    assert pieces == ["123", "456", "7"]  # digits in threes, as llama.cpp splits them
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "deepseek-v3"


# Kimi-K2's tiktoken pat_str (tokenization_kimi.py) as the ``regex`` package's V1 sets
# spell it: tiktoken's "letters && not Han" is the set difference "letters -- Han".
_UPPER = r"[[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]--\p{Han}]"
_LOWER = r"[[\p{Ll}\p{Lm}\p{Lo}\p{M}]--\p{Han}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_KIMI_PAT = (
    rf"\p{{Han}}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_kimi_k2_pre_tokenizer_splits_as_tiktoken_and_travels_back(tmp_path):
    """llama.cpp's ``kimi-k2`` (what its converter writes for Kimi-K2's tiktoken BPE)
    mounts as a tokenizer whose pieces are tiktoken's pattern's, checked against the
    ``regex`` package; export writes ``kimi-k2`` again."""
    import gguf
    import regex

    text = "Hello World's FOXes 12345 中文字符かなカナ über\n\n  x!?\r\n  end"
    src, mounted, ids, path = _pre_tokenizer_round_trip(
        tmp_path, (PRE_REGEX["kimi-k2"],), "kimi-k2", text
    )
    pieces = [text[a:b] for _, (a, b) in mounted.pre_tokenizer.pre_tokenize_str(text)]
    want = regex.findall(_KIMI_PAT, text, flags=regex.V1)
    assert pieces == want
    assert "中文字符" in want and "かなカナ" in want  # Han apart from kana
    assert ids == src.encode(text, add_special_tokens=False).ids
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "kimi-k2"
