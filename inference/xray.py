"""X-Ray: what every expert transfer did, and what the run paid for I/O.

Scope: collecting :class:`~inference.planner.Transfer` records and cache
counters, turning them into a JSON report (validated against
``inference/xray.schema.json``) and a short terminal table. No I/O of its
own besides writing the report.

Per transfer: requested and completed bytes, source path and destination
slot, request / start / first-byte / completion / first-use times (µs
since the run began), prefetch lead, exposed wait, outcome (hidden,
exposed, demand, wasted, failed), the evicted owner and the eviction
reason, checksum result, deadline stall and error. The checksum result is
``pending`` for a transfer read by the native pool and never used: its
checksum is verified at first use, which a wasted prefetch never has.

Per run: model bytes resident, bytes read per token, I/O time hidden versus
exposed (the exposure equation, ``exposed = max(0, transfer - overlap)``:
I/O time is the time any read was in flight, exposed is the time the
consumer was blocked on a completion event, hidden is the rest, the I/O
that overlapped compute; ``transfer_seconds`` sums every read's own
duration, which counts parallel reads twice), hit rate, prefetch recall and wasted reads, and useful
bandwidth (bytes of used transfers over the time any read was in flight)
against the device baseline measured by ``czyx bench io``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from czyx.inference.options import renamed

if TYPE_CHECKING:  # annotations only: the planner imports nothing from here
    from czyx.inference.planner import Transfer
    from czyx.inference.streaming import StreamingExpertCache

SCHEMA_PATH = Path(__file__).with_name("xray.schema.json")
SCHEMA_VERSION = 1


def _us(t: int | None, t0: int) -> float | None:
    return None if t is None else round((t - t0) / 1e3, 3)


def outcome(t: Transfer) -> str:
    """A transfer's outcome: failed, wasted (never used), demand, hidden or exposed."""
    if t.error is not None:
        return "failed"
    if not t.used:
        return "wasted"
    if t.kind == "demand":
        return "demand"
    return "exposed" if t.exposed_ns > 0 else "hidden"


def _busy_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of ``[start, end)`` intervals: time any read was in flight."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class XRay:
    """Collects transfers during a run; :meth:`report` summarises them.

    Parameters
    ----------
    io_path
        The I/O path name the transfers used.
    readers
        Reader threads (``threads``: its deprecated spelling).
    device_baseline
        The device's measured bandwidth in bytes/s (``czyx bench io``), or None.
    """

    def __init__(
        self,
        io_path: str = "",
        readers: int = 0,
        device_baseline: float | None = None,
        **deprecated: int,
    ) -> None:
        if deprecated:
            readers = int(renamed(deprecated, stacklevel=2).get("readers", readers))
        self.t0 = time.monotonic_ns()
        self.io_path = io_path
        self.readers = readers
        self.device_baseline = device_baseline
        self.transfers: list[Transfer] = []
        self._mark: tuple[int, int, int, int, int] | None = None

    def mark(self, cache: StreamingExpertCache | None = None) -> None:
        """Start the reporting window now (for example after prefill, to report decode).

        :meth:`report` with ``since_mark=True`` then counts only transfers
        requested or first used after this point, and cache counters as
        differences from their values now.
        """
        c = cache
        self._mark = (
            time.monotonic_ns(),
            int(c.hits) if c is not None else 0,
            int(c.misses) if c is not None else 0,
            int(getattr(c, "predicted_total", 0)),
            int(getattr(c, "predicted_correct", 0)),
        )

    def add(self, t: Transfer) -> None:
        """Record a transfer at submission (its fields are read at report time)."""
        self.transfers.append(t)

    # ------------------------------------------------------------------ records

    def transfer_record(self, t: Transfer) -> dict[str, Any]:
        """The JSON record of one transfer."""
        t0 = self.t0
        dur = None
        if t.t_start is not None and t.t_complete is not None:
            dur = t.t_complete - t.t_start
        bw = (t.completed_bytes / (dur / 1e9)) if dur else None
        lead = None
        if t.t_first_use is not None:
            lead = round((t.t_first_use - t.t_request) / 1e3, 3)
        return {
            "id": t.id,
            "layer": t.layer,
            "expert": t.expert,
            "kind": t.kind,
            "source": t.source,
            "dest_slot": t.slot,
            "requested_bytes": t.requested_bytes,
            "completed_bytes": t.completed_bytes,
            "t_request_us": _us(t.t_request, t0),
            "t_start_us": _us(t.t_start, t0),
            "t_first_byte_us": _us(t.t_first_byte, t0),
            "t_complete_us": _us(t.t_complete, t0),
            "t_first_use_us": _us(t.t_first_use, t0),
            "prefetch_lead_us": lead if t.kind == "prefetch" else None,
            "exposed_wait_us": round(t.exposed_ns / 1e3, 3),
            "bandwidth_bytes_per_s": bw,
            "staging_copy_bytes": t.staging_copy_bytes,
            "outcome": outcome(t),
            "evicted": None if t.evicted is None else list(t.evicted),
            "eviction_reason": t.evict_reason,
            "checksum": t.checksum_result,
            "stalled": t.stalled,
            "error": None if t.error is None else f"{type(t.error).__name__}: {t.error}",
            **({} if t.tier is None else {"tier": t.tier}),
        }

    def report(
        self,
        cache: StreamingExpertCache | None = None,
        *,
        tokens: int = 0,
        trunk_bytes: int = 0,
        extra: dict[str, Any] | None = None,
        since_mark: bool = False,
        speculation: Sequence[tuple[int, int]] | None = None,
    ) -> dict[str, Any]:
        """The whole report: ``{"schema_version", "run", "transfers"}``.

        Parameters
        ----------
        cache
            The :class:`~inference.streaming.StreamingExpertCache` (for its
            counters and resident bytes), or None.
        tokens
            Tokens processed (prompt plus generated) for bytes per token.
        trunk_bytes
            Bytes of resident trunk tensors, counted as model bytes resident.
        extra
            Run facts to carry along (model, budget, command line).
        since_mark
            Report only the window since :meth:`mark` (``tokens`` should then
            count that window's tokens).
        speculation
            Speculative decoding's ``(drafted, accepted)`` per decode step
            (:attr:`GenerationStats.draft_steps`): reported as ``run.speculation``
            with its totals; None: no speculation, no field.
        """
        transfers = self.transfers
        base = (0, 0, 0, 0, 0)
        if since_mark:
            if self._mark is None:
                raise ValueError("report(since_mark=True) needs mark() first")
            base = self._mark
            transfers = [
                t for t in transfers if t.t_request >= base[0] or (t.t_first_use or 0) >= base[0]
            ]
        recs = [self.transfer_record(t) for t in transfers]
        done = [t for t in transfers if t.t_start is not None and t.t_complete is not None]
        io_ns = sum(t.t_complete - t.t_start for t in done)
        exposed_ns = sum(t.exposed_ns for t in transfers)
        used = [t for t in done if t.used and t.error is None]
        useful = sum(t.completed_bytes for t in used)
        busy = _busy_ns([(t.t_start, t.t_complete) for t in done])
        read_bytes = sum(t.completed_bytes for t in transfers)
        counts = {k: 0 for k in ("hidden", "exposed", "demand", "wasted", "failed")}
        for r in recs:
            counts[r["outcome"]] += 1
        prefetches = [t for t in transfers if t.kind == "prefetch"]
        wasted = [t for t in prefetches if not t.used]
        hits = misses = 0
        resident = trunk_bytes
        recall = None
        stalls = sum(1 for t in transfers if t.stalled)
        if cache is not None:
            hits, misses = int(cache.hits) - base[1], int(cache.misses) - base[2]
            resident += int((cache.owner >= 0).sum()) * int(cache.slot_nbytes)
            total = int(getattr(cache, "predicted_total", 0)) - base[3]
            if total:
                recall = (int(cache.predicted_correct) - base[4]) / total
        lookups = hits + misses
        useful_bw = useful / (busy / 1e9) if busy else None
        run = {
            "io_path": self.io_path,
            "reader_threads": self.readers,
            "tokens": tokens,
            "transfers": len(transfers),
            "outcomes": counts,
            "model_bytes_resident": resident,
            "bytes_read": read_bytes,
            "staging_copy_bytes": sum(t.staging_copy_bytes for t in transfers),
            "bytes_read_per_token": read_bytes / tokens if tokens else None,
            "io_seconds": busy / 1e9,
            "transfer_seconds": io_ns / 1e9,
            "exposed_seconds": exposed_ns / 1e9,
            "hidden_seconds": max(busy - exposed_ns, 0) / 1e9,
            "stalls": stalls,
            "lookups": lookups,
            "hits": hits,
            "hit_rate": hits / lookups if lookups else None,
            "prefetch_issued": len(prefetches),
            "prefetch_wasted": len(wasted),
            "prefetch_wasted_bytes": sum(t.requested_bytes for t in wasted),
            "prefetch_recall": recall,
            "useful_bytes": useful,
            "useful_bandwidth_bytes_per_s": useful_bw,
            "device_baseline_bytes_per_s": self.device_baseline,
            "useful_vs_device": (
                useful_bw / self.device_baseline if useful_bw and self.device_baseline else None
            ),
            "extra": extra or {},
        }
        tiers = getattr(cache, "tier_report", None)
        if tiers is not None and cache.tier_map is not None:
            run["tiers"] = tiers()
        if speculation is not None:
            drafted = sum(int(d) for d, _ in speculation)
            accepted = sum(int(a) for _, a in speculation)
            run["speculation"] = {
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "steps": [[int(d), int(a)] for d, a in speculation],
            }
        return {"schema_version": SCHEMA_VERSION, "run": run, "transfers": recs}

    def write_json(self, path: str | os.PathLike, report: dict[str, Any]) -> Path:
        """Write ``report`` (from :meth:`report`) as JSON; returns the path."""
        p = Path(path)
        p.write_text(json.dumps(report, indent=1) + "\n")
        return p


def load_schema() -> dict[str, Any]:
    """The report's JSON schema (draft 2020-12)."""
    return json.loads(SCHEMA_PATH.read_text())


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def table(report: dict[str, Any]) -> str:
    """A short terminal summary of a report's run section."""
    r = report["run"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    bw = r["useful_bandwidth_bytes_per_s"]
    rows = [
        ("I/O path / readers", f"{r['io_path']} / {r['reader_threads']}"),
        ("tokens", str(r["tokens"])),
        ("model bytes resident", _fmt_bytes(r["model_bytes_resident"])),
        (
            "bytes read (per token)",
            f"{_fmt_bytes(r['bytes_read'])} ({_fmt_bytes(r['bytes_read_per_token'])})",
        ),
        ("hit rate", pct(r["hit_rate"])),
        ("staging-copy bytes", _fmt_bytes(r["staging_copy_bytes"])),
        ("transfers", " ".join(f"{k}={v}" for k, v in r["outcomes"].items())),
        (
            "I/O time hidden / exposed",
            f"{r['hidden_seconds'] * 1e3:.2f} ms / {r['exposed_seconds'] * 1e3:.2f} ms",
        ),
        ("stalls", str(r["stalls"])),
        ("prefetch recall / wasted", f"{pct(r['prefetch_recall'])} / {r['prefetch_wasted']}"),
        (
            "useful bandwidth",
            "-"
            if bw is None
            else f"{_fmt_bytes(bw)}/s"
            + (f" ({pct(r['useful_vs_device'])} of device)" if r["useful_vs_device"] else ""),
        ),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)
