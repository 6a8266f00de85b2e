from __future__ import annotations

import subprocess
import sys

import czyx
from czyx.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert czyx.__version__ in capsys.readouterr().out


def test_help_lists_usage():
    out = subprocess.run(
        [sys.executable, "-m", "czyx", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "usage: czyx" in out


def test_unknown_command_fails_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "czyx", "no-such-command"], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
