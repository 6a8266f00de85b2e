"""``czyx store``: inspect, verify and tidy a store directory.

- ``czyx store info PATH``: published spaces (records, bytes, manifest keys) and tags;
- ``czyx store fsck PATH [--no-data] [--direct]``: verify every block file and
  every extent checksum (exit 1 and one line per problem if any);
- ``czyx store gc PATH [--grace SECONDS]``: remove block files no space refers to;
- ``czyx store migrate PATH``: add index checksums to a store written before them.

PATH defaults to ``--store`` / ``$CZYX_STORE`` / ``./czyx-store`` like every other
command.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``store`` subcommand and its actions."""
    p = subparsers.add_parser("store", help="inspect, verify and tidy a store directory")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    from czyx.cli.commands._storearg import add_store_arg

    info = actions.add_parser("info", help="list spaces and tags")
    info.add_argument("--json", action="store_true", help="one JSON object per space")
    info.set_defaults(func=_info)
    check = actions.add_parser("fsck", help="verify the index, block files and extent checksums")
    check.add_argument("--no-data", action="store_true", help="only check block-file identity")
    check.add_argument("--direct", action="store_true", help="read with O_DIRECT")
    check.set_defaults(func=_fsck)
    gc = actions.add_parser("gc", help="remove unreferenced block files")
    gc.add_argument("--grace", type=float, default=3600.0, help="seconds (default 3600)")
    gc.set_defaults(func=_gc)
    mig = actions.add_parser("migrate", help="add index checksums to an older store")
    mig.set_defaults(func=_migrate)
    for sub in (info, check, gc, mig):
        sub.add_argument("path", nargs="?", help="store directory (default: --store)")
        add_store_arg(sub)


def _path(args: argparse.Namespace) -> str:
    from czyx.cli.commands._storearg import store_dir

    return args.path or store_dir(args)


def _migrate(args: argparse.Namespace) -> int:
    from czyx.store import Store

    with Store.open(_path(args), create=False):
        pass  # a writable open seals every value of a format-1 store
    print(f"{_path(args)}: index checksummed (format 2)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from czyx.store import Store

    with Store.open(_path(args), create=False, readonly=True) as st:
        names: dict[bytes, list[str]] = {}
        for tag, sel in st.tags().items():
            names.setdefault(sel.raw, []).append(tag)
        for sp in st.spaces():
            count, nbytes = st.aggregate(sp)
            manifest = st.manifest(sp)
            tags = ",".join(sorted(names.get(sp.raw, []))) or "-"
            if args.json:
                import json

                row = {"space": sp.hex(), "records": count, "bytes": nbytes}
                row |= {"tags": sorted(names.get(sp.raw, [])), "manifest_keys": sorted(manifest)}
                print(json.dumps(row))
                continue
            print(
                f"{sp.hex()}  records={count}  bytes={nbytes}  tags={tags}  "
                f"manifest={sorted(manifest)}"
            )
    return 0


def _fsck(args: argparse.Namespace) -> int:
    from czyx.store import Store
    from czyx.store.core.fsck import fsck

    with Store.open(_path(args), create=False, readonly=True) as st:
        report = fsck(st, data=not args.no_data, direct=args.direct)
    for line in report.problems:
        print(f"czyx: fsck: {line}")
    print(
        f"{report.spaces} spaces, {report.extents} extents, {report.nbytes} bytes verified, "
        f"{len(report.problems)} problems"
    )
    return 0 if report.ok else 1


def _gc(args: argparse.Namespace) -> int:
    from czyx.store import Store, collect_garbage

    with Store.open(_path(args), create=False) as st:
        removed = collect_garbage(st, grace_s=args.grace)
    for name in removed:
        print(f"removed {name}")
    return 0
