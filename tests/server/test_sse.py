"""The streamed path's own mechanics, under a scheduler that hands several tokens over at
once: a burst is written in one send yet stays one SSE event per token (the real
``openai`` client parses it token by token, equal to the non-streamed text), a client
that leaves during such a stream frees its sequence at once, the chunk encoding equals
``json.dumps`` byte for byte, and the bulk histograms expose what a Prometheus
histogram would.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from czyx.inference.batch import Done, SchedulerStats, Token
from czyx.inference.tokenizer import ByteTokenizer
from czyx.server import ServeOptions, create_app
from czyx.server.app import _Chunks, _TextStream
from czyx.server.metrics import LATENCY_BUCKETS, BulkHistogram
from czyx.server.threaded import serve_in_thread
from tests.server.conftest import make_store, stream_completion

TEXT = "héllo, wörld: the quick brown fox ✓ jumps over the lazy dog.\n"
BURST = 5  # tokens handed over together


class _Handle:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class BurstScheduler:
    """Emits the UTF-8 bytes of TEXT (repeated) as tokens, BURST of them per step, every
    event of a step from one thread call after another (as the batch thread does)."""

    def __init__(self, *_args) -> None:
        self.handles: list[_Handle] = []
        self.steps = 0

    def submit(self, ids, max_tokens, sampling, eos, on_event, **_kw):
        h = _Handle()
        self.handles.append(h)
        data = (TEXT.encode() * (max_tokens // len(TEXT.encode()) + 1))[:max_tokens]

        def run() -> None:
            deadline = time.monotonic() + 30
            i = 0
            while i < max_tokens and time.monotonic() < deadline:
                if h.cancelled.is_set():
                    on_event(Done("cancelled", len(ids), i))
                    return
                for tok in data[i : i + BURST]:
                    on_event(Token(tok, i, time.perf_counter()))
                    i += 1
                self.steps += 1
                time.sleep(0.002)
            on_event(Done("length", len(ids), i))

        threading.Thread(target=run, daemon=True).start()
        return h

    def stats(self) -> SchedulerStats:
        return SchedulerStats(0, 0, self.steps, 0, 0, 0, 0, 0, None, 0.0)

    def close(self) -> None:
        pass


class SendCounter:
    """ASGI middleware counting a response's body messages and SSE events."""

    def __init__(self, app) -> None:
        self.app = app
        self.sends = 0
        self.events = 0

    async def __call__(self, scope, receive, send):
        async def counted(msg):
            if msg["type"] == "http.response.body" and msg.get("body"):
                self.sends += 1
                self.events += msg["body"].count(b"data: ")
            await send(msg)

        await self.app(scope, receive, counted)


@pytest.fixture(scope="module")
def bursty(tmp_path_factory):
    store_dir, _, tokens, _ = make_store(tmp_path_factory.mktemp("bursty"))
    sched = BurstScheduler()
    opts = ServeOptions(engine={"stream": None}, scheduler=lambda *a: sched, event_timeout=30.0)
    app = create_app(str(store_dir), ["stdlib@1"], opts)
    counter = SendCounter(app)
    with serve_in_thread(counter) as url:
        yield url, tokens["root"], sched, counter, app


def test_coalesced_events_parse_token_by_token(bursty):
    url, token, _, counter, _ = bursty
    c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=30)
    n = 3 * len(TEXT.encode())
    whole = c.completions.create(model="stdlib@1", prompt="x", max_tokens=n)
    assert whole.choices[0].text == TEXT * 3 and whole.usage.completion_tokens == n
    counter.sends = counter.events = 0
    chunks, texts = stream_completion(c, n)
    assert "".join(texts) == whole.choices[0].text
    # One event per character (a byte tokenizer: a multi-byte character is one piece, once
    # its last byte came), though the bytes came BURST at a time.
    assert len(texts) == len(TEXT) * 3
    assert chunks[-1].usage.completion_tokens == n
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # The events were written fewer than one send each: bursts shared a send.
    assert counter.events == len(texts) + 3  # + the finish chunk, usage and [DONE]
    assert counter.sends < counter.events / 2


def test_chat_stream_starts_with_the_role_and_equals_the_whole(tmp_path):
    store_dir, cfg, tokens, _ = make_store(tmp_path)
    sched = BurstScheduler()
    opts = ServeOptions(
        engine={"stream": None},
        scheduler=lambda *a: sched,
        chat_templates=(("stdlib@1", str(cfg)),),
        event_timeout=30.0,
    )
    app = create_app(str(store_dir), ["stdlib@1"], opts)
    msgs = [{"role": "user", "content": "hi"}]
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=tokens["root"], max_retries=0, timeout=30)
        whole = c.chat.completions.create(model="stdlib@1", messages=msgs, max_tokens=40)
        chunks = list(
            c.chat.completions.create(model="stdlib@1", messages=msgs, max_tokens=40, stream=True)
        )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content == TEXT[: len(text)]
    assert chunks[-1].choices[0].finish_reason == "length"


def _audit_after(store, since: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in store.audit_log():
            if e["seq"] > since and e["event"] == "serve.request":
                return e
        time.sleep(0.02)
    raise AssertionError("no serve.request audit entry")


def test_disconnect_during_a_coalesced_stream_frees_the_sequence(bursty):
    url, token, sched, _, app = bursty
    store = app.state.czyx.store
    since = max((e["seq"] for e in store.audit_log()), default=0)
    body = {"model": "stdlib@1", "prompt": "x", "max_tokens": 5000, "stream": True}
    with (
        httpx.Client(timeout=30) as h,
        h.stream(
            "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}
        ) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    handle = sched.handles[-1]
    assert handle.cancelled.wait(10), "the sequence was not cancelled when the client left"
    entry = _audit_after(store, since)
    assert entry["status"] == 499 and 0 < entry["completion_tokens"] < 5000


def test_a_full_text_chunk_equals_json_dumps():
    for chat in (False, True):
        ch = _Chunks("cmpl-x", "stdlib@1", chat)
        pieces = ["a", "", 'quote " back \\ slash', "ünï ✓ 日本", "\n\t\x00\x1f", "\ud800"]
        assert ch.texts(pieces) == b"".join(ch.chunk(p, None) for p in pieces)
        one = json.loads(ch.texts(["x"])[6:])
        assert one["object"] == ("chat.completion.chunk" if chat else "text_completion")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40), st.lists(st.sampled_from([256, 300]), max_size=3))
def test_byte_stream_pieces_equal_a_full_decode(data, specials):
    tok = ByteTokenizer(512)
    ids = list(data) + specials
    s = _TextStream(tok, (), frozenset())
    assert "".join(s.push(t) for t in ids) + s.finish() == tok.decode(ids)


def test_bulk_histogram_exposes_what_a_prometheus_histogram_does():
    ref_reg, reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("h_seconds", "doc", ["version"], buckets=LATENCY_BUCKETS, registry=ref_reg)
    bulk = BulkHistogram("h_seconds", "doc", "version", LATENCY_BUCKETS, reg)
    values = [0.0, 0.001, 0.0011, 0.005, 0.25, 0.3, 30.0, 31.0] + [i * 1e-4 for i in range(5000)]
    for v in values:  # one observation at a time (crosses a fold), then in bulk
        ref.labels("a@1").observe(v)
        bulk.labels("a@1").observe(v)
    ref.labels("b@1").observe(0.02)
    bulk.labels("b@1").observe_many([0.02])

    def series(text: bytes) -> dict[str, float]:
        out = {}
        for line in text.decode().splitlines():
            if line.startswith("#") or "_created" in line:
                continue
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
        return out

    want, got = series(generate_latest(ref_reg)), series(generate_latest(reg))
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9), k
