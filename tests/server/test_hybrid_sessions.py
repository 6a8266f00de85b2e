"""``X-Czyx-Session`` on a hybrid model (Qwen3-Next): the server's batched step runs it, and
a request resumes the saved KV *and* recurrent state (nothing recomputed) and saves both."""

from __future__ import annotations

import httpx
import pytest

from czyx import portals
from czyx.portals.model import grant_model
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.testing.tiny_models import make_tiny_checkpoint

P1, P2 = "abc hybrid ", " more"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from czyx.inference.batch import BatchOptions
    from czyx.server import ServeOptions, create_app
    from czyx.server.threaded import serve_in_thread

    root = tmp_path_factory.mktemp("serve-hybrid")
    ckpt = make_tiny_checkpoint("qwen3_next", root / "ck", initializer_range=0.2, vocab_size=256)
    with Store.open(root / "store") as store:
        mount(store, ckpt, "hy@1")
        token = grant_model(store, "hy@1", tenant="alice").token
        assert portals.root_token(store)
    opts = ServeOptions(
        engine={"stream": None},
        batch=BatchOptions(max_batch=4, prefill_chunk=4, prefix_cache_bytes=2**20),
        event_timeout=60.0,
    )
    app = create_app(str(root / "store"), ["hy@1"], opts)
    with serve_in_thread(app) as url:
        yield url, token, app


def _post(url, token, prompt, session=None, n=6):
    headers = {"Authorization": f"Bearer {token}"}
    if session:
        headers["X-Czyx-Session"] = session
    body = {"model": "hy@1", "prompt": prompt, "max_tokens": n, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_hybrid_session_resumes_its_recurrent_state(served):
    url, token, app = served
    a = _post(url, token, P1, "talk")
    assert a.status_code == 200, a.text
    assert a.headers["x-czyx-session-version"] == "1"
    b = _post(url, token, P2, "talk")
    assert b.status_code == 200 and b.headers["x-czyx-session-version"] == "2"
    usage = b.json()["usage"]
    assert usage["prompt_tokens"] == len(P2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(P1) + 6
    from czyx.inference.sessions.format import FORMAT_RECURRENT
    from czyx.inference.sessions.store import RECORD_KEY, SessionStore

    store = app.state.czyx.store
    ss = SessionStore(store, portals.root_token(store), tenant="alice")
    info = ss.info("talk")
    assert info.version == 2 and info.length == len(P1) + 6 + len(P2) + 6
    # The same conversation recomputed from its token ids (a random model's bytes are not
    # text that round-trips): the same greedy continuation.
    ids = ss.tokens("talk").tolist()
    assert ss.tokens("talk", 1).tolist() == ids[: len(P1) + 6]
    whole = _post(url, token, ids[:-6])
    assert b.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]
    rec = store.get(store.resolve_tag("session:talk@00000002"), RECORD_KEY)
    assert rec["format"] == FORMAT_RECURRENT
