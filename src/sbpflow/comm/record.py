"""Recording which collectives ran, on which ranks, with how many bytes.

>>> import sbpflow
>>> with sbpflow.comm.record() as log:
...     pass
>>> log.counts()
{}
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommEvent:
    """One collective call: its kind, the global ranks that took part, and bytes.

    ``bytes`` is the total number of bytes received over all ranks of the group
    (ring algorithms for all-reduce and reduce-scatter), so an even all-gather of
    a tensor of ``n`` bytes on ``p`` ranks records ``(p - 1) * n``.
    """

    kind: str
    ranks: tuple[int, ...]
    bytes: int
    note: str = ""


@dataclass
class CommLog:
    events: list[CommEvent] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Number of calls per collective kind."""
        return dict(Counter(e.kind for e in self.events))

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    def clear(self) -> None:
        self.events.clear()


_local = threading.local()


def _active() -> list[CommLog]:
    if not hasattr(_local, "logs"):
        _local.logs = []
    return _local.logs  # type: ignore[no-any-return]


@contextmanager
def record() -> Iterator[CommLog]:
    """Records every collective issued inside the block (nested blocks all see them)."""
    log = CommLog()
    _active().append(log)
    try:
        yield log
    finally:
        _active().remove(log)


def emit(kind: str, ranks: tuple[int, ...], nbytes: int, note: str = "") -> None:
    logs = _active()
    if logs:
        event = CommEvent(kind, tuple(ranks), int(nbytes), note)
        for log in logs:
            log.events.append(event)


def current_logs() -> tuple[CommLog, ...]:
    """The logs recording in this thread, for a worker thread to record into (:func:`recording_into`)."""
    return tuple(_active())


@contextmanager
def recording_into(logs: tuple[CommLog, ...]) -> Iterator[None]:
    """Records this thread's collectives into ``logs`` too: the actor runtime's worker threads issue
    collectives on behalf of a caller whose ``record()`` block must see them."""
    active = _active()
    added = [log for log in logs if all(log is not a for a in active)]  # by identity: logs compare by content
    active.extend(added)
    try:
        yield
    finally:
        del active[len(active) - len(added):]
