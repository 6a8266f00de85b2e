"""Schedulers driven on the event loop (czyx.server.app._LoopDriver), the server's default:
the loop answers other requests between steps, a long prompt's prefill chunks share
steps with another client's decode tokens, the threaded mode gives the same text, and
shutdown ends the stepping task (no hang, no pending task left)."""

from __future__ import annotations

import itertools
import logging
import threading
import time

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

CHUNK = 8
LONG = 2000  # tokens of a stream that outlives what a test does beside it (cancelled at its end)
PROMPTS = ["def main(argv):\n    ", "import os\nimport sys\n", "class Parser:\n"]


def _app(root, **kw):
    with Store.open(root / "store") as store:
        mount(store, bundled_model_dir(), "stdlib@1")
        token = portals.root_token(store)
    batch = BatchOptions(max_batch=4, max_queue=8, prefill_chunk=CHUNK, step_tokens=64)
    opts = ServeOptions(engine={"stream": None}, batch=batch, event_timeout=60.0, **kw)
    return create_app(str(root / "store"), ["stdlib@1"], opts), token


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    app, token = _app(tmp_path_factory.mktemp("driven"))
    served = app.state.czyx.models["stdlib@1"]
    steps: list[list[tuple[int, int]]] = []  # per step: (request id, chunk length)
    step = served.scheduler._step

    def recorded(work):
        steps.append([(s.handle.id, int(c.size)) for s, c in work])
        return step(work)

    served.scheduler._step = recorded
    with serve_in_thread(app) as url:
        yield url, token, app, steps


def _stream(h: httpx.Client, url: str, token: str, body: dict):
    return h.stream(
        "POST",
        url + "/v1/completions",
        json={"model": "stdlib@1", "temperature": 0, "stream": True, **body},
        headers={"Authorization": f"Bearer {token}"},
    )


def _wait_idle(sched, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while sched.stats().active or sched.stats().waiting:
        assert time.monotonic() < deadline, f"sequences still held: {sched.stats()}"
        time.sleep(0.02)


def _texts(lines) -> list[str]:
    import json

    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.extend(c["text"] for c in json.loads(line[6:])["choices"] if c["text"])
    return out


def test_the_default_is_driven_on_the_loop(driven):
    _, _, app, _ = driven
    served = app.state.czyx.models["stdlib@1"]
    assert served.driver is not None and served.driver.scheduler is served.scheduler


def test_health_is_answered_between_steps_of_a_stream(driven):
    url, token, app, _ = driven
    sched = app.state.czyx.models["stdlib@1"].scheduler
    body = {"prompt": "x", "max_tokens": LONG}
    with httpx.Client(timeout=30) as h, _stream(h, url, token, body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        before = sched.stats().steps
        for _ in range(3):
            hr = httpx.get(url + "/health", timeout=30)
            assert hr.status_code == 200 and hr.json()["status"] == "ok"
            # Answered while the stream still runs: the loop served it between two steps.
            assert sched.stats().active == 1
        assert sched.stats().steps > before
        assert _texts(itertools.islice(lines, 8))  # the stream goes on
    _wait_idle(sched)  # the disconnect freed it


def test_a_long_prefill_shares_steps_with_a_streaming_client(driven):
    url, token, app, steps = driven
    sched = app.state.czyx.models["stdlib@1"].scheduler
    long_prompt = list((PROMPTS[2] * 8).encode())[: 6 * CHUNK]
    c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=60)
    alone = c.completions.create(model="stdlib@1", prompt=long_prompt, max_tokens=4, temperature=0)
    body = {"prompt": "x", "max_tokens": LONG}
    with httpx.Client(timeout=30) as h, _stream(h, url, token, body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        a_id = max(rid for s in steps for rid, _ in s)  # the newest request: this stream
        mark = len(steps)
        together = c.completions.create(
            model="stdlib@1", prompt=long_prompt, max_tokens=4, temperature=0
        )
        assert sched.stats().active == 1  # the stream still runs
    _wait_idle(sched)
    assert together.choices[0].text == alone.choices[0].text
    b_steps = [s for s in steps[mark:] if any(n == CHUNK for _, n in s)]
    # One chunk of the long prompt per step, each beside the stream's decode token.
    assert len(b_steps) == 6
    assert all((a_id, 1) in s for s in b_steps)


def test_the_threaded_mode_gives_the_same_text(driven, tmp_path):
    url, token, _, _ = driven
    app, token2 = _app(tmp_path, scheduler_thread=True)
    assert app.state.czyx.models["stdlib@1"].driver is None

    def run(u: str, t: str) -> list[str]:
        c = openai.OpenAI(base_url=u + "/v1", api_key=t, max_retries=0, timeout=60)
        return [
            c.completions.create(model="stdlib@1", prompt=p, max_tokens=12, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]

    with serve_in_thread(app) as url2:
        threaded = run(url2, token2)
    assert run(url, token) == threaded


def test_shutdown_ends_the_stepping_task(tmp_path, caplog):
    app, token = _app(tmp_path)
    served = app.state.czyx.models["stdlib@1"]
    before = set(threading.enumerate())
    with caplog.at_level(logging.WARNING):
        with serve_in_thread(app) as url:
            new = [t for t in threading.enumerate() if t not in before]
            with (
                httpx.Client(timeout=30) as h,
                _stream(h, url, token, {"prompt": "x", "max_tokens": 4}) as r,
            ):
                assert _texts(r.iter_lines())
            task = served.driver._task
            assert task is not None and not task.done()
        assert not any(t.is_alive() for t in new)  # the server thread ended
    assert task.done() and not task.cancelled() and task.exception() is None
    assert served.scheduler.closed
    assert not [r for r in caplog.records if r.name in ("asyncio", "czyx.server")]
