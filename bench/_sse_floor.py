"""The floor of a streamed token's HTTP cost, for ``bench_serve.py`` only.

A Starlette route on uvicorn (the stack ``czyx serve`` runs on, same event loop and
HTTP parser) that answers a POST with ``tokens`` server-sent events the size of
czyx's completion chunks, one write per event, and between two events computes for
``pace_us`` microseconds of its thread's CPU time (standing in for a decode step).
The serving process's CPU time per event beyond the pace is what one streamed token
costs through this stack on this machine, whatever the server around it does.

With ``work_bytes``, the pace reads through a buffer of that many bytes (16 KiB at a
time, round and round) instead of spinning on the clock: a decode step leaves the
caches holding the weights it read, not the event loop's and the socket's code and
data, and the event written after it pays for that. Without, the pace spins in the
caches the write path already holds: the floor's lower bound.

Run: ``python bench/_sse_floor.py PORT`` (127.0.0.1 only); ``POST /`` with JSON
``{"tokens": N, "pace_us": P}`` and optionally ``"work_bytes": B``; the stream's last
event's ``usage`` says how much CPU time the paces took (``paced_us``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# One text chunk as czyx serve writes it (a one-character text).
EVENT = (
    "data: "
    + json.dumps(
        {
            "id": "cmpl-0123456789abcdef01234567",
            "object": "text_completion",
            "created": 1764640000,
            "model": "stdlib@1",
            "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
        }
    )
    + "\n\n"
).encode()


_SLICE = 4096  # float32 values read per call: 16 KiB, so the clock is checked often


def _pace_reading(seconds: float, buf: np.ndarray, at: int) -> int:
    """Read ``buf`` from float ``at`` on, a slice at a time, until this thread has
    computed for ``seconds``; returns where the next pace goes on reading."""
    clock = time.thread_time
    end = clock() + seconds
    top = buf.size - _SLICE
    while clock() < end:
        buf[at : at + _SLICE].sum()
        at = at + _SLICE if at + _SLICE <= top else 0
    return at


class _Stream(Response):
    media_type = "text/event-stream"

    def __init__(self, tokens: int, pace_us: float, work_bytes: int) -> None:
        self.tokens = tokens
        self.pace = pace_us / 1e6
        # (filled: its pages are real memory, not the kernel's shared zero page)
        self.buf = np.ones(max(work_bytes // 4, 2 * _SLICE), np.float32) if work_bytes else None
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        clock = time.thread_time
        buf, at, paced = self.buf, 0, 0.0
        for _ in range(self.tokens):
            t0 = clock()
            if buf is None:
                end = t0 + self.pace
                while clock() < end:
                    pass
            else:
                at = _pace_reading(self.pace, buf, at)
            paced += clock() - t0  # (a pace ends a little after its due time)
            await asyncio.sleep(0)  # the loop runs its I/O between steps, as czyx's driver
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        # The CPU time the paces took, so the caller subtracts exactly that.
        usage = {"completion_tokens": self.tokens, "paced_us": paced * 1e6}
        tail = f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail.encode()})


async def _stream(request: Request) -> Response:
    body = await request.json()
    return _Stream(int(body["tokens"]), float(body["pace_us"]), int(body.get("work_bytes", 0)))


async def _health(request: Request) -> Response:
    return Response("ok")


app = Starlette(routes=[Route("/", _stream, methods=["POST"]), Route("/health", _health)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
