"""The engine options ``czyx run``, ``czyx serve`` and ``czyx chat`` share.

One place defines the flags (cache budget, eviction policy, pinned classes, hot
list, I/O path, reader threads, prefetch, trunk window) and turns them into
:class:`~czyx.inference.engine.Engine` keyword arguments, so the commands cannot
drift apart.
"""

from __future__ import annotations

import argparse
from typing import Any

from czyx.inference.memory import MEMORY_SHARE
from czyx.inference.options import DEFAULT_OPTIONS as DEFAULTS
from czyx.inference.options import EngineOptions


def add_engine_args(p: argparse.ArgumentParser, defaults: EngineOptions = DEFAULTS) -> None:
    """Add the engine flags of ``czyx run`` to ``p``, defaulting to ``defaults``' fields
    (``czyx serve`` passes :data:`~czyx.inference.options.BATCHED_OPTIONS`)."""
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--cache-mb",
        type=float,
        help="expert slot budget in MiB (default: every expert, within "
        f"{MEMORY_SHARE * 100:.0f}%% of the memory this process may take)",
    )
    budget.add_argument(
        "--cache-fraction", type=float, help="expert slot budget as a fraction of expert bytes"
    )
    p.add_argument(
        "--policy",
        choices=["lru", "lfu", "decay", "slru", "cyclic", "nextuse"],
        default=defaults.policy,
        help=f"expert eviction policy (default {defaults.policy}; decay: decaying frequency, "
        "half-life 32 tokens; slru: segmented LRU, 80%% protected; cyclic: decaying frequency "
        "over forward steps divided by how many layers ahead the expert's layer comes; "
        "nextuse: the farthest expected next use, decay's rate plus the layer cycle)",
    )
    p.add_argument(
        "--pin-classes",
        metavar="LO-HI",
        help="pin the experts with router bytes LO..HI (inclusive) in every layer",
    )
    p.add_argument(
        "--hot", metavar="PROFILE", help="routing profile (czyx profile) whose hot list to prewarm"
    )
    p.add_argument(
        "--io",
        default="auto",
        choices=["auto", "pread", "mmap", "direct", "io_uring"],
        help="expert I/O path (auto: the one `czyx bench io` measured fastest, else direct for "
        "a model bigger than the memory left, where the filesystem allows O_DIRECT, else pread)",
    )
    p.add_argument(
        "--readers",
        type=int,
        default=defaults.readers,
        help=f"expert reader threads (default {defaults.readers})",
    )
    prefetch = p.add_mutually_exclusive_group()
    prefetch.add_argument(
        "--no-prefetch",
        dest="no_prefetch",
        action="store_true",
        default=not defaults.prefetch,
        help="no look-ahead: read experts on demand only"
        + ("" if defaults.prefetch else " (the default here)"),
    )
    prefetch.add_argument(
        "--prefetch",
        dest="no_prefetch",
        action="store_false",
        help="look-ahead expert prefetch" + (" (the default)" if defaults.prefetch else ""),
    )
    p.add_argument(
        "--prefetch-evicts",
        action="store_true",
        default=defaults.prefetch_evicts,
        help="a predicted read may evict a resident expert (default: predictions only fill "
        "free slots)",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        default=defaults.lookahead,
        help=f"sparse layers predicted ahead (default {defaults.lookahead}; 0: early routing "
        "alone)",
    )
    p.add_argument(
        "--no-early",
        action="store_true",
        help="no early routing: predict a layer's experts by look-ahead only, not also from "
        "the residual stream entering it",
    )
    p.add_argument(
        "--width",
        "--prefetch-width",
        dest="width",
        type=int,
        default=defaults.width,
        help="predicted experts read per token and layer (default: top-k; --prefetch-width "
        "is its old spelling)",
    )
    p.add_argument(
        "--tiers",
        metavar="HIGH,LOW[:FRACTION]",
        default=defaults.tiers,
        help="per-expert precision tiers (off by default; changes the outputs): run the "
        "versions NAME@HIGH (the one named) and NAME@LOW of the same model together, the "
        "--hot profile's most used experts read at HIGH until their slots fill FRACTION of "
        "the budget (default 0.5), every other expert at LOW (e.g. q4,q2)",
    )
    p.add_argument(
        "--trunk-window",
        type=int,
        metavar="K",
        default=None,
        help="hold at most K layers' trunk matrices, reading the next layer while one "
        "computes (for a trunk that does not fit memory; default: whole trunk resident)",
    )
    p.add_argument(
        "--threads",
        "-t",
        type=int,
        default=None,
        metavar="N",
        help="threads of the engine's kernels (default: the cores this process may use); "
        "the output does not depend on N",
    )


def parse_class_range(text: str | None) -> tuple[int, int] | None:
    """``"LO-HI"`` (inclusive, decimal or 0x hex) as a half-open ``(lo, hi + 1)``."""
    if text is None:
        return None
    try:
        lo_s, _, hi_s = text.partition("-")
        lo, hi = int(lo_s, 0), int(hi_s or lo_s, 0)
    except ValueError:
        raise ValueError(f"--pin-classes {text!r} is not LO-HI (e.g. 0-15 or 0x20-0x2f)") from None
    if not 0 <= lo <= hi <= 255:
        raise ValueError(f"--pin-classes {text!r} must satisfy 0 <= LO <= HI <= 255")
    return lo, hi + 1


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The :class:`EngineOptions` the flags ask for (each flag defaults to its field)."""
    if args.readers < 1:
        raise ValueError(f"--readers {args.readers} must be at least 1")
    if args.lookahead < 0 or (args.lookahead == 0 and args.no_early):
        raise ValueError(
            f"--lookahead {args.lookahead}: at least 1, or 0 with early routing (no --no-early)"
        )
    return EngineOptions(
        policy=args.policy,
        io=None if args.io == "auto" else args.io,  # auto: the engine decides
        readers=args.readers,
        prefetch=not args.no_prefetch,
        prefetch_evicts=args.prefetch_evicts,
        lookahead=args.lookahead,
        width=args.width,
        early=not args.no_early,
        tiers=args.tiers,
    )


def stream_options(args: argparse.Namespace) -> tuple[EngineOptions, Any]:
    """The engine options and X-Ray collector (when ``args.xray``) the flags ask for."""
    from czyx.inference.xray import XRay
    from czyx.store.io.iopaths import load_io_config

    options = engine_options(args)
    xray = None
    if getattr(args, "xray", None):
        cfg = load_io_config()
        xray = XRay(
            io_path=options.io or "",  # auto: the cache records the path the engine chose
            readers=options.readers,
            device_baseline=cfg.bandwidth if cfg else None,
        )
    return options, xray


def check_engine_args(args: argparse.Namespace) -> None:
    """Fail closed on engine flags out of range (before any store is opened)."""
    if args.trunk_window is not None and args.trunk_window < 1:
        raise ValueError(f"--trunk-window {args.trunk_window} must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads} must be at least 1")
    parse_class_range(args.pin_classes)
    if args.tiers is not None:
        from czyx.inference.tiers import TierSpec, TierSpecError

        TierSpec.parse(args.tiers)
        if not args.hot:
            raise TierSpecError(
                f"--tiers {args.tiers}: needs --hot PROFILE (the measured usage that picks the "
                "high-precision experts)"
            )


def engine_kwargs(args: argparse.Namespace, consumer: Any) -> dict[str, Any]:
    """:class:`~czyx.inference.engine.Engine` keyword arguments from the flags.

    ``consumer`` is the opened version (its shape reads the ``--hot`` profile); None
    leaves ``hot`` unset (``czyx serve`` loads the profile per version).
    """
    from czyx.inference.profile import RoutingProfile

    check_engine_args(args)
    hot = None
    if args.hot and consumer is not None:
        info = consumer.info
        hot = RoutingProfile.load(args.hot, info.n_layers, info.n_experts).hot_list()
    options, xray = stream_options(args)
    return {
        "cache_bytes": None if args.cache_mb is None else int(args.cache_mb * 2**20),
        "cache_fraction": args.cache_fraction,
        "options": options,
        "hot": hot,
        "pin_classes": parse_class_range(args.pin_classes),
        "xray": xray,
        "trunk_window": args.trunk_window,
        "threads": args.threads,
    }
