"""A class-scoped portal runs the model: routing picks its top-k among the permitted
experts only, renormalised over them, and never reads outside the grant.

Reference: transformers' own model with each router patched to mask the forbidden
experts' logits to -inf before its softmax and top-k (computed independently of
the engine's routing code). The permitted experts come from the portal's class
caveat and the version's stored expert layout.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from czyx.inference.engine import Engine
from czyx.inference.errors import ScopeRoutingError
from czyx.inference.opened import OpenedModel
from czyx.portals.caveats import parse_classes
from czyx.portals.model import grant_model
from czyx.store import Store
from czyx.store.models.expert_layout import layout_from_manifest
from czyx.store.models.mount import mount
from czyx.testing.tiny_models import make_tiny_checkpoint, model_class

PROMPT = [3, 17, 5, 60, 1, 88, 42, 9, 11, 2]


def _masked_reference(ckpt, arch: str, permitted: np.ndarray) -> np.ndarray:
    model = model_class(arch).from_pretrained(ckpt, dtype=torch.float32).eval()

    def masked_forward(self, hidden_states, layer):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(h, self.weight)
        allowed = torch.as_tensor(permitted[layer])
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        gate.forward = types.MethodType(lambda self, h, i=i: masked_forward(self, h, i), gate)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_class_scoped_portal_runs_with_masked_routing(tmp_path, arch) -> None:
    over = {"num_local_experts": 8} if arch == "mixtral" else {"num_experts": 8}
    ckpt = make_tiny_checkpoint(arch, tmp_path / "ckpt", **over)
    with Store.open(tmp_path / "store") as st:
        res = mount(st, ckpt, "m@1")
        token = grant_model(st, res.selector, tenant="alice", classes="0-3", rights="infer").token
        layout = layout_from_manifest(st.manifest(res.selector))
        n_layers = int(st.manifest(res.selector)["expert"]["n_layers"])
    cls = layout.class_array(np.arange(n_layers)[:, None], np.arange(8)[None, :])
    mask = parse_classes("0-3").mask
    permitted = np.array([[bool(mask >> int(c) & 1) for c in row] for row in cls])
    assert permitted.sum(axis=1).min() >= 2 and not permitted.all()

    with OpenedModel(str(tmp_path / "store"), "m@1", token) as om:
        eng = Engine(om.consumer)
        got = eng.prefill(PROMPT, all_logits=True)
        decoded = eng.decode(7)
        assert eng.route_restriction and "restricted by the portal" in eng.route_restriction
        counts = eng.model.route_counts
        eng.close()
    assert counts.sum() > 0 and counts[~permitted].sum() == 0  # never routed outside
    want = _masked_reference(ckpt, arch, permitted)
    assert np.abs(got - want).max() < 1e-4 * float(want.max() - want.min())
    assert np.isfinite(decoded).all()
    with Store.open(tmp_path / "store") as st:
        denies = [e for e in st.audit_log() if e["event"] == "portal.deny"]
    assert not denies  # no read was attempted outside the grant


def test_scope_narrower_than_top_k_is_refused(tmp_path) -> None:
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", num_local_experts=8)
    with Store.open(tmp_path / "store") as st:
        res = mount(st, ckpt, "m@1")
        token = grant_model(st, res.selector, tenant="a", classes="0", rights="infer").token
    with (
        OpenedModel(str(tmp_path / "store"), "m@1", token) as om,
        pytest.raises(ScopeRoutingError, match="routes each token to 2"),
    ):
        Engine(om.consumer)
