"""``czyx chat``: history, streaming, /reset, and Ctrl-C stopping one answer only; fed by
stdin against a local engine, and through --url against a running server."""

from __future__ import annotations

import io

import openai

from czyx.cli import main
from czyx.cli.commands.chat import converse
from tests.server.conftest import make_store

GREEDY = {"max_tokens": 6, "temperature": 0}


def _chat(url, token, messages, max_tokens=6):
    c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=60)
    r = c.chat.completions.create(
        model="stdlib@1", messages=messages, **dict(GREEDY, max_tokens=max_tokens)
    )
    return r.choices[0].message.content


def test_local_chat_from_stdin_keeps_history(served, tmp_path, monkeypatch, capsys):
    url, tokens, *_ = served
    a1 = _chat(url, tokens["alice"], [{"role": "user", "content": "import os"}])
    a2 = _chat(
        url,
        tokens["alice"],
        [
            {"role": "user", "content": "import os"},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": "print("},
        ],
    )
    a3 = _chat(url, tokens["alice"], [{"role": "user", "content": "x = "}])
    store_dir, cfg, _, _ = make_store(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("import os\nprint(\n/reset\nx = \n"))
    code = main(
        [
            "chat",
            "stdlib@1",
            "--store",
            str(store_dir),
            "--chat-template",
            str(cfg),
            "--temperature",
            "0",
            "--max-tokens",
            "6",
            "--no-prefetch",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out == f"{a1}\n{a2}\n{a3}\n"


def test_local_chat_without_a_template_says_so_before_the_first_prompt(
    tmp_path, monkeypatch, capsys
):
    store_dir, _, _, _ = make_store(tmp_path)
    stdin = io.StringIO("never read\n")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["chat", "stdlib@1", "--store", str(store_dir), "--no-prefetch"]) == 1
    err = capsys.readouterr().err
    assert "stdlib@1 has no chat template" in err and "--chat-template" in err
    assert stdin.tell() == 0  # failed before reading a prompt


class _InterruptOnce(io.StringIO):
    """Raises KeyboardInterrupt at the first write (a Ctrl-C during the first answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = False

    def write(self, s: str) -> int:
        if not self.fired and s.strip():
            self.fired = True
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_stops_one_answer_not_the_chat(served):
    url, tokens, _, app, _ = served
    c = openai.OpenAI(base_url=url + "/v1", api_key=tokens["alice"], max_retries=0, timeout=60)
    out = _InterruptOnce()
    history = converse(
        c,
        "stdlib@1",
        ["import os\n", "x = \n"],
        out,
        dict(GREEDY, max_tokens=200),
        err=io.StringIO(),
    )
    assert out.fired
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    full = _chat(url, tokens["alice"], [{"role": "user", "content": "import os"}], 200)
    partial = history[1]["content"]
    assert full.startswith(partial) and 0 < len(partial) < len(full)  # stopped early, kept
    assert len(history[3]["content"]) > 0  # the next answer still came
    # The stopped stream freed its sequence: audited as a client that left, short of 200.
    entries = [e for e in app.state.czyx.store.audit_log() if e["event"] == "serve.request"]
    stopped = [e for e in entries if e["status"] == 499 and e["tenant"] == "alice"]
    assert stopped and stopped[-1]["completion_tokens"] < 200


def test_chat_through_url(served, monkeypatch, capsys):
    url, tokens, *_ = served
    want = _chat(url, tokens["alice"], [{"role": "user", "content": "def f("}])
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(\n"))
    code = main(
        [
            "chat",
            "stdlib@1",
            "--url",
            url,
            "--portal",
            tokens["alice"],
            "--temperature",
            "0",
            "--max-tokens",
            "6",
        ]
    )
    assert code == 0 and capsys.readouterr().out == want + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "tiny@1", "--url", url, "--portal", tokens["bob"]]) == 1
    assert "no chat template" in capsys.readouterr().err
