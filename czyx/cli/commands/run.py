"""``czyx run NAME@VERSION --prompt TEXT``: generate text with a mounted model version.

The model is opened only through a portal carrying the ``infer`` right
(:class:`czyx.inference.OpenedModel`: the portal's checked view and the store's
consumer, with O_DIRECT expert reads; no ``--portal`` means the store owner's
root portal); the trunk is loaded resident (or, with ``--trunk-window K``,
only K layers' big matrices at a time, the next read while one computes) and routed experts
stream through the slot cache sized by ``--cache-mb`` or ``--cache-fraction``
(default: every expert resident), read by the transfer planner
(``--io`` path, ``--readers`` threads, look-ahead prefetch unless
``--no-prefetch``; ``--xray FILE`` writes every transfer's X-Ray report). The
text streams to stdout; the figures
(tokens/s of prefill and decode, hit rate, bytes read per token, exposed I/O
wait) follow on stderr so the text stays clean for pipes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from czyx.cli.commands._engineargs import add_engine_args, check_engine_args, parse_class_range
from czyx.cli.commands._engineargs import engine_options as engine_options  # re-exported
from czyx.cli.commands._engineargs import stream_options as _stream_options
from czyx.cli.commands._samplingargs import add_penalty_args
from czyx.cli.commands._specargs import add_speculate_args, speculate_options
from czyx.cli.commands._storearg import add_store_arg, store_dir
from czyx.inference.opened import OpenedModel
from czyx.store.interfaces import StoreInterface


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand."""
    p = subparsers.add_parser(
        "run",
        help="generate text with a mounted MoE model",
        description="Generate text with a mounted model version, opened through a portal.",
    )
    p.add_argument("ref", metavar="NAME@VERSION", help="the model version's tag")
    p.add_argument(
        "prompt_arg", nargs="?", metavar="PROMPT", default=None, help="the text to continue"
    )
    p.add_argument(
        "-p",
        "--prompt",
        default=None,
        help="the text to continue ('-': read it from stdin); or give it positionally",
    )
    p.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE (UTF-8)")
    p.add_argument(
        "--portal",
        default=os.environ.get("CZYX_PORTAL"),
        help="portal token with the infer right (default: $CZYX_PORTAL, else the owner's)",
    )
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1.0: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_penalty_args(p)
    add_engine_args(p)
    add_speculate_args(p)
    p.add_argument(
        "--xray", metavar="FILE", help="write the X-Ray transfer report (JSON) and print a summary"
    )
    add_store_arg(p)
    p.add_argument(
        "--session",
        metavar="NAME",
        help="continue (or start) saved session NAME: its KV cache is loaded, not recomputed; "
        "the prompt is appended and the new state saved (inference.sessions)",
    )
    p.add_argument(
        "--tenant", help="tenant the session belongs to (default: the portal's, or 'owner')"
    )
    from czyx.cli.commands._ray_run import add_args as _add_ray_args

    _add_ray_args(p)
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from exactly one of PROMPT, ``--prompt`` (``-``: stdin), ``--prompt-file``.

    Raises
    ------
    ValueError
        None or several given, or text that is not valid UTF-8 (a command-line
        argument with undecodable bytes arrives as lone surrogates).
    """
    given = [
        (name, v)
        for name, v in (
            ("PROMPT", args.prompt_arg),
            ("--prompt", args.prompt),
            ("--prompt-file", args.prompt_file),
        )
        if v is not None
    ]
    if len(given) != 1:
        names = " and ".join(n for n, _ in given) if given else "none"
        raise ValueError(f"give the prompt once: PROMPT, --prompt or --prompt-file ({names})")
    name, value = given[0]
    if name == "--prompt-file" or (value == "-" and name in ("--prompt", "PROMPT")):
        if name == "--prompt-file":
            with open(value, "rb") as fh:
                data = fh.read(64 << 20)
        else:
            data = sys.stdin.buffer.read(64 << 20)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}: not valid UTF-8 (byte {exc.start})") from None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name}: not valid UTF-8 (check the terminal's encoding)") from None
    return value


def _check_xray_path(path: str | None) -> None:
    """Refuse an unwritable ``--xray`` path before generating, not after."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"--xray {path!r}: cannot write a file there")


def fit_context(n_prompt: int, max_tokens: int, n_positions: int | None) -> int:
    """The tokens to generate within the model's positions (message on stderr if cut).

    Raises
    ------
    ValueError
        The prompt alone fills the model's context.
    """
    if not n_positions:
        return max_tokens
    if n_prompt >= n_positions:
        raise ValueError(
            f"the prompt is {n_prompt} tokens; the model's context holds {n_positions}"
        )
    if n_prompt + max_tokens > n_positions:
        room = n_positions - n_prompt
        print(
            f"czyx: --max-tokens {max_tokens} cut to {room}: the model's context holds "
            f"{n_positions} positions and the prompt uses {n_prompt}",
            file=sys.stderr,
        )
        return room
    return max_tokens


def _write_xray(args: argparse.Namespace, engine, xray, stats) -> None:
    """Finish the reads in flight, write the X-Ray JSON and print its table on stderr."""
    from czyx.inference.xray import table

    engine.cache.planner.drain()
    extra = {
        "model": args.ref,
        "speculate": args.speculate,
        "budget_bytes": engine.budget_bytes,
        "expert_bytes": engine.expert_bytes,
        "prefetch": not args.no_prefetch,
        "lookahead": args.lookahead,
        "early": not args.no_early,
        "tiers": args.tiers,
    }
    window = engine.trunk_window_stats()
    if window is not None:
        extra["trunk_window"] = dataclasses.asdict(window)
    report = xray.report(
        engine.cache,
        tokens=stats.prompt_tokens + stats.decode_steps,
        # With a trunk window: the small per-layer tensors plus the window's peak.
        trunk_bytes=engine.model.trunk_nbytes(),
        extra=extra,
        speculation=stats.draft_steps if args.speculate != "off" else None,
    )
    path = xray.write_json(args.xray, report)
    print(table(report), file=sys.stderr)
    print(f"x-ray: {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Open, generate, stream, report."""
    from czyx.inference.engine import Engine
    from czyx.inference.generate import generate
    from czyx.inference.profile import RoutingProfile
    from czyx.inference.sampling import SamplingParams
    from czyx.inference.tokenizer import tokenizer_for

    if getattr(args, "ray", None):
        from czyx.cli.commands._ray_run import run_ray

        if speculate_options(args).enabled:
            raise ValueError("--speculate: not with --ray (the cluster decodes without drafts)")

        return run_ray(args)
    sampling = SamplingParams(
        args.temperature,
        args.top_k,
        args.top_p,
        args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    pin = parse_class_range(args.pin_classes)
    speculate = speculate_options(args)
    if speculate.enabled and args.session:
        raise ValueError("--speculate: not with --session (a session decodes without drafts)")
    if args.max_tokens < 0:
        raise ValueError(f"--max-tokens {args.max_tokens} is negative")
    args.prompt = read_prompt(args)
    _check_xray_path(args.xray)
    check_engine_args(args)
    windowed = args.trunk_window is not None
    opened = OpenedModel(
        store_dir(args), args.ref, args.portal, lazy_trunk=windowed, tiers=args.tiers
    )
    consumer = opened.consumer
    try:
        cache_bytes = None if args.cache_mb is None else int(args.cache_mb * 2**20)
        hot = None
        if args.hot:
            info = consumer.info
            hot = RoutingProfile.load(args.hot, info.n_layers, info.n_experts).hot_list()
        options, xray = _stream_options(args)
        if args.lookahead > consumer.info.n_layers:
            raise ValueError(
                f"--lookahead {args.lookahead}: the model has {consumer.info.n_layers} layers"
            )
        engine = Engine(
            consumer,
            cache_bytes=cache_bytes,
            cache_fraction=args.cache_fraction,
            options=options,
            hot=hot,
            pin_classes=pin,
            xray=xray,
            trunk_window=args.trunk_window,
            threads=args.threads,
        )
        tokenizer = tokenizer_for(consumer, engine.cfg.vocab_size)
        if engine.budget_note:
            print(f"czyx run: {engine.budget_note}", file=sys.stderr)

        def emit(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        if args.session:
            _run_session(args, opened.store, engine, tokenizer, sampling, emit)
            if engine.route_restriction:
                print(engine.route_restriction, file=sys.stderr)
            if engine.trunk_window_stats() is not None:
                print(engine.trunk_window_stats().summary(), file=sys.stderr)
            engine.close()
            return 0
        n_positions = consumer.info.config.get("max_position_embeddings")
        n_prompt = len(tokenizer.encode(args.prompt))
        max_tokens = fit_context(n_prompt, args.max_tokens, n_positions)
        from czyx.inference.speculative import Speculator

        spec = Speculator.open(speculate, engine, opened.store, args.portal)
        try:
            out = generate(
                engine, tokenizer, args.prompt, max_tokens, sampling, on_text=emit, speculate=spec
            )
        finally:
            if spec is not None:
                spec.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        budget_mb = engine.cache.n_slots * engine.cache.slot_nbytes / 2**20
        print(
            f"cache: {budget_mb:.1f} MiB of {engine.expert_bytes / 2**20:.1f} MiB experts "
            f"({engine.cache.n_slots} slots), tokenizer: {tokenizer.name}",
            file=sys.stderr,
        )
        print(out.stats.summary(), file=sys.stderr)
        if engine.route_restriction:
            print(engine.route_restriction, file=sys.stderr)
        window = engine.trunk_window_stats()
        if window is not None:
            print(window.summary(), file=sys.stderr)
        if xray is not None:
            _write_xray(args, engine, xray, out.stats)
        engine.close()
    finally:
        opened.close()
    return 0


def _run_session(
    args: argparse.Namespace,
    store: StoreInterface,
    engine: object,
    tokenizer: object,
    sampling: object,
    emit: object,
) -> None:
    """``--session NAME``: :func:`inference.sessions.run_with_session`, then its figures."""
    from czyx.inference.sampling import SamplingParams
    from czyx.inference.sessions import SessionStore, run_with_session
    from czyx.inference.sessions.errors import SessionNotFoundError

    sessions = SessionStore.open(store, args.portal, tenant=args.tenant)
    try:
        held = sessions.info(args.session).length
    except SessionNotFoundError:
        held = 0
    n_positions = engine.consumer.info.config.get("max_position_embeddings")
    n_prompt = len(tokenizer.encode(args.prompt))
    try:
        args.max_tokens = fit_context(held + n_prompt, args.max_tokens, n_positions)
    except ValueError:
        raise ValueError(
            f"session {args.session!r} holds {held} tokens and the prompt adds {n_prompt}; "
            f"the model's context holds {n_positions}: fork it shorter (czyx sessions fork "
            "--at N) or start a new session"
        ) from None
    # Sampling flags left at their defaults keep a resumed session's own sampler
    # (parameters and RNG state), so the continuation is exact.
    chosen = None if sampling == SamplingParams() else sampling
    r = run_with_session(
        engine, tokenizer, sessions, args.session, args.prompt, args.max_tokens, chosen, emit
    )
    sys.stdout.write("\n")
    sys.stdout.flush()
    how = "resumed" if r.resumed else "started"
    print(
        f"session {r.info.name}@{r.info.version} ({how}): {r.reused} tokens restored in "
        f"{r.restore_seconds * 1e3:.1f} ms, {r.prefilled} prefilled in "
        f"{r.prefill_seconds * 1e3:.1f} ms, {len(r.tokens)} generated in "
        f"{r.decode_seconds * 1e3:.1f} ms; {r.info.length} tokens saved",
        file=sys.stderr,
    )
