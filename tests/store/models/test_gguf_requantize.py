"""``--allow-requantize``: a quantized GGUF's classes the store policy names are requantized.

References: each requantized expert must equal the store's quantizer applied to the
``gguf`` package's own dequantization of that expert (read here straight from the
file with ``gguf.GGUFReader``), bit for bit; every class the policy leaves alone
must be the plain mount's, records and selector, so that the q4 and q2 versions of
one file pair as tiers (``TieredModel``, which refuses differing trunks).
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.options import EngineOptions
from czyx.inference.tiers import open_tiered
from czyx.portals import open_consumer
from czyx.store import Store
from czyx.store.models.gguf import ConversionPolicyError
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import MountError
from czyx.store.models.tiered import trunk_digest
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.formats import dequantize, get_format, quantize
from czyx.store.quant.policy import parse_policy
from czyx.testing.gguf_writer import write_gguf
from czyx.testing.refmodels import tiny_model

# Row lengths multiples of 64: q2's groups divide both hidden and the experts' width.
_MODEL = {"hidden_size": 64, "intermediate_size": 64, "num_key_value_heads": 4}
Q4, Q2 = "none,expert=q4", "none,expert=q2"


def _codec(policy: str) -> QuantCodec:
    return QuantCodec(parse_policy(policy))


@pytest.fixture(scope="module")
def q8_store(tmp_path_factory):
    """An OLMoE Q8_0 GGUF mounted plain (``m@q8``) and requantized (``m@q4``, ``m@q2``)."""
    root = tmp_path_factory.mktemp("requant")
    write_gguf(tiny_model("olmoe", seed=2, **_MODEL), root / "m.gguf", "q8_0")
    results = {}
    with Store.open(root / "s") as st:
        results["q8"] = mount(st, root / "m.gguf", "m@q8")
        for tag, policy in (("q4", Q4), ("q2", Q2)):
            results[tag] = mount(
                st, root / "m.gguf", f"m@{tag}", quant=_codec(policy), allow_requantize=True
            )
    return root, results


def _gguf_experts(path) -> dict[int, dict[str, np.ndarray]]:
    """Per layer, the expert stacks' float values as the ``gguf`` package dequantizes them."""
    import gguf

    out: dict[int, dict[str, np.ndarray]] = {}
    for t in gguf.GGUFReader(path).tensors:
        if "_exps." in t.name:
            layer, part = int(t.name.split(".")[1]), t.name.split(".")[2][4:-5]
            out.setdefault(layer, {})[part] = gguf.quants.dequantize(t.data, t.tensor_type)
    return out


@pytest.mark.parametrize("tag", ["q4", "q2"])
def test_requantized_experts_are_the_store_quantizer_on_the_gguf_reference(q8_store, tag):
    root, results = q8_store
    fmt = get_format(tag)
    ref = _gguf_experts(root / "m.gguf")
    with Store.open(root / "s", create=False) as st:
        m = open_consumer(st, None, f"m@{tag}")
        info = m.info
        assert info.expert_format == tag
        slot = np.empty(info.expert_slot_nbytes, np.uint8)
        err: dict[str, list[float]] = {}  # stack -> [squared error, squared reference]
        for layer in range(info.n_layers):
            for e in range(info.n_experts):
                parts = {p: quantize(ref[layer][p][e], fmt) for p in ("gate", "up", "down")}
                m.read_expert(layer, e, slot)
                want = np.concatenate(list(parts.values()))
                assert np.array_equal(slot[: info.expert_nbytes], want), (layer, e)
                for p, packed in parts.items():
                    r = ref[layer][p][e].astype(np.float64)
                    d = dequantize(packed, fmt, r.shape) - r
                    acc = err.setdefault(f"blk.{layer}.ffn_{p}_exps.weight", [0.0, 0.0])
                    acc[0] += float((d * d).sum())
                    acc[1] += float((r * r).sum())
        m.close()
        manifest = st.manifest(results[tag].selector)
    quant = manifest["quant"]
    assert quant["policy"] == f"gguf:native+requantize:none,expert={tag}"
    assert quant["formats"]["expert"] == tag
    # one drift record per requantized stack, nothing else converted
    assert sorted(quant["converted"]) == sorted(
        f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")
    )
    for name, (source, target, rel_rms, _) in quant["converted"].items():
        assert (source, target) == ("Q8_0", tag)
        assert rel_rms == pytest.approx((err[name][0] / err[name][1]) ** 0.5, rel=1e-6)
    assert results[tag].conversions[-1].startswith("requantized 6 tensors under --quant")


def test_the_trunk_is_the_plain_mounts_and_the_pair_runs_as_tiers(q8_store):
    root, results = q8_store
    # the trunk is the plain mount's own space: same selector, nothing rewritten
    assert results["q4"].trunk_selector == results["q8"].trunk_selector
    assert results["q2"].trunk_selector == results["q8"].trunk_selector
    with Store.open(root / "s", create=False) as st:
        digests = set()
        for tag in ("q8", "q4", "q2"):
            m = open_consumer(st, None, f"m@{tag}")
            digests.add(trunk_digest(m))
            m.close()
        assert len(digests) == 1
        tiered = open_tiered(st, None, "m@q4", "q4,q2:0.5")
        assert tiered.formats == ("q4", "q2")
        info = tiered.info
        hot = [(layer, e) for e in range(info.n_experts) for layer in range(info.n_layers)]
        eng = Engine(
            tiered,
            options=EngineOptions(tiers="q4,q2:0.5"),
            hot=hot,
            threads=1,
            cache_bytes=4 * info.expert_slot_nbytes,
        )
        tokens = [int(eng.prefill([3, 17, 5, 60]).argmax())]
        for _ in range(3):
            logits = eng.decode(tokens[-1])
            assert np.isfinite(logits).all()
            tokens.append(int(logits.argmax()))
        assert eng.cache.tier_reads.min() > 0  # both tiers were read
        eng.close()
        tiered.close()


def test_q4_0_requantizes_to_q2_and_keeps_its_native_q4(tmp_path):
    write_gguf(tiny_model("olmoe", seed=2, **_MODEL), tmp_path / "m.gguf", "q4_0")
    ref = _gguf_experts(tmp_path / "m.gguf")
    with Store.open(tmp_path / "s") as st:
        plain = mount(st, tmp_path / "m.gguf", "m@plain")
        q4 = mount(st, tmp_path / "m.gguf", "m@q4", quant=_codec(Q4), allow_requantize=True)
        q2 = mount(st, tmp_path / "m.gguf", "m@q2", quant=_codec(Q2), allow_requantize=True)
        mp, m4, m2 = (st.manifest(r.selector) for r in (plain, q4, q2))
        m = open_consumer(st, None, "m@q2")
        slot = np.empty(m.info.expert_slot_nbytes, np.uint8)
        m.read_expert(1, 3, slot)
        m.close()
    # q4 is Q4_0's own lossless repack: the plain mount's expert bytes, nothing requantized
    assert m4["experts"] == mp["experts"] and m4["quant"]["converted"] == {}
    assert q4.bytes_written == 0 and q4.bytes_shared > 0  # nothing new: all shared
    assert q4.conversions == (
        "requantized no tensor under --quant none,expert=q4 (all kept as stored)",
    )
    assert m2["quant"]["converted"]["blk.0.ffn_up_exps.weight"][:2] == ["Q4_0", "q2"]
    want = np.concatenate([quantize(ref[1][p][3], "q2") for p in ("gate", "up", "down")])
    assert np.array_equal(slot[: want.size], want)
    assert q2.trunk_selector == plain.trunk_selector
    with Store.open(tmp_path / "s") as st:  # the same content again: nothing written
        again = mount(st, tmp_path / "m.gguf", "m@q2", quant=_codec(Q2), allow_requantize=True)
    assert again.selector == q2.selector and not again.created and again.bytes_written == 0


def test_a_trunk_class_the_policy_names_is_requantized_too(tmp_path):
    write_gguf(tiny_model("olmoe", seed=2, **_MODEL), tmp_path / "m.gguf", "q8_0")
    with Store.open(tmp_path / "s") as st:
        plain = mount(st, tmp_path / "m.gguf", "m@plain")
        res = mount(
            st,
            tmp_path / "m.gguf",
            "m@a",
            quant=_codec("none,attention=q4"),
            allow_requantize=True,
        )
        manifest = st.manifest(res.selector)
        trunk = st.manifest(res.trunk_selector)
    assert res.trunk_selector != plain.trunk_selector
    assert trunk["quant"]["policy"] == "none,attention=q4"
    # experts stay the file's Q8_0 repacked (the plain mount's bytes, shared)
    assert manifest["expert"]["format"] == "q8" and res.bytes_shared > 0
    conv = manifest["quant"]["converted"]
    assert conv["blk.0.attn_q.weight"][:2] == ["Q8_0", "q4"]
    assert not any("_exps" in n for n in conv)
    assert manifest["quant"]["formats"]["q_proj"] == "q4"


def test_refusals_are_one_line(tmp_path):
    from czyx.testing.tiny_models import make_tiny_checkpoint

    write_gguf(tiny_model("olmoe", seed=2, **_MODEL), tmp_path / "m.gguf", "q8_0")
    ckpt = make_tiny_checkpoint("olmoe", tmp_path / "hf", hidden_size=64)
    cases = [
        (tmp_path / "m.gguf", {"quant": _codec(Q2)}, ConversionPolicyError, "--allow-requantize"),
        (tmp_path / "m.gguf", {"allow_requantize": True}, MountError, "needs --quant"),
        (ckpt, {"quant": _codec(Q2), "allow_requantize": True}, ConversionPolicyError, "GGUF"),
    ]
    with Store.open(tmp_path / "s") as st:
        for path, kw, err, match in cases:
            with pytest.raises(err, match=match) as exc:
                mount(st, path, "m@x", **kw)
            assert "\n" not in str(exc.value)
        assert st.tags() == {}


def test_float_gguf_takes_the_flag_harmlessly(tmp_path):
    write_gguf(tiny_model("olmoe", seed=2, **_MODEL), tmp_path / "m.gguf", "f16")
    with Store.open(tmp_path / "s") as st:
        a = mount(st, tmp_path / "m.gguf", "m@a", quant=_codec(Q4))
        b = mount(st, tmp_path / "m.gguf", "m@b", quant=_codec(Q4), allow_requantize=True)
    assert a.selector == b.selector and b.conversions == ()


def test_cli_requantizes_with_the_flag_only(tmp_path, capsys):
    from czyx.cli import main

    write_gguf(tiny_model("olmoe", seed=2, **_MODEL), tmp_path / "m.gguf", "q8_0")
    args = ["mount", str(tmp_path / "m.gguf"), "--as", "m@q2", "--store", str(tmp_path / "s")]
    assert main([*args, "--quant", Q2]) != 0
    err = capsys.readouterr().err
    assert "--allow-requantize" in err and len(err.strip().splitlines()) == 1
    assert main([*args, "--allow-requantize"]) != 0
    assert "needs --quant" in capsys.readouterr().err
    assert main([*args, "--quant", Q2, "--allow-requantize"]) == 0
    out = capsys.readouterr().out
    assert "mounted: m@q2" in out
    assert "converted blk.0.ffn_down_exps.weight: Q8_0 -> q2, relative RMS error" in out
    assert "requantized 6 tensors under --quant none,expert=q2 (lossy" in out


def test_released_pages_read_back_the_same(tmp_path):
    from czyx.store.models.gguf_source import GGUFCheckpoint

    write_gguf(tiny_model("olmoe", seed=2, **_MODEL), tmp_path / "m.gguf", "q8_0")
    with GGUFCheckpoint(tmp_path / "m.gguf") as ckpt:
        name = "model.layers.1.mlp.experts.3.down_proj.weight"
        before = ckpt.reference(name)
        ckpt.release(ckpt.vtensor(name))  # a hint to the kernel: the bytes map back
        assert np.array_equal(ckpt.reference(name), before)
