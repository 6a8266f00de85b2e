"""``czyx serve [NAME@VER ...]``: the OpenAI-compatible server, portals as bearer tokens.

A thin layer over :func:`czyx.server.create_app`: the engine flags are those of
``czyx run`` (:mod:`czyx.cli.commands._engineargs`), the batching flags build a
:class:`~czyx.inference.batch.BatchOptions`, and uvicorn serves the app on a
loopback address (put a TLS-terminating proxy in front to reach it from
elsewhere: bearer tokens must not cross a network in clear text).
``--ray ADDRESS --ray-shape pipeline|experts`` serves each version placed over
a Ray cluster instead of the local engine (:mod:`czyx.cli.commands._ray_run`):
requests are not batched there, each runs as one sequence with up to
``--ray-in-flight`` of them in flight.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import sys

from czyx.cli.commands._engineargs import add_engine_args, check_engine_args, engine_kwargs
from czyx.cli.commands._specargs import add_speculate_args, speculate_options
from czyx.cli.commands._storearg import add_store_arg, store_dir
from czyx.inference.options import BATCHED_OPTIONS

LOOPBACK = ("127.0.0.1", "::1", "localhost")
SWITCH_INTERVAL = 0.0005  # seconds (CPython's default is 0.005)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    p = subparsers.add_parser(
        "serve",
        help="serve model versions over the OpenAI API (portals are the bearer tokens)",
        description="Serve mounted model versions through an OpenAI-compatible HTTP API. "
        "Each request carries a portal token as 'Authorization: Bearer <token>'.",
    )
    p.add_argument(
        "refs", nargs="*", metavar="NAME@VERSION", help="versions to serve (default: every one)"
    )
    p.add_argument("--host", default="127.0.0.1", help="loopback address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free)")
    add_store_arg(p)
    # A batched engine's defaults (inference.options.BATCHED_OPTIONS, measured there).
    add_engine_args(p, BATCHED_OPTIONS)
    p.add_argument(
        "--kv-mb", type=float, default=None, help="KV memory budget over active sequences (MiB)"
    )
    p.add_argument("--max-batch", type=int, default=16, help="sequences stepped together")
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting before 429 (default 64)"
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=32, help="prompt tokens per sequence per step"
    )
    p.add_argument("--step-tokens", type=int, default=256, help="tokens per step at most")
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=32.0,
        help="memory for finished prompts' KV reused by later prompts sharing a prefix "
        "(MiB; 0: off)",
    )
    p.add_argument(
        "--chat-template",
        metavar="PATH",
        help="a checkpoint directory, its tokenizer_config.json or a .jinja file: the chat "
        "template the chat endpoint renders (default: the one mounted with each checkpoint, "
        "its chat_template.jinja or its tokenizer_config.json's; without one chat answers 400)",
    )
    p.add_argument(
        "--default-max-tokens", type=int, default=256, help="chat max_tokens when none is given"
    )
    p.add_argument("--no-audit", action="store_true", help="no per-request audit entries")
    add_speculate_args(p, served=True)
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=0.0,
        help="a streamed token may wait this long to share a socket write with the next ones "
        "(default 0: each burst of tokens is written at once)",
    )
    p.add_argument(
        "--replicate",
        action="store_true",
        help="also serve the replication endpoints (czyx pull; portals with the read right)",
    )
    from czyx.cli.commands._ray_run import add_args as _add_ray_args

    _add_ray_args(p, serving=True)
    p.set_defaults(func=run)


def serve_options(args: argparse.Namespace):
    """The :class:`~czyx.server.ServeOptions` the flags ask for."""
    from czyx.inference.batch import BatchOptions
    from czyx.server import ServeOptions

    check_engine_args(args)
    kwargs = engine_kwargs(args, None)
    kwargs.pop("xray", None)
    if args.kv_mb is not None and args.kv_mb <= 0:
        raise ValueError(f"--kv-mb {args.kv_mb} must be positive")
    batch = BatchOptions(
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        step_tokens=args.step_tokens,
        kv_bytes=None if args.kv_mb is None else int(args.kv_mb * 2**20),
        prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
        speculate=speculate_options(args),
    )
    scheduler = None
    if getattr(args, "ray", None) and batch.speculate.enabled:
        raise ValueError("--speculate: not with --ray (the cluster steps without drafts)")
    if getattr(args, "ray", None):  # each version placed over the Ray cluster
        from czyx.cli.commands._ray_run import scheduler_factory

        scheduler = scheduler_factory(args)
    return ServeOptions(
        scheduler=scheduler,
        engine=kwargs,
        hot_profile=args.hot,
        batch=batch,
        chat_template=args.chat_template,
        default_max_tokens=args.default_max_tokens,
        audit=not args.no_audit,
        stream_interval=getattr(args, "stream_interval_ms", 0.0) / 1000.0,
    )


def run(args: argparse.Namespace) -> int:
    """Build the app, then serve it until interrupted."""
    import uvicorn

    from czyx.server import create_app

    if args.host not in LOOPBACK:
        raise ValueError(
            f"--host {args.host}: czyx serve binds a loopback address only; put a TLS proxy "
            "in front of it to reach it from elsewhere"
        )
    options = serve_options(args)
    # This process is the server's: a short GIL switch interval lets the event loop
    # deliver each step's tokens without the batch thread holding it for 5 ms slices.
    sys.setswitchinterval(SWITCH_INTERVAL)
    extra = []
    if args.replicate:
        from czyx.server.replication import routes

        extra = routes(store_dir(args))
    sock = _listen(args.host, args.port)  # a taken port fails here, before models load
    with sock, _ray_connection(args):
        app = create_app(store_dir(args), args.refs, options, extra_routes=extra)
        refs = ", ".join(app.state.czyx.models)
        over = f" over Ray ({args.ray_shape}, {args.ray_nodes} actors)" if args.ray else ""
        host, port = sock.getsockname()[:2]  # (--port 0: the one the system chose)
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        print(f"czyx serve: {refs}{over} on {url}", file=sys.stderr)
        print(f"czyx serve: web playground at {url[: -len('v1')]}", file=sys.stderr)
        # Every request needs a portal token: say how to make one (the first thing a new
        # user's client asks for, as an API key).
        first = shlex.quote(next(iter(app.state.czyx.models), "NAME@VER"))
        where = f" --store {shlex.quote(args.store)}" if args.store else ""
        print(
            "czyx serve: send 'Authorization: Bearer <portal token>'; a token: "
            f"czyx grant {first} --tenant NAME --rights infer{where}",
            file=sys.stderr,
        )
        for ref, served in app.state.czyx.models.items():
            if served.engine.budget_note:
                print(f"czyx serve: {ref}: {served.engine.budget_note}", file=sys.stderr)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` for uvicorn to serve on.

    Raises
    ------
    ValueError
        The address does not resolve, or cannot be bound (a port in use, out of range).
    """
    if not 0 <= port <= 65535:  # (getaddrinfo would take 70000 as 4464)
        raise ValueError(f"--port {port}: not a TCP port (0..65535; 0: any free one)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, OverflowError) as exc:
        raise ValueError(f"--host {host} --port {port}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except (OSError, OverflowError) as exc:
        sock.close()
        why = getattr(exc, "strerror", None) or exc
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def _ray_connection(args: argparse.Namespace):
    """Connected to the ``--ray`` cluster while serving (nothing without ``--ray``)."""
    import contextlib

    if not args.ray:
        return contextlib.nullcontext()
    from czyx.cli.commands._ray_run import ray_connection

    return ray_connection(args)
