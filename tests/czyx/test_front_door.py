"""What a new user hits first (issue 19, "the front door"): each case refused with one
clear line or handled, never an internal error, a traceback or a silent success."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from czyx.cli import main
from czyx.inference.assets import bundled_model_dir


def czyx(*args: str, input: str | None = None, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "czyx", *args],
        capture_output=True,
        text=True,
        timeout=300,
        input=input,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("door") / "store")
    assert main(["mount", str(bundled_model_dir()), "--as", "stdlib@v1", "--store", d]) == 0
    return d


def _run(store, *extra, rc=0):
    return main(["run", "stdlib@v1", "--store", store, "-n", "2", *extra])


def test_prompt_sources(store, tmp_path, capsys) -> None:
    assert _run(store, "def ") == 0  # positional
    assert _run(store, "-p", "def ") == 0
    f = tmp_path / "p.txt"
    f.write_bytes(b"def f():\n")
    assert _run(store, "--prompt-file", str(f)) == 0
    r = czyx("run", "stdlib@v1", "--store", store, "--prompt", "-", "-n", "2", input="def ")
    assert r.returncode == 0, r.stderr
    capsys.readouterr()
    assert _run(store) == 1 and "give the prompt once" in capsys.readouterr().err
    assert _run(store, "x", "-p", "y") == 1


def test_invalid_utf8_prompt_is_one_line(store, tmp_path, capsys) -> None:
    bad = os.fsdecode(b"def \xff\xfe")  # how a non-UTF-8 argv byte arrives
    assert _run(store, "-p", bad) == 1
    err = capsys.readouterr().err
    assert "not valid UTF-8" in err and "internal error" not in err
    f = tmp_path / "bad.txt"
    f.write_bytes(b"\xff\xfe")
    assert _run(store, "--prompt-file", str(f)) == 1
    assert "not valid UTF-8" in capsys.readouterr().err


def test_context_length(store, capsys) -> None:
    long = "x" * 1100  # the bundled model has 1024 positions, one byte a token
    assert _run(store, long) == 1
    assert "context holds 1024" in capsys.readouterr().err
    assert main(["run", "stdlib@v1", "--store", store, "x" * 1020, "-n", "50"]) == 0
    assert "cut to 4" in capsys.readouterr().err


def test_bad_xray_path_and_lookahead_refused_before_generating(store, capsys) -> None:
    assert _run(store, "def ", "--xray", "/nonexistent/dir/x.json") == 1
    out = capsys.readouterr()
    assert "--xray" in out.err and out.out == ""
    assert _run(store, "def ", "--lookahead", "9") == 1
    out = capsys.readouterr()
    assert "4 layers" in out.err and out.out == ""


def test_store_commands_honour_store_option_and_env(store, capsys) -> None:
    for argv in (["store", "info", "--store", store], ["--store", store, "ls"]):
        assert main(argv) == 0 and "stdlib@v1" in capsys.readouterr().out
    r = czyx("store", "fsck", env={"CZYX_STORE": store})
    assert r.returncode == 0 and "0 problems" in r.stdout
    r = czyx("store", "gc", "--grace", "0", env={"CZYX_STORE": store})
    assert r.returncode == 0


def test_json_listings(store, capsys) -> None:
    assert main(["ls", "--store", store, "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rows[0]["tag"] == "stdlib@v1" and rows[0]["experts"] > 0
    assert main(["store", "info", "--store", store, "--json"]) == 0
    assert all(json.loads(x)["space"] for x in capsys.readouterr().out.splitlines())
    assert main(["sessions", "--store", store, "--json"]) == 0


def test_tag_without_version_and_expiry(store, capsys) -> None:
    assert main(["grant", "stdlib", "--tenant", "a", "--store", store]) == 1
    err = capsys.readouterr().err
    assert "NAME@VERSION" in err and "not hex" not in err
    assert main(["grant", "stdlib@v1", "--tenant", "a", "--expires", "0s", "--store", store]) == 1
    assert "not in the future" in capsys.readouterr().err
    assert main(["grant", "stdlib@v1", "--tenant", "a", "--expires", "1h", "--store", store]) == 0
    capsys.readouterr()
    assert main(["audit", "--store", store]) == 0
    out = capsys.readouterr().out
    assert "expires=" not in out or "expires=20" in out  # a date, not a Unix time


def test_sessions_show_unknown_and_rm(store, capsys) -> None:
    assert main(["sessions", "show", "nosuch", "--store", store]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["run", "stdlib@v1", "--store", store, "def ", "-n", "2", "--session", "s"]) == 0
    assert main(["sessions", "rm", "s", "--store", store]) == 0
    assert main(["sessions", "show", "s", "--store", store]) == 1


def test_rm_untags(store, capsys) -> None:
    assert main(["mount", str(bundled_model_dir()), "--as", "other@v1", "--store", store]) == 0
    assert main(["rm", "other@v1", "--store", store]) == 0
    assert "still tagged stdlib@v1" in capsys.readouterr().out  # same content, same space
    assert main(["rm", "other@v1", "--store", store]) == 1
    assert main(["ls", "--store", store]) == 0 and "other@v1" not in capsys.readouterr().out


def test_rm_frees_the_version(tmp_path, capsys) -> None:
    d = str(tmp_path / "store")
    assert main(["mount", str(bundled_model_dir()), "--as", "m@1", "--store", d]) == 0
    blocks = tmp_path / "store" / "blocks"
    assert any(blocks.glob("*.blk"))
    capsys.readouterr()
    assert main(["rm", "m@1", "--store", d]) == 0
    assert "deleted" in capsys.readouterr().out
    assert not any(blocks.glob("*.blk"))
    assert main(["store", "fsck", "--store", d]) == 0
    assert main(["run", "m@1", "--store", d, "-n", "1", "x"]) == 1
    assert main(["mount", str(bundled_model_dir()), "--as", "m@1", "--store", d]) == 0
    assert main(["run", "m@1", "--store", d, "-n", "1", "x"]) == 0


def test_broken_pipe_is_quiet(store) -> None:
    for i in range(30):
        main(["grant", "stdlib@v1", "--tenant", f"t{i}", "--store", store])
    p = subprocess.Popen(
        f"{sys.executable} -m czyx audit --store {store} | head -1",
        shell=True,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=120)
    assert len(out.splitlines()) == 1 and "Broken pipe" not in err and "Traceback" not in err


def _reading_stdin(pid: int) -> bool:
    # /proc/PID/syscall: the call a blocked process is in, then its arguments
    # (x86-64 read is 0; its first argument the descriptor).
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] == "0" and int(fields[1], 16) == 0


def test_sigint_is_one_line(store) -> None:
    # The prompt comes from a stdin that never ends; the signal is sent once the
    # command blocks reading it. The child starts with SIGINT at its default: a
    # suite launched in the background by a non-interactive shell inherits it
    # ignored, and Python then (rightly) keeps ignoring it.
    p = subprocess.Popen(
        [sys.executable, "-m", "czyx", "run", "stdlib@v1", "--store", store, "-p", "-"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    if platform.machine() == "x86_64" and Path(f"/proc/{p.pid}/syscall").exists():
        deadline = time.monotonic() + 90
        while not _reading_stdin(p.pid) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    else:  # no syscall numbers to read: past start-up by time
        time.sleep(3.0)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_export_refuses_a_non_empty_dir_unless_forced(store, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    (out / "README.md").write_text("mine")
    (out / ".czyx-export-k1ll3d").mkdir()  # what an export killed midway leaves
    (out / ".czyx-export-k1ll3d" / "model.safetensors").write_bytes(b"half")
    (out / ".model.gguf.123.abcd.partial").write_bytes(b"half")
    assert main(["export", "stdlib@v1", str(out), "--store", store]) == 1
    assert "not empty" in capsys.readouterr().err
    src = bundled_model_dir()  # exporting over the source is the same refusal
    assert main(["export", "stdlib@v1", str(src), "--store", store]) == 1
    assert main(["export", "stdlib@v1", str(out), "--store", store, "--force"]) == 0
    assert not (out / "model-00009-of-00009.safetensors").exists()
    assert not (out / ".czyx-export-k1ll3d").exists()
    assert (out / "README.md").read_text() == "mine" and (out / "config.json").exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_progress_shows_on_a_terminal_only(monkeypatch) -> None:
    import io

    from czyx.cli.commands._progress import progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert list(progress(range(5), "profile")) == list(range(5))
    assert "profile" in tty.getvalue()
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    assert list(progress(range(5), "profile")) == list(range(5)) and pipe.getvalue() == ""


def test_every_front_door_case_is_one_clear_line(tmp_path) -> None:
    from czyx.testing.attacks import cli_attacks

    _, cases = cli_attacks(tmp_path)
    outcomes = [(c.name, c.run()) for c in cases]
    bad = [(n, o) for n, o in outcomes if o.kind != "refused"]
    assert len(outcomes) >= 25 and not bad, bad


def test_session_context_length(store, capsys) -> None:
    base = ["run", "stdlib@v1", "--store", store, "--session", "long", "-n", "1"]
    assert main([*base, "x" * 1000]) == 0
    capsys.readouterr()
    assert main([*base, "y" * 40]) == 1
    assert "holds 1001 tokens" in capsys.readouterr().err
