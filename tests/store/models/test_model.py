"""The store-backed ModelConsumer: expert reads and trunk tensors against transformers' own."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.portals import open_consumer
from czyx.store import ChecksumError, Store
from czyx.store.consumer import ModelConsumer
from czyx.store.models.model import open_version
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import ExpertIndexError, MissingTrunkRoleError, ModelSpaceError
from czyx.testing.tiny_models import build_tiny_model, make_tiny_checkpoint

CASES = [
    ("mixtral", True),
    ("qwen2_moe", False),
    ("qwen3_moe", True),
    ("olmoe", False),
    ("deepseek_v3", False),
]


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    store = Store.open(root / "store")
    for arch, fused in CASES:
        mount(store, make_tiny_checkpoint(arch, root / arch, fused=fused), f"{arch}@1")
    perm = [np.random.default_rng(l).permutation(8).tolist() for l in range(2)]
    mount(store, root / "qwen3_moe", "qwen3_moe@perm", class_perm=perm)
    yield store
    store.close()


@pytest.fixture(scope="module")
def mixtral_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("mx") / "ck", seed=5)


def _torch_trunk(model, role, layer):
    """The transformers parameter behind a role (the mapping the engine relies on)."""
    if layer is None:
        return {
            "embed": model.model.embed_tokens.weight,
            "final_norm": model.model.norm.weight,
            "lm_head": model.lm_head.weight,
        }[role]
    blk = model.model.layers[layer]
    table = {
        "input_norm": blk.input_layernorm.weight,
        "post_attn_norm": blk.post_attention_layernorm.weight,
        "o_proj": blk.self_attn.o_proj.weight,
    }
    if hasattr(blk.mlp, "experts"):
        table["router"] = blk.mlp.gate.weight
    for name in ("q_proj", "q_norm"):
        if getattr(blk.self_attn, name, None) is not None:
            table[name] = getattr(blk.self_attn, name).weight
    if hasattr(blk.mlp, "shared_expert_gate"):
        table["shared_expert_gate"] = blk.mlp.shared_expert_gate.weight
        table["shared_down_proj"] = blk.mlp.shared_expert.down_proj.weight
    if hasattr(blk.mlp, "shared_experts"):
        table["shared_down_proj"] = blk.mlp.shared_experts.down_proj.weight
    return table.get(role)


@pytest.mark.parametrize(("arch", "tag"), [(a, "1") for a, _ in CASES] + [("qwen3_moe", "perm")])
def test_experts_and_trunk_match_transformers(mounted, arch, tag):
    model = build_tiny_model(arch)
    with open_consumer(mounted, None, f"{arch}@{tag}") as m:
        assert isinstance(m, ModelConsumer)
        info = m.info
        assert info.arch == arch and info.expert_format == "f32"
        assert info.expert_slot_nbytes % 4096 == 0
        slot = np.empty(info.expert_slot_nbytes, np.uint8)
        sparse = mounted.manifest(m._space.selector)["expert"]["sparse_layers"]
        for layer in sparse:
            experts = model.model.layers[layer].mlp.experts
            for byte in range(info.n_experts):
                m.read_expert(layer, byte, slot)
                gate, up, down = m.expert_views(slot)
                gu = experts.gate_up_proj[byte].detach().numpy()
                inter = gate.shape[0]
                assert np.array_equal(gate, gu[:inter]) and np.array_equal(up, gu[inter:])
                assert np.array_equal(down, experts.down_proj[byte].detach().numpy())
                ext = m.expert_extent(layer, byte)
                with open(m.expert_block_paths()[ext.block], "rb") as fh:
                    on_disk = os.pread(fh.fileno(), ext.length, ext.offset)
                assert on_disk == slot[: ext.length].tobytes()
        checked = 0
        for layer in [None, *range(info.n_layers)]:
            roles = (
                ["embed", "final_norm", "lm_head"]
                if layer is None
                else [
                    "input_norm",
                    "post_attn_norm",
                    "o_proj",
                    "router",
                    "q_proj",
                    "q_norm",
                    "shared_expert_gate",
                    "shared_down_proj",
                ]
            )
            for role in roles:
                want = _torch_trunk(model, role, layer)
                if want is None:
                    if role not in ("q_proj", "q_norm"):  # DeepSeek's q is LoRA-factored
                        assert not m.has_trunk(role, layer)
                    continue
                got = m.trunk(role, layer)
                assert got.dtype == np.float32 and not got.flags.writeable
                assert np.array_equal(got, want.detach().numpy())
                checked += 1
        assert checked >= 3 + 4 * info.n_layers - 1


def test_bf16_trunk_is_widened_exactly_and_views_are_bits(tmp_path):
    import torch

    path = make_tiny_checkpoint("olmoe", tmp_path / "ck", dtype="bfloat16")
    model = build_tiny_model("olmoe", dtype="bfloat16")
    with Store.open(tmp_path / "s") as s:
        mount(s, path, "o@bf")
        with open_consumer(s, None, "o@bf") as m:
            assert m.info.expert_format == "bf16"
            assert np.array_equal(
                m.trunk("q_norm", 1),
                model.model.layers[1].self_attn.q_norm.weight.detach().float().numpy(),
            )
            slot = np.empty(m.info.expert_slot_nbytes, np.uint8)
            m.read_expert(0, 3, slot)
            gate, _, down = m.expert_views(slot)
            assert gate.dtype == np.uint16
            want = model.model.layers[0].mlp.experts.down_proj[3].detach()
            assert np.array_equal(down, want.view(torch.int16).numpy().view(np.uint16))


def test_corrupt_block_file_is_a_checksum_error(tmp_path):
    path = make_tiny_checkpoint("mixtral", tmp_path / "ck")
    with Store.open(tmp_path / "s") as s:
        res = mount(s, path, "x@1")
        with open_consumer(s, None, "x@1") as m:
            ext = m.expert_extent(1, 2)
            with open(s.block_path(res.selector), "r+b") as fh:
                fh.seek(ext.offset + 17)
                byte = fh.read(1)
                fh.seek(ext.offset + 17)
                fh.write(bytes([byte[0] ^ 0x01]))
            slot = np.empty(m.info.expert_slot_nbytes, np.uint8)
            m.read_expert(1, 1, slot)  # other experts are still fine
            with pytest.raises(ChecksumError, match="checksum"):
                m.read_expert(1, 2, slot)


def test_bad_fetches(mounted):
    with open_consumer(mounted, None, "deepseek_v3@1") as m:
        slot = np.empty(m.info.expert_slot_nbytes, np.uint8)
        with pytest.raises(ModelSpaceError, match="no routed expert"):
            m.read_expert(0, 1, slot)  # layer 0 is dense
        with pytest.raises(ExpertIndexError, match="outside"):
            m.read_expert(2, 1, slot)
        with pytest.raises(ModelSpaceError):
            m.read_expert(1, 8, slot)  # 8 experts
        with pytest.raises(ValueError, match="slot"):
            m.read_expert(1, 1, slot[:100])
        assert m.has_trunk("kv_b_proj", 1) and m.has_trunk("mlp_up_proj", 0)
        with pytest.raises(MissingTrunkRoleError, match="no shared_expert_gate at layer 1"):
            m.trunk("shared_expert_gate", 1)
        with pytest.raises(ValueError):
            m.trunk("nonsense", 1)


def test_open_refuses_non_model_spaces(mounted):
    trunk = mounted.manifest(mounted.resolve_tag("olmoe@1"))["trunk"]
    with pytest.raises(ModelSpaceError, match="not a mounted model"):
        open_consumer(mounted, None, trunk)


def test_portal_restricts_by_class_after_permutation(mounted):
    from czyx import portals
    from czyx.portals.caveats import ClassRange, LayerRange

    sel = mounted.resolve_tag("qwen3_moe@perm")
    perm = mounted.manifest(sel)["layout"]["class_perm"]
    grant = portals.grant(
        mounted,
        [ClassRange(0, 3), LayerRange(1, 1)],
        tenant="alice",
        parent=portals.root_token(mounted),
    )
    view = portals.open_model(mounted, grant.token, "qwen3_moe@perm")
    with open_version(mounted, sel, view=view) as m:
        slot = np.empty(m.info.expert_slot_nbytes, np.uint8)
        for byte in range(8):
            if perm[1][byte] < 4:  # the portal speaks classes, the engine router bytes
                m.read_expert(1, byte, slot)
            else:
                with pytest.raises(portals.PortalError):
                    m.read_expert(1, byte, slot)
        with pytest.raises(portals.PortalError):
            m.expert_extent(0, 0)
        assert m.trunk("embed").shape == (96, 32)  # the trunk is read whole
    with pytest.raises(ModelSpaceError, match="another space"):
        open_version(mounted, "qwen3_moe@1", view=view)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_engine_on_a_mounted_model_matches_transformers(tmp_path, arch):
    """The consumer contract end to end: mount (permuted classes), open, run the numpy
    engine with half the experts resident, compare with transformers' logits."""
    import torch

    from czyx.inference.engine import Engine

    tokens = [3, 17, 5, 60, 1, 88, 42, 9]
    path = make_tiny_checkpoint(arch, tmp_path / "ck", seed=3)
    n = 4 if arch == "mixtral" else 8
    perm = [np.random.default_rng(l).permutation(n).tolist() for l in range(2)]
    with Store.open(tmp_path / "s") as s:
        mount(s, path, "e@1", class_perm=perm)
        with open_consumer(s, None, "e@1") as m:
            engine = Engine(m, cache_fraction=0.5)
            got = engine.prefill(tokens, all_logits=True)
            engine.close()
    with torch.no_grad():
        want = build_tiny_model(arch, seed=3)(torch.tensor([tokens])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.ptp(want)


@settings(max_examples=8, deadline=None)
@given(
    outer=st.sampled_from(["morton", "hilbert", "rowmajor"]),
    perm=st.lists(st.permutations(range(4)), min_size=2, max_size=2),
)
def test_for_all_layouts_and_permutations_reads_return_the_router_bytes_expert(
    mixtral_ckpt, outer, perm
):
    """Whatever the curve and class order, (layer, router byte) reads that expert's
    bytes, every own extent sits at data_start + ordinal * stride, none overlap."""
    import tempfile

    from czyx.store.models.checkpoint import Checkpoint
    from czyx.store.models.mount_plan import plan_checkpoint

    with Checkpoint(mixtral_ckpt) as ck:
        plan = plan_checkpoint(ck)
        want = {
            k: b"".join(bytes(ck.raw(p.tensor)[p.start : p.start + p.nbytes]) for p in parts)
            for k, parts in plan.experts.items()
        }
    with tempfile.TemporaryDirectory() as d, Store.open(d) as s:
        mount(s, mixtral_ckpt, "m@1", outer=outer, class_perm=perm)
        with open_consumer(s, None, "m@1") as m:
            slot = np.empty(m.info.expert_slot_nbytes, np.uint8)
            offsets = set()
            for (layer, byte), data in want.items():
                m.read_expert(layer, byte, slot)
                assert slot[: m.info.expert_nbytes].tobytes() == data
                offsets.add(m.expert_extent(layer, byte).offset)
            assert len(offsets) == len(want)
            assert (max(offsets) - min(offsets)) // m.info.expert_slot_nbytes == len(want) - 1


def test_direct_io_reads_the_padded_stride(mounted):
    from czyx.store import aligned_empty

    with (
        open_consumer(mounted, None, "olmoe@1") as plain,
        open_consumer(mounted, None, "olmoe@1", direct=True) as m,
    ):
        a = aligned_empty(m.info.expert_slot_nbytes)
        b = np.empty(plain.info.expert_slot_nbytes, np.uint8)
        for layer, byte in [(0, 0), (1, 7), (0, 5)]:
            m.read_expert(layer, byte, a)
            plain.read_expert(layer, byte, b)
            n = m.info.expert_nbytes
            assert a[:n].tobytes() == b[:n].tobytes()
            assert not a[n:].any()  # the padding of the block file is zeros
