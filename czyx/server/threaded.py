"""Run an app with uvicorn on a background thread, on 127.0.0.1 and an ephemeral port.

For tests, benchmarks and ``czyx chat`` without ``--url``: the caller gets the
base URL; leaving the context stops the server (bounded wait) and runs the
app's shutdown, which closes its engines and store.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from czyx.errors import CzyxError

LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def serve_in_thread(app, port: int = 0, start_timeout: float = 30.0) -> Iterator[str]:
    """Serve ``app`` on ``127.0.0.1:port`` (0: any free port); yields ``http://127.0.0.1:PORT``.

    Raises
    ------
    CzyxError
        The server did not start within ``start_timeout`` seconds.
    """
    import uvicorn

    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it a response written in two parts waits out the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="czyx-uvicorn", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise CzyxError(f"the server did not start on {LOOPBACK}:{bound}")
        time.sleep(0.01)
    try:
        yield f"http://{LOOPBACK}:{bound}"
    finally:
        server.should_exit = True
        thread.join(30.0)
        sock.close()
