"""``ServeOptions.stream_interval`` (``czyx serve --stream-interval-ms``): a streamed
token sooner than the interval after the last write waits to share the next write. The
stream still carries one SSE event per token (the real ``openai`` client's text equals
the non-streamed text, usage and finish_reason as without the interval), the first token
is written at once, the tokens still held at the end go out with the last message, and
a bad interval is refused when the options are built.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from czyx import portals
from czyx.inference.assets import bundled_model_dir
from czyx.inference.batch import BatchOptions, Done, SchedulerStats, Token
from czyx.server import ServeOptions, create_app
from czyx.server.app import ServerError
from czyx.server.threaded import serve_in_thread
from czyx.store import Store
from czyx.store.models.mount import mount
from tests.server.conftest import make_store, stream_completion
from tests.server.test_sse import SendCounter, _audit_after

TEXT = "abcdefghij"


class _Handle:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class TrickleScheduler:
    """One token per step, a few ms apart: the case the interval is for (one client,
    every step one token)."""

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self.handles: list[_Handle] = []

    def submit(self, ids, max_tokens, sampling, eos, on_event, **_kw):
        h = _Handle()
        self.handles.append(h)
        data = (TEXT * (max_tokens // len(TEXT) + 1)).encode()[:max_tokens]

        def run() -> None:
            deadline = time.monotonic() + 30
            for i, tok in enumerate(data):
                if h.cancelled.is_set() or time.monotonic() > deadline:
                    on_event(Done("cancelled", len(ids), i))
                    return
                on_event(Token(tok, i, time.perf_counter()))
                # (a longer gap after the first token: the first write holds it alone)
                time.sleep(self.gap if i else 0.1)
            on_event(Done("length", len(ids), len(data)))

        threading.Thread(target=run, daemon=True).start()
        return h

    def stats(self) -> SchedulerStats:
        return SchedulerStats(0, 0, 0, 0, 0, 0, 0, 0, None, 0.0)

    def close(self) -> None:
        pass


class BodyLog(SendCounter):
    """SendCounter that also keeps the SSE events of every body message."""

    def __init__(self, app) -> None:
        super().__init__(app)
        self.bodies: list[int] = []  # events per body message

    async def __call__(self, scope, receive, send):
        async def logged(msg):
            if msg["type"] == "http.response.body" and msg.get("body"):
                self.bodies.append(msg["body"].count(b"data: "))
            await send(msg)

        await super().__call__(scope, receive, logged)


def _trickle(tmp_path):
    """A store, its tokens, a scheduler handing a token every 2 ms, and serve options that
    write a stream at most every 50 ms."""
    store_dir, _, tokens, _ = make_store(tmp_path)
    sched = TrickleScheduler(gap=0.002)
    opts = ServeOptions(
        engine={"stream": None},
        scheduler=lambda *a: sched,
        event_timeout=30.0,
        stream_interval=0.05,
    )
    return store_dir, tokens, sched, opts


def test_interval_batches_writes_one_event_per_token(tmp_path):
    store_dir, tokens, _, opts = _trickle(tmp_path)
    log = BodyLog(create_app(str(store_dir), ["stdlib@1"], opts))
    n = 60
    with serve_in_thread(log) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=tokens["root"], max_retries=0, timeout=30)
        whole = c.completions.create(model="stdlib@1", prompt="x", max_tokens=n)
        log.bodies.clear()
        chunks, texts = stream_completion(c, n)
    assert whole.choices[0].text == (TEXT * 6)[:n]
    assert texts == list(whole.choices[0].text)  # one event per token
    assert chunks[-1].usage.completion_tokens == n
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert sum(log.bodies) == n + 3  # + the finish chunk, usage and [DONE]
    assert log.bodies[0] == 1  # the first token is not held (nothing was written before)
    # Tokens 2 ms apart, written at most every 50 ms: far fewer writes than tokens.
    assert len(log.bodies) < n / 4


def test_interval_stream_stops_at_a_stop_string_and_frees_on_disconnect(tmp_path):
    store_dir, tokens, sched, opts = _trickle(tmp_path)
    app = create_app(str(store_dir), ["stdlib@1"], opts)
    store = app.state.czyx.store
    since = max((e["seq"] for e in store.audit_log()), default=0)
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=tokens["root"], max_retries=0, timeout=30)
        chunks = list(
            c.completions.create(
                model="stdlib@1", prompt="x", max_tokens=40, stop=["hij"], stream=True
            )
        )
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == "abcdefg"
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert _audit_after(store, since)["status"] == 200
        # A client that leaves while tokens are held: the sequence is cancelled at once.
        since = max(e["seq"] for e in store.audit_log())
        body = {"model": "stdlib@1", "prompt": "x", "max_tokens": 5000, "stream": True}
        with (
            httpx.Client(timeout=30) as h,
            h.stream(
                "POST",
                url + "/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {tokens['root']}"},
            ) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
        assert sched.handles[-1].cancelled.wait(10), "not cancelled when the client left"
        entry = _audit_after(store, since)
        assert entry["status"] == 499 and 0 < entry["completion_tokens"] < 5000


def test_interval_on_the_driven_engine_equals_no_interval(tmp_path):
    with Store.open(tmp_path / "store") as store:
        mount(store, bundled_model_dir(), "stdlib@1")
        token = portals.root_token(store)
    batch = BatchOptions(max_batch=4, max_queue=8, prefill_chunk=8, step_tokens=64)
    outs = []
    for interval in (0.0, 0.02):
        opts = ServeOptions(
            engine={"stream": None}, batch=batch, event_timeout=60.0, stream_interval=interval
        )
        app = create_app(str(tmp_path / "store"), ["stdlib@1"], opts)
        with serve_in_thread(app) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=60)
            chunks = list(
                c.completions.create(
                    model="stdlib@1",
                    prompt="def main(argv):\n    ",
                    max_tokens=40,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            outs.append((text, finish, chunks[-1].usage.completion_tokens))
    assert outs[0] == outs[1]
    assert outs[0][2] == 40 and outs[0][0]


@pytest.mark.parametrize("bad", [-0.001, 1.5])
def test_bad_interval_is_refused(bad):
    with pytest.raises(ServerError, match="stream_interval"):
        ServeOptions(stream_interval=bad)
