"""The store secret: 32 random bytes in ``<store>/portal.secret``, mode 0600.

Created on first use, atomically (written to a private temporary file,
fsynced, then hard-linked into place, so a concurrent creator either wins or
reads the winner's complete file). Loading refuses a file that is readable by
group or others, or of the wrong size: fail closed rather than sign with a
secret someone else may hold. The bytes are wrapped in :class:`StoreSecret`,
whose ``repr`` never shows them, and no error message includes them.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from czyx.portals.errors import SecretError

SECRET_FILE = "portal.secret"
SECRET_SIZE = 32


class StoreSecret:
    """Opaque holder of the secret bytes; ``repr``/``str`` never reveal them."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        if len(raw) != SECRET_SIZE:
            raise SecretError(f"store secret: expected {SECRET_SIZE} bytes")
        self._raw = bytes(raw)

    def reveal(self) -> bytes:
        """The raw bytes, for key derivation only."""
        return self._raw

    def __repr__(self) -> str:
        return "<StoreSecret (hidden)>"

    __str__ = __repr__

    def __reduce__(self):  # refuse pickling: a secret must not travel by accident
        raise TypeError("StoreSecret cannot be pickled")


def secret_path(store_dir: str | os.PathLike) -> Path:
    """Where the secret of the store at ``store_dir`` lives."""
    return Path(store_dir) / SECRET_FILE


def _load(path: Path) -> StoreSecret:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise SecretError(f"store secret {path}: cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"store secret {path}: not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(
                f"store secret {path}: mode {stat.S_IMODE(st.st_mode):04o} is readable "
                "by others; refusing it (chmod 600 if it was not exposed, else rotate it)"
            )
        data = os.read(fd, SECRET_SIZE + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_SIZE:
        raise SecretError(f"store secret {path}: {len(data)} bytes, expected {SECRET_SIZE}")
    return StoreSecret(data)


def load_or_create_secret(store_dir: str | os.PathLike, *, create: bool = True) -> StoreSecret:
    """Load the store secret, creating it (mode 0600) if absent and ``create``.

    Raises
    ------
    SecretError
        Missing (and not ``create``), unreadable, wrong size or too permissive.
    """
    path = secret_path(store_dir)
    if path.exists() or not create:
        return _load(path)
    directory = path.parent
    if not directory.is_dir():
        raise SecretError(f"store secret: store directory {directory} does not exist")
    tmp = directory / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask could only have narrowed it; be explicit
        os.write(fd, secrets.token_bytes(SECRET_SIZE))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic publish; EEXIST means another process won
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return _load(path)
