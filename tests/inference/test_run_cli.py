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


def test_pin_class_ranges_parse_inclusive_and_refuse_nonsense():
    import pytest

    from czyx.commands.run import parse_class_range

    assert parse_class_range("0-15") == (0, 16)
    assert parse_class_range("0x20-0x2f") == (0x20, 0x30)
    assert parse_class_range("7") == (7, 8)
    assert parse_class_range(None) is None
    for bad in ("a-b", "5-2", "0-256"):
        with pytest.raises(ValueError):
            parse_class_range(bad)
