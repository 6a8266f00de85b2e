"""The web playground's endpoints (czyx.server.playground) and the watched stream, over HTTP.

The page and its files are served with a strict content-security policy; every JSON
endpoint is portal-checked (no token 401, another version 403, the store view only
for a store-wide granting portal); the layout is the expert space's curve order; a
streamed chat with ``X-Czyx-Watch: routes`` carries one routing event per fed token
and the same text as the unwatched stream.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from czyx.store.models.expert_layout import layout_from_manifest


def _get(url, path, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(url + path, headers=headers, timeout=30)


def test_page_and_files_are_served_with_a_strict_policy(served):
    url = served[0]
    page = _get(url, "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert '<script src="/web/app.js"' in page.text and "http" not in page.text.split("<body>")[1]
    js = _get(url, "/web/app.js")
    assert js.status_code == 200 and "X-Czyx-Watch" in js.text
    assert _get(url, "/web/app.css").status_code == 200
    assert _get(url, "/web/../app.py").status_code == 404
    assert _get(url, "/web/secret.txt").status_code == 404


def test_whoami_lists_what_the_portal_may_run(served):
    url, tokens = served[0], served[1]
    assert _get(url, "/v1/czyx/whoami").status_code == 401
    alice = _get(url, "/v1/czyx/whoami", tokens["alice"]).json()
    assert alice["tenant"] == "alice" and alice["store_view"] is False
    assert [m["id"] for m in alice["models"]] == ["stdlib@1"]
    assert alice["models"][0]["chat_template"] is True and alice["models"][0]["watch"] is True
    root = _get(url, "/v1/czyx/whoami", tokens["root"]).json()
    assert root["store_view"] is True and "grant" in root["rights"]
    assert sorted(m["id"] for m in root["models"]) == ["stdlib@1", "tiny@1"]
    assert _get(url, "/v1/czyx/whoami", tokens["expired"]).status_code == 403


def test_layout_is_the_spaces_curve_order(served):
    url, tokens, _, app, _ = served
    lay = _get(url, "/v1/czyx/models/stdlib@1/layout", tokens["alice"]).json()
    store = app.state.czyx.store
    want = layout_from_manifest(store.manifest(store.resolve_tag("stdlib@1")))
    assert lay["curve"] == want.outer
    order = np.array(lay["order"])
    assert order.shape == (lay["n_layers"], lay["n_experts"])
    for layer in range(lay["n_layers"]):
        slots = [want.ordinal(layer, int(e)) for e in order[layer]]
        assert slots == sorted(slots)  # the curve's order within the layer
        assert sorted(order[layer].tolist()) == list(range(lay["n_experts"]))
    assert _get(url, "/v1/czyx/models/tiny@1/layout", tokens["alice"]).status_code == 403
    assert _get(url, "/v1/czyx/models/none@1/layout", tokens["alice"]).status_code == 404


def test_render_is_the_chat_template_the_api_uses(served):
    url, tokens = served[0], served[1]
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(
        url + "/v1/czyx/render",
        json={"model": "stdlib@1", "messages": msgs},
        headers={"Authorization": f"Bearer {tokens['alice']}"},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.json() == {"prompt": "<user>hi\n<assistant>", "tokens": len(b"<user>hi\n<assistant>")}
    bad = httpx.post(
        url + "/v1/czyx/render",
        json={"model": "stdlib@1", "messages": []},
        headers={"Authorization": f"Bearer {tokens['alice']}"},
        timeout=30,
    )
    assert bad.status_code == 400


def test_store_view_only_for_a_store_wide_granting_portal(served, tmp_path):
    from czyx.store.models.mount import mount
    from tests.server.conftest import second_version

    url, tokens, ids, app = served[0], served[1], served[2], served[3]
    # A second version of the same name, its experts unchanged (one norm differs): it
    # shares every expert extent of stdlib@1.
    mount(app.state.czyx.store, second_version(tmp_path / "v2"), "stdlib@2")
    denied = _get(url, "/v1/czyx/store", tokens["alice"])
    assert denied.status_code == 403 and "grant right" in denied.json()["error"]["message"]
    view = _get(url, "/v1/czyx/store", tokens["root"]).json()
    versions = {v["tag"]: v for v in view["versions"]}
    assert set(versions) == {"stdlib@1", "tiny@1", "stdlib@2"}
    assert [t for t, v in versions.items() if not v["served"]] == ["stdlib@2"]
    base = versions["stdlib@1"]["selector"]
    assert versions["stdlib@2"]["own_bytes"] == 0
    shared = {s["space"]: s for s in versions["stdlib@2"]["shared"]}
    assert base in shared and shared[base]["bytes"] > 0 and shared[base]["tags"] == ["stdlib@1"]
    assert versions["stdlib@1"]["shared"] == [] and versions["stdlib@1"]["own_bytes"] > 0
    portals = {p["id"]: p for p in view["portals"]}
    assert portals[ids["alice"]]["tenant"] == "alice"
    assert {p["status"] for p in portals.values()} >= {"active", "expired"}
    assert view["audit"] and view["audit"][0]["seq"] > view["audit"][-1]["seq"]
    assert {s["selector"] for s in view["spaces"]} >= {base}


def _stream(url, token, watch: str | None, n=12, stream=True):
    headers = {"Authorization": f"Bearer {token}"}
    if watch is not None:
        headers["X-Czyx-Watch"] = watch
    body = {
        "model": "stdlib@1",
        "messages": [{"role": "user", "content": "def main(argv):"}],
        "max_tokens": n,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    if r.status_code != 200 or not stream:
        return r, None, None, None
    frames, text, usage = [], "", None
    for block in r.text.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        if lines[0] == "event: czyx.routes":
            frames.append(json.loads(lines[1][len("data: ") :]))
            continue
        data = lines[0][len("data: ") :]
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if obj.get("usage"):
            usage = obj["usage"]
        if obj["choices"] and obj["choices"][0]["delta"].get("content"):
            text += obj["choices"][0]["delta"]["content"]
    return r, frames, text, usage


def test_a_watched_stream_carries_each_tokens_routing_and_the_same_text(served):
    url, tokens, _, app, _ = served
    _, none, plain, _ = _stream(url, tokens["alice"], None)
    _, frames, text, usage = _stream(url, tokens["alice"], "routes")
    assert none == [] and text == plain
    n = usage["completion_tokens"]
    assert [f["index"] for f in frames] == list(range(n - 1))  # (the last token is never fed)
    served_model = app.state.czyx.models["stdlib@1"]
    cfg = served_model.engine.cfg
    for f in frames:
        assert len(f["layers"]) == sum(cfg.sparse_layers)
        assert all(len(e) == cfg.top_k and len(set(e)) == cfg.top_k for e in f["experts"])
        assert all(s in (0, 1, 2) for row in f["state"] for s in row)
        assert all(len(h) == 2 * ((cfg.n_experts + 7) // 8) for h in f["resident"])
        assert f["step"]["sequences"] >= 1 and f["text"] == chr(f["token"])
    assert served_model.scheduler._watching == 0


@pytest.mark.parametrize(
    ("watch", "stream", "param"), [("routes", False, "stream"), ("all", True, "x-czyx-watch")]
)
def test_a_bad_watch_request_is_refused(served, watch, stream, param):
    r, *_ = _stream(served[0], served[1]["alice"], watch, stream=stream)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
