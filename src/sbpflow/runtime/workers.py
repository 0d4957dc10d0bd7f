"""The actor runtime's worker threads: one per (device type, stream), each with its own pick rule.

Every method but the thread's own loop runs under the runtime's lock.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from typing import Any

from ._cuda import CudaLane
from .board import Actor, Board, stream_order


class Worker:
    """A thread, its condition variable, and what it did last (for the watchdog)."""

    def __init__(self, lane: str, lock: threading.Lock, actors: list[Actor], micro_batches: int,
                 device: Any = None) -> None:
        self.lane = lane
        self.cond = threading.Condition(lock)
        self.actors = actors
        self.micro_batches = micro_batches
        self.running: tuple[Actor, int, float] | None = None  # (actor, step, start) while acting
        self.last: tuple[Actor, int, float] | None = None  # (actor, step, end) of the last act this run
        self.cuda = _cuda_lane(device)
        self.waiting = False  # in cond.wait(): only then does a wake-up need a notify (notify is not free)
        self.signal = False  # a wake-up came while the thread was not waiting: its next wait returns at once
        self._thread: threading.Thread | None = None

    def start(self, main: Callable[[Any, Worker], None], runtime: Any) -> None:
        self._thread = threading.Thread(target=main, args=(runtime, self), name=f"sbpflow {self.lane}", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def reset(self) -> None:
        """A new run (called in the caller's thread)."""
        self.last = None
        if self.cuda is not None:
            self.cuda.follow_caller()

    def wait(self, timeout: float) -> None:
        """Waits (lock held) for a wake-up, at most ``timeout`` seconds; returns at once if one came meanwhile."""
        if not self.signal:
            self.waiting = True
            self.cond.wait(timeout)
            self.waiting = False
        self.signal = False

    def notify(self) -> None:
        """Wakes the thread (lock held): something may be ready for it, or the runtime closed."""
        self.signal = True
        if self.waiting:
            self.cond.notify()

    def pick(self, board: Board) -> Actor | None:
        raise NotImplementedError

    def peek(self, board: Board) -> tuple[int, int, int] | None:
        """The priority (:meth:`Actor.priority`: schedule key, plan position, step) of what :meth:`pick` would
        return now, if any: one thread acting for several lanes takes the earliest
        (:class:`~sbpflow.runtime.actors.ActorRuntime` on virtual ranks), as :func:`dry_run` does."""
        raise NotImplementedError

    def wake(self, actor: Actor, board: Board) -> None:
        raise NotImplementedError

    def seek(self, head: int) -> None:
        """Sets a comm stream's next act (after :func:`.play.play` acted for it); nothing on a compute lane."""

    def turn(self, actor: Actor) -> list[str]:
        """Why ``actor`` is not this thread's next act although it may be ready (a comm stream's order)."""
        return []

    def synchronize(self) -> None:
        if self.cuda is not None:
            self.cuda.synchronize()

    def describe_last(self, now: float) -> str:
        if self.running is not None:
            actor, step, start = self.running
            return f"acting now: {actor.label()} micro-batch {step}, for {now - start:.1f} s"
        if self.last is None:
            return "no act in this run"
        actor, step, end = self.last
        return f"{actor.label()} micro-batch {step}, ended {now - end:.1f} s ago"


class ComputeWorker(Worker):
    """Acts whichever actor is ready, earliest plan position first (then earliest micro-batch; under a pipeline
    schedule, its stage's list first): producers run ahead until their registers are full, so the schedule is
    what the register counts allow, and ties go to the compiled order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._heap: list[tuple[int, int, int, Actor]] = []  # (Actor.priority, actor): unique, actors never compared

    def reset(self) -> None:
        super().reset()
        self._heap.clear()

    def pick(self, board: Board) -> Actor | None:
        if not self._heap:
            return None
        return heapq.heappop(self._heap)[-1]

    def peek(self, board: Board) -> tuple[int, int, int] | None:
        return (self._heap[0][0], self._heap[0][1], self._heap[0][2]) if self._heap else None

    def wake(self, actor: Actor, board: Board) -> None:
        if board.ready(actor):
            actor.busy = True  # queued: ready() says no until it has acted
            step, keys = actor.step, actor.keys  # Actor.priority, written out (a call per wake-up costs)
            heapq.heappush(self._heap, (keys[step] if keys is not None else 0, actor.position, step, actor))
            self.signal = True  # notify(), written out
            if self.waiting:
                self.cond.notify()


class CommWorker(Worker):
    """Acts its actors in the plan's order for its stream (pre, micro-batches 0..m-1, post), waiting for the head
    to be ready. Every member of a group derives the same sequence, so collectives meet in one order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sequence = stream_order(self.actors, self.micro_batches)
        self._next = 0

    def reset(self) -> None:
        super().reset()
        self._next = 0

    def pick(self, board: Board) -> Actor | None:
        if self._next >= len(self.sequence):
            return None
        actor, step = self.sequence[self._next]
        if actor.step != step or not board.ready(actor):
            return None
        self._next += 1
        return actor

    def peek(self, board: Board) -> tuple[int, int, int] | None:
        if self._next >= len(self.sequence):
            return None
        actor, step = self.sequence[self._next]
        return actor.priority(step) if actor.step == step and board.ready(actor) else None

    def wake(self, actor: Actor, board: Board) -> None:
        if self._next < len(self.sequence) and self.sequence[self._next][0] is actor:
            self.notify()

    def seek(self, head: int) -> None:
        self._next = head

    def turn(self, actor: Actor) -> list[str]:
        if self._next >= len(self.sequence):
            return []
        head, step = self.sequence[self._next]
        if head is actor:
            return []
        return [f"its turn on {self.lane}, after actor {head.label()} micro-batch {step}"]


def _cuda_lane(device: Any) -> Any:
    if device is None:
        return None
    return CudaLane(device)
