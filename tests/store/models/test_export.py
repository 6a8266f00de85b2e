"""Export: byte-identical files, transformers reloads them, logits compared exactly."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from czyx.store import Store
from czyx.store.models.export import export
from czyx.store.models.mount import mount
from czyx.testing.tiny_models import make_tiny_checkpoint, reference_logits

TOKENS = [3, 17, 5, 60, 1, 88, 42, 9]


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_files(src, out):
    names = sorted(p.name for p in src.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in out.glob("*.safetensors"))
    for name in names:
        assert _sha(src / name) == _sha(out / name), name


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "store") as s:
        yield s


@pytest.mark.parametrize(
    ("arch", "fused", "kw"),
    [
        ("mixtral", False, {}),
        ("mixtral", True, {}),
        ("qwen2_moe", True, {}),
        ("qwen3_moe", False, {"max_shard_size": "20KB"}),
        ("olmoe", False, {"dtype": "bfloat16"}),
        ("deepseek_v3", True, {}),
        ("deepseek_v2", False, {"dtype": "float16"}),
        ("qwen2_moe", False, {"mlp_only_layers": [0]}),
    ],
    ids=[
        "mixtral",
        "mixtral-fused",
        "qwen2-fused",
        "qwen3-sharded",
        "olmoe-bf16",
        "dsv3-fused",
        "dsv2-f16",
        "qwen2-dense-layer0",
    ],
)
def test_export_is_bit_identical_and_reloads(store, tmp_path, arch, fused, kw):
    import torch

    src = make_tiny_checkpoint(arch, tmp_path / "src", fused=fused, **kw)
    mount(store, src, f"{arch}@1", class_perm=None)
    out = tmp_path / "out"
    export(store, f"{arch}@1", out)
    _same_files(src, out)
    if "max_shard_size" in kw:
        index = "model.safetensors.index.json"
        assert (
            json.loads((out / index).read_text())["weight_map"]
            == json.loads((src / index).read_text())["weight_map"]
        )
    want, got = reference_logits(src, arch, TOKENS), reference_logits(out, arch, TOKENS)
    assert torch.equal(want, got)


def test_export_after_permutation_and_dedup(store, tmp_path):
    from safetensors.torch import load_file, save_file

    src = make_tiny_checkpoint("qwen3_moe", tmp_path / "v1")
    v2 = shutil.copytree(src, tmp_path / "v2")
    st = load_file(str(src / "model.safetensors"))
    st["model.layers.1.mlp.experts.4.down_proj.weight"] -= 0.5
    save_file(st, str(v2 / "model.safetensors"), metadata={"format": "pt"})
    perm = [list(reversed(range(8))), list(range(8))]
    mount(store, src, "q@1", class_perm=perm)
    res = mount(store, v2, "q@2", class_perm=perm)
    assert res.bytes_shared > 0
    for tag, ck in (("q@1", src), ("q@2", v2)):
        out = tmp_path / f"out-{tag}"
        export(store, tag, out)
        _same_files(ck, out)


def test_export_of_adapter_is_the_merged_model(store, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = make_tiny_checkpoint("mixtral", tmp_path / "base")
    mount(store, src, "m@1")
    st = load_file(str(src / "model.safetensors"))
    replaced = {
        "model.layers.0.block_sparse_moe.experts.1.w1.weight": None,
        "model.layers.0.block_sparse_moe.experts.1.w2.weight": None,
        "model.layers.0.block_sparse_moe.experts.1.w3.weight": None,
        "model.layers.1.self_attn.v_proj.weight": None,
    }
    rng = np.random.default_rng(0)
    for name in replaced:
        replaced[name] = torch.from_numpy(rng.standard_normal(tuple(st[name].shape)).astype("f4"))
    ad = tmp_path / "adapter"
    ad.mkdir()
    shutil.copy(src / "config.json", ad)
    save_file(replaced, str(ad / "model.safetensors"))
    mount(store, ad, "m@1-ad", adapter_of="m@1")
    out = tmp_path / "out"
    export(store, "m@1-ad", out)
    merged = load_file(str(out / "model.safetensors"))
    for name, tensor in st.items():
        assert torch.equal(merged[name], replaced.get(name, tensor)), name
    assert not torch.equal(
        reference_logits(out, "mixtral", TOKENS), reference_logits(src, "mixtral", TOKENS)
    )


def _flip_an_expert_byte(store, sel, tag):
    from czyx.portals import open_consumer

    with open_consumer(store, None, tag) as m:
        ext = m.expert_extent(1, 2)
    with open(store.block_path(sel), "r+b") as fh:
        fh.seek(ext.offset + 17)
        byte = fh.read(1)
        fh.seek(ext.offset + 17)
        fh.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("gguf", [False, True], ids=["safetensors", "gguf"])
def test_a_failed_export_changes_nothing(store, tmp_path, gguf):
    """A checksum mismatch midway: the error, and the target as it was (nothing half
    written, no staging left, a directory the export created removed)."""
    from czyx.store import ChecksumError
    from czyx.store.models.gguf_export import export_gguf

    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    sel = mount(store, ckpt, "m@1").selector
    _flip_an_expert_byte(store, sel, "m@1")
    run = (
        (lambda out: export_gguf(store, "m@1", out))
        if gguf
        else (lambda out: export(store, "m@1", out))
    )
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "config.json").write_text("{}")
    (kept / "model.gguf").write_bytes(b"old")
    for out in (kept, tmp_path / "new" / "deeper"):
        with pytest.raises(ChecksumError, match="checksum"):
            run(out)
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "model.gguf"]
    assert (kept / "config.json").read_text() == "{}"
    assert (kept / "model.gguf").read_bytes() == b"old"
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("gguf", [False, True], ids=["safetensors", "gguf"])
def test_export_reports_its_progress_in_bytes(store, tmp_path, gguf):
    from czyx.store.models.gguf_export import export_gguf

    if gguf:
        ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    else:
        ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", max_shard_size="20KB")
    mount(store, ckpt, "m@1")
    seen = []
    if gguf:
        (path,) = export_gguf(
            store, "m@1", tmp_path / "g", progress=lambda d, t: seen.append((d, t))
        )
    else:
        files = export(store, "m@1", tmp_path / "o", progress=lambda d, t: seen.append((d, t)))
    done = [d for d, _ in seen]
    (total,) = {t for _, t in seen}
    assert done == sorted(done) and done[-1] == total and len(seen) > 10
    if gguf:
        import gguf as gg

        assert total == sum(int(t.n_bytes) for t in gg.GGUFReader(path).tensors)
        plain = tmp_path / "plain"
        plain.write_bytes(b"")  # the mode a file created here gets (the umask's)
        assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    else:
        _same_files(ckpt, tmp_path / "o")  # (and the data bytes are the total)
        data = sum(
            p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little")
            for p in files
            if p.suffix == ".safetensors"
        )
        assert total == data
