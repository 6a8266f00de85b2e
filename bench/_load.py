"""The load generator of ``bench_serve.py``: streamed completions over raw HTTP/1.1.

One process, one asyncio loop (uvloop's where installed), one keep-alive connection
per client slot, so the clients cost the machine (which they share with the server)
as little as a load generator can in Python: while a stream runs, a client only
keeps each read with its time (one protocol callback per read); the chunked body
and its server-sent events are parsed after the request ends. An event's time is
the time of the read that completed it.

Run by :class:`LoadGenerator` (a subprocess speaking JSON lines on stdin/stdout);
every request is bounded by the level's deadline and targets the given loopback
port only.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

HOST = "127.0.0.1"
_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked body (events end in "\n\n")


def _sse_events(raw: bytes, reads: list[tuple[int, float]]) -> list[tuple[float, bytes]]:
    """``(time, data)`` of every ``data:`` event in a chunked HTTP body, ``raw`` being
    the bytes after the header (``reads``: each read's end offset in ``raw`` and its time)."""
    out: list[tuple[float, bytes]] = []
    pos, r = 0, 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            return out
        start, end = eol + 2, eol + 2 + size
        while reads[r][0] < end:  # the read that completed this chunk
            r += 1
        when = reads[r][1]
        for ev in raw[start:end].replace(b"\r\n", b"\n").split(b"\n\n"):
            if ev.startswith(b"data: "):
                out.append((when, ev[6:]))
        pos = end + 2


class _Conn(asyncio.Protocol):
    """One keep-alive connection; a response's reads are only kept (with their times)
    until it is complete: one callback per read, nothing parsed meanwhile."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reads: list[tuple[float, bytes]] = []
        self.size = 0
        self.head = -1  # the header's length once seen
        self.need = -1  # a plain (not chunked) response's total length
        self.done: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reads.append((time.perf_counter(), data))
        self.size += len(data)
        if self.head < 0:
            raw = b"".join(d for _, d in self.reads)
            end = raw.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = end + 4
            lower = raw[: self.head].lower()
            if b"transfer-encoding: chunked" not in lower:  # an error answer: a plain body
                n = 0
                if b"content-length:" in lower:
                    n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
                self.need = self.head + n
        if self.need >= 0:
            finished = self.size >= self.need
        else:
            finished = data.endswith(_END) or (
                len(data) < len(_END) and b"".join(d for _, d in self.reads[-2:]).endswith(_END)
            )
        if finished and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the server closed the connection"))

    def start(self, message: bytes) -> None:
        self.reads, self.size, self.head, self.need = [], 0, -1, -1
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(message)


async def _request(conns: dict, slot: int, port: int, req: dict, deadline: float) -> dict:
    body = json.dumps(req["body"]).encode()
    head = [f"POST {req['path']} HTTP/1.1", f"Host: {HOST}:{port}"]
    head += [f"{k}: {v}" for k, v in req.get("headers", {}).items()]
    head += ["Content-Type: application/json", f"Content-Length: {len(body)}", "", ""]
    message = "\r\n".join(head).encode() + body
    loop = asyncio.get_running_loop()
    for attempt in (0, 1):
        conn = conns.get((port, slot))
        if conn is None or conn.closed:
            # (a keep-alive connection the server closed while idle: a new one)
            _, conn = await loop.create_connection(_Conn, HOST, port)
            conns[(port, slot)] = conn
        t0 = time.perf_counter()
        conn.start(message)
        try:
            await asyncio.wait_for(conn.done, deadline - time.monotonic())
            break
        except ConnectionError:
            # Closed before any answer (the server's idle timeout raced the request):
            # once more on a new connection, as HTTP clients do.
            conns.pop((port, slot), None)
            if attempt or conn.reads:
                raise
    raw = b"".join(d for _, d in conn.reads)
    status = int(raw.split(b" ", 2)[1])
    if conn.need >= 0:
        return {"status": status, "error": raw[conn.head :][:300].decode("utf-8", "replace")}
    reads, got = [], -conn.head  # each read's end offset in the body
    for when, d in conn.reads:
        got += len(d)
        reads.append((got, when))
    stamps, texts, usage, detail = [], [], None, None
    for when, ev in _sse_events(raw[conn.head :], reads):
        if ev == b"[DONE]":
            continue
        obj = json.loads(ev)
        if obj.get("usage"):
            detail = obj["usage"]
            usage = detail["completion_tokens"]
        for ch in obj.get("choices", []):
            text = ch.get("text") or (ch.get("delta") or {}).get("content")
            if text:
                stamps.append(when)
                texts.append(text)
    return {
        "status": status,
        "t0": t0,
        "stamps": stamps,
        "usage": usage,
        "usage_detail": detail,
        "text": "".join(texts),
    }


async def _level(conns: dict, cmd: dict) -> list[dict]:
    deadline = time.monotonic() + cmd["budget"]
    port = cmd["port"]
    jobs = [_request(conns, i, port, req, deadline) for i, req in enumerate(cmd["requests"])]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    out = []
    for i, res in enumerate(results):
        if isinstance(res, BaseException):
            # A connection in an unknown state is not reused.
            conn = conns.pop((port, i), None)
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            res = {"status": 0, "error": f"{type(res).__name__}: {res}"}
        out.append(res)
    return out


def _serve() -> None:
    """Read one JSON command per stdin line, answer one JSON line each."""
    conns: dict = {}
    try:  # uvloop where installed (the serve extra): less CPU per read
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "close":
            for key in list(conns):
                conn = conns.pop(key)
                if conn.transport is not None:
                    conn.transport.close()
            continue
        out = loop.run_until_complete(_level(conns, cmd))
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    loop.close()


class LoadGenerator:
    """The load process: :meth:`level` runs one level's requests concurrently."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def level(self, port: int, requests: list[dict], budget_s: float) -> list[dict]:
        """Each request ``{"path", "body", "headers"}`` on its own connection, all at
        once; one result per request: ``status``, and ``t0`` (request written),
        ``stamps`` (each text event's time), ``usage`` (completion tokens, or None),
        ``usage_detail`` (the whole usage object, or None) and ``text``, or ``error``."""
        cmd = {"port": port, "requests": requests, "budget": budget_s}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the load generator exited")
        return json.loads(line)

    def close_connections(self) -> None:
        """Drop the keep-alive connections (before a server they point at stops)."""
        self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def pid(self) -> int:
        return self.proc.pid


if __name__ == "__main__":
    _serve()
