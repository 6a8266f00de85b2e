"""End to end: a tiny checkpoint mounted in a store, opened through a portal, run.

The engine sees only the store's ModelConsumer (``store.model``) behind a
portal view (``portals.open_model``): logits match transformers, tiered runs
match resident ones bit for bit, a portal narrowed to some classes refuses
the experts outside them, and ``czyx run`` streams text and its figures.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from czyx import portals
from czyx.cli import main
from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.testing.refmodels import ARCHS, tiny_model

PROMPT = np.random.default_rng(11).integers(0, 256, 10)


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    """A store holding each architecture as ``ARCH@1``, and the reference models."""
    root = tmp_path_factory.mktemp("e2e")
    models = {}
    store = Store.open(root / "store")
    for arch in ARCHS:
        model = tiny_model(arch, seed=3)
        model.save_pretrained(root / arch)
        mount(store, root / arch, f"{arch}@1")
        models[arch] = model
    token = portals.root_token(store)
    store.close()
    return root / "store", models, token


@pytest.mark.parametrize("arch", ARCHS)
def test_mounted_model_through_a_portal_matches_transformers(mounted, arch):
    store_dir, models, token = mounted
    with torch.no_grad():
        want = models[arch](torch.tensor(PROMPT)[None]).logits[0].numpy()
    opened = OpenedModel(str(store_dir), f"{arch}@1", token)
    try:
        got = Engine(opened.consumer).prefill(PROMPT, all_logits=True)
        assert np.abs(got - want).max() < 1e-4 * float(want.max() - want.min())
        full, _ = generate_ids(Engine(opened.consumer), PROMPT.tolist(), 16)
        top_k = int(opened.consumer.info.config["num_experts_per_tok"])
        slot = opened.consumer.info.expert_slot_nbytes
        small = Engine(opened.consumer, cache_bytes=top_k * slot)
        tiered, st = generate_ids(small, PROMPT.tolist(), 16)
        assert tiered == full and st.decode_cache.misses > 0
        small.reset()
        assert np.array_equal(small.prefill(PROMPT, all_logits=True), got)
    finally:
        opened.close()


def test_portal_narrowed_to_some_classes_refuses_the_rest(mounted):
    store_dir, _, token = mounted
    narrow = portals.attenuate(token, [portals.ClassRange(0, 0)])
    opened = OpenedModel(str(store_dir), "mixtral@1", narrow)
    try:
        # One class cannot feed a top-2 router: refused when the engine is built
        # (routing is masked to the grant; tests/inference/test_scoped_routing.py).
        from czyx.inference.errors import ScopeRoutingError

        with pytest.raises(ScopeRoutingError, match="permits 1 of"):
            Engine(opened.consumer)
    finally:
        opened.close()


def test_czyx_run_streams_text_and_figures(mounted, capsys):
    store_dir, _, token = mounted
    argv = ["run", "olmoe@1", "--prompt", "hi", "--store", str(store_dir), "--portal", token]
    assert main([*argv, "--max-tokens", "8", "--cache-fraction", "0.5", "--seed", "1"]) == 0
    out = capsys.readouterr()
    assert out.out.endswith("\n") and len(out.out) >= 1
    for figure in ("prefill:", "decode:", "hit rate", "MB/token", "exposed I/O wait"):
        assert figure in out.err
    assert main([*argv, "--cache-mb", "0.001"]) == 1
    assert "top-2" in capsys.readouterr().err


def test_czyx_run_streams_a_model_bigger_than_the_memory_it_may_take(mounted, capsys, monkeypatch):
    from czyx.inference import engine as engine_mod
    from czyx.inference.cache import ExpertCache

    store_dir, _, token = mounted
    argv = ["run", "olmoe@1", "--prompt", "hi", "--store", str(store_dir), "--portal", token]
    argv += ["--max-tokens", "8", "--seed", "1"]
    assert main([*argv, "--cache-fraction", "1.0"]) == 0
    resident = capsys.readouterr()
    assert "expert slots:" not in resident.err
    with OpenedModel(str(store_dir), "olmoe@1", token) as opened:
        probe = Engine(opened.consumer)
        total = probe.expert_bytes
        probe.close()
    # beyond the caches other tests left open, room for about half of the experts
    open_caches = ExpertCache.reserved_bytes()
    monkeypatch.setattr(engine_mod, "available_bytes", lambda: int(total * 0.6) + open_caches)
    assert main(argv) == 0
    streamed = capsys.readouterr()
    assert "czyx run: expert slots:" in streamed.err and "--cache-mb" in streamed.err
    assert streamed.out == resident.out  # the budget sets the hit rate, not the tokens

    def slots(err: str) -> int:
        return int(re.search(r"experts \((\d+) slots\)", err).group(1))

    assert slots(streamed.err) < slots(resident.err) / 2 + 1


def test_a_model_bigger_than_memory_reads_around_the_page_cache(mounted, tmp_path, monkeypatch):
    """No I/O path named, none recorded: slots short of the experts whose files the
    memory left could not also hold read with O_DIRECT (where the filesystem allows it);
    with room for the files, memory unknown, or every expert held, buffered pread. The
    tokens are the same whichever path read the bytes."""
    from czyx.inference import engine as engine_mod
    from czyx.store.io.iopaths import CONFIG_ENV, accepts_direct

    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "no-io-config.json"))
    store_dir, _, token = mounted
    prompt = [int(t) for t in PROMPT]
    with OpenedModel(str(store_dir), "mixtral@1", token) as opened:
        consumer = opened.consumer
        probe = Engine(consumer)  # every expert fits this machine
        total, ids = probe.expert_bytes, generate_ids(probe, prompt, 8)[0]
        assert probe.cache.io == "pread"
        probe.close()
        direct = accepts_direct(engine_mod._first_block(consumer))
        # the engine's preference, whatever this filesystem then allows
        asked: list[bool] = []
        store_default = engine_mod.default_io_path

        def recorded(prefer, probe):
            asked.append(prefer)
            return store_default(prefer, probe)

        monkeypatch.setattr(engine_mod, "default_io_path", recorded)

        def io_with_room(room):
            monkeypatch.setattr(engine_mod, "available_bytes", lambda: room)
            eng = Engine(consumer, cache_fraction=0.5)
            try:
                return eng.cache.io, generate_ids(eng, prompt, 8)[0]
            finally:
                eng.close()

        # room for the slots, not for the rest of the files beside them
        assert io_with_room(total) == ("direct" if direct else "pread", ids)
        assert io_with_room(10 * total) == ("pread", ids)
        assert io_with_room(None) == ("pread", ids)
        assert asked == [True, False, False]
        # the default budget and the default path come from one reading of the memory
        reads = []
        monkeypatch.setattr(engine_mod, "available_bytes", lambda: reads.append(1) or total)
        eng = Engine(consumer)
        try:
            assert eng.budget_bytes < total and len(reads) == 1
            assert eng.cache.io == ("direct" if direct else "pread") and asked[-1] is True
        finally:
            eng.close()


def test_torch_consumer_on_the_mounted_store_agrees_with_the_engine(mounted):
    from czyx.inference.torch_moe import TorchMoELayer

    store_dir, _, token = mounted
    opened = OpenedModel(str(store_dir), "qwen3_moe@1", token)
    try:
        eng = Engine(opened.consumer, cache_fraction=0.5)
        x = np.random.default_rng(5).standard_normal((7, eng.cfg.hidden_size)).astype(np.float32)
        ours = eng.model._routed(0, eng.model.layers[0], x)
        layer = TorchMoELayer(opened.consumer, 0, eng.cfg.top_k, eng.cfg.renormalize)
        theirs = layer(torch.from_numpy(x)).numpy()
        assert np.abs(theirs - ours).max() < 1e-5 * float(np.abs(ours).max())
    finally:
        opened.close()


def test_czyx_profile_then_run_with_the_hot_list(mounted, tmp_path, capsys):
    store_dir, _, token = mounted
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    prof = tmp_path / "trace.npz"
    common = ["--store", str(store_dir), "--portal", token]
    argv = ["profile", "mixtral@1", "--text", str(text), "--out", str(prof), "--chunk", "64"]
    assert main([*argv, *common]) == 0
    assert "hottest: L" in capsys.readouterr().err
    # The trace is the documented format, one row per token, chunked into segments.
    from czyx.inference.trace import RoutingTrace

    trace = RoutingTrace.load(prof)
    n_tokens = len(text.read_bytes())
    assert trace.n_tokens == n_tokens
    assert trace.segments.max() == (n_tokens - 1) // 64
    assert trace.text_sha256 == __import__("hashlib").sha256(text.read_bytes()).hexdigest()
    # Renormalised top-k weights of each (token, layer) sum to one.
    assert np.allclose(trace.weights.sum(-1), 1.0, atol=1e-5)
    argv = ["run", "mixtral@1", "--prompt", "the quick", "--max-tokens", "4", *common]
    assert main([*argv, "--cache-fraction", "0.5", "--hot", str(prof)]) == 0
    assert "hit rate" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "czyx-routing-profile-1", "counts": [[1]]}')
    assert main([*argv, "--hot", str(bad)]) == 1
    assert "routing profile" in capsys.readouterr().err


def test_czyx_run_penalties_are_the_samplers(mounted, capsys):
    """--presence-penalty / --frequency-penalty reach the sampler: the printed text is the
    engine's own penalized greedy run, not the plain one."""
    from czyx.inference.sampling import SamplingParams
    from czyx.inference.tokenizer import tokenizer_for

    store_dir, _, token = mounted
    argv = ["run", "olmoe@1", "--prompt", "hello", "--store", str(store_dir), "--portal", token]
    argv += ["--max-tokens", "16", "--cache-fraction", "1.0"]
    pen = ["--presence-penalty", "0.5", "--frequency-penalty", "1.5"]
    assert main([*argv, *pen]) == 0
    penalized = capsys.readouterr().out
    assert main(argv) == 0
    plain = capsys.readouterr().out
    with OpenedModel(str(store_dir), "olmoe@1", token) as om:
        engine = Engine(om.consumer)
        try:
            tok = tokenizer_for(om.consumer, engine.cfg.vocab_size)
            sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=1.5)
            ids, _ = generate_ids(engine, tok.encode("hello"), 16, sampling)
        finally:
            engine.close()
    assert penalized == tok.decode(ids) + "\n"
    assert penalized != plain
