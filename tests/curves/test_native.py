"""The C kernel's fallback: without it the numpy path warns once and gives the same words."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from czyx.curves import HilbertCurve, MortonCurve

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import numpy as np
from czyx.curves import HilbertCurve, MortonCurve
pts = np.arange(30, dtype=np.uint64).reshape(10, 3) * np.uint64(76543210987)
print(MortonCurve().encode_array(pts).tolist())
print(HilbertCurve().encode_array(pts).tolist())
"""


def test_pure_fallback_warns_and_agrees():
    env = {**os.environ, "CZYX_CURVES_PURE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "C kernel unavailable" in proc.stderr
    pts = np.arange(30, dtype=np.uint64).reshape(10, 3) * np.uint64(76543210987)
    expect = [
        str(MortonCurve().encode_array(pts).tolist()),
        str(HilbertCurve().encode_array(pts).tolist()),
    ]
    assert proc.stdout.split("\n")[:2] == expect
