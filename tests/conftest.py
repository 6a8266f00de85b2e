"""Suite-wide settings.

Hypothesis's per-example deadline (200 ms by default) measures wall time, and
this suite runs on shared 2-core machines: a deadline would make correctness
tests fail on load, which tests must never do. Example counts stay as each
test sets them.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("czyx", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("czyx")
