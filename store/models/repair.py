"""Repairing a published version from its source checkpoint, when it is mounted again.

Scope: the block files of one version's own spaces (its expert space and its
trunk space). A published space is immutable in the index: its records (offset,
length, XXH3 sum) and block identity (name, generation, size, alignment) stay
exactly as they were. What can be damaged is the block file; re-mounting the
same checkpoint (same content, so the same selector) rewrites what is bad:

- a block file that is whole is read extent by extent, and each extent whose
  checksum fails is rewritten from the source;
- a missing, truncated or replaced block file is rebuilt: the header with the
  published generation, then every extent the space owns, at its recorded offset.

Every byte written is first checked against the checksum the record has held
since publication, so a repair can only restore the published bytes, never
publish different ones; a source that differs is refused. The new file is
written beside the old one under a ``.part`` name (held with the same flock a
publication holds, so gc leaves it alone), fsync-ed, and renamed over it.
Extents a version shares from an earlier version's block file are that
version's to repair.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from czyx.space import Selector
from czyx.store.core.blockfile import encode_header, fsync_dir, verify_block_file
from czyx.store.core.checksum import checksum
from czyx.store.errors import BlockFileError
from czyx.store.models.archs import SIDE_FILES, TOKENIZER_ROLE
from czyx.store.models.mount_errors import MountError


def repair_version(store: Any, src: Any, sels: list[Selector]) -> int:
    """Rewrite the damaged extents of ``sels`` (a version's own spaces) from ``src``.

    Returns the number of extents rewritten (0: nothing was damaged).

    Raises
    ------
    MountError
        The source's bytes do not match a record's checksum (a different checkpoint).
    """
    trunk = {(t.role, t.layer): t for t in src.plan.trunk}

    def source_bytes(rec: dict) -> np.ndarray:
        if "expert" in rec:
            src.assemble((int(rec["layer"]), int(rec["expert"])), src.buf)
            return src.buf.reshape(-1).view(np.uint8)
        if rec.get("role") == TOKENIZER_ROLE:
            return np.frombuffer(src.tokenizer or b"", np.uint8)
        side = {role: name for name, (role, _) in SIDE_FILES.items()}.get(rec.get("role"))
        if side is not None:
            return np.frombuffer(src.side_files.get(side, b""), np.uint8)
        t = trunk.get((rec.get("role"), rec.get("layer")))
        if t is None:
            raise MountError(f"record of role {rec.get('role')!r}: not in the source checkpoint")
        data, _ = src.stored_tensor(t)
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)

    return sum(_repair_space(store, sp, source_bytes) for sp in sels)


def _repair_space(store: Any, sp: Selector, source: Callable[[dict], np.ndarray]) -> int:
    ident = store.block_identity(sp)
    path = store.path / "blocks" / ident.name
    own = [
        (k, r) for k, r in store.scan(sp) if "blk" not in r and {"off", "len", "sum"} <= r.keys()
    ]
    try:
        verify_block_file(path, ident, sp.raw)
        whole = True
    except BlockFileError:
        whole = False
    if whole:
        bad = []
        with open(path, "rb") as f:
            for k, r in own:
                if checksum(os.pread(f.fileno(), r["len"], r["off"])) != r["sum"]:
                    bad.append((k, r))
        if not bad:
            return 0
    else:
        bad = own
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # gc skips a locked file
        if whole:
            with open(path, "rb") as f:
                os.copy_file_range(f.fileno(), fd, ident.size, 0, 0)
        else:
            os.pwrite(fd, encode_header(sp.raw, ident.generation, ident.align), 0)
            os.ftruncate(fd, ident.size)
        for k, r in bad:
            data = source(r)[: r["len"]]
            if data.nbytes != r["len"] or checksum(data) != r["sum"]:
                raise MountError(
                    f"space {sp.hex()} record {bytes(k).hex()}: the source's bytes differ from "
                    "the published ones; not repaired (is this the same checkpoint?)"
                )
            mv, done = memoryview(data), 0
            while done < r["len"]:
                done += os.pwrite(fd, mv[done:], r["off"] + done)
        if os.fstat(fd).st_size != ident.size:
            os.ftruncate(fd, ident.size)
        os.fsync(fd)
        os.rename(part, path)
        fsync_dir(path.parent)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    verify_block_file(path, ident, sp.raw)
    return len(bad)
