"""``X-Czyx-Session``: a request resumes the caller's saved session (KV restored from the
store, not recomputed) and saves the new state as its next version, as ``czyx run
--session`` does; other tenants' sessions are refused."""

from __future__ import annotations

import httpx
import openai

from czyx.portals.model import grant_model

P1 = "def main(argv):\n    "
P2 = "\n    return "


def _post(url, token, prompt, session=None, n=8, stream=False):
    headers = {"Authorization": f"Bearer {token}"}
    if session:
        headers["X-Czyx-Session"] = session
    body = {"model": "stdlib@1", "prompt": prompt, "max_tokens": n, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_session_resumes_and_saves_versions(served):
    url, tokens, _, app, _ = served
    a = _post(url, tokens["alice"], P1, "notes")
    assert a.status_code == 200 and a.headers["x-czyx-session-version"] == "1"
    t1 = a.json()["choices"][0]["text"]
    b = _post(url, tokens["alice"], P2, "notes")
    assert b.status_code == 200 and b.headers["x-czyx-session-version"] == "2"
    usage = b.json()["usage"]
    # The whole history came back from the store: first prompt and its 8 tokens.
    assert usage["prompt_tokens"] == len(P2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(P1) + 8
    # The same conversation without a session: the same greedy continuation.
    c = openai.OpenAI(base_url=url + "/v1", api_key=tokens["alice"], max_retries=0)
    whole = c.completions.create(model="stdlib@1", prompt=P1 + t1 + P2, max_tokens=8, temperature=0)
    assert b.json()["choices"][0]["text"] == whole.choices[0].text
    from czyx.inference.sessions.store import SessionStore
    from czyx.portals import root_token

    store = app.state.czyx.store
    saved = SessionStore(store, root_token(store), tenant="alice").info("notes")
    assert saved.version == 2 and saved.tenant == "alice"
    assert saved.length == len(P1) + 8 + len(P2) + 8


def test_streamed_session_reports_its_version(served):
    url, tokens, *_ = served
    r = _post(url, tokens["alice"], P1, "streamed", stream=True)
    assert r.status_code == 200
    assert '"czyx_session_version": 1' in r.text


def test_other_tenants_sessions_are_refused(served):
    url, tokens, _, app, _ = served
    assert _post(url, tokens["alice"], P1, "private").status_code == 200
    store = app.state.czyx.store
    mallory = grant_model(store, "stdlib@1", tenant="mallory").token
    r = _post(url, mallory, P2, "private")
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert _post(url, mallory, P2, "mallory-notes").status_code == 200  # her own: fine
    r = _post(url, tokens["alice"], P1, "bad name!")
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Czyx-Session"


def test_user_field_is_the_end_user_not_a_session(served):
    """OpenAI's ``user`` identifies the end user a client serves (any string, e.g. an
    e-mail address): it is audited and never resumes a session, so one user's
    requests do not continue each other."""
    url, tokens, _, app, _ = served
    c = openai.OpenAI(base_url=url + "/v1", api_key=tokens["alice"], max_retries=0)
    kw = dict(model="stdlib@1", max_tokens=8, temperature=0, user="alice@example.com")
    c.completions.create(prompt=P1, **kw)
    b = c.completions.with_raw_response.create(prompt=P2, **kw)
    assert "x-czyx-session-version" not in b.headers
    second = b.parse()
    alone = c.completions.create(model="stdlib@1", prompt=P2, max_tokens=8, temperature=0)
    assert second.choices[0].text == alone.choices[0].text  # P2 alone, not after P1
    entries = [e for e in app.state.czyx.store.audit_log() if e["event"] == "serve.request"]
    assert [e.get("end_user") for e in entries[-3:]] == [
        "alice@example.com",
        "alice@example.com",
        None,
    ]
    headers = {"Authorization": f"Bearer {tokens['alice']}"}
    for bad in (7, ["a"], "x" * 257):
        body = {"model": "stdlib@1", "prompt": P1, "max_tokens": 2, "user": bad}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
