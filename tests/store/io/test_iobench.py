"""``czyx bench io`` and the measuring helpers: the winner is recorded where the engine looks."""

from __future__ import annotations

from czyx.cli import main
from czyx.store.io import iobench
from czyx.store.io import iopaths as iop


def test_bench_io_records_the_fastest_measured_path(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "io.json"
    monkeypatch.setenv(iop.CONFIG_ENV, str(cfg))
    argv = ["bench", "io", "--dir", str(tmp_path), "--size-mib", "2", "--block-kib", "256"]
    assert main([*argv, "--repeats", "1", "--paths", "pread,direct"]) == 0
    out = capsys.readouterr().out
    got = iop.load_io_config()
    assert got is not None and got.path in ("pread", "direct")
    assert set(got.measured) == {"pread", "direct"}
    assert got.bandwidth == max(got.measured.values()) and "vs pread" in out
    assert iop.default_io_path() == got.path
    assert not list(tmp_path.glob(".czyx-bench-io-*"))  # the scratch file is gone


def test_bench_io_use_records_without_measuring_and_refuses_unknown(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(iop.CONFIG_ENV, str(tmp_path / "io.json"))
    assert main(["bench", "io", "--use", "mmap"]) == 0
    assert iop.default_io_path() == "mmap"
    assert main(["bench", "io", "--use", "warp"]) == 1
    assert "not one of" in capsys.readouterr().err


def test_measure_and_machine_description(tmp_path):
    f = iobench.make_file(tmp_path / "f.bin", 1 << 20)
    m = iobench.measure("pread", f, block=1 << 18, threads=2, repeats=2)
    assert m.nbytes == 1 << 20 and len(m.samples) == 2 and m.bandwidth > 0
    assert m.p50_us <= m.p99_us
    desc = iobench.machine_description(tmp_path)
    for key in ("cpu", "memory", "filesystem", "mount_options", "kernel"):
        assert desc[key] and desc[key] != "?"
