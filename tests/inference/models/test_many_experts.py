"""More than 256 routed experts a layer: Kimi-K2's 384 and a Qwen3-Next-like 512.

The key splits a class value above 255 between the class byte and ``y``
(``czyx.expert_key``). Checked here through the whole store path: logits within
1e-5 of transformers, greedy equal with every expert resident and with a
quarter cached, export byte-exact (per-expert files and transformers 5's stacked
form); the records sit where the key design says; a class-scoped portal grants a
contiguous range of experts and routing stays inside it; the batched server
step matches the engine; routing traces keep indices above 255.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.expert_key import class_shift, expert_key
from czyx.inference.batch import forward_batch
from czyx.inference.engine import Engine
from czyx.inference.opened import OpenedModel
from czyx.inference.profile import RouteRecorder
from czyx.inference.trace import RoutingTrace
from czyx.key import Key
from czyx.portals.model import grant_model
from czyx.store import Store
from czyx.store.models.expert_layout import layout_from_manifest
from czyx.store.models.mount import mount
from czyx.testing.archparity import run_parity, write_checkpoint
from czyx.testing.tiny_models import build_tiny_model

# Kimi-K2 is the DeepSeek-V3 architecture with 384 routed experts, top-8, one group.
KIMI = ("deepseek_v3", dict(n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1))
# Qwen3-Next routes 512 experts top-10 (its hybrid attention is tested on its own).
QWEN512 = ("qwen3_moe", dict(num_experts=512, num_experts_per_tok=10))
BASE = dict(initializer_range=0.2, num_hidden_layers=2)


@pytest.mark.parametrize(
    ("arch", "over", "fused"),
    [(*KIMI, False), (*KIMI, True), (*QWEN512, False)],
    ids=["kimi384-per_expert", "kimi384-fused", "qwen512-per_expert"],
)
def test_more_than_256_experts_match_transformers(tmp_path, arch, over, fused):
    r = run_parity(arch, tmp_path, fused=fused, steps=10, **BASE, **over)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 * r.logit_range and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5


@pytest.fixture(scope="module")
def kimi_store(tmp_path_factory):
    """A mounted 384-expert model (identity class order)."""
    tmp = tmp_path_factory.mktemp("kimi")
    arch, over = KIMI
    model = build_tiny_model(arch, 0, **BASE, **over)
    ckpt = write_checkpoint(model, tmp / "ckpt", fused=False)
    with Store.open(tmp / "store") as st:
        res = mount(st, ckpt, "kimi@1")
    return tmp / "store", res.selector


def test_records_sit_at_the_split_key(kimi_store):
    store_dir, sel = kimi_store
    with Store.open(store_dir) as st:
        manifest = st.manifest(sel)
        layout = layout_from_manifest(manifest)
        records = list(st.scan(sel))
    n = int(manifest["expert"]["n_experts"])
    assert n == 384 and class_shift(n) == 1
    sparse = manifest["expert"]["sparse_layers"]
    assert len(records) == n * len(sparse)
    seen = set()
    for raw, rec in records:
        k = Key.unpack(raw)
        value = layout.class_of(rec["layer"], rec["expert"])
        assert k == expert_key(value, rec["layer"], 1)
        assert k.cls == value >> 1 and k.y == value & 1
        seen.add((k.cls, k.y))
    assert max(c for c, _ in seen) == 191 and {y for _, y in seen} == {0, 1}
    # A class prefix scan returns exactly the experts of that class: two a layer.
    with Store.open(store_dir) as st:
        in_class = [rec["expert"] for _, rec in st.scan(sel, 100, 100)]
    assert sorted(in_class) == sorted([200, 201] * len(sparse))


def test_a_class_scoped_portal_grants_a_contiguous_expert_range(kimi_store):
    store_dir, sel = kimi_store
    with Store.open(store_dir) as st:
        token = grant_model(st, sel, tenant="t", classes="0-7", rights="infer").token
    with OpenedModel(str(store_dir), "kimi@1", token) as om:
        allowed = om.consumer.allowed_experts
        sparse = [i for i in range(allowed.shape[0]) if allowed[i].any()]
        for layer in sparse:
            assert np.array_equal(np.flatnonzero(allowed[layer]), np.arange(16))
        eng = Engine(om.consumer)
        eng.prefill([3, 17, 5, 60, 1, 88, 42, 9])
        eng.decode(3)
        counts = eng.model.route_counts
        eng.close()
    assert counts.sum() > 0 and counts[:, 16:].sum() == 0


def test_the_batched_step_matches_the_engine_with_512_experts(tmp_path):
    arch, over = QWEN512
    model = build_tiny_model(arch, 1, **BASE, **over)
    ckpt = write_checkpoint(model, tmp_path / "ckpt", fused=True)
    with Store.open(tmp_path / "store") as st:
        mount(st, ckpt, "q@1")
    seqs = [[3, 17, 5, 60, 1, 88], [7, 7, 30], [50, 4, 19, 23]]
    with OpenedModel(str(tmp_path / "store"), "q@1", None) as om:
        eng = Engine(om.consumer)
        want = []
        for s in seqs:
            eng.reset()
            want.append(eng.prefill(s))
        m = eng.model
        together = forward_batch(m, [np.array(s) for s in seqs], [m.new_kv() for _ in seqs])
        eng.close()
    for w, got in zip(want, together, strict=True):
        assert np.abs(got - w).max() <= 1e-5 * float(w.max() - w.min())


def test_routing_traces_keep_indices_above_255(tmp_path):
    rec = RouteRecorder((True, True), n_experts=384, top_k=2)
    rec.new_segment(2)
    for layer in (0, 1):
        rec.record(layer, np.array([[383, 256], [1, 300]]), np.full((2, 2), 0.5))
    trace = rec.trace("m", "0" * 64, "router")
    assert trace.experts.dtype == np.uint16 and int(trace.experts.max()) == 383
    trace.save(tmp_path / "t.npz")
    back = RoutingTrace.load(tmp_path / "t.npz")
    assert np.array_equal(back.experts, trace.experts) and back.n_experts == 384


def test_czyx_show_names_the_classes_of_a_384_expert_version(kimi_store, capsys):
    from czyx.cli import main

    store_dir, _ = kimi_store
    assert main(["show", "kimi@1", "--store", str(store_dir)]) == 0
    shown = capsys.readouterr().out
    assert "384 experts/layer" in shown
    assert "192 classes" in shown and "(2 consecutive experts a class per layer)" in shown
