"""A portal scoped to some expert classes is served with its routing narrowed: top-k over
the permitted experts only, weights renormalised over them. Checked against transformers'
Mixtral with its routers masked the same way (an independent reference), in a batch shared
with an unscoped caller; a scope that leaves a layer fewer than top-k experts is 403."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from czyx.inference.assets import bundled_model_dir
from czyx.portals.model import grant_model

PROMPT = "def main(argv):\n    "
N = 8


def _masked_reference(allowed: np.ndarray, prompt: bytes, n: int) -> bytes:
    """Greedy bytes from transformers' Mixtral whose routers see only ``allowed`` experts."""
    import torch.nn.functional as F
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        block = torch.from_numpy(~allowed[i])

        def forward(h, gate=gate, block=block):
            h = h.reshape(-1, gate.hidden_dim)
            logits = F.linear(h, gate.weight).masked_fill(block, float("-inf"))
            probs = torch.softmax(logits.float(), dim=-1)
            top, idx = torch.topk(probs, gate.top_k, dim=-1)
            return logits, top / top.sum(dim=-1, keepdim=True), idx

        gate.forward = forward
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return bytes(ids[len(prompt) :])


def test_class_scoped_portal_routes_within_its_classes(served):
    url, tokens, _, app, _ = served
    store = app.state.czyx.store
    tok = grant_model(store, "stdlib@1", tenant="erin", classes="0-7").token
    gate = app.state.czyx.gate
    mask = gate.routing_mask(gate.authenticate(f"Bearer {tok}"), "stdlib@1")
    assert mask.shape == (4, 16) and mask[:, :8].all() and not mask[:, 8:].any()
    scoped = openai.OpenAI(base_url=url + "/v1", api_key=tok, max_retries=0, timeout=60)
    whole = openai.OpenAI(base_url=url + "/v1", api_key=tokens["alice"], max_retries=0)
    from concurrent.futures import ThreadPoolExecutor

    def ask(c):
        r = c.completions.create(model="stdlib@1", prompt=PROMPT, max_tokens=N, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(2) as pool:  # the scoped and the unscoped sequence batch together
        got, free = pool.map(ask, [scoped, whole])
    want = _masked_reference(mask, PROMPT.encode(), N)
    assert got.encode() == want
    assert free != got  # the scope really changed the routing


@pytest.mark.parametrize("caveat", [{"classes": "3"}, {"layers": "0-1"}])
def test_a_scope_leaving_fewer_than_top_k_is_403(served, caveat):
    url, _, _, app, _ = served
    tok = grant_model(app.state.czyx.store, "stdlib@1", tenant="fay", **caveat).token
    c = openai.OpenAI(base_url=url + "/v1", api_key=tok, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="fewer than the top-2"):
        c.completions.create(model="stdlib@1", prompt="x", max_tokens=2)
