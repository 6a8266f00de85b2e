"""``czyx sessions``: list saved sessions with their lineage, diff, fork, show versions.

Usage::

    czyx sessions [--store DIR] [--tenant T]          # list (forks under their parents)
    czyx sessions diff A B [--tenant T]               # where two histories diverge
    czyx sessions fork PARENT CHILD [--at N]          # start CHILD from PARENT
    czyx sessions show NAME                           # every saved version of NAME
    czyx sessions rm NAME                             # untag every version of NAME
    czyx sessions --json                              # the listing as JSON lines

The store defaults to ``$CZYX_STORE`` or ``./czyx-store``. ``diff``, ``fork``
and ``show`` act through a portal: ``--portal TOKEN`` (default
``$CZYX_PORTAL``, else the owner's root portal of a store you own), for the
portal's tenant, or for ``--tenant`` / ``$CZYX_TENANT`` when the portal is the
owner's (else for the owner's own sessions, tenant ``owner``). Listing reads
only the catalog (names, sizes, lineage), never a session's bytes; without
``--tenant`` it shows every tenant's sessions.
"""

from __future__ import annotations

import argparse
import os

from czyx.cli.commands._storearg import DEFAULT_STORE, store_dir


def _store_arg(p: argparse.ArgumentParser, top: bool) -> None:
    # Sub-actions suppress their default so `czyx sessions --store X diff ...` keeps X.
    p.add_argument(
        "--store",
        default=None if top else argparse.SUPPRESS,
        metavar="DIR",
        help=f"store directory (default: $CZYX_STORE or ./{DEFAULT_STORE})",
    )


def _tenant_arg(p: argparse.ArgumentParser, top: bool) -> None:
    p.add_argument(
        "--tenant",
        default=None if top else argparse.SUPPRESS,
        help="act for (list: only show) this tenant (default: the portal's, or $CZYX_TENANT)",
    )


def _portal_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--portal",
        default=os.environ.get("CZYX_PORTAL"),
        help="portal token (default: $CZYX_PORTAL, else the store owner's root portal)",
    )


def _sessions(args: argparse.Namespace, st):
    from czyx.inference.sessions.store import SessionStore

    tenant = args.tenant or os.environ.get("CZYX_TENANT") or None
    return SessionStore.open(st, args.portal, tenant=tenant)


def _action_args(q: argparse.ArgumentParser) -> None:
    """The store, tenant and portal options every session action takes."""
    _store_arg(q, False)
    _tenant_arg(q, False)
    _portal_arg(q)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sessions`` subcommand and its actions."""
    p = subparsers.add_parser(
        "sessions",
        help="list, diff, fork saved sessions",
        description="Saved sessions (KV cache + history + sampler) with their lineage.",
    )
    _store_arg(p, True)
    _tenant_arg(p, True)
    p.add_argument("--json", action="store_true", help="one JSON object per session")
    p.set_defaults(func=_list)
    sub = p.add_subparsers(dest="sessions_command", metavar="ACTION")

    q = sub.add_parser("list", help="list sessions, forks under their parents")
    _store_arg(q, False)
    _tenant_arg(q, False)
    q.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    q.set_defaults(func=_list)

    q = sub.add_parser("rm", help="remove a session (every version's tag)")
    q.add_argument("name")
    _action_args(q)
    q.set_defaults(func=_rm)

    q = sub.add_parser("diff", help="show where two session histories diverge")
    q.add_argument("a")
    q.add_argument("b")
    q.add_argument("--context", type=int, default=8, help="tokens shown after the divergence")
    _action_args(q)
    q.set_defaults(func=_diff)

    q = sub.add_parser("fork", help="start a session from another one's head")
    q.add_argument("parent")
    q.add_argument("child")
    q.add_argument("--at", type=int, default=None, help="keep only the first N tokens")
    _action_args(q)
    q.set_defaults(func=_fork)

    q = sub.add_parser("show", help="every saved version of a session")
    q.add_argument("name")
    _action_args(q)
    q.set_defaults(func=_show)


def _open(args: argparse.Namespace, readonly: bool):
    from czyx.store import Store

    return Store.open(store_dir(args), create=False, readonly=readonly)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_listing(infos: list) -> list[str]:
    """Lines of the listing: each fork indented under its parent (orphans at top level)."""
    by_name = {i.name: i for i in infos}
    children: dict[str | None, list] = {}
    for i in infos:
        parent = i.parent.rsplit("@", 1)[0] if i.parent else None
        children.setdefault(parent if parent in by_name else None, []).append(i)
    lines = [f"{'NAME':<28} {'VER':>4} {'TOKENS':>7} {'SIZE':>10}  {'TENANT':<12} MODEL"]

    def walk(parent: str | None, depth: int, seen: set[str]) -> None:
        for i in sorted(children.get(parent, []), key=lambda x: x.name):
            if i.name in seen:
                continue
            seen.add(i.name)
            label = ("  " * (depth - 1) + "└─ " if depth else "") + i.name
            fork = f"  fork of {i.parent} at {i.fork_at}" if i.parent else ""
            lines.append(
                f"{label:<28} {'v' + str(i.version):>4} {i.length:>7} {_size(i.nbytes):>10}  "
                f"{i.tenant:<12} {i.model.hex()[:12]}{fork}"
            )
            walk(i.name, depth + 1, seen)

    walk(None, 0, set())
    return lines


def _list(args: argparse.Namespace) -> int:
    from czyx.inference.sessions.store import list_sessions

    with _open(args, readonly=True) as st:
        infos = list_sessions(st, args.tenant)
    if getattr(args, "json", False):
        import json

        for i in infos:
            print(
                json.dumps(
                    {
                        "name": i.name,
                        "version": i.version,
                        "tokens": i.length,
                        "bytes": i.nbytes,
                        "tenant": i.tenant,
                        "model": i.model.hex(),
                        "parent": i.parent,
                        "fork_at": i.fork_at,
                    }
                )
            )
        return 0
    if not infos:
        print("no saved sessions")
        return 0
    print("\n".join(format_listing(infos)))
    return 0


def _diff(args: argparse.Namespace) -> int:
    with _open(args, readonly=False) as st:  # portal opens are audited: writable
        d = _sessions(args, st).diff(args.a, args.b, args.context)

    def tail(toks: tuple[int, ...], length: int) -> str:
        if not toks:
            return "(ends here)"
        more = " ..." if d.common + len(toks) < length else ""
        return " ".join(str(t) for t in toks) + more

    print(f"a: {d.a} ({d.a_length} tokens)")
    print(f"b: {d.b} ({d.b_length} tokens)")
    if d.identical:
        print(f"identical histories ({d.common} tokens)")
        return 0
    print(f"common prefix: {d.common} tokens; they diverge at position {d.common}")
    print(f"a continues: {tail(d.a_next, d.a_length)}")
    print(f"b continues: {tail(d.b_next, d.b_length)}")
    return 0


def _fork(args: argparse.Namespace) -> int:
    with _open(args, readonly=False) as st:
        info = _sessions(args, st).fork(args.parent, args.child, at=args.at)
    print(f"{info.name}@{info.version}: fork of {info.parent} at {info.fork_at} tokens")
    return 0


def _show(args: argparse.Namespace) -> int:
    with _open(args, readonly=False) as st:
        ss = _sessions(args, st)
        ss.info(args.name)  # SessionNotFoundError (exit 1) for a name never saved
        lineage = ss.lineage(args.name)
        print(f"{args.name}" + (f" (lineage: {' <- '.join(lineage)})" if len(lineage) > 1 else ""))
        for v, _ in ss.versions(args.name):
            i = ss.info(args.name, v)
            print(f"  v{v}: {i.length} tokens, {_size(i.nbytes)}, space {i.space.hex()[:16]}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    """Untag every version of a session (after the portal and tenant checks)."""
    with _open(args, readonly=False) as st:
        ss = _sessions(args, st)
        ss.info(args.name)  # not found / wrong tenant: refused before anything changes
        versions = ss.versions(args.name)
        for v, _ in versions:
            st.remove_tag(f"session:{args.name}@{v:08d}")
        st.audit("session.remove", name=args.name, versions=len(versions), tenant=ss.tenant)
    print(
        f"removed session {args.name} ({len(versions)} versions untagged; their spaces are "
        "kept while a fork or prefix entry may still refer to them)"
    )
    return 0
