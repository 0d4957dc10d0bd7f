"""Timelines of the actor runtime: Chrome-trace / Perfetto JSON, one file per process.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "t.json")
>>> w = TraceWriter(path, pid=0)
>>> w.span("compute", "#3 compute relu", "relu", micro=0, start=1.0, end=1.5, nbytes=64)
>>> w.flush(); w.close()
>>> [e["name"] for e in load(path) if e["ph"] == "X"]
['#3 compute relu']
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


# Every act is a complete event ("ph": "X") on its thread's lane, args = actor, op, micro-batch, bytes. pid is the
# process's global rank and tid the lane, so `sbpflow trace merge` lays ranks side by side; times are wall-clock
# microseconds, so processes of one machine line up. The file is a JSON array appended after every run and
# closed with "]" on close(): Chrome and Perfetto read an unclosed array, so a job that dies leaves a timeline.
class TraceWriter:
    """Collects spans in memory; :meth:`flush` appends them to ``path`` (see :func:`claim` for a path in use)."""

    def __init__(self, path: str | Path, pid: int) -> None:
        self.path = Path(claim(str(path)))
        self.pid = pid
        self._lanes: dict[str, int] = {}
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def span(self, lane: str, name: str, op: str, *, micro: int, start: float, end: float, nbytes: int) -> None:
        """One act on ``lane``, from ``start`` to ``end`` (seconds since the epoch)."""
        with self._lock:
            tid = self._lane(lane)
            self._pending.append({
                "name": name, "cat": op, "ph": "X", "pid": self.pid, "tid": tid,
                "ts": round(start * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                "args": {"actor": name, "op": op, "micro_batch": micro, "bytes": nbytes},
            })

    def _lane(self, lane: str) -> int:
        if lane not in self._lanes:
            tid = len(self._lanes)
            self._lanes[lane] = tid
            self._pending.append({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                                  "args": {"name": lane}})
        return self._lanes[lane]

    def flush(self) -> None:
        """Appends the spans collected since the last flush."""
        with self._lock:
            events, self._pending = self._pending, []
            if self._closed or not (events or not self._started):
                return
            with self.path.open("a" if self._started else "w") as f:
                if not self._started:
                    f.write("[\n")
                    f.write(json.dumps({"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0,
                                        "args": {"name": f"rank {self.pid}"}}))
                    self._started = True
                for event in events:
                    f.write(",\n" + json.dumps(event))

    def close(self) -> None:
        """Flushes and closes the array: the file is then strict JSON."""
        self.flush()
        with self._lock:
            if self._started and not self._closed:
                with self.path.open("a") as f:
                    f.write("\n]\n")
            if not self._closed:
                release(str(self.path))
            self._closed = True


def load(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file: array form (closed or not) or ``{"traceEvents": [...]}``."""
    text = Path(path).read_text().strip()
    if text.startswith("[") and not text.endswith("]"):
        text = text.rstrip(",") + "]"
    data = json.loads(text)
    return list(data["traceEvents"] if isinstance(data, dict) else data)


def merge(paths: list[str], out: str) -> int:
    """Joins several processes' traces into one file; returns the number of spans.

    Files whose ``pid`` collides with an earlier file's (two single-process runs, both rank 0)
    get the next free pid, so each file keeps a lane group of its own.
    """
    merged: list[dict[str, Any]] = []
    used: set[int] = set()
    for path in paths:
        events = load(path)
        remap = {}
        for pid in sorted({e.get("pid", 0) for e in events}):
            new = pid
            while new in used:
                new += 1
            remap[pid] = new
        used |= set(remap.values())
        merged += [dict(e, pid=remap[e.get("pid", 0)]) for e in events]
    Path(out).write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
    return sum(1 for e in merged if e.get("ph") == "X")


def trace_path(base: str, rank: int, processes: int) -> str:
    """Where a process writes its timeline: ``base`` alone, or ``<stem>.rank<r><suffix>`` for several processes."""
    if processes <= 1:
        return base
    p = Path(base)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}"))


_claimed: set[str] = set()
_claim_lock = threading.Lock()


def claim(path: str) -> str:
    """``path``, or ``<stem>.<n><suffix>`` while an open writer of this process uses it: several graphs (a
    training and an evaluation step) under one ``SBPFLOW_TRACE`` each keep a file of their own.

    >>> first, second = claim("/tmp/sbpflow-claim.json"), claim("/tmp/sbpflow-claim.json")
    >>> Path(second).name
    'sbpflow-claim.2.json'
    >>> release(first); release(second)
    """
    with _claim_lock:
        p, n, candidate = Path(path), 1, path
        while candidate in _claimed:
            n += 1
            candidate = str(p.with_name(f"{p.stem}.{n}{p.suffix}"))
        _claimed.add(candidate)
        return candidate


def release(path: str) -> None:
    """Frees a claimed path (its writer closed)."""
    with _claim_lock:
        _claimed.discard(path)
