"""The validating safetensors reader: round trips, lying headers, truncation, shards."""

from __future__ import annotations

import itertools
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from czyx.store.models.checkpoint import Checkpoint, SafetensorsFile, to_float32, write_safetensors
from czyx.store.models.mount_errors import (
    CheckpointError,
    HeaderError,
    MissingTensorError,
    TruncatedFileError,
    UnexpectedTensorError,
)

_NP = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "U8": np.uint8, "BF16": np.uint16}


def _raw_file(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(sorted(_NP)), st.lists(st.integers(0, 5), max_size=3)),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 2**31),
)
def test_roundtrip_any_tensors(tmp_path, specs, seed):
    rng = np.random.default_rng(seed)
    tensors = {}
    for i, (dtype, shape) in enumerate(specs):
        arr = rng.integers(0, 255, size=shape).astype(_NP[dtype])
        tensors[f"t{i}"] = (dtype, tuple(shape), np.ascontiguousarray(arr))
    path = tmp_path / f"rt{seed}.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt"}
        for name, (dtype, shape, arr) in tensors.items():
            got = f.array(name)
            assert got.shape == shape and f.info(name).dtype == dtype
            assert got.tobytes() == arr.tobytes()
            assert bytes(f.raw(name)) == arr.tobytes()


def test_reads_what_the_reference_writer_wrote(tmp_path):
    import torch
    from safetensors.torch import save_file

    t = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.ones(2, 2)}
    save_file(t, str(tmp_path / "x.safetensors"))
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        assert np.array_equal(f.array("a"), t["a"].numpy())
        b = to_float32(f.array("b"), f.info("b").dtype)
        assert np.array_equal(b, t["b"].float().numpy())
        view = f.array("a")
        assert not view.flags.writeable and not view.flags.owndata  # zero-copy, read-only


def _assert_names(exc: CheckpointError, path, tensor: str | None) -> None:
    assert str(path) in str(exc)
    if tensor:
        assert repr(tensor) in str(exc) and exc.tensor == tensor


@pytest.mark.parametrize(
    ("entry", "data_len", "error"),
    [
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, 8, TruncatedFileError),
        ({"dtype": "F32", "shape": [4], "data_offsets": [32, 48]}, 16, HeaderError),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, 16, HeaderError),
        ({"dtype": "F16", "shape": [4], "data_offsets": [0, 16]}, 16, HeaderError),
        ({"dtype": "Q3", "shape": [4], "data_offsets": [0, 16]}, 16, HeaderError),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, 16, HeaderError),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, 16, HeaderError),
        ({"dtype": "F32", "shape": [4]}, 16, HeaderError),
    ],
    ids=[
        "truncated",
        "outside",
        "too-short",
        "wrong-dtype-size",
        "unknown-dtype",
        "negative-shape",
        "reversed",
        "no-offsets",
    ],
)
def test_lying_headers_name_file_and_tensor(tmp_path, entry, data_len, error):
    path = tmp_path / "bad.safetensors"
    _raw_file(path, {"w": entry}, bytes(data_len))
    with pytest.raises(error) as info:
        SafetensorsFile(path)
    _assert_names(info.value, path, "w")


def test_overlapping_tensors(tmp_path):
    path = tmp_path / "ov.safetensors"
    hdr = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    _raw_file(path, hdr, bytes(24))
    with pytest.raises(HeaderError, match="overlaps") as info:
        SafetensorsFile(path)
    _assert_names(info.value, path, "b")


@pytest.mark.parametrize("cut", [3, 8 + 5, None])
def test_truncated_file(tmp_path, cut):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"w": ("F32", (64,), np.arange(64, dtype=np.float32))})
    blob = path.read_bytes()
    path.write_bytes(blob[: cut if cut is not None else len(blob) - 10])
    with pytest.raises(TruncatedFileError) as info:
        SafetensorsFile(path)
    _assert_names(info.value, path, "w" if cut is None else None)


def test_header_not_json_and_header_too_long(tmp_path):
    path = tmp_path / "j.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(HeaderError, match="not JSON"):
        SafetensorsFile(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(HeaderError, match="cap"):
        SafetensorsFile(path)


def _sharded(tmp_path, weight_map=None):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    write_safetensors(d / "a.safetensors", {"x": ("F32", (2,), np.ones(2, np.float32))})
    write_safetensors(d / "b.safetensors", {"y": ("F32", (3,), np.zeros(3, np.float32))})
    wm = weight_map if weight_map is not None else {"x": "a.safetensors", "y": "b.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return d


def test_sharded_index(tmp_path):
    with Checkpoint(_sharded(tmp_path)) as ck:
        assert ck.names() == ["x", "y"] and len(ck) == 2
        assert ck.array("y").shape == (3,)
        assert ck.index_name == "model.safetensors.index.json"


def test_shard_tensor_missing_from_index(tmp_path):
    d = _sharded(tmp_path)
    write_safetensors(
        d / "a.safetensors",
        {
            "x": ("F32", (2,), np.ones(2, np.float32)),
            "stray": ("F32", (1,), np.ones(1, np.float32)),
        },
    )
    with pytest.raises(UnexpectedTensorError) as info:
        Checkpoint(d)
    assert info.value.tensor == "stray" and "a.safetensors" in str(info.value)


@pytest.mark.parametrize(
    ("wm", "error", "tensor"),
    [
        (
            {"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors"},
            MissingTensorError,
            "z",
        ),
        ({"x": "a.safetensors", "y": "a.safetensors"}, MissingTensorError, "y"),
        ({"x": "a.safetensors", "y": "c.safetensors"}, MissingTensorError, None),
        ({"x": "../a.safetensors", "y": "b.safetensors"}, CheckpointError, None),
    ],
    ids=["index-names-absent-tensor", "index-lies-about-shard", "missing-shard", "escape"],
)
def test_bad_index(tmp_path, wm, error, tensor):
    with pytest.raises(error) as info:
        Checkpoint(_sharded(tmp_path, wm))
    if tensor:
        assert info.value.tensor == tensor


def test_directory_problems(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        Checkpoint(tmp_path)
    for n in ("a", "b"):
        write_safetensors(tmp_path / f"{n}.safetensors", {})
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors\.index\.json"):
        Checkpoint(tmp_path)


@given(st.integers(0, 0xFFFF))
def test_bf16_widening_is_exact(bits):
    import torch

    got = to_float32(np.array([bits], np.uint16), "BF16")
    want = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    assert got.view(np.uint32)[0] == want.numpy().view(np.uint32)[0]


_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "BF16", "U8", "Q4", 7]),
        "shape": st.one_of(st.lists(st.integers(-2, 6), max_size=3), st.just("x")),
        "data_offsets": st.one_of(
            st.lists(st.integers(-4, 200), min_size=0, max_size=3),
            st.tuples(st.integers(0, 100), st.integers(0, 100)).map(list),
        ),
    }
)


@settings(max_examples=150, deadline=None)
@given(
    header=st.dictionaries(st.text(min_size=1, max_size=6), _entry, max_size=4),
    data_len=st.integers(0, 160),
)
def test_for_all_headers_valid_or_typed_error(tmp_path_factory, header, data_len):
    """Whatever the header says, the reader either refuses with a CheckpointError or
    every tensor it accepts lies inside the file, sized right, overlapping no other."""
    path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
    _raw_file(path, header, bytes(data_len))
    try:
        f = SafetensorsFile(path)
    except CheckpointError:
        return
    with f:
        spans = sorted((i.begin, i.end) for i in f.tensors.values() if i.nbytes)
        for (_, end), (begin, _) in itertools.pairwise(spans):
            assert begin >= end
        for name, info in f.tensors.items():
            assert 0 <= info.begin <= info.end <= data_len
            assert f.array(name).nbytes == info.nbytes
