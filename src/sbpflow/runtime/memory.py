"""The memory plan: one step played without threads or kernels, with the runtime's own accounting."""

from __future__ import annotations

from ..comm import Backend
from ..graph.physical import PhysicalPlan
from .board import Board, Stats
from .errors import ExecutionError
from .play import play


def dry_run(plan: PhysicalPlan, backend: Backend) -> Stats:
    """Plays one step's messages on one thread, with no kernels: the acts and register counts of a run.

    Every thread's pick rule is kept (compute: earliest plan position first; a comm stream: its fixed
    order) and the threads are merged by plan position, so this is the runtime's schedule when
    communication takes no time. Its ``peak_bytes`` is what the runtime reports for such a run, which
    makes it the memory plan a compiler can predict with (the same accounting, not a second model).

    >>> import sbpflow
    >>> from sbpflow import sbp
    >>> from sbpflow.comm import SimulatedBackend
    >>> from sbpflow.runtime.builder import PlanBuilder
    >>> b = PlanBuilder(micro_batches=2)
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> b.output("y", b.pack(b.compute("relu", b.unpack(b.input("x", (8, 4), p, (sbp.split(0),))))))
    >>> stats = dry_run(b.build(), SimulatedBackend())
    >>> stats.acts, stats.peak_bytes   # the input or pack's output (64 B/rank), with two 32 B micro values
    (8, {0: 128, 1: 128})
    """
    board = Board(plan, backend)
    board.reset()
    play(board, lambda actor, step, inputs: [None] * len(actor.outputs) if actor.emits(step) else [])
    if not board.all_done:
        stuck = [f"{a.label()}: {'; '.join(board.waits(a)) or 'its turn on ' + a.lane}"
                 for a in board.actors if not a.done]
        raise ExecutionError("the plan cannot finish a step; waiting actors:\n  " + "\n  ".join(stuck))
    return board.stats
