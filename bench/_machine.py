"""One line describing the machine a benchmark ran on, for every report's header.

The CPU model, visible vCPUs, RAM, the czyx kernels' SIMD level, the Python and
numpy versions, the BLAS thread setting and the commit: what a reader needs to
compare two reports (the machines are shared, so the load average is each
report's own business).
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _first(path: str, prefix: str) -> str | None:
    try:
        with open(path) as f:
            return next((ln for ln in f if ln.startswith(prefix)), None)
    except OSError:
        return None


def machine() -> str:
    """The machine and software of this run, one line."""
    import numpy as np

    from czyx.inference.kernels.fused import level

    cpu_line = _first("/proc/cpuinfo", "model name")
    cpu = cpu_line.split(":", 1)[1].strip() if cpu_line else platform.machine()
    mem_line = _first("/proc/meminfo", "MemTotal")
    mem = f", {int(mem_line.split()[1]) / 2**20:.1f} GiB RAM" if mem_line else ""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return (
        f"{cpu}, {os.cpu_count()} vCPUs (shared with other jobs){mem}, czyx kernels: {level()}; "
        f"Python {platform.python_version()}, numpy {np.__version__}; "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; "
        f"commit {commit or 'unknown'}"
    )
