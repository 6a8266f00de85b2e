"""The OpenAI-compatible API through the real ``openai`` client, on 127.0.0.1.

Completions and chat, streamed and not, usage counts and finish reasons, stop
strings, the 401/403 paths of portals as bearer tokens (and a revocation taking
effect on the next request), the audit trail, /health and /metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROMPT = "def main(argv):\n    "


def client(url: str, token: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=token or "x", max_retries=0, timeout=60)


def test_health_and_models_by_portal(served):
    url, tokens, *_ = served
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    assert sorted(m.id for m in client(url, tokens["root"]).models.list()) == [
        "stdlib@1",
        "tiny@1",
    ]
    assert [m.id for m in client(url, tokens["alice"]).models.list()] == ["stdlib@1"]
    assert [m.id for m in client(url, tokens["bob"]).models.list()] == ["tiny@1"]


def test_retrieve_a_model_by_portal(served):
    """OpenAI's GET /v1/models/{model}: a version outside the caller's portal is a 404
    like one not served at all (the portal learns nothing of it)."""
    url, tokens, *_ = served
    m = client(url, tokens["alice"]).models.retrieve("stdlib@1")
    assert (m.id, m.object, m.owned_by) == ("stdlib@1", "model", "czyx")
    assert m.created == next(
        x.created for x in client(url, tokens["root"]).models.list() if x.id == "stdlib@1"
    )
    for who, model in (("alice", "tiny@1"), ("alice", "nope@1"), ("root", "nope@1")):
        with pytest.raises(openai.NotFoundError) as exc:
            client(url, tokens[who]).models.retrieve(model)
        assert exc.value.body["code"] == "model_not_found"
    assert client(url, tokens["bob"]).models.retrieve("tiny@1").id == "tiny@1"
    with pytest.raises(openai.AuthenticationError):
        client(url, "not-a-portal").models.retrieve("stdlib@1")


def test_completion_greedy_usage_and_length(served):
    url, tokens, *_ = served
    c = client(url, tokens["alice"])
    r = c.completions.create(model="stdlib@1", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(PROMPT.encode())
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    again = c.completions.create(model="stdlib@1", prompt=PROMPT, max_tokens=12, temperature=0)
    assert again.choices[0].text == r.choices[0].text and r.choices[0].text


def test_streaming_equals_non_streaming_and_reports_usage(served):
    url, tokens, *_ = served
    c = client(url, tokens["alice"])
    whole = c.completions.create(model="stdlib@1", prompt=PROMPT, max_tokens=20, temperature=0)
    pieces, usage, finish = [], None, None
    stream = c.completions.create(
        model="stdlib@1",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text
    assert finish == "length" and usage.completion_tokens == 20


def test_seeded_sampling_reproduces(served):
    url, tokens, *_ = served
    c = client(url, tokens["alice"])
    kw = dict(model="stdlib@1", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95)
    a = c.completions.create(seed=7, **kw).choices[0].text
    b = c.completions.create(seed=7, **kw).choices[0].text
    assert a == b


def test_presence_and_frequency_penalties_are_the_engines(served):
    """OpenAI's penalties reach the sampler: the served greedy text is the engine's own
    penalized greedy run (in this process, on the server's store), not the plain one."""
    from czyx.inference.engine import Engine
    from czyx.inference.generate import generate_ids
    from czyx.inference.options import EngineOptions
    from czyx.inference.sampling import SamplingParams
    from czyx.portals import open_consumer

    url, tokens, _, app, _ = served
    c = client(url, tokens["alice"])
    kw = dict(model="stdlib@1", prompt=PROMPT, max_tokens=24, temperature=0)
    pen = dict(presence_penalty=0.5, frequency_penalty=1.5)
    got = c.completions.create(**kw, **pen).choices[0].text
    plain = c.completions.create(**kw).choices[0].text
    consumer = open_consumer(app.state.czyx.store, None, "stdlib@1")
    engine = Engine(consumer, options=EngineOptions(stream=False))
    try:
        ids, _ = generate_ids(engine, list(PROMPT.encode()), 24, SamplingParams(**pen))
    finally:
        engine.close()
        consumer.close()
    assert got == bytes(ids).decode("utf-8", "replace")
    assert got != plain
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        c.completions.create(model="stdlib@1", prompt="x", frequency_penalty=2.5)


def test_top_k_is_used_and_unimplemented_controls_are_refused(served):
    """vLLM's and llama.cpp's top_k is the sampler's (top_k=1 samples the greedy text);
    a control this server does not implement is a 400 naming it, unless set to its no-op."""
    url, tokens, *_ = served
    c = client(url, tokens["alice"])
    kw = dict(model="stdlib@1", prompt=PROMPT, max_tokens=16)
    greedy = c.completions.create(**kw, temperature=0).choices[0].text
    for seed in (1, 2):
        r = c.completions.create(**kw, temperature=1.5, seed=seed, extra_body={"top_k": 1})
        assert r.choices[0].text == greedy
    ok = c.chat.completions.create(
        model="stdlib@1",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        response_format={"type": "text"},
        extra_body={"repetition_penalty": 1.0, "min_p": 0},
    )
    assert ok.choices[0].finish_reason == "length"
    for extra in (
        {"response_format": {"type": "json_object"}},
        {"repetition_penalty": 1.1},
        {"min_p": 0.05},
        {"guided_json": {"type": "object"}},
        {"tool_choice": "required"},
    ):
        (key,) = extra
        with pytest.raises(openai.BadRequestError, match=key) as exc:
            c.completions.create(**kw, extra_body=extra)
        assert exc.value.body["param"] == key
    with pytest.raises(openai.BadRequestError, match="top_k"):
        c.completions.create(**kw, extra_body={"top_k": -2})


def test_stop_string_ends_the_text_before_it(served):
    url, tokens, *_ = served
    c = client(url, tokens["alice"])
    full = c.completions.create(model="stdlib@1", prompt=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[5:8]
    assert stop and text.find(stop) >= 0
    r = c.completions.create(
        model="stdlib@1", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    pieces = []
    for chunk in c.completions.create(
        model="stdlib@1", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    ):
        pieces.extend(ch.text for ch in chunk.choices)
    assert "".join(pieces) == r.choices[0].text


def test_chat_with_template_streamed_and_not(served):
    url, tokens, *_ = served
    c = client(url, tokens["alice"])
    msgs = [{"role": "user", "content": "import os"}]
    r = c.chat.completions.create(model="stdlib@1", messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    # The template renders "<user>import os\n<assistant>": bytes of the prompt.
    assert r.usage.prompt_tokens == len(b"<user>import os\n<assistant>")
    pieces = []
    for chunk in c.chat.completions.create(
        model="stdlib@1", messages=msgs, max_tokens=10, temperature=0, stream=True
    ):
        pieces.extend(ch.delta.content or "" for ch in chunk.choices)
    assert "".join(pieces) == r.choices[0].message.content


def test_chat_without_template_is_400_completions_still_work(served):
    url, tokens, *_ = served
    c = client(url, tokens["bob"])
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        c.chat.completions.create(model="tiny@1", messages=[{"role": "user", "content": "hi"}])
    r = c.completions.create(model="tiny@1", prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def test_bad_requests_are_400_in_the_openai_shape(served):
    url, tokens, *_ = served
    c = client(url, tokens["alice"])
    with pytest.raises(openai.BadRequestError, match="n=1"):
        c.completions.create(model="stdlib@1", prompt="x", n=2)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope@1", prompt="x")
    r = httpx.post(
        url + "/v1/completions",
        headers={"Authorization": f"Bearer {tokens['alice']}"},
        content=b"{not json",
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_401_and_403(served):
    url, tokens, *_ = served
    with pytest.raises(openai.AuthenticationError):
        client(url, "not-a-portal").completions.create(model="stdlib@1", prompt="x")
    r = httpx.post(url + "/v1/completions", json={"model": "stdlib@1", "prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(url, tokens["alice"][:-4] + "AAAA").models.list()
    for who, model in (("bob", "stdlib@1"), ("reader", "stdlib@1"), ("expired", "stdlib@1")):
        with pytest.raises(openai.PermissionDeniedError):
            client(url, tokens[who]).completions.create(model=model, prompt="x", max_tokens=2)


def test_revocation_takes_effect_on_the_next_request(served):
    url, _, _, app, _ = served
    from czyx.portals.model import grant_model

    store = app.state.czyx.store
    tok = grant_model(store, "stdlib@1", tenant="frank").token
    c = client(url, tok)
    assert c.completions.create(model="stdlib@1", prompt="x", max_tokens=2).usage
    gate = app.state.czyx.gate
    before = gate.verifications
    assert c.completions.create(model="stdlib@1", prompt="x", max_tokens=2).usage
    assert gate.verifications == before  # the second request used the cached verification
    pid = gate.authenticate(f"Bearer {tok}").portal_id
    from czyx.portals.authority import open_authority

    open_authority(store).revoke(pid, reason="test")
    with pytest.raises(openai.PermissionDeniedError, match="revoked"):
        c.completions.create(model="stdlib@1", prompt="x", max_tokens=2)


def test_every_request_is_audited(served):
    url, tokens, ids, app, _ = served
    c = client(url, tokens["alice"])
    c.completions.create(model="stdlib@1", prompt="abc", max_tokens=3, temperature=0)
    store = app.state.czyx.store
    entries = [e for e in store.audit_log() if e["event"] == "serve.request"]
    last = entries[-1]
    assert last["tenant"] == "alice" and last["portal"] == ids["alice"]
    assert last["version"] == "stdlib@1" and last["status"] == 200
    assert last["prompt_tokens"] == 3 and last["completion_tokens"] == 3
    denies = [e for e in store.audit_log() if e["event"] == "portal.deny"]
    assert denies  # the refusals of the other tests were audited by the authority


def test_metrics_exposes_prometheus_text(served):
    url, tokens, *_ = served
    client(url, tokens["alice"]).completions.create(model="stdlib@1", prompt="x", max_tokens=2)
    text = httpx.get(url + "/metrics", timeout=10).text
    for name in (
        "czyx_requests_total",
        "czyx_completion_tokens_total",
        "czyx_time_to_first_token_seconds_bucket",
        "czyx_inter_token_latency_seconds_bucket",
        "czyx_batch_sequences_bucket",
        "czyx_queue_depth",
        "czyx_expert_hit_rate",
        "czyx_expert_bytes_per_token",
    ):
        assert name in text, name
    assert 'tenant="alice"' in text


def test_cli_revoke_in_another_process_is_seen(served):
    """``czyx revoke`` from another process: the server's next check refuses the token."""
    url, _, _, app, store_dir = served
    from czyx.portals.model import grant_model

    store = app.state.czyx.store
    g = grant_model(store, "stdlib@1", tenant="gina")
    c = client(url, g.token)
    assert c.completions.create(model="stdlib@1", prompt="x", max_tokens=1).usage
    out = subprocess.run(
        [sys.executable, "-m", "czyx", "revoke", g.id_hex, "--store", str(store_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    with pytest.raises(openai.PermissionDeniedError):
        c.completions.create(model="stdlib@1", prompt="x", max_tokens=1)


def test_a_shared_prompt_prefix_is_reused_not_recomputed(served):
    url, tokens, *_ = served
    c = client(url, tokens["alice"])
    prompt = "import os\nimport sys\nimport json\nimport time\nimport re\n"
    first = c.completions.create(model="stdlib@1", prompt=prompt + "x", max_tokens=6, temperature=0)
    second = c.completions.create(
        model="stdlib@1", prompt=prompt + "x", max_tokens=6, temperature=0
    )
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.prompt_tokens == len(prompt) + 1
    # Whole 16-token chunks of the prompt, short of the chunk holding its last token.
    assert second.usage.prompt_tokens_details.cached_tokens == (len(prompt) + 1 - 1) // 16 * 16


def test_non_finite_numbers_are_400_not_a_stuck_request(served):
    """JSON as Python reads it has NaN and Infinity: each sampling number refuses them (a
    NaN temperature once wedged its sequence until the event timeout)."""
    url, tokens, *_ = served
    headers = {"Authorization": f"Bearer {tokens['alice']}", "Content-Type": "application/json"}
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        for lit in ("NaN", "Infinity", "-Infinity"):
            body = f'{{"model": "stdlib@1", "prompt": "x", "max_tokens": 2, "{key}": {lit}}}'
            r = httpx.post(url + "/v1/completions", headers=headers, content=body, timeout=10)
            assert r.status_code == 400, (key, lit, r.text)
            assert r.json()["error"]["param"] == key
    r = httpx.post(
        url + "/v1/completions",
        headers=headers,
        json={"model": "stdlib@1", "prompt": "x", "max_tokens": 2, "seed": -1},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)
_KEYS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "response_format",
    "logprobs",
    "echo",
    "tools",
]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    chat=st.booleans(),
    model=st.sampled_from(["stdlib@1", "tiny@1", "nope@1", 3, None]),
    fields=st.dictionaries(st.sampled_from(_KEYS), _values, max_size=6),
)
def test_any_json_body_gets_an_answer_never_a_500(served, chat, model, fields):
    """Whatever the JSON body, the API answers a success or a 4xx error in the OpenAI
    shape at once: no request crashes the server or hangs (bounded: small max_tokens)."""
    url, tokens, *_ = served
    body = {"model": model, **fields}
    for key in ("max_tokens", "max_completion_tokens"):  # (keep the successes short)
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], 3)
    body.setdefault("max_tokens", 2)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(
        url + path,
        headers={"Authorization": f"Bearer {tokens['alice']}"},
        content=json.dumps(body),  # (allow_nan: NaN and Infinity literals as clients may send)
        timeout=30,
    )
    assert r.status_code in (200, 400, 403, 404, 422), (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert (
            isinstance(err["message"], str) and err["message"] and "internal" not in err["message"]
        )
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert r.text.rstrip().endswith("data: [DONE]")
        assert "server_error" not in r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
