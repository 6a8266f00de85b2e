"""Adversarial inputs shared by the hardening tests and ``bench/adversarial.py``.

Each generator yields :class:`Attack` cases: a name and a function that runs the
attack and returns its :class:`Outcome`. An outcome is ``refused`` (a
:class:`czyx.errors.CzyxError` subclass was raised, the one acceptable result),
``crashed`` (any other exception: an untyped failure) or ``silent`` (the attack
was accepted: the damaged input was computed with or exported). The tests assert
every case is refused; the bench script counts them per class for
``bench/HARDENING.md``. Keeping both on one list means the report counts exactly
what the tests check.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from czyx.errors import CzyxError


@dataclass(frozen=True)
class Outcome:
    """How one attack ended: ``kind`` is ``refused``, ``crashed`` or ``silent``."""

    kind: str
    detail: str


@dataclass(frozen=True)
class Attack:
    """One adversarial case: ``run()`` performs it and classifies the result."""

    name: str
    run: Callable[[], Outcome]


def classify(fn: Callable[[], object]) -> Outcome:
    """Run ``fn``: a typed czyx error is ``refused``, another exception ``crashed``,
    a normal return ``silent``."""
    try:
        fn()
    except CzyxError as exc:
        return Outcome("refused", f"{type(exc).__name__}: {exc}"[:200])
    except Exception as exc:
        return Outcome("crashed", f"{type(exc).__name__}: {exc}"[:200])
    return Outcome("silent", "accepted")


# -- the index (LMDB) -----------------------------------------------------------------

INDEX_DBS = ("records", "spaces", "tags", "portals", "edges", "audit", "meta")


def build_index_store(root: pathlib.Path) -> pathlib.Path:
    """A small store holding every kind of index value: a mounted tiny model (manifests
    with its config, extents, tags), a portal with its audit trail, and an edge."""
    from czyx.portals.model import grant_model
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.testing.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("mixtral", root / "ckpt", num_hidden_layers=1)
    path = root / "store"
    with Store.open(path) as st:
        res = mount(st, ckpt, "m@1")
        grant_model(st, res.selector, tenant="alice", classes="0-1", rights="infer")
        st.put_edge(b"\xff" + b"e" * 8, {"to": "m@1"})
    return path


def read_everything(path: pathlib.Path) -> None:
    """Read every index value through the public API, as a consumer and export would."""
    from czyx.store import Store

    with Store.open(path, readonly=True) as st:
        for sp in st.spaces():
            st.space_info(sp)
            list(st.scan(sp))
        st.tags()
        list(st.portal_descriptors())
        list(st.edges())
        list(st.audit_log())


def _raw_items(path: pathlib.Path) -> list[tuple[str, bytes, bytes]]:
    import lmdb

    env = lmdb.open(str(path / "index"), max_dbs=16, readonly=True, lock=False)
    try:
        out = []
        with env.begin() as txn:
            for name in INDEX_DBS:
                if txn.get(name.encode()) is None:
                    continue  # (a format-1 store has no meta database)
                db = env.open_db(name.encode(), txn=txn, create=False)
                out += [(name, k, v) for k, v in txn.cursor(db=db)]
        return out
    finally:
        env.close()


def _raw_replace(path: pathlib.Path, name: str, old: tuple, new: tuple) -> None:
    import lmdb

    env = lmdb.open(str(path / "index"), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(name.encode(), txn=txn, create=False)
            txn.delete(old[0], db=db)
            txn.put(new[0], new[1], db=db)
    finally:
        env.close()


def index_bitflips(path: pathlib.Path, per_value: int = 6) -> Iterator[Attack]:
    """One bit flipped in index values (several positions each) and in their keys.

    Each attack damages the store at ``path``, checks that reading it through the
    public API is refused *and* that ``fsck`` reports it, then restores the value.
    """
    from czyx.store import Store
    from czyx.store.core.fsck import fsck

    for name, key, value in _raw_items(path):
        positions = sorted(
            p for p in {0, 1, 8, 9, len(value) // 2, len(value) - 1} if 0 <= p < len(value)
        )[:per_value]
        variants = [(key, _flip(value, p), f"value byte {p}") for p in positions]
        if name != "meta":
            variants.append((_flip(key, len(key) - 1), value, "key last byte"))
        for new_key, new_value, what in variants:

            def run(name=name, key=key, value=value, nk=new_key, nv=new_value) -> Outcome:
                _raw_replace(path, name, (key, value), (nk, nv))
                try:
                    out = classify(lambda: read_everything(path))
                    if out.kind == "refused":
                        found = []

                        def check() -> None:
                            with Store.open(path) as st:
                                found.append(not fsck(st, data=False).ok)

                        after = classify(check)
                        if after.kind == "crashed":
                            out = after
                        elif after.kind == "silent" and not found[0]:
                            out = Outcome("silent", "read refused but fsck found nothing")
                    return out
                finally:
                    _raw_replace(path, name, (nk, nv), (key, value))

            yield Attack(f"index {name} {key[:6].hex()}.. {what}", run)


def _flip(b: bytes, pos: int) -> bytes:
    return b[:pos] + bytes([b[pos] ^ 0x10]) + b[pos + 1 :]


def index_truncations(path: pathlib.Path) -> Iterator[Attack]:
    """``data.mdb`` cut at several lengths: opening must be refused, never SIGBUS.

    Runs each read in a child process, so a SIGBUS would be seen (as a signal exit)
    instead of killing the caller.
    """
    import shutil
    import subprocess
    import sys

    data = path / "index" / "data.mdb"
    size = data.stat().st_size
    for cut in sorted({4096, 8192, size // 2, size - 4096, size - 1}):
        if not 0 < cut < size:
            continue

        def run(cut=cut) -> Outcome:
            work = path.parent / f"trunc-{cut}"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(path, work)
            with open(work / "index" / "data.mdb", "r+b") as f:
                f.truncate(cut)
            code = (
                "import sys, pathlib\n"
                "from czyx.testing.attacks import classify, read_everything\n"
                "o = classify(lambda: read_everything(pathlib.Path(sys.argv[1])))\n"
                "print(o.kind); print(o.detail)\n"
            )
            r = subprocess.run(
                [sys.executable, "-c", code, str(work)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            shutil.rmtree(work, ignore_errors=True)
            if r.returncode != 0:
                return Outcome("crashed", f"exit {r.returncode}: {r.stderr[-200:]}")
            kind, _, detail = r.stdout.partition("\n")
            return Outcome(kind.strip(), detail.strip())

        yield Attack(f"index data.mdb truncated to {cut} of {size} bytes", run)


def remove_tree(path: pathlib.Path) -> None:
    """Remove a directory tree, ignoring errors (attack scratch space)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    os.sync()


# -- malformed checkpoints ------------------------------------------------------------


def _header_of(path: pathlib.Path) -> tuple[int, bytes, bytes]:
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n], raw[8 + n :]


def _with_header(path: pathlib.Path, n: int, header: bytes, data: bytes) -> None:
    import struct

    path.write_bytes(struct.pack("<Q", n) + header + data)


def checkpoint_attacks(root: pathlib.Path) -> Iterator[Attack]:
    """A folder of malformed checkpoints (generated from one valid tiny checkpoint), in
    the spirit of safetensors' ``attacks/``: each must be refused by mount with a typed
    error, leave no space, tag or block file behind, and never hang."""
    import json
    import shutil
    import stat

    from czyx.testing.tiny_models import make_tiny_checkpoint

    base = make_tiny_checkpoint("mixtral", root / "valid", num_hidden_layers=1)
    st_name = "model.safetensors"
    cfg = json.loads((base / "config.json").read_text())
    cases: dict[str, Callable[[pathlib.Path], None]] = {}

    def header_case(name: str, fn: Callable[[int, bytes, bytes], tuple[int, bytes, bytes]]):
        def make(d: pathlib.Path) -> None:
            _with_header(d / st_name, *fn(*_header_of(d / st_name)))

        cases[f"safetensors {name}"] = make

    header_case("header length one short", lambda n, h, d: (n - 1, h[:-1], h[-1:] + d))
    header_case("header length one long", lambda n, h, d: (n + 1, h + d[:1], d[1:]))
    header_case("header length 2**63", lambda n, h, d: (1 << 63, h, d))
    header_case("header length past EOF", lambda n, h, d: (n + len(d) + 1, h, d))
    header_case("header not JSON", lambda n, h, d: (n, b"{" + b"x" * (n - 1), d))
    header_case("header JSON array", lambda n, h, d: (n, b"[" + b" " * (n - 2) + b"]", d))
    header_case("header leading space", lambda n, h, d: (n, b" " + h[:-1], d))
    header_case("trailing bytes after data", lambda n, h, d: (n, h, d + b"\0" * 8))
    header_case("data one byte short", lambda n, h, d: (n, h, d[:-1]))

    def edit_entry(name: str, fn: Callable[[dict], None]) -> None:
        def make(d: pathlib.Path) -> None:
            _n, h, data = _header_of(d / st_name)
            header = json.loads(h)
            first = sorted(k for k in header if k != "__metadata__")[0]
            fn(header[first])
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            _with_header(d / st_name, len(blob), blob, data)

        cases[f"safetensors {name}"] = make

    edit_entry("unknown dtype", lambda e: e.update(dtype="F8_E9"))
    edit_entry("negative shape", lambda e: e.update(shape=[-1, 4]))
    edit_entry("shape overflow", lambda e: e.update(shape=[1 << 40, 1 << 40, 1 << 40]))
    edit_entry("shape float", lambda e: e.update(shape=[2.5]))
    edit_entry("offsets reversed", lambda e: e.update(data_offsets=e["data_offsets"][::-1]))
    edit_entry(
        "offsets shifted by one",
        lambda e: e.update(data_offsets=[e["data_offsets"][0] + 1, e["data_offsets"][1] + 1]),
    )
    edit_entry("offsets as strings", lambda e: e.update(data_offsets=["0", "4"]))

    def deep_header(d: pathlib.Path) -> None:
        blob = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        blob += b" " * (-len(blob) % 8)
        _with_header(d / st_name, len(blob), blob, b"")

    cases["safetensors header nested 100000 deep"] = deep_header

    def dup_key(d: pathlib.Path) -> None:
        _n, h, data = _header_of(d / st_name)
        text = h.decode().rstrip()
        first = json.loads(text)
        name = sorted(k for k in first if k != "__metadata__")[0]
        entry = json.dumps(first[name], separators=(",", ":"))
        blob = (text[:-1] + f',"{name}":{entry}' + "}").encode()
        blob += b" " * (-len(blob) % 8)
        _with_header(d / st_name, len(blob), blob, data)

    cases["safetensors duplicate tensor name"] = dup_key

    def bad_config(**kv: object) -> Callable[[pathlib.Path], None]:
        def make(d: pathlib.Path) -> None:
            (d / "config.json").write_text(json.dumps({**cfg, **kv}))

        return make

    n_exp = cfg["num_local_experts"]
    for key, value in [
        ("num_experts_per_tok", n_exp + 1),
        ("num_experts_per_tok", 0),
        ("rms_norm_eps", -1e-5),
        ("rms_norm_eps", 0.0),
        ("rms_norm_eps", float("nan")),
        ("rope_theta", 0.0),
        ("rope_theta", float("inf")),
        ("rope_parameters", {"rope_theta": 0, "rope_type": "default"}),
        ("rope_parameters", {"rope_theta": -10000.0, "rope_type": "default"}),
        ("num_hidden_layers", 10**9),
        ("num_hidden_layers", [4]),
        ("num_hidden_layers", "1"),
        ("num_hidden_layers", 1.0),
        ("num_hidden_layers", True),
        ("num_hidden_layers", 0),
        ("hidden_size", 0),
        ("hidden_size", -32),
        ("vocab_size", 1 << 40),
        ("num_attention_heads", 3),
        ("num_local_experts", 10**6),
        ("intermediate_size", None),
        ("max_position_embeddings", -1),
        ("model_type", ["mixtral"]),
        ("head_dim", 0),
    ]:
        cases[f"config {key}={value!r}"] = bad_config(**{key: value})

    def deep_config(d: pathlib.Path) -> None:
        (d / "config.json").write_text('{"a":' + "[" * 100_000 + "]" * 100_000 + "}")

    cases["config nested 100000 deep"] = deep_config
    cases["config not an object"] = lambda d: (d / "config.json").write_text("[1, 2]")
    cases["config duplicate key"] = lambda d: (d / "config.json").write_text(
        json.dumps(cfg)[:-1] + ', "num_hidden_layers": 1}'
    )
    cases["config invalid UTF-8"] = lambda d: (d / "config.json").write_bytes(b'{"a": "\xff"}')

    def link(name: str, target: str) -> Callable[[pathlib.Path], None]:
        def make(d: pathlib.Path) -> None:
            (d / name).unlink()
            (d / name).symlink_to(target)

        return make

    def fifo(name: str) -> Callable[[pathlib.Path], None]:
        def make(d: pathlib.Path) -> None:
            (d / name).unlink()
            os.mkfifo(d / name)

        return make

    def directory(name: str) -> Callable[[pathlib.Path], None]:
        def make(d: pathlib.Path) -> None:
            (d / name).unlink()
            (d / name).mkdir()

        return make

    cases["config.json -> /dev/urandom"] = link("config.json", "/dev/urandom")
    cases["config.json -> /dev/zero"] = link("config.json", "/dev/zero")
    cases["config.json is a FIFO"] = fifo("config.json")
    cases["config.json is a directory"] = directory("config.json")
    cases["model.safetensors is a FIFO"] = fifo(st_name)
    cases["model.safetensors -> /dev/zero"] = link(st_name, "/dev/zero")
    cases["model.safetensors -> /dev/urandom"] = link(st_name, "/dev/urandom")
    cases["model.safetensors is a directory"] = directory(st_name)
    cases["model.safetensors empty"] = lambda d: (d / st_name).write_bytes(b"")
    cases["model.safetensors 7 bytes"] = lambda d: (d / st_name).write_bytes(b"\x08" * 7)

    def index_escape(d: pathlib.Path) -> None:
        _n, h, _ = _header_of(d / st_name)
        names = [k for k in json.loads(h) if k != "__metadata__"]
        wm = dict.fromkeys(names, "../model.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))

    cases["index names ../ path"] = index_escape

    for i, (name, make) in enumerate(sorted(cases.items())):

        def run(i=i, make=make) -> Outcome:
            d = root / f"attack-{i}"
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(base, d, symlinks=True)
            make(d)
            try:
                return _mount_refused(d, root / f"store-{i}")
            finally:
                for p in d.iterdir():  # a FIFO left behind must not trip rmtree
                    if stat.S_ISFIFO(p.lstat().st_mode):
                        p.unlink()
                shutil.rmtree(d, ignore_errors=True)
                shutil.rmtree(root / f"store-{i}", ignore_errors=True)

        yield Attack(f"checkpoint {name}", run)


def _mount_refused(ckpt: pathlib.Path, store_path: pathlib.Path) -> Outcome:
    """Mount ``ckpt`` (bounded to 20 s), then check nothing of it is left in the store."""
    import signal
    import threading

    from czyx.store import Store
    from czyx.store.models.mount import mount

    class _Hung(Exception):
        pass

    def alarm(*_: object) -> None:
        raise _Hung("mount did not return within 20 s")

    main = threading.current_thread() is threading.main_thread()
    with Store.open(store_path) as st:
        old = signal.signal(signal.SIGALRM, alarm) if main else None
        if main:
            signal.alarm(20)
        try:
            out = classify(lambda: mount(st, ckpt, "attack@1"))
        except _Hung as exc:  # raised outside classify's frame is impossible; kept safe
            out = Outcome("crashed", str(exc))
        finally:
            if main:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
        left = list(st.spaces()) or list(st.tags())
        blocks = [p.name for p in (store_path / "blocks").iterdir()]
    if out.kind == "refused" and (left or blocks):
        return Outcome("silent", f"refused but left {left or blocks}")
    return out


# -- portals ----------------------------------------------------------------------------


def portal_attacks(root: pathlib.Path) -> tuple[str, list[Attack]]:
    """Hand-built tokens that reuse a registered portal id outside the caveats it was
    issued with; each must fail verification (a typed ``PortalDenied``)."""
    from czyx.portals import ClassRange, LayerRange, Rights
    from czyx.portals.authority import PortalAuthority
    from czyx.portals.caveats import PortalId
    from czyx.portals.chain import _extend
    from czyx.portals.token import Token
    from czyx.space import Selector
    from czyx.store import Store

    path = root / "store"
    sp = Selector.from_name("m")
    with Store.open(path) as st:
        with st.begin_space(sp, {"x": 1}):
            pass
        a = PortalAuthority(st)
        holder = a.grant([Rights({"read", "grant"})], tenant="alice")
        child = a.grant(
            [ClassRange(0, 7), Rights({"read", "grant"})], tenant="alice", parent=holder.token
        )
        sibling = a.grant([LayerRange(0, 1), Rights({"read"})], tenant="alice", parent=holder.token)
        grand = a.grant([Rights({"read"})], tenant="alice", parent=child.token)

    def forge(base: str, *cavs: object) -> str:
        out = Token.from_text(base)
        sig, chain = out.signature, list(out.caveats)
        for c in cavs:
            sig = _extend(sig, c.encode())
            chain.append(c)
        return Token(out.store_id, out.root_id, tuple(chain), sig).to_text()

    cases = {
        "child id appended to the holder's token": forge(holder.token, PortalId(child.portal_id)),
        "child id + wider classes": forge(
            holder.token, PortalId(child.portal_id), ClassRange(0, 255)
        ),
        "child id + its rights only (classes dropped)": forge(
            holder.token, PortalId(child.portal_id), Rights({"read"})
        ),
        "sibling id appended": forge(holder.token, PortalId(sibling.portal_id)),
        "child then sibling id": forge(
            holder.token, PortalId(child.portal_id), PortalId(sibling.portal_id)
        ),
        "grandchild id under a forged child": forge(
            holder.token, PortalId(child.portal_id), PortalId(grand.portal_id)
        ),
        "holder id appended twice": forge(holder.token, PortalId(holder.portal_id)),
        "random unregistered id": forge(holder.token, PortalId(os.urandom(16))),
    }

    def run_one(token: str) -> Outcome:
        with Store.open(path) as st:
            return classify(lambda: PortalAuthority(st).verify(token, space=sp))

    return (
        "portals: a registered portal id appended by hand",
        [Attack(f"portal {n}", lambda t=t: run_one(t)) for n, t in cases.items()],
    )


# -- the front door (CLI) ---------------------------------------------------------------


def cli_attacks(root: pathlib.Path) -> tuple[str, list[Attack]]:
    """Mistyped and hostile command lines a new user hits; each must exit 1 (or argparse's
    2) with one ``czyx: error:`` line, never 0, an internal error or a traceback."""
    import contextlib
    import io

    from czyx.cli import main
    from czyx.inference.assets import bundled_model_dir

    store = str(root / "store")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["mount", str(bundled_model_dir()), "--as", "stdlib@v1", "--store", store]) == 0
    root.mkdir(parents=True, exist_ok=True)
    (root / "bad.txt").write_bytes(b"def \xff\xfe")
    (root / "full").mkdir()
    (root / "full" / "x").write_text("mine")
    (root / "afile").write_text("x")
    run = ["run", "stdlib@v1", "--store", store, "-n", "2"]
    st = ["--store", store]
    cases = {
        "prompt not UTF-8 (argv)": [*run, "-p", os.fsdecode(b"def \xff")],
        "prompt file not UTF-8": [*run, "--prompt-file", str(root / "bad.txt")],
        "prompt file missing": [*run, "--prompt-file", str(root / "nope.txt")],
        "no prompt": run,
        "two prompts": [*run, "a", "-p", "b"],
        "prompt longer than the context": [*run, "x" * 1100],
        "--xray into a missing directory": [*run, "x", "--xray", "/nonexistent/d/x.json"],
        "--lookahead beyond the layers": [*run, "x", "--lookahead", "9"],
        "--max-tokens negative": [*run[:-2], "x", "-n", "-1"],
        "--cache-mb below top-k": [*run, "x", "--cache-mb", "0.001"],
        "garbage portal token": [*run, "x", "--portal", "czp1_garbage"],
        "unknown version": ["run", "stdlib@v9", "--store", store, "x"],
        "tag without @version (run)": ["run", "stdlib", "--store", store, "x"],
        "tag without @version (grant)": ["grant", "stdlib", "--tenant", "a", "--store", store],
        "--expires 0s": ["grant", "stdlib@v1", "--tenant", "a", "--expires", "0s", *st],
        "--expires in the past (ISO)": [
            "grant",
            "stdlib@v1",
            "--tenant",
            "a",
            "--expires",
            "2001-01-01",
            "--store",
            store,
        ],
        "--expires garbage": [
            "grant",
            "stdlib@v1",
            "--tenant",
            "a",
            "--expires",
            "soon",
            "--store",
            store,
        ],
        "sessions show unknown": ["sessions", "show", "nosuch", "--store", store],
        "sessions rm unknown": ["sessions", "rm", "nosuch", "--store", store],
        "rm unknown tag": ["rm", "nosuch@v1", "--store", store],
        "rm without @version": ["rm", "stdlib", "--store", store],
        "export into a non-empty dir": ["export", "stdlib@v1", str(root / "full"), *st],
        "export over a file": ["export", "stdlib@v1", str(root / "afile"), "--store", store],
        "ls on a missing store": ["ls", "--store", str(root / "nostore")],
        "store fsck on a missing store": ["store", "fsck", str(root / "nostore")],
        "mount a missing directory": ["mount", str(root / "nodir"), "--as", "a@1", *st],
        "mount a file": ["mount", str(root / "afile"), "--as", "a@1", "--store", store],
        "mount with a bad tag": ["mount", str(bundled_model_dir()), "--as", "a", "--store", store],
    }

    def run_one(argv: list[str]) -> Outcome:
        err, out = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                rc = main(argv)
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code if isinstance(exc.code, int) else 2
        text = err.getvalue()
        if rc == 0:
            return Outcome("silent", "exit 0")
        if rc == 70 or "internal error" in text or "Traceback" in text:
            return Outcome("crashed", text.strip()[-200:])
        if "error:" not in text:
            return Outcome("crashed", f"exit {rc} without an error line")
        return Outcome("refused", text.strip().splitlines()[-1][:200])

    return (
        "front door: mistyped or hostile command lines",
        [Attack(f"cli {n}", lambda a=a: run_one(a)) for n, a in cases.items()],
    )
