"""The ``czyx run`` subcommand's interface (the end-to-end run needs a mounted store)."""

from __future__ import annotations

import subprocess
import sys

import pytest


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
        "--policy",
    ):
        assert flag in out
    assert "decay" in out and "slru" in out


def test_run_defaults_to_nextuse_eviction():
    import argparse

    from czyx.cli.commands import run as run_cmd

    sub = argparse.ArgumentParser().add_subparsers()
    run_cmd.register(sub)
    parse = sub.choices["run"].parse_args
    assert parse(["m@1", "--prompt", "x"]).policy == "nextuse"
    assert parse(["m@1", "--prompt", "x", "--policy", "lru"]).policy == "lru"
    assert parse(["m@1", "--prompt", "x", "--policy", "decay"]).policy == "decay"


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

    from czyx.cli.commands.run import parse_class_range

    assert parse_class_range("0-15") == (0, 16)
    assert parse_class_range("0x20-0x2f") == (0x20, 0x30)
    assert parse_class_range("7") == (7, 8)
    assert parse_class_range(None) is None
    for bad in ("a-b", "5-2", "0-256"):
        with pytest.raises(ValueError):
            parse_class_range(bad)


def test_policy_choices_run_and_generate_the_same_text(tmp_path, capsys):
    from czyx.cli import main
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.testing.tiny_models import make_tiny_checkpoint

    cfg = dict(vocab_size=256, max_position_embeddings=512, eos_token_id=None, bos_token_id=None)
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=0, **cfg)
    with Store.open(tmp_path / "st") as st:
        mount(st, ckpt, "tiny@1")
    texts = {}
    for policy in ("lru", "lfu", "decay", "slru", "nextuse"):
        argv = ["run", "tiny@1", "--store", str(tmp_path / "st"), "--prompt", "def f(x):"]
        argv += ["--max-tokens", "8", "--cache-fraction", "0.25", "--policy", policy]
        assert main(argv) == 0
        texts[policy] = capsys.readouterr().out
    assert len(set(texts.values())) == 1 and texts["lru"]
    with pytest.raises(SystemExit):
        main(["run", "tiny@1", "--store", str(tmp_path / "st"), "--policy", "belady"])
