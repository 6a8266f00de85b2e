"""GGUF out: ``czyx export --format gguf`` read back by the gguf reader and by llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.store import Store
from czyx.store.models.gguf import UnsupportedGGUFError
from czyx.store.models.gguf_export import export_gguf
from czyx.store.models.mount import mount
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.policy import parse_policy
from czyx.testing.gguf_writer import (
    reference_model,
    same_tensors,
    tiny_bpe_tokenizer_json,
    write_gguf,
)
from czyx.testing.refmodels import ARCHS, hf_greedy

from .test_gguf import gguf_model

PROMPT = [int(t) for t in np.random.default_rng(9).integers(0, 256, 10)]
STEPS = 8


def _greedy_transformers(model) -> list[int]:
    return hf_greedy(model, PROMPT, STEPS)


def _greedy_llama_cpp(path) -> list[int]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(
        str(path), n_ctx=64, verbose=False, use_extra_bufts=False, n_threads=1, seed=0
    )
    try:
        got = []
        for t in llm.generate(PROMPT, temp=0.0, top_k=1, reset=True):
            got.append(int(t))
            if len(got) == STEPS:
                return got
        return got
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_gguf_runs_in_llama_cpp_with_the_same_greedy_tokens(tmp_path, arch):
    model = gguf_model(arch, vocab_size=320)
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_text(tiny_bpe_tokenizer_json(320))
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out")
    assert _greedy_llama_cpp(path) == _greedy_transformers(model)


def _llama_cpp_knows(arch: str) -> bool:
    """Whether the installed llama.cpp names ``arch`` (its architecture table's string)."""
    from pathlib import Path

    llama_cpp = pytest.importorskip("llama_cpp")
    libs = list(Path(llama_cpp.__file__).parent.glob("lib/libllama*"))
    return any(b"\0" + arch.encode() + b"\0" in lib.read_bytes() for lib in libs)


@pytest.mark.parametrize("arch", ["llama4_text", "llama4_text-llama3", "qwen3_next", "jamba"])
def test_llama_cpp_decodes_a_converter_layout_gguf_as_czyx_does(tmp_path, arch):
    """llama.cpp loads each newer architecture as the converter lays it out (the test
    writer) and decodes the same greedy tokens as czyx mounted from that file (Llama 4
    also with llama3 rope scaling: its rope_freqs divide the frequencies in both)."""
    from .test_gguf_archs import _run, hybrid, llama4, llama4_llama3_rope

    gguf_arch = {"qwen3_next": "qwen3next"}.get(arch, "llama4" if "llama4" in arch else arch)
    if not _llama_cpp_knows(gguf_arch):
        pytest.skip(f"this llama.cpp has no {gguf_arch} architecture")
    makers = {"llama4_text": llama4, "llama4_text-llama3": llama4_llama3_rope}
    model = makers[arch](vocab_size=320) if arch in makers else hybrid(arch, vocab_size=320)
    path = tmp_path / "m.gguf"
    write_gguf(model, path, "f32", tokenizer_json=tiny_bpe_tokenizer_json(320))
    with Store.open(tmp_path / "s") as store:
        mount(store, path, "m@1")
    _, tokens = _run(tmp_path / "s", "m@1", STEPS, PROMPT)
    assert _greedy_llama_cpp(path) == tokens


def test_native_gguf_round_trips_bit_exactly(tmp_path):
    import gguf

    model = gguf_model("mixtral", vocab_size=320)
    write_gguf(model, tmp_path / "in.gguf", "q8_0", tokenizer_json=tiny_bpe_tokenizer_json(320))
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "in.gguf", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    same_tensors(tmp_path / "in.gguf", path)
    ref = gguf.GGUFReader(path)
    assert ref.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert "source" in ref.fields["czyx.format_history"].contents()


def test_q4_store_format_exports_as_q4_1_with_the_same_values(tmp_path):
    import gguf

    model = gguf_model("qwen3_moe")
    write_gguf(model, tmp_path / "in.gguf", "q4_0")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "in.gguf", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    src = {t.name: t for t in gguf.GGUFReader(tmp_path / "in.gguf").tensors}
    for t in gguf.GGUFReader(path).tensors:
        s = src[t.name]
        if s.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
            a = gguf.quants.dequantize(np.asarray(s.data), s.tensor_type)
            b = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            assert np.array_equal(a, b), t.name


def test_quantized_store_version_runs_in_llama_cpp(tmp_path):
    model = gguf_model("qwen2_moe", vocab_size=320)
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_text(tiny_bpe_tokenizer_json(320))
    with Store.open(tmp_path / "s") as store:
        codec = QuantCodec(parse_policy("q4-all"))
        mount(store, tmp_path / "ckpt", "m@q4", quant=codec)
        (path,) = export_gguf(store, "m@q4", tmp_path / "q4.gguf")
        with pytest.raises(UnsupportedGGUFError, match="no GGUF type"):
            mount(store, tmp_path / "ckpt", "m@sel", quant=QuantCodec(parse_policy("selective")))
            export_gguf(store, "m@sel", tmp_path / "sel.gguf")
    assert len(_greedy_llama_cpp(path)) == STEPS  # loads and decodes (values: q4, not exact)


@pytest.mark.parametrize(
    ("arch", "over", "match"),
    [
        ("mixtral", {"sliding_window": 16}, "sliding window"),
        ("olmoe", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ],
)
def test_config_llama_cpp_cannot_express_is_refused(tmp_path, arch, over, match):
    model = gguf_model(arch, **over)
    model.save_pretrained(tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1")
        with pytest.raises(UnsupportedGGUFError, match=match):
            export_gguf(store, "m@1", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_cli_exports_gguf(tmp_path, capsys):
    from czyx.cli import main

    write_gguf(gguf_model("olmoe"), tmp_path / "in.gguf", "f16")
    sd = str(tmp_path / "s")
    assert main(["mount", str(tmp_path / "in.gguf"), "--as", "m@1", "--store", sd]) == 0
    out = tmp_path / "o.gguf"
    assert main(["export", "m@1", str(out), "--format", "gguf", "--store", sd]) == 0
    assert out.is_file() and "exported m@1" in capsys.readouterr().out
    # and the exported file mounts back to the same weights
    with Store.open(tmp_path / "s") as store:
        a = mount(store, out, "m@again")
    assert a.tensors > 0
    _ = reference_model  # the float round trip is exact: covered by the mount tests


def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp_and_round_trips(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from czyx.inference.opened import OpenedModel
    from czyx.inference.tokenizer import tokenizer_for
    from czyx.portals import root_token
    from czyx.testing.gguf_writer import tiny_spm_vocab

    model = gguf_model("mixtral", vocab_size=600)
    write_gguf(model, tmp_path / "in.gguf", "f16", spm_vocab=tiny_spm_vocab(600))
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "in.gguf", "m@1")
        (out,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
        token = root_token(store)
    texts = ["the quick brown fox", "  two spaces", "mixture of experts! 42 \u00e9 \u65e5\u672c\nx"]
    with OpenedModel(str(tmp_path / "s"), "m@1", token) as opened:
        tok = tokenizer_for(opened.consumer, 600)
        for path in (tmp_path / "in.gguf", out):
            llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
            try:
                for text in texts:
                    want = llm.tokenize(text.encode(), add_bos=False, special=False)
                    assert tok.encode(text) == want, (path.name, text)
                    assert tok.decode(want) == text
            finally:
                llm.close()


def test_a_checkpoints_chat_template_goes_into_the_gguf_as_llama_cpp_converts_it(tmp_path):
    """The template transformers would load (chat_template.jinja over the config's) is the
    GGUF's tokenizer.chat_template; a config's named templates keep their names."""
    import json

    import gguf

    model = gguf_model("mixtral")
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    named = [
        {"name": "default", "template": "{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "{{ tools }}"},
    ]
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    jinja = "{% for m in messages %}[{{ m['role'] }}]{% endfor %}"
    with Store.open(tmp_path / "s") as store:
        mount(store, ckpt, "named@1")
        (ckpt / "chat_template.jinja").write_text(jinja)
        mount(store, ckpt, "jinja@1")
        (gn,) = export_gguf(store, "named@1", tmp_path / "named.gguf")
        (gj,) = export_gguf(store, "jinja@1", tmp_path / "jinja.gguf")
    fields = gguf.GGUFReader(gn).fields
    assert fields["tokenizer.chat_template"].contents() == named[0]["template"]
    assert fields["tokenizer.chat_template.tool_use"].contents() == "{{ tools }}"
    fields = gguf.GGUFReader(gj).fields
    assert fields["tokenizer.chat_template"].contents() == jinja
    assert "tokenizer.chat_template.tool_use" not in fields


def test_gguf_export_holds_one_layers_experts_at_a_time(tmp_path):
    """The experts stream to the file a layer at a time: the export's peak of Python
    allocations stays a small part of the version's expert bytes (16 layers)."""
    import tracemalloc

    from czyx.store.models.model import ModelSpace
    from czyx.testing.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(
        "mixtral", tmp_path / "ckpt", num_hidden_layers=16, intermediate_size=256
    )
    with Store.open(tmp_path / "s") as store:
        mount(store, ckpt, "m@1")
        space = ModelSpace(store, "m@1")
        expert_bytes = space.nbytes * len(space.records)
        export_gguf(store, "m@1", tmp_path / "warm.gguf")  # (imports and caches first)
        tracemalloc.start()
        try:
            (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert path.read_bytes() == (tmp_path / "warm.gguf").read_bytes()
    assert path.stat().st_size > expert_bytes  # every expert was written
    assert peak < expert_bytes / 4, (peak, expert_bytes)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    groups=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    bits=st.sampled_from([4, 8]),
)
def test_gguf_blocks_repack_every_code_as_unpacking_does(rows, groups, seed, bits):
    """The nibble-level Q4_1 repack and the Q8_0 sign flip equal the reference: every
    code unpacked, then packed as GGUF lays its blocks out."""
    from czyx.store.models.gguf_export import to_gguf_blocks
    from czyx.store.quant.formats import get_format, pack_codes, unpack_codes, views

    cols = 32 * groups
    fmt = get_format(f"q{bits}")
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 1 << bits, (rows, cols)).astype(np.uint8)
    buf = np.zeros(fmt.nbytes(rows, cols), np.uint8)
    codes, d, m = views(buf, fmt, (rows, cols))
    codes[...] = pack_codes(q, bits)
    d[...] = rng.uniform(0.01, 1, d.shape).astype(np.float16)
    m[...] = -128 * d if bits == 8 else rng.uniform(-1, 1, m.shape).astype(np.float16)
    blocks, _ = to_gguf_blocks(buf, fmt.name, (rows, cols), "t")
    u = unpack_codes(codes, bits, cols).reshape(rows, groups, 32)
    dq = np.ascontiguousarray(d).view(np.uint8).reshape(rows, groups, 2)
    if bits == 8:
        want = np.concatenate([dq, (u.astype(np.int16) - 128).astype(np.int8).view(np.uint8)], 2)
    else:
        mq = np.ascontiguousarray(m).view(np.uint8).reshape(rows, groups, 2)
        want = np.concatenate([dq, mq, (u[:, :, :16] | (u[:, :, 16:] << 4)).astype(np.uint8)], 2)
    assert np.array_equal(blocks, want.reshape(rows, -1))


def test_gguf_with_384_experts_mounts_runs_and_round_trips(tmp_path):
    """384 experts a layer in qwen3moe's layout: logits as the source, export bit-exact
    (Kimi-K2 itself, DeepSeek-V3's deepseek2 layout: test_gguf_deepseek.py)."""
    import gguf

    from .test_gguf import _mount_and_run, _want

    model = gguf_model("qwen3_moe", num_experts=384, num_experts_per_tok=8)
    _, manifest, got = _mount_and_run(tmp_path, model, "q8_0")
    assert manifest["expert"]["n_experts"] == 384
    want = _want(reference_model(model, "q8_0"))
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    with Store.open(tmp_path / "s") as store:
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    src = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    out = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert set(src) == set(out)
    assert out["blk.0.ffn_gate_exps.weight"].shape[-1] == 384
    for name, t in src.items():
        assert out[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(out[name].data), np.asarray(t.data)), name
