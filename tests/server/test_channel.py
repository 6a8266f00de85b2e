"""The per-request event channel (czyx.server.app._Channel): every wait bounded.

A wait's timeout is a deadline checked by one timer per channel (re-armed when
it fires while a later wait is pending, moved earlier for a shorter timeout),
so each wait must end by its own deadline, never at an earlier wait's, and
events delivered in time must end it at once.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from czyx.server.app import _Channel


def test_a_wait_without_events_times_out():
    async def main():
        ch = _Channel(asyncio.get_running_loop())
        with pytest.raises(TimeoutError):
            await ch.take(0.05)
        ch.close()

    asyncio.run(main())


def test_each_wait_keeps_its_own_deadline():
    async def main():
        loop = asyncio.get_running_loop()
        ch = _Channel(loop)
        loop.call_later(0.01, ch._deliver, [1, 2])
        assert await ch.take(0.1) == [1, 2]
        # The timer armed for the first wait fires during this one: it must be re-armed
        # for this wait's later deadline (a TimeoutError here would be the first's).
        loop.call_later(0.3, ch._deliver, [3])
        assert await ch.take(5.0) == [3]
        # A shorter timeout than the armed timer's (5 s): it ends at its own deadline.
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await ch.take(0.05)
        short = time.monotonic() - t0
        ch.close()
        return short

    assert asyncio.run(main()) < 2.5  # its own 0.05 s deadline, not the 5 s timer's
