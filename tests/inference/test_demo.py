"""The main job end to end: ``czyx demo`` on a temporary store, with the bundled model."""

from __future__ import annotations

import io
import subprocess
import sys

from czyx.inference.demo import run_demo
from czyx.inference.options import EngineOptions


def test_demo_end_to_end(tmp_path):
    buf = io.StringIO()
    res = run_demo(tmp_path / "store", max_tokens=12, out=buf, progress=False)
    text = buf.getvalue()
    assert res.mounted
    # Both refusals happened and were typed portal denials.
    assert len(res.refusals) == 2
    assert all(r.startswith("OutOfScope") for r in res.refusals)
    tiered, full = res.runs
    assert tiered.text == full.text and len(tiered.text) > 0
    # A quarter of the expert bytes holds a quarter of the slots of the full cache.
    assert tiered.n_slots * 4 == full.n_slots
    assert 0.0 <= tiered.hit_rate <= full.hit_rate <= 1.0
    # Predictions read into free slots only: the full cache prefetches as it fills, the
    # quarter cache at most once per slot (it is full after the prompt).
    assert full.prefetch_reads > 0 and 0.0 < full.prefetch_recall <= 1.0
    assert tiered.prefetch_reads <= tiered.n_slots
    # Both runs evict by the engine's default (the expected next use), and the narration
    # says so.
    assert tiered.policy == full.policy == EngineOptions().policy == "nextuse"
    assert "eviction: the farthest expected next use" in text
    for needle in ("1. mount", "2. grant", "refused", "3. generate", "4. report", "5. next"):
        assert needle in text

    # Second run: same content, same space, nothing new written.
    again = run_demo(tmp_path / "store", max_tokens=4, out=io.StringIO(), progress=False)
    assert not again.mounted


def test_demo_cli(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "czyx", "demo", "--store", str(tmp_path / "s"), "--max-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "decode tokens/s" in proc.stdout


def test_demo_rejects_bad_fraction(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "czyx",
            "demo",
            "--store",
            str(tmp_path / "s"),
            "--cache-fraction",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "cache_fraction" in proc.stderr and "Traceback" not in proc.stderr
