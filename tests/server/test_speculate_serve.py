"""Speculative decoding served: per request (czyx's ``speculate`` field) over the batch,
the same greedy text as without, refusals, the Prometheus acceptance figures, and
``czyx serve --speculate`` as the server's default."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef "


def _client(url: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=60)


def test_a_request_speculates_with_the_same_text(served):
    url, tokens, *_ = served
    c = _client(url, tokens["alice"])

    def complete(**extra):
        r = c.completions.create(
            model="stdlib@1", prompt=PROMPT, max_tokens=32, temperature=0, extra_body=extra
        )
        return r.choices[0].text

    want = complete()
    assert complete(speculate="lookup", draft_tokens=3) == want
    assert complete(speculate="off") == want
    text = httpx.get(url + "/metrics", timeout=10).text

    def value(name: str) -> float:
        m = re.search(rf'^{name}{{version="stdlib@1"}} (\S+)$', text, re.M)
        assert m, name
        return float(m.group(1))

    drafted = value("czyx_speculative_drafted_tokens_total")
    accepted = value("czyx_speculative_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    rate = value("czyx_speculative_acceptance_rate")
    assert rate == pytest.approx(accepted / drafted)
    for bad in ({"speculate": "draft:stdlib@1"}, {"speculate": "maybe"}, {"draft_tokens": 0}):
        with pytest.raises(openai.BadRequestError):
            complete(**bad)


def test_a_request_without_draft_tokens_drafts_the_servers_number(served, monkeypatch):
    # "speculate": "lookup" alone takes the server's --draft-tokens, not a global default.
    from dataclasses import replace

    url, tokens, _, app, _ = served
    scheduler = app.state.czyx.models["stdlib@1"].scheduler
    monkeypatch.setattr(
        scheduler,
        "options",
        replace(
            scheduler.options,
            speculate=replace(scheduler.options.speculate, draft_tokens=2),
        ),
    )
    seen = []
    submit = scheduler.submit

    def spy(*args, **kw):
        seen.append(kw.get("speculate"))
        return submit(*args, **kw)

    monkeypatch.setattr(scheduler, "submit", spy)
    c = _client(url, tokens["alice"])
    for extra in ({"speculate": "lookup"}, {"speculate": "lookup", "draft_tokens": 5}):
        c.completions.create(
            model="stdlib@1", prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra
        )
    assert [(s.mode, s.draft_tokens) for s in seen] == [("lookup", 2), ("lookup", 5)]


def test_serve_flag_sets_the_default():
    from czyx.cli import build_parser
    from czyx.cli.commands.serve import serve_options

    def opts(*argv: str):
        return serve_options(build_parser().parse_args(["serve", *argv])).batch.speculate

    assert opts().mode == "off"
    got = opts("--speculate", "lookup", "--draft-tokens", "6")
    assert (got.mode, got.draft_tokens, got.adaptive) == ("lookup", 6, True)
    with pytest.raises(ValueError, match="not served"):
        opts("--speculate", "draft:m@q2")
