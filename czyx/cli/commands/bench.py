"""``czyx bench io``: measure the I/O paths here and record the winner for the engine.

Reads a scratch file (default 256 MiB, in the directory given, which should
be on the filesystem the store lives on) cold, through every available
path, in engine-sized requests; prints each path's median bandwidth as a
ratio against buffered ``pread`` measured in the same run; and saves the
fastest in the I/O config (``$CZYX_IO_CONFIG`` or ``~/.config/czyx/io.json``)
that ``czyx run`` reads. ``--use PATH`` records a path without measuring.
"""

from __future__ import annotations

import argparse
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` (with the ``io`` target) to the CLI."""
    p = subparsers.add_parser("bench", help="measure this machine (I/O paths)")
    sub = p.add_subparsers(dest="target", metavar="TARGET")
    io = sub.add_parser("io", help="measure the I/O paths and record the fastest")
    io.add_argument("--dir", default=".", help="where to put the scratch file (default: .)")
    io.add_argument("--size-mib", type=int, default=256, help="scratch file size (MiB)")
    io.add_argument("--block-kib", type=int, default=1024, help="request size (KiB)")
    io.add_argument(
        "--readers",
        "--threads",
        dest="readers",
        type=int,
        default=1,
        help="reader threads (--threads is its old spelling)",
    )
    io.add_argument("--queue-depth", type=int, default=8, help="io_uring queue depth")
    io.add_argument("--repeats", type=int, default=3, help="repeats per path (median)")
    io.add_argument("--warm", action="store_true", help="measure with the page cache warm")
    io.add_argument("--paths", default="", help="comma-separated subset of paths")
    io.add_argument("--config", default=None, help="config file to write")
    io.add_argument("--no-save", action="store_true", help="do not record the winner")
    io.add_argument("--use", default=None, help="record this path without measuring")
    io.set_defaults(func=run_io)
    p.set_defaults(func=lambda a: p.print_help() or 2)


def run_io(args: argparse.Namespace) -> int:
    """The ``czyx bench io`` command."""
    from czyx.store.io import iobench
    from czyx.store.io import iopaths as iop

    avail = iop.available_paths()
    desc = iobench.machine_description(args.dir)
    machine = "; ".join(f"{k}: {v}" for k, v in desc.items())
    unavailable = {k: v for k, v in avail.items() if v != "available"}
    if args.use:
        if args.use not in iop.PATHS:
            raise ValueError(f"--use {args.use!r}: not one of {iop.PATHS}")
        if args.use in unavailable:
            raise iop.IOPathUnavailableError(f"{args.use}: {unavailable[args.use]}")
        cfg = iop.IOConfig(args.use, 0.0, 0, {}, unavailable, machine)
        print(f"recorded {args.use} (not measured) in {iop.save_io_config(cfg, args.config)}")
        return 0
    wanted = [p.strip() for p in args.paths.split(",") if p.strip()] or list(iop.PATHS)
    for w in wanted:
        if w not in iop.PATHS:
            raise ValueError(f"--paths: {w!r} is not one of {iop.PATHS}")
    for k, why in unavailable.items():
        print(f"{k:9s} unavailable: {why}")
    block = args.block_kib << 10
    scratch = os.path.join(args.dir, f".czyx-bench-io-{os.getpid()}.tmp")
    results = {}
    try:
        iobench.make_file(scratch, args.size_mib << 20)
        for k in wanted:
            if k in unavailable:
                continue
            results[k] = iobench.measure(
                k,
                scratch,
                block=block,
                threads=args.readers,
                queue_depth=args.queue_depth,
                cold=not args.warm,
                repeats=args.repeats,
            )
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    base = results.get("pread")
    print(
        f"{'path':9s} {'median':>11s} {'vs pread':>9s} {'p50 us':>8s} {'p99 us':>8s}  "
        f"({args.size_mib} MiB, {args.block_kib} KiB requests, {args.readers} thread(s), "
        f"{'warm' if args.warm else 'cold'})"
    )
    for k, m in results.items():
        ratio = f"{m.bandwidth / base.bandwidth:8.2f}x" if base else "        -"
        print(
            f"{k:9s} {m.bandwidth / 1e9:7.2f} GB/s {ratio} {m.p50_us:8.0f} {m.p99_us:8.0f}"
            + (f"  qd={m.queue_depth}" if m.queue_depth > 1 else "")
        )
    if not results:
        raise iop.IOPathUnavailableError("no I/O path could be measured")
    best = max(results.values(), key=lambda m: m.bandwidth)
    print(f"fastest: {best.path}")
    if not args.no_save:
        cfg = iop.IOConfig(
            best.path,
            best.bandwidth,
            block,
            {k: m.bandwidth for k, m in results.items()},
            unavailable,
            machine,
        )
        print(f"recorded in {iop.save_io_config(cfg, args.config)}")
    return 0
