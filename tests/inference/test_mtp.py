"""The DeepSeek-V3 multi-token-prediction layer as a draft head (inference.mtp).

A tiny random DeepSeek-V3 is mounted with an MTP layer appended as the published
checkpoints lay it out (``model.layers.<num_hidden_layers>.*``): its decoder block is
layer 0 of a second, one-layer transformers model, so that model is the block's
reference. The head's logits match a torch reference of the MTP formula
(``eh_proj(cat(enorm(emb(t[i+1])), hnorm(h[i])))``, the block, ``shared_head``)
written here from the tensors; greedy output with ``--speculate mtp`` is the
output without drafts; acceptance is reported; a model without MTP is refused.
"""

from __future__ import annotations

import itertools

import jsonschema
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from czyx.inference.batch import BatchOptions
from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.opened import OpenedModel
from czyx.inference.options import SpeculateOptions
from czyx.inference.speculative import SpeculationError, Speculator
from czyx.inference.xray import XRay, load_schema
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.testing.archparity import write_checkpoint
from czyx.testing.tiny_models import build_tiny_model, mtp_layer_tensors

BASE = dict(initializer_range=0.2, num_hidden_layers=3)
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 96, 12)]


def _block_model(arch: str = "deepseek_v3"):
    """The MTP layer's decoder block: layer 0 of a one-layer model of ``arch`` (sparse)."""
    return build_tiny_model(arch, 7, **{**BASE, "num_hidden_layers": 1}, first_k_dense_replace=0)


def _mounted(tmp_path, main, mtp: dict[str, torch.Tensor] | None) -> OpenedModel:
    src = write_checkpoint(main, tmp_path / "ckpt", fused=False)
    if mtp is not None:
        file = src / "model.safetensors"
        save_file({**load_file(str(file)), **mtp}, str(file), metadata={"format": "pt"})
    store = Store.open(tmp_path / "store")
    try:
        mount(store, src, "ds@1")
    finally:
        store.close()
    return OpenedModel(str(tmp_path / "store"), "ds@1", None)


@pytest.fixture(scope="module")
def main_model():
    model = build_tiny_model("deepseek_v3", 2, **BASE)
    assert model.config.num_nextn_predict_layers == 1
    return model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_head_logits_match_a_torch_reference_of_the_mtp_formula(tmp_path, main_model) -> None:
    block = _block_model()
    mtp = mtp_layer_tensors(main_model, block, echo=False)
    n = main_model.config.num_hidden_layers
    eps = main_model.config.rms_norm_eps
    ids = torch.tensor([PROMPT])
    # The main model's last hidden state before its final norm (transformers' own forward).
    seen: list[torch.Tensor] = []
    hook = main_model.model.norm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        main_model(ids)
    hook.remove()
    h = seen[0][0, :-1]  # positions 0 .. T-2, each followed by the token after it
    p = f"model.layers.{n}."
    emb = mtp[p + "embed_tokens.weight"][ids[0, 1:]]
    x = torch.cat(
        [_rms(emb, mtp[p + "enorm.weight"], eps), _rms(h, mtp[p + "hnorm.weight"], eps)], -1
    )
    x = x @ mtp[p + "eh_proj.weight"].T
    out: list[torch.Tensor] = []
    hook = block.model.norm.register_forward_pre_hook(lambda m, a: out.append(a[0]))
    with torch.no_grad():
        block.model(inputs_embeds=x[None])
    hook.remove()
    want = (
        _rms(out[0][0], mtp[p + "shared_head.norm.weight"], eps)
        @ mtp[p + "shared_head.head.weight"].T
    )

    from czyx.inference.mtp import MTPDrafter

    opened = _mounted(tmp_path, main_model, mtp)
    try:
        engine = Engine(opened.consumer)
        drafter = MTPDrafter.open(engine)
        try:
            engine.prefill(PROMPT[:-1])
            drafter.propose(PROMPT, 0)  # the module's cache over the prompt's positions
            head = drafter.head
            assert head.kv.length == len(PROMPT) - 1
            # The same positions again, through the head, compared row by row.
            head.kv.truncate(0)
            got = head.logits(head.block(PROMPT[1:], drafter._hidden[: len(PROMPT) - 1], 0))
        finally:
            drafter.close()
            engine.close()
    finally:
        opened.close()
    assert got.shape == tuple(want.shape)
    assert np.abs(got - want.numpy()).max() < 1e-4
    assert np.ptp(want.numpy()) > 1.0  # decisive logits, not a flat comparison


@pytest.mark.parametrize(
    "arch, echo",
    [("deepseek_v3", False), ("deepseek_v3", True), ("glm4_moe", False)],
    ids=["random", "echo", "glm4_moe"],
)
def test_mtp_greedy_output_is_the_output_without_drafts(tmp_path, main_model, arch, echo) -> None:
    """GLM-4.5 lays its MTP layer out as DeepSeek-V3 does (grouped-query attention)."""
    if arch != "deepseek_v3":
        main_model = build_tiny_model(arch, 2, **BASE, num_nextn_predict_layers=1)
    opened = _mounted(tmp_path, main_model, mtp_layer_tensors(main_model, _block_model(arch), echo))
    xray = XRay()
    try:
        engine = Engine(opened.consumer, xray=xray)
        try:
            want, _ = generate_ids(engine, PROMPT, 24)
            options = SpeculateOptions("mtp", draft_tokens=3, adaptive=False)
            spec = Speculator.open(options, engine)
            try:
                got, stats = generate_ids(engine, PROMPT, 24, speculate=spec)
            finally:
                spec.close()
            assert engine.model.hidden_hook is None  # the drafter let go of the engine
            report = xray.report(engine.cache, tokens=24, speculation=stats.draft_steps)
        finally:
            engine.close()
    finally:
        opened.close()
    assert got == want
    jsonschema.validate(report, load_schema())
    run = report["run"]["speculation"]
    assert run["drafted"] == stats.drafted > 0
    assert run["accepted"] == stats.accepted
    assert run["acceptance_rate"] == pytest.approx(stats.acceptance_rate)
    if echo:  # the head echoes the pending token: accepted where the text repeats one
        assert any(a == b for a, b in itertools.pairwise(want)) and stats.accepted > 0


def test_a_model_without_mtp_is_refused_in_one_line(tmp_path, main_model) -> None:
    opened = _mounted(tmp_path, main_model, None)
    try:
        engine = Engine(opened.consumer)
        try:
            with pytest.raises(SpeculationError, match="num_nextn_predict_layers") as err:
                Speculator.open(SpeculateOptions("mtp"), engine)
            assert "\n" not in str(err.value)
            assert engine.model.hidden_hook is None
        finally:
            engine.close()
    finally:
        opened.close()
    opened = _mounted(tmp_path / "with", main_model, mtp_layer_tensors(main_model, _block_model()))
    try:
        engine = Engine(opened.consumer)
        try:  # a portal narrowing routing does not scope the MTP experts: refused
            engine.model.route_mask = np.ones((3, 8), bool)
            with pytest.raises(SpeculationError, match="restricts routing"):
                Speculator.open(SpeculateOptions("mtp"), engine)
        finally:
            engine.close()
    finally:
        opened.close()
    with pytest.raises(ValueError, match="mtp is not served"):  # czyx serve, czyx chat
        BatchOptions(speculate=SpeculateOptions("mtp"))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_every_forward_path_hands_the_same_pre_norm_rows(arch) -> None:
    """The hidden hook (the drafter's input) on the C paths (a prompt through the batched
    C step, a decode, a verify) gives the rows of the numpy forward, each at its position,
    and they are what the final norm and head turn into the logits."""
    from czyx.inference.batch import forward_batch
    from czyx.inference.models.base import rms_norm
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    model = tiny_model(arch)
    tokens = [*PROMPT, 5, 7, 9, 11]
    got: dict[int, np.ndarray] = {}

    def keep(kv, start, h):
        for j, row in enumerate(np.asarray(h)):
            got[start + j] = row.copy()

    engine = Engine(StateDictConsumer(model))
    assert engine.model.decode_in_c()
    engine.model.hidden_hook = keep
    engine.prefill(tokens[:12])  # the batched C step
    engine.decode(tokens[12])  # the one-token C step
    logits = engine.verify(tokens[13:])  # the batched C step, every row
    engine.close()
    numpy = Engine(StateDictConsumer(model))
    want: dict[int, np.ndarray] = {}
    numpy.model.hidden_hook = lambda kv, start, h: want.update(enumerate(np.array(h), start))
    forward_batch(numpy.model, [np.array(tokens)], [numpy.kv], c_decode=False)  # numpy rows
    cfg = numpy.cfg
    hn = rms_norm(np.stack([got[p] for p in range(13, 16)]), numpy.model.final_norm, cfg.rms_eps)
    numpy.close()
    assert sorted(got) == sorted(want) == list(range(len(tokens)))
    assert max(np.abs(got[p] - want[p]).max() for p in want) < 1e-4
    assert np.abs(hn @ numpy.model.lm_head.T - logits).max() < 1e-4
