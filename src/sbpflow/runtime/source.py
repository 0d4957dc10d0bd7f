"""Source actors: producers that feed a plan's ``input`` nodes across step boundaries (a data loader's batches).

A source acts on a thread of its own under the actors' register protocol, so at most ``register_num``
values are loaded ahead of the consumer.

>>> src = SourceActor(iter(range(3)), register_num=2, name="numbers")
>>> [src.take() for _ in range(3)]
[0, 1, 2]
>>> src.stats.peak_ahead <= 2
True
>>> src.close()
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import ExecutionError
from .trace import TraceWriter

IDLE_CHECK = 1.0  # seconds a waiting source thread waits before checking that its actor is still in use
PENDING_SPANS = 4096  # spans kept while no timeline is attached yet (the oldest are dropped beyond)
_END = object()  # the producer's end of data, queued like a value so it arrives after every value before it


@dataclass
class SourceStats:
    """Counters of a source actor (read them any time; the source keeps counting)."""

    loaded: int = 0  # values produced (acts)
    taken: int = 0  # values the consumer took (frees sent back)
    peak_ahead: int = 0  # most values ever loaded and not yet taken: at most register_num
    full_waits: int = 0  # times the source waited on a full set of registers (back-pressure)
    load_seconds: float = 0.0  # time spent producing
    take_wait_seconds: float = 0.0  # time the consumer waited for a ready register (a data-bound step)


@dataclass(frozen=True)
class _Span:
    start: float  # wall clock (time.time) for the timeline
    end: float
    index: int
    nbytes: int


class SourceActor:
    """Produces ``producer``'s values ahead of the consumer into ``register_num`` registers.

    It acts when a register is free (and the producer not exhausted) and sends "ready"; :meth:`take` reads
    the oldest ready register and sends "free", so while step t computes the source loads t+1 .. t+k, then
    waits. ``register_num=0``: no actor, :meth:`take` produces in the caller's thread. The producer is any
    iterator: its end makes :meth:`take` raise StopIteration; its error is raised in the consumer's thread at
    the position it happened, naming the source, and ends the source.

    ``measure(value)`` gives the bytes a value holds, for the timeline (default 0); ``device`` names the
    lane's device type. :attr:`timeline` can be attached at any time: spans made before are kept until then.
    """

    def __init__(self, producer: Iterator[Any], register_num: int, name: str = "source", *, device: str = "cpu",
                 measure: Callable[[Any], int] | None = None) -> None:
        if not isinstance(register_num, int) or register_num < 0:
            raise ExecutionError(f"source actor {name!r}: register_num must be an int >= 0 (0: no prefetch), "
                                 f"but got {register_num!r}")
        self.name = name
        self.lane = f"{device}/source:{name}"
        self.register_num = register_num
        self.stats = SourceStats()
        self._producer = producer
        self._measure = measure or (lambda value: 0)
        self._ready: deque[Any] = deque()  # the registers holding values, oldest first
        self._error: BaseException | None = None
        self._error_at = -1  # the index of the value whose production failed
        self._closed = False
        self._timeline: TraceWriter | None = None
        self._spans: deque[_Span] = deque(maxlen=PENDING_SPANS)  # spans not yet written (no timeline yet)
        self._record = True  # False once the consumer said there is no timeline (attached None)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if register_num > 0:
            self._thread = threading.Thread(target=_source_main, args=(weakref.ref(self), self._cond),
                                            name=f"sbpflow {self.lane}", daemon=True)
            self._thread.start()

    # -- the consumer's side -----------------------------------------------------------------------

    def take(self) -> Any:
        """The next value (waits for a ready register, then frees it); ``StopIteration`` at the end of data."""
        if self.register_num == 0:
            return self._take_inline()
        start = time.perf_counter()
        with self._cond:
            while not self._ready and self._error is None and not self._closed:
                self._cond.wait(0.5)
                if not self._ready and self._thread is not None and not self._thread.is_alive() \
                        and self._error is None:
                    raise ExecutionError(f"source actor {self.name!r}: its thread ended without a value or an error")
            self.stats.take_wait_seconds += time.perf_counter() - start
            if not self._ready:
                if self._error is not None:
                    raise self._named(self._error) from self._error
                raise ExecutionError(f"source actor {self.name!r} was closed")
            value = self._ready.popleft()
            if value is _END:
                self._ready.appendleft(_END)  # the end stays: every later take ends too
                raise StopIteration
            self.stats.taken += 1
            self._cond.notify_all()  # "free": the source may act again
        time.sleep(0)  # lets the woken source take the interpreter now, so its act starts before the step's
        return value

    def _take_inline(self) -> Any:
        value = self._produce_one() if self._error is None else None
        if value is _END:
            raise StopIteration
        if self._error is not None:
            raise self._named(self._error) from self._error
        self.stats.taken += 1
        return value

    def close(self) -> None:
        """Stops the source (a value being produced is finished, then dropped) and writes pending spans."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._write_spans()
        if self._timeline is not None:
            self._timeline.flush()

    @property
    def timeline(self) -> TraceWriter | None:
        return self._timeline

    @timeline.setter
    def timeline(self, writer: TraceWriter | None) -> None:
        """Attaches a timeline (the consumer's runtime's): the source's spans go to its own lane there."""
        with self._cond:
            self._timeline = writer
            self._record = writer is not None
            if writer is None:
                self._spans.clear()
        self._write_spans()

    # -- the source's thread ---------------------------------------------------------------------------

    def _act_if_free(self) -> bool | None:
        """One turn of the source's thread: produces a value if a register is free. Returns None when the source
        is done (closed, failed or at the end), True when it acted, False when every register is full."""
        with self._cond:
            if self._closed:
                return None
            if len(self._ready) >= self.register_num:
                self.stats.full_waits += 1
                return False
        value = self._produce_one()
        with self._cond:
            if self._closed:
                return None
            if self._error is not None:
                self._cond.notify_all()
                return None
            self._ready.append(value)
            if value is not _END:
                self.stats.peak_ahead = max(self.stats.peak_ahead, len(self._ready))
            self._cond.notify_all()  # "ready"
        self._write_spans()
        return None if value is _END else True

    def _full(self) -> bool:
        return len(self._ready) >= self.register_num and not self._closed

    def _produce_one(self) -> Any:
        """One act: the producer's next value (or the end); a failure is kept for the consumer."""
        index = self.stats.loaded
        wall, start = time.time(), time.perf_counter()
        try:
            value = next(self._producer)
        except StopIteration:
            return _END
        except BaseException as e:  # noqa: BLE001 - raised in the consumer's thread by take()
            with self._cond:
                self._error, self._error_at = e, index
            return None
        seconds = time.perf_counter() - start
        span = _Span(wall, wall + seconds, index, self._measure(value))
        with self._cond:
            self.stats.loaded += 1
            self.stats.load_seconds += seconds
            if self._record:
                self._spans.append(span)
        return value

    def _write_spans(self) -> None:
        with self._cond:
            writer = self._timeline
            if writer is None or not self._spans:
                return
            spans = list(self._spans)
            self._spans.clear()
        for s in spans:
            writer.span(self.lane, f"source {self.name} #{s.index}", "load", micro=s.index, start=s.start,
                        end=s.end, nbytes=s.nbytes)

    def _named(self, error: BaseException) -> ExecutionError:
        return ExecutionError(f"source actor {self.name!r} failed producing value #{self._error_at}: "
                              f"{type(error).__name__}: {error}")


def _source_main(ref: weakref.ref[SourceActor], cond: threading.Condition) -> None:
    """The source's thread holds its actor only while it acts; it waits on full registers holding a weak reference
    and the condition alone, so a source nobody consumes any more (an abandoned iteration) is collected, its
    ``close`` runs, and the thread ends."""
    while True:
        source = ref()
        if source is None:
            return
        acted = source._act_if_free()
        if acted is None:
            return
        if acted:
            continue
        del source
        with cond:
            source = ref()
            if source is None:
                return
            if source._full():
                del source
                cond.wait(IDLE_CHECK)  # back-pressure: every register holds a value not yet taken
