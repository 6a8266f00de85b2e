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


def test_user_field_names_the_session(served):
    """The OpenAI ``user`` field resumes and saves a session exactly as the header does."""
    url, tokens, *_ = served
    c = openai.OpenAI(base_url=url + "/v1", api_key=tokens["alice"], max_retries=0)
    a = c.completions.create(
        model="stdlib@1", prompt=P1, max_tokens=8, temperature=0, user="by-user"
    )
    b = c.completions.with_raw_response.create(
        model="stdlib@1", prompt=P2, max_tokens=8, temperature=0, user="by-user"
    )
    assert b.headers["x-czyx-session-version"] == "2"
    second = b.parse()
    assert second.usage.prompt_tokens == len(P2)
    assert second.usage.prompt_tokens_details.cached_tokens == len(P1) + 8
    # The header names the same session: it continues from version 2.
    h = _post(url, tokens["alice"], P2, "by-user")
    assert h.status_code == 200 and h.headers["x-czyx-session-version"] == "3"
    # Same text as the whole conversation without a session.
    whole = c.completions.create(
        model="stdlib@1", prompt=P1 + a.choices[0].text + P2, max_tokens=8, temperature=0
    )
    assert second.choices[0].text == whole.choices[0].text
    # Streamed, with the real client too: the last chunk reports the version it saved.
    stream = c.completions.create(
        model="stdlib@1", prompt=P1, max_tokens=4, temperature=0, user="by-user-2", stream=True
    )
    saved = [ch.model_extra.get("czyx_session_version") for ch in stream]
    assert saved[-1] == 1


def test_user_field_is_checked(served):
    url, tokens, *_ = served
    c = openai.OpenAI(base_url=url + "/v1", api_key=tokens["alice"], max_retries=0)
    try:
        c.completions.create(model="stdlib@1", prompt=P1, max_tokens=2, user="bad name!")
        raise AssertionError("a bad session name was accepted")
    except openai.BadRequestError as exc:
        assert exc.body["param"] == "user"
    headers = {"Authorization": f"Bearer {tokens['alice']}", "X-Czyx-Session": "one"}
    body = {"model": "stdlib@1", "prompt": P1, "max_tokens": 2, "user": "two"}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"
    body["user"] = 7
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"
