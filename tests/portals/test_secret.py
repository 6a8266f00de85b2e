"""The store secret file: created once, private, refused when it is not."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from czyx.portals.errors import SecretError
from czyx.portals.secret import SECRET_FILE, StoreSecret, load_or_create_secret


def test_created_once_with_mode_0600_even_when_racing(tmp_path):
    got: list[bytes] = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        got.append(load_or_create_secret(tmp_path).reveal())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(got[0]) == 32
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == [SECRET_FILE]  # no temporary files left behind


def test_refusals(tmp_path):
    with pytest.raises(SecretError, match="cannot open"):
        load_or_create_secret(tmp_path, create=False)
    with pytest.raises(SecretError, match="does not exist"):
        load_or_create_secret(tmp_path / "missing")
    path = tmp_path / SECRET_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(SecretError, match="5 bytes"):
        load_or_create_secret(tmp_path)
    path.unlink()
    real = tmp_path / "elsewhere"
    real.write_bytes(b"x" * 32)
    real.chmod(0o600)
    path.symlink_to(real)
    with pytest.raises(SecretError):
        load_or_create_secret(tmp_path)


def test_secret_holder_hides_its_bytes():
    s = StoreSecret(b"\x01" * 32)
    assert "01" not in repr(s) and "01" not in str(s)
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(s)
    with pytest.raises(SecretError):
        StoreSecret(b"x")
