"""The ``czyx run`` subcommand's interface (the end-to-end run needs a mounted store)."""

from __future__ import annotations

import subprocess
import sys


def test_run_help_lists_the_issue_options():
    out = subprocess.run(
        [sys.executable, "-m", "czyx", "run", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in (
        "--prompt",
        "--portal",
        "--cache-mb",
        "--cache-fraction",
        "--max-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--store",
    ):
        assert flag in out


def test_cache_budget_flags_are_exclusive():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "czyx",
            "run",
            "m@1",
            "--prompt",
            "x",
            "--cache-mb",
            "1",
            "--cache-fraction",
            "0.5",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "not allowed with" in proc.stderr
