"""``czyx chat NAME@VER``: an interactive terminal chat, streamed, with history.

Against ``--url`` of a running ``czyx serve`` (through the OpenAI client, with
``--portal`` as the bearer token), or, without it, against a local engine: the
same server app started in-process on 127.0.0.1 (so templates, batching and
portal checks are the very code ``czyx serve`` runs) with the engine flags of
``czyx run``. Lines are read from stdin; each answer streams to stdout.
Ctrl-C during an answer stops that generation (the server frees its sequence)
and keeps the partial answer; Ctrl-D (end of input) or ``/exit`` quits;
``/reset`` forgets the history.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from czyx.cli.commands._engineargs import add_engine_args
from czyx.cli.commands._samplingargs import add_penalty_args
from czyx.cli.commands._specargs import add_speculate_args, speculate_options
from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``chat`` subcommand."""
    p = subparsers.add_parser(
        "chat",
        help="chat with a model version in the terminal (local engine or --url of a server)",
        description="Interactive chat: streaming answers, history, Ctrl-C stops a generation.",
    )
    p.add_argument("ref", metavar="NAME@VERSION", help="the model version's tag")
    p.add_argument("--url", help="base URL of a running czyx serve (default: a local engine)")
    p.add_argument(
        "--portal",
        default=os.environ.get("CZYX_PORTAL"),
        help="portal token (default: $CZYX_PORTAL; locally, the owner's)",
    )
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1.0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_penalty_args(p)
    p.add_argument(
        "--chat-template",
        metavar="PATH",
        help="local engine: a checkpoint directory, its tokenizer_config.json or a .jinja "
        "file whose chat template to use (default: the one mounted with the checkpoint)",
    )
    add_store_arg(p)
    add_engine_args(p)
    add_speculate_args(p, served=True)
    p.set_defaults(func=run)


def converse(
    client: Any,
    model: str,
    lines: Iterable[str],
    out: TextIO,
    params: dict[str, Any],
    system: str | None = None,
    err: TextIO = sys.stderr,
) -> list[dict[str, str]]:
    """Run the chat loop over ``lines``; returns the final history.

    Each answer streams to ``out``. A ``KeyboardInterrupt`` while an answer
    streams stops that answer only (its stream is closed, so the server frees
    the sequence); the partial answer stays in the history.
    """
    history: list[dict[str, str]] = []
    if system:
        history.append({"role": "system", "content": system})
    for raw in lines:
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history = history[:1] if system else []
            print("(history cleared)", file=err)
            continue
        history.append({"role": "user", "content": line})
        answer = []
        stream = client.chat.completions.create(
            model=model, messages=history, stream=True, **params
        )
        try:
            for chunk in stream:
                for ch in chunk.choices:
                    piece = ch.delta.content or ""
                    if piece:
                        answer.append(piece)
                        out.write(piece)
                        out.flush()
        except KeyboardInterrupt:
            print("\n(stopped)", file=err)
        finally:
            stream.close()
        out.write("\n")
        out.flush()
        history.append({"role": "assistant", "content": "".join(answer)})
    return history


def _lines(inp: TextIO, err: TextIO) -> Iterable[str]:
    """Lines of ``inp``; an interactive prompt on a terminal, Ctrl-C at the prompt ignored."""
    tty = inp.isatty()
    while True:
        try:
            if tty:
                line = input("> ")
            else:
                line = inp.readline()
                if not line:
                    return
        except EOFError:
            return
        except KeyboardInterrupt:
            print("", file=err)
            continue
        yield line


def run(args: argparse.Namespace) -> int:
    """Connect (or start a local server), then chat until end of input."""
    import openai

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens} must be at least 1")
    params: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
    }
    if args.seed is not None:
        params["seed"] = args.seed
    if args.speculate != "off":  # czyx's request extension (a local server has it as default too)
        from czyx.inference.batch import served_speculation

        # A bad mode, or one the server cannot draft with, fails here, before anything starts.
        served_speculation(speculate_options(args))
        params["extra_body"] = {"speculate": args.speculate, "draft_tokens": args.draft_tokens}
    with contextlib.ExitStack() as stack:
        if args.url:
            url, token = args.url.rstrip("/"), args.portal
            if not token:
                raise ValueError("--url needs --portal (or $CZYX_PORTAL): the bearer token")
        else:
            url, token = stack.enter_context(_local_server(args))
        base = url if url.endswith("/v1") else url + "/v1"
        client = openai.OpenAI(base_url=base, api_key=token, max_retries=0, timeout=600)
        try:
            converse(
                client, args.ref, _lines(sys.stdin, sys.stderr), sys.stdout, params, args.system
            )
        except openai.APIStatusError as exc:
            msg = exc.body.get("message") if isinstance(exc.body, dict) else str(exc)
            raise ValueError(f"chat: the server answered {exc.status_code}: {msg}") from None
        except openai.APIConnectionError as exc:
            raise ValueError(f"chat: cannot reach {base}: {exc}") from None
    return 0


@contextlib.contextmanager
def _local_server(args: argparse.Namespace):
    """The server app over the local store on 127.0.0.1; yields (url, token)."""
    from czyx.cli.commands.serve import serve_options
    from czyx.portals import root_token
    from czyx.server import create_app
    from czyx.server.threaded import serve_in_thread

    ns = argparse.Namespace(**vars(args))
    for key, value in {
        "kv_mb": None,
        "max_batch": 4,
        "max_queue": 4,
        "prefill_chunk": 32,
        "step_tokens": 256,
        "prefix_cache_mb": 32.0,
        "default_max_tokens": args.max_tokens,
        "no_audit": False,
    }.items():
        setattr(ns, key, value)
    app = create_app(store_dir(args), [args.ref], serve_options(ns))
    started = False
    try:
        served = app.state.czyx.models.get(args.ref)
        if served is not None and served.template is None:
            # Said before the first prompt is typed, with this command's own flag.
            raise ValueError(
                f"chat: {args.ref} has no chat template (mounted with neither a "
                "chat_template.jinja nor a tokenizer_config.json chat_template); give one "
                "with --chat-template (a checkpoint directory, its tokenizer_config.json or a "
                ".jinja file), or use czyx run for plain text"
            )
        token = args.portal or root_token(app.state.czyx.store)
        with serve_in_thread(app) as url:
            started = True  # from here on the app's shutdown closes its state
            yield url, token
    finally:
        if not started:
            app.state.czyx.close()
