"""Mounting: content-derived selectors, dedup across versions, tags, adapters, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from czyx.key import Key
from czyx.store import Store, TagConflictError
from czyx.store.models.expert_layout import layout_from_manifest
from czyx.store.models.mount import ADAPTER_KIND, mount, parse_tag, summarize
from czyx.store.models.mount_errors import (
    HeaderError,
    MissingTensorError,
    MountError,
    TruncatedFileError,
    UnexpectedTensorError,
    UnknownArchitectureError,
)
from czyx.testing.tiny_models import make_tiny_checkpoint

EXPERT = "model.layers.{l}.mlp.experts.{e}.{p}_proj.weight"


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("m") / "base")


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "store") as s:
        yield s


def _finetune(
    src, dst, changed=((1, 2), (0, 5)), trunk=("model.layers.0.self_attn.q_proj.weight",)
):
    """A copy of ``src`` whose listed experts and trunk tensors are perturbed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    st = load_file(str(src / "model.safetensors"))
    for l, e in changed:
        for p in ("gate", "up", "down"):
            st[EXPERT.format(l=l, e=e, p=p)] += 1.0
    for name in trunk:
        st[name] *= 2.0
    save_file(st, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _state(store):
    blocks = (
        sorted(p.name for p in (store.path / "blocks").iterdir())
        if (store.path / "blocks").exists()
        else []
    )
    return store.spaces(), store.tags(), blocks


def test_same_checkpoint_twice_is_the_same_space(store, base_ckpt, tmp_path):
    first = mount(store, base_ckpt, "q@1")
    assert first.created and first.bytes_written == first.bytes_total
    before = _state(store)
    again = mount(store, base_ckpt, "q@1")
    copy = shutil.copytree(base_ckpt, tmp_path / "elsewhere")
    moved = mount(store, copy, "q@alias")  # the same bytes elsewhere: the same space
    assert again.selector == first.selector == moved.selector
    assert not again.created and again.bytes_written == 0 and not moved.created
    assert _state(store)[0] == before[0] and _state(store)[2] == before[2]
    assert store.resolve_tag("q@alias") == first.selector


def test_extents_follow_the_layout_arithmetic(store, base_ckpt):
    outer = "hilbert"
    res = mount(store, base_ckpt, "q@1", outer=outer)
    m = store.manifest(res.selector)
    layout = layout_from_manifest(m)
    assert m["layout"]["outer"] == outer
    stride = m["expert"]["stride"]
    assert stride % 4096 == 0 and stride >= m["expert"]["nbytes"]
    recs = list(store.scan(res.selector))
    starts = {r["off"] - layout.ordinal(r["layer"], r["expert"]) * stride for _, r in recs}
    assert len(starts) == 1 and len(recs) == 16
    for key, r in recs:
        k = Key.unpack(key)
        assert (k.cls, k.z) == (r["expert"], r["layer"])
        assert {s[0] for s in r["src"]} == {"model.safetensors"}
        assert [s[1] for s in r["src"]] == [
            EXPERT.format(l=r["layer"], e=r["expert"], p=p) for p in ("gate", "up", "down")
        ]
        assert len(r["hash"]) == 64 and r["fmt"] == "f32"


def test_second_version_shares_unchanged_extents(store, base_ckpt, tmp_path):
    v1 = mount(store, base_ckpt, "q@1")
    v2 = mount(store, _finetune(base_ckpt, tmp_path / "ft"), "q@2")
    nbytes = store.manifest(v1.selector)["expert"]["nbytes"]
    assert v2.created and v2.selector != v1.selector
    assert v2.bytes_shared == 14 * nbytes  # 16 experts, 2 changed
    assert v2.trunk_selector != v1.trunk_selector
    recs = {(r["layer"], r["expert"]): r for _, r in store.scan(v2.selector)}
    v1recs = {(r["layer"], r["expert"]): r for _, r in store.scan(v1.selector)}
    for key, r in recs.items():
        if key in ((1, 2), (0, 5)):
            assert "blk" not in r and r["hash"] != v1recs[key]["hash"]
        else:
            assert r["blk"] == v1.selector.hex() and r["blk_off"] == v1recs[key]["off"]
            assert "off" not in r
    info = summarize(store, "q@2")
    assert info["expert_bytes_shared"] == 14 * nbytes and info["expert_bytes_own"] == 2 * nbytes
    # Only the two new extents were written into v2's block file.
    assert v2.bytes_written < v1.bytes_written


def test_unchanged_trunk_is_shared_whole(store, base_ckpt, tmp_path):
    v1 = mount(store, base_ckpt, "q@1")
    v2 = mount(store, _finetune(base_ckpt, tmp_path / "ft", trunk=()), "q@2")
    assert v2.trunk_selector == v1.trunk_selector
    trunk_bytes = store.aggregate(v1.trunk_selector)[1]
    nbytes = store.manifest(v1.selector)["expert"]["nbytes"]
    assert v2.bytes_written == 2 * nbytes and v2.bytes_total == 16 * nbytes + trunk_bytes


def test_tag_pointing_elsewhere_is_refused_before_writing(store, base_ckpt, tmp_path):
    mount(store, base_ckpt, "q@1")
    before = _state(store)
    with pytest.raises(TagConflictError, match="q@1"):
        mount(store, _finetune(base_ckpt, tmp_path / "ft"), "q@1")
    assert _state(store) == before


@pytest.mark.parametrize("tag", ["q", "@1", "q@", "a b@1", "q@1@2", ""])
def test_malformed_tags(tag):
    with pytest.raises(ValueError, match="NAME@VERSION"):
        parse_tag(tag)


def _lie(path, mutate):
    blob = (path / "model.safetensors").read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    mutate(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (path / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + n :])


def _outside(h):
    h["lm_head.weight"]["data_offsets"] = [10**9, 10**9 + 96 * 32 * 4]


def _overlap(h):
    h["model.norm.weight"]["data_offsets"] = list(h["lm_head.weight"]["data_offsets"])
    h["model.norm.weight"]["data_offsets"][1] = h["model.norm.weight"]["data_offsets"][0] + 128


def _dtype(h):
    h["model.norm.weight"]["dtype"] = "F16"


def _truncate(path):
    blob = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(blob[:-100])


def _drop_expert(path):
    from safetensors.torch import load_file, save_file

    st = load_file(str(path / "model.safetensors"))
    del st[EXPERT.format(l=1, e=7, p="down")]
    save_file(st, str(path / "model.safetensors"))


def _extra_expert(path):
    import torch
    from safetensors.torch import load_file, save_file

    st = load_file(str(path / "model.safetensors"))
    st[EXPERT.format(l=1, e=8, p="down")] = torch.zeros(32, 16)
    save_file(st, str(path / "model.safetensors"))


def _unknown_arch(path):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))


@pytest.mark.parametrize(
    ("spoil", "error", "tensor"),
    [
        (lambda p: _lie(p, _outside), HeaderError, "lm_head.weight"),
        (lambda p: _lie(p, _overlap), HeaderError, "model.norm.weight"),
        (lambda p: _lie(p, _dtype), HeaderError, "model.norm.weight"),
        (_truncate, TruncatedFileError, None),
        (_drop_expert, MissingTensorError, None),
        (_extra_expert, UnexpectedTensorError, EXPERT.format(l=1, e=8, p="down")),
        (_unknown_arch, UnknownArchitectureError, None),
    ],
    ids=[
        "offsets-outside",
        "overlap",
        "dtype-size",
        "truncated",
        "missing-expert",
        "extra-expert",
        "unknown-arch",
    ],
)
def test_bad_input_leaves_nothing_visible(store, base_ckpt, tmp_path, spoil, error, tensor):
    path = shutil.copytree(base_ckpt, tmp_path / "bad")
    spoil(path)
    before = _state(store)
    with pytest.raises(error) as info:
        mount(store, path, "bad@1")
    assert _state(store) == before
    msg = str(info.value)
    assert str(path) in msg or "config.json" in msg
    if tensor:
        assert tensor in msg


def test_failure_while_writing_leaves_no_version(store, base_ckpt, monkeypatch):
    import czyx.store.models.mount as mount_mod

    calls = []

    def boom(self, key, out):
        calls.append(key)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        out[:] = 0

    monkeypatch.setattr(mount_mod.MountSource, "assemble", boom)
    with pytest.raises(OSError, match="No space"):
        mount(store, base_ckpt, "q@1")
    assert "q@1" not in store.tags()
    assert all(store.manifest(s)["kind"] == "czyx.trunk" for s in store.spaces())
    assert not [p for p in (store.path / "blocks").iterdir() if p.suffix == ".part"]


def test_class_permutation(store, base_ckpt):
    rng = np.random.default_rng(1)
    perm = [rng.permutation(8).tolist() for _ in range(2)]
    res = mount(store, base_ckpt, "q@perm", class_perm=perm)
    for key, r in store.scan(res.selector):
        assert Key.unpack(key).cls == perm[r["layer"]][r["expert"]]
    assert store.manifest(res.selector)["layout"]["class_perm"] == perm
    assert res.selector != mount(store, base_ckpt, "q@plain").selector


@pytest.mark.parametrize(
    "perm", [[[0] * 8, list(range(8))], [list(range(8))], [list(range(9))] * 2]
)
def test_bad_class_permutation_is_refused_before_writing(store, base_ckpt, perm):
    from czyx.curves.errors import CurveError

    before = _state(store)
    with pytest.raises(CurveError):
        mount(store, base_ckpt, "q@perm", class_perm=perm)
    assert _state(store) == before


def test_adapter_holds_only_replaced_tensors(store, base_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    base = mount(store, base_ckpt, "q@1")
    st = load_file(str(base_ckpt / "model.safetensors"))
    keep = [EXPERT.format(l=1, e=2, p=p) for p in ("gate", "up", "down")]
    keep.append("model.layers.0.input_layernorm.weight")
    ad = tmp_path / "adapter"
    ad.mkdir()
    shutil.copy(base_ckpt / "config.json", ad)
    save_file({k: st[k] * 3 for k in keep}, str(ad / "model.safetensors"))
    res = mount(store, ad, "q@1-ad", adapter_of="q@1")
    m = store.manifest(res.selector)
    assert m["kind"] == ADAPTER_KIND and m["base"] == base.selector.hex()
    assert [(r["layer"], r["expert"]) for _, r in store.scan(res.selector)] == [(1, 2)]
    assert [r["role"] for _, r in store.scan(res.trunk_selector)] == ["input_norm"]
    # Replacing an expert with the base's own bytes shares it instead.
    ad2 = tmp_path / "adapter2"
    ad2.mkdir()
    shutil.copy(base_ckpt / "config.json", ad2)
    save_file({k: st[k] for k in keep[:3]}, str(ad2 / "model.safetensors"))
    res2 = mount(store, ad2, "q@1-same", adapter_of="q@1")
    assert res2.bytes_shared == m["expert"]["nbytes"] and res2.bytes_written == 0


def test_progress_and_summary(store, base_ckpt, capsys):
    res = mount(store, base_ckpt, "q@1", progress=True)
    line = res.summary()
    assert "q@1" in line and "GB/s" in line and "69 tensors" in line
    assert "\n" not in line


def test_adapter_must_fit_its_base(store, base_ckpt, tmp_path):
    import torch
    from safetensors.torch import save_file

    mount(store, base_ckpt, "q@1")
    cases = {
        "wrong-shape": (
            {"model.layers.0.input_layernorm.weight": torch.ones(31)},
            "cannot replace",
        ),
        "wrong-dtype": (
            {"model.layers.0.input_layernorm.weight": torch.ones(32, dtype=torch.float16)},
            "cannot replace",
        ),
    }
    for name, (tensors, match) in cases.items():
        ad = tmp_path / name
        ad.mkdir()
        shutil.copy(base_ckpt / "config.json", ad)
        save_file(tensors, str(ad / "model.safetensors"))
        before = _state(store)
        with pytest.raises(MountError, match=match) as info:
            mount(store, ad, f"q@{name}", adapter_of="q@1")
        assert "input_layernorm" in str(info.value) and _state(store) == before


def test_trunk_only_adapter_of_a_bf16_model(store, tmp_path):
    from safetensors.torch import load_file, save_file

    from czyx.portals import open_consumer

    src = make_tiny_checkpoint("olmoe", tmp_path / "bf", dtype="bfloat16")
    base = mount(store, src, "o@1")
    st = load_file(str(src / "model.safetensors"))
    ad = tmp_path / "ad"
    ad.mkdir()
    shutil.copy(src / "config.json", ad)
    save_file({"model.norm.weight": st["model.norm.weight"] * 2}, str(ad / "model.safetensors"))
    res = mount(store, ad, "o@1-norm", adapter_of="o@1")
    m = store.manifest(res.selector)
    assert m["expert"] == store.manifest(base.selector)["expert"] and m["experts"] == []
    with open_consumer(store, None, "o@1-norm") as model, open_consumer(store, None, "o@1") as orig:
        assert np.array_equal(model.trunk("final_norm"), 2 * orig.trunk("final_norm"))
        assert model.info.expert_format == "bf16"
