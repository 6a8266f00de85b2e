"""Continuous batching behind the API: 8 concurrent clients get what each gets alone,
a full queue answers 429 with Retry-After, a client that leaves frees its sequence,
and the KV budget refuses a context that could never fit."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from czyx import portals
from czyx.inference.assets import bundled_model_dir
from czyx.inference.batch import BatchOptions
from czyx.server import ServeOptions, create_app
from czyx.server.threaded import serve_in_thread
from czyx.store import Store
from czyx.store.models.mount import mount

#: Tokens of a request that must still run while the test acts beside it (it is cancelled at
#: the end): at well under a millisecond a token, a few hundred could finish first. Within
#: the "wide" server's KV budget (2048 positions of the bundled model).
LONG = 2000

PROMPTS = [
    "def main(argv):\n    ",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self",
    "    return ",
    "# Copyright",
    "for i in range(",
    "if __name__ == ",
    "raise ValueError(",
]


def _server(tmp_path_factory, name: str, batch: BatchOptions):
    root = tmp_path_factory.mktemp(name)
    with Store.open(root / "store") as store:
        mount(store, bundled_model_dir(), "stdlib@1")
        token = portals.root_token(store)
    opts = ServeOptions(engine={"stream": None}, batch=batch, event_timeout=60.0)
    app = create_app(str(root / "store"), ["stdlib@1"], opts)
    return app, token


def _wait_idle(app, timeout: float = 30.0) -> None:
    sched = app.state.czyx.models["stdlib@1"].scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = sched.stats()
        if st.active == 0 and st.waiting == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"sequences still held after {timeout} s: {sched.stats()}")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    app, token = _server(
        tmp_path_factory,
        "wide",
        BatchOptions(
            max_batch=8, max_queue=16, prefill_chunk=8, step_tokens=64, kv_bytes=4 * 2**20
        ),
    )
    with serve_in_thread(app) as url:
        yield url, token, app


def _complete(url: str, token: str, prompt: str, n: int = 16) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=120)
    r = c.completions.create(model="stdlib@1", prompt=prompt, max_tokens=n, temperature=0)
    assert r.usage.completion_tokens == n
    return r.choices[0].text


def test_eight_concurrent_clients_equal_solo(wide):
    url, token, app = wide
    sched = app.state.czyx.models["stdlib@1"].scheduler
    solo = [_complete(url, token, p) for p in PROMPTS]
    before = sched.stats()
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _complete(url, token, p), PROMPTS))
    after = sched.stats()
    assert together == solo
    # They were batched: fewer forward steps than generated tokens.
    assert after.steps - before.steps < after.generated - before.generated
    _wait_idle(app)


def _next_request_audit(store, since: int, timeout: float = 30.0) -> dict:
    """The first serve.request audit entry after ``since`` (the audit is written after the
    response ends, so poll, bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in store.audit_log(since):
            if e["event"] == "serve.request":
                return e
        time.sleep(0.02)
    raise AssertionError(f"no serve.request audit entry within {timeout} s")


def _last_seq(store) -> int:
    return max((e["seq"] for e in store.audit_log()), default=0)


def test_disconnect_frees_the_sequence(wide):
    url, token, app = wide
    store = app.state.czyx.store
    since = _last_seq(store)
    headers = {"Authorization": f"Bearer {token}"}
    body = {
        "model": "stdlib@1",
        "prompt": "x",
        "max_tokens": LONG,
        "stream": True,
        "temperature": 0,
    }
    with (
        httpx.Client(timeout=30) as h,
        h.stream("POST", url + "/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    _wait_idle(app)
    last = _next_request_audit(store, since)
    assert last["status"] == 499 and last["completion_tokens"] < LONG
    # A non-streaming client that gives up is freed too.
    since = _last_seq(store)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            url + "/v1/completions",
            headers=headers,
            timeout=0.3,
            json={"model": "stdlib@1", "prompt": "x", "max_tokens": LONG},
        )
    _wait_idle(app)
    last = _next_request_audit(store, since)
    assert last["status"] == 499 and last["completion_tokens"] < LONG


def test_context_over_the_kv_budget_is_400(wide):
    url, token, _ = wide
    c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError, match="KV"):
        c.completions.create(model="stdlib@1", prompt="x", max_tokens=100_000)


def test_full_queue_is_429_with_retry_after(tmp_path_factory):
    app, token = _server(
        tmp_path_factory, "narrow", BatchOptions(max_batch=1, max_queue=1, prefill_chunk=8)
    )
    headers = {"Authorization": f"Bearer {token}"}
    body = {"model": "stdlib@1", "prompt": "x", "max_tokens": LONG, "stream": True}
    with serve_in_thread(app) as url, httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/completions", json=body, headers=headers) as a:
            a_lines = a.iter_lines()  # kept: a dropped iterator closes the stream
            next(a_lines)  # running
            with h.stream("POST", url + "/v1/completions", json=body, headers=headers) as b:
                assert b.status_code == 200  # queued
                r = h.post(url + "/v1/completions", json=body, headers=headers)
                assert r.status_code == 429
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    c.completions.create(model="stdlib@1", prompt="x", max_tokens=2)
        _wait_idle(app)
