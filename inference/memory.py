"""How much memory this process may still take, for an engine's default slot budget.

Scope: :func:`available_bytes`, the smaller of the kernel's estimate
(``MemAvailable`` in ``/proc/meminfo``) and the room left under the memory
limit of the process's own cgroup (v2 ``memory.max`` / ``memory.current``, v1
``memory.limit_in_bytes`` / ``memory.usage_in_bytes``), file pages the kernel
can drop (``inactive_file``) counted as room, as the kernel's own estimate
counts them. A container's limit is what kills the process, not the host's
free memory, so both are read. None where neither can be read; the caller then
keeps its old default.

Read once when an engine is made (:func:`inference.engine.resolve_budget`),
never per token.
"""

from __future__ import annotations

from pathlib import Path

#: The share of :func:`available_bytes` a default expert slot budget fills
#: (:func:`inference.engine.resolve_budget`); the rest is for KV caches,
#: activations and the heap.
MEMORY_SHARE = 0.8

#: A cgroup limit at or above this is "no limit" (v1 writes 2**63 rounded to pages).
_UNLIMITED = 1 << 60


def _int_file(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    """``key``'s value in a cgroup ``memory.stat`` file (0 when absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def meminfo_available(proc: Path = Path("/proc")) -> int | None:
    """``MemAvailable`` in bytes, or None."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_room(proc: Path = Path("/proc"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under the process's cgroup memory limit, or None (no limit, or unreadable)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # v2: one unified hierarchy
            base = root / rel
            limit, usage = _int_file(base / "memory.max"), _int_file(base / "memory.current")
            droppable = _stat(base / "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):
            base = root / "memory" / rel
            if not base.is_dir():  # a namespaced mount shows the group as its root
                base = root / "memory"
            limit = _int_file(base / "memory.limit_in_bytes")
            usage = _int_file(base / "memory.usage_in_bytes")
            droppable = _stat(base / "memory.stat", "total_inactive_file")
        else:
            continue
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        return max(0, limit - usage + droppable)
    return None


def available_bytes(proc: Path = Path("/proc"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory this process may still take: the smaller of :func:`meminfo_available`
    and :func:`cgroup_room` (either may be missing), or None when neither is known."""
    known = [b for b in (meminfo_available(proc), cgroup_room(proc, root)) if b is not None]
    return min(known) if known else None
