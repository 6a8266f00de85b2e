"""inference.memory: the memory a process may still take, from /proc and its cgroup."""

from __future__ import annotations

from pathlib import Path

from czyx.inference.memory import available_bytes, cgroup_room, meminfo_available


def _proc(tmp: Path, cgroup: str, meminfo_kb: int | None = 8_000_000) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    if meminfo_kb is not None:
        (proc / "meminfo").write_text(
            f"MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:   {meminfo_kb} kB\n"
        )
    return proc


def _group(base: Path, v2: bool, limit: str, usage: str, stat: str = "") -> None:
    """A cgroup directory's memory files (v2 names, or v1's)."""
    base.mkdir(parents=True, exist_ok=True)
    names = (
        ("memory.max", "memory.current")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    (base / names[0]).write_text(limit + "\n")
    (base / names[1]).write_text(usage + "\n")
    if stat:
        (base / "memory.stat").write_text(stat)


def test_meminfo_available_is_read_in_bytes(tmp_path):
    proc = _proc(tmp_path, "0::/\n", 2_000)
    assert meminfo_available(proc) == 2_000 * 1024
    assert meminfo_available(tmp_path / "nowhere") is None


def test_cgroup_v2_room_counts_droppable_file_pages(tmp_path):
    proc = _proc(tmp_path, "0::/a/b\n")
    root = tmp_path / "cg"
    _group(
        root / "a" / "b", True, "1000000", "400000", "anon 3\ninactive_file 100000\nactive_file 5\n"
    )
    assert cgroup_room(proc, root) == 1_000_000 - 400_000 + 100_000
    # the smaller of the host's estimate and the group's room
    assert available_bytes(proc, root) == 700_000
    (root / "a" / "b" / "memory.max").write_text("max\n")
    assert cgroup_room(proc, root) is None
    assert available_bytes(proc, root) == 8_000_000 * 1024


def test_cgroup_v1_room_and_a_namespaced_mount(tmp_path):
    proc = _proc(tmp_path, "9:cpu:/x\nnot a cgroup line\n4:memory:/grp\n0::/\n")
    root = tmp_path / "cg"
    _group(
        root / "memory" / "grp",
        False,
        "5000000",
        "3000000",
        "inactive_file 7\ntotal_inactive_file 250000\n",
    )
    assert cgroup_room(proc, root) == 5_000_000 - 3_000_000 + 250_000
    # inside a container the group is mounted as the hierarchy's root
    _group(tmp_path / "ns" / "memory", False, "9223372036854771712", "3000000")  # v1's "no limit"
    assert cgroup_room(proc, tmp_path / "ns") is None
    (tmp_path / "ns" / "memory" / "memory.limit_in_bytes").write_text("4000000\n")
    assert cgroup_room(proc, tmp_path / "ns") == 1_000_000


def test_over_the_limit_is_no_room_and_nothing_readable_is_unknown(tmp_path):
    proc = _proc(tmp_path, "0::/g\n", meminfo_kb=None)
    root = tmp_path / "cg"
    _group(root / "g", True, "100", "400")
    assert cgroup_room(proc, root) == 0
    assert available_bytes(proc, root) == 0
    (root / "g" / "memory.current").write_text("garbage\n")
    assert available_bytes(proc, root) is None
    assert available_bytes(tmp_path / "none", tmp_path / "none") is None
