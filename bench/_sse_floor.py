"""The floor of a streamed token's HTTP cost, for ``bench_serve.py`` only.

A Starlette route on uvicorn (the stack ``czyx serve`` runs on, same event loop and
HTTP parser) that answers a POST with ``tokens`` server-sent events the size of
czyx's completion chunks, one write per event, and between two events computes for
``pace_us`` microseconds of its thread's CPU time (standing in for a decode step).
The serving process's CPU time per event beyond the pace is what one streamed token
costs through this stack on this machine, whatever the server around it does.

Run: ``python bench/_sse_floor.py PORT`` (127.0.0.1 only); ``POST /`` with JSON
``{"tokens": N, "pace_us": P}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

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


class _Stream(Response):
    media_type = "text/event-stream"

    def __init__(self, tokens: int, pace_us: float) -> None:
        self.tokens = tokens
        self.pace = pace_us / 1e6
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        clock = time.thread_time
        for _ in range(self.tokens):
            end = clock() + self.pace
            while clock() < end:
                pass
            await asyncio.sleep(0)  # the loop runs its I/O between steps, as czyx's driver
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _stream(request: Request) -> Response:
    body = await request.json()
    return _Stream(int(body["tokens"]), float(body["pace_us"]))


async def _health(request: Request) -> Response:
    return Response("ok")


app = Starlette(routes=[Route("/", _stream, methods=["POST"]), Route("/health", _health)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
