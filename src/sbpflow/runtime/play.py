"""The play loop: one thread acts for every lane of a :class:`~.board.Board`, the board's messages in one loop.

It is the runtime on virtual ranks, where an act's bookkeeping is set against a kernel of a few microseconds.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable
from typing import Any

from .board import Actor, Board, RegisterState, Slot, _slot
from .errors import ExecutionError

# What play keeps cheap (benchmarks/runtime_overhead.py): each actor counts its inputs with an empty queue
# (`missing`), so readiness is one check, not a scan of every input (an optimizer update reads a hundred buffers,
# and each of them wakes it); an actor is offered only when a message may have made it ready; where at most one
# value of a register can be live for its readers (one reader, or one slot), the queues hold the value itself and
# the register counts the reads (no Slot object); an act with such values only, no control edge and no comm turn
# (most acts) walks tuples built once (board._prepare_play) and tests no flag that cannot be set for it; claims
# and frees are logged and counted (bytes and slots, and their peaks) only when first asked for; a run of
# variables next to each other in the plan is one pick; and the heap holds ints. The messages, the schedule and
# every count are the ones Board.take and Board.finish give (tests/logic/test_runtime_actors.py plays both).


def play(board: Board, perform: Callable[[Actor, int, list[Any]], list[Any]], state: Any = None) -> None:
    """Acts every ready actor on the calling thread until none can, lanes merged by priority (schedule key, plan
    position, step); ``perform(actor, step, inputs)`` (or ``actor.run``) runs an act. An exception ends the play
    (:attr:`Board.failed` says where); the caller checks :attr:`Board.all_done`; once per :meth:`Board.reset`."""
    # The same messages as :meth:`Board.take` and :meth:`Board.finish`, written out in one loop (this is the
    # runtime's hot path on one thread: a call costs as much as a message here). One heap holds every ready act (a
    # comm stream offers only its head); priorities are unique (one entry per actor, positions differ), so actors
    # are never compared. An actor is offered to the heap only when a message may have made it ready: its last
    # missing input arrived (:attr:`Actor.missing` fell to 0), a register of its went from full to one free slot, a
    # control token came, its own act ended, or its comm stream's turn came to it. Claims and frees are logged and
    # counted when first read (:attr:`stats`, :attr:`live_bytes`; :meth:`Board._count_bytes`): the same peaks of
    # bytes and of slots as counting on every claim.
    #
    # Most acts take the short path (:attr:`Actor.fast`, set by :func:`_prepare_play`): inputs and outputs passed as
    # values, no control edge, no comm turn, so that an act walks tuples built once (its input queues, (queue,
    # register) pairs to free, each output's (queue, reader) pairs) and tests no flag that cannot be set for it. The
    # others (a comm stream's acts, control edges, :class:`Slot` registers, inputs from another process, a run of
    # variables) take the general path below it: the same messages.
    heap: list[int] = []  # codes (key * span + position): unique, as one actor is in the heap at most once
    # the ready act with the lowest code offered since the last pick, in front of the heap: an act that readies
    # only its reader (a chain) hands it over without a push and a pop
    ahead: Actor | None = None
    ahead_code = 0
    streams, heads, push, pop = board.streams, board.heads, heapq.heappush, heapq.heappop
    by_position, span = board._by_position, len(board._by_position)
    log: list[Any] = []  # claims (a register) and frees (its ``release`` twin)
    note = log.append
    first = operator.itemgetter(0)
    acts = finished = 0

    def offer(actor: Actor) -> None:
        """Queues ``actor`` if it can act (callers checked that no input is missing, and busy and done):
        :meth:`ready` written out."""
        nonlocal ahead, ahead_code
        step = actor.step
        if not actor.fast:  # a fast actor has no comm turn and no control edge to check
            if actor.comm:
                seq, i = streams[actor.lane], heads[actor.lane]
                if i >= len(seq) or seq[i][0] is not actor:
                    return
            if actor.gated:
                for edge in actor.controls:
                    if len(edge.queue) < edge.tokens_needed():
                        return
        if not actor.gathers or step == 0:
            for reg in actor.outputs:
                if reg.free <= 0:
                    return
        actor.busy = True
        code = actor.codes[step]
        if ahead is None:
            ahead, ahead_code = actor, code
        elif code < ahead_code:
            push(heap, ahead_code)
            ahead, ahead_code = actor, code
        else:
            push(heap, code)

    def send(reg: RegisterState, value: Any, micro: int) -> None:
        """A written slot to the register's readers (the main loop below writes this out)."""
        readers = reg.readers
        if not readers:
            reg.free += 1  # nobody here reads it: the slot is free again at once
            note(reg.release)
            return
        if reg.direct:
            reg.left = len(readers)
            slot: Any = value
        else:
            slot = _slot(reg, value, micro)
        for edge in readers:
            queue = edge.queue
            queue.append(slot)
            if len(queue) == 1:
                other = edge.consumer
                other.missing -= 1
                if not other.missing and not other.busy and other.step < other.steps:
                    offer(other)

    for actor in board._starters:
        if not actor.missing and not actor.busy and actor.step < actor.steps:
            offer(actor)
    step = 0
    try:
        while True:
            actor = ahead  # type: ignore[assignment]
            if actor is not None and (not heap or ahead_code < heap[0]):
                ahead = None
            elif heap:
                actor = by_position[pop(heap) % span]  # type: ignore[assignment]  # only actors are pushed
            else:
                break
            step = actor.step
            gathers, outputs = actor.gathers, actor.outputs
            if actor.fast:
                # take: claim the output slots, read the inputs (each queue's head is the value itself)
                if not gathers or step == 0:
                    for reg in outputs:
                        reg.free -= 1
                        note(reg)
                queues = actor.queues
                arity = actor.arity
                if arity == 1:
                    inputs = [queues[0][0]]
                elif arity == 2:
                    inputs = [queues[0][0], queues[1][0]]
                else:
                    inputs = [*map(first, queues)]
                run = actor.run
                values = run(inputs, state, step) if run is not None else perform(actor, step, inputs)
                # finish: "ready" to the consumers, "free" to the producers; offers follow the messages that may
                # make an actor ready (the module docstring's rules), after the state they read is written
                if outputs and (not gathers or step == actor.steps - 1):
                    if len(values) != len(outputs):
                        raise ExecutionError(f"{actor.label()} returned {len(values)} values for its "
                                             f"{len(outputs)} outputs")
                    reg = actor.single  # type: ignore[assignment]
                    if reg is not None:  # the usual case: one output, its value put in each reader's queue
                        reg.left = reg.fanout  # read only where shared: a store costs less than a check
                        value = values[0]
                        for queue, other in reg.targets:
                            queue.append(value)
                            if len(queue) == 1:
                                other.missing -= 1
                                if not other.missing and not other.busy and other.step < other.steps:
                                    offer(other)
                    else:  # (zip(strict=True) would cost more than this whole block: the lengths were checked)
                        for reg, value in zip(outputs, values, strict=False):
                            reg.left = reg.fanout
                            for queue, other in reg.targets:
                                queue.append(value)
                                if len(queue) == 1:
                                    other.missing -= 1
                                    if not other.missing and not other.busy and other.step < other.steps:
                                        offer(other)
                missing = 0  # every queue had a value at the pick; count the ones emptied now
                for queue, reg in actor.drops:
                    queue.popleft()
                    if not queue:
                        missing += 1
                    if reg.shared:
                        reg.left -= 1
                        if reg.left:
                            continue
                    reg.free += 1
                    note(reg.release)
                    if reg.again and reg.free == 1:  # was full: its producer may act again
                        other = reg.producer
                        if not other.missing and not other.busy and other.step < other.steps:
                            offer(other)
                for edge in actor.repeats:  # a value read on every micro-batch: freed after its last read
                    edge.reads += 1
                    if edge.reads < edge.reads_per_slot:
                        continue
                    edge.reads = 0
                    queue = edge.queue
                    queue.popleft()
                    if not queue:
                        missing += 1
                    reg = edge.register  # type: ignore[assignment]  # a fed edge has one
                    if reg.shared:
                        reg.left -= 1
                        if reg.left:
                            continue
                    reg.free += 1
                    note(reg.release)
                    if reg.again and reg.free == 1:
                        other = reg.producer
                        if not other.missing and not other.busy and other.step < other.steps:
                            offer(other)
                actor.missing = missing
                actor.step = step = step + 1
                actor.busy = False
                acts += 1
                if step >= actor.steps:
                    finished += 1
                elif not missing:
                    offer(actor)
                continue
            sources = actor.sources
            if sources is not None:  # a run of variables (_group_sources): each one's act, in plan order
                for actor, reg in sources:
                    reg.free -= 1
                    note(reg)
                    run = actor.run
                    value = (run([], state, 0) if run is not None else perform(actor, 0, []))[0]
                    actor.step = 1
                    if not reg.direct:
                        send(reg, value, 0)
                        continue
                    reg.left = reg.fanout
                    for queue, other in reg.targets:
                        queue.append(value)
                        if len(queue) == 1:
                            other.missing -= 1
                            if not other.missing and not other.busy and other.step < other.steps:
                                offer(other)
                sources[0][0].busy = False  # the leader: the others were never offered
                acts += len(sources)
                finished += len(sources)
                continue
            # the general path: the short path's messages, and Slots, control tokens, comm turns, absent inputs
            if outputs and (not gathers or step == 0):
                for reg in outputs:
                    reg.free -= 1
                    note(reg)
            fed = actor.fed
            inputs = [(e.queue[0] if e.direct else e.queue[0].value) if e.producer is not None else {}
                      for e in actor.inputs]
            run = actor.run
            if actor.transient is not None:
                note(actor.transient)
            values = run(inputs, state, step) if run is not None else perform(actor, step, inputs)
            if actor.transient is not None:
                note(actor.transient.release)
            if outputs and (not gathers or step == actor.steps - 1):
                if len(values) != len(outputs):
                    raise ExecutionError(f"{actor.label()} returned {len(values)} values for its "
                                         f"{len(outputs)} outputs")
                for reg, value in zip(outputs, values, strict=False):
                    send(reg, value, 0 if gathers else step)
            if actor.control_out:
                for edge in actor.control_out:
                    edge.queue.append(Slot(None, step, 1, None))
                    other = edge.consumer
                    if not other.missing and not other.busy and other.step < other.steps:
                        offer(other)
            for edge in fed:
                if edge.reads_per_slot > 1:
                    edge.reads += 1
                    if edge.reads < edge.reads_per_slot:
                        continue
                    edge.reads = 0
                queue = edge.queue
                if edge.direct:
                    queue.popleft()
                    if not queue:
                        actor.missing += 1
                    reg = edge.register  # type: ignore[assignment]  # a fed edge has one
                    if reg.shared:
                        reg.left -= 1
                        if reg.left:
                            continue
                else:
                    slot = queue.popleft()
                    if not queue:
                        actor.missing += 1
                    slot.reads_left -= 1
                    if slot.reads_left:
                        continue
                    reg = slot.register
                    slot.value = None  # the value may be freed now
                    reg.spare.append(slot)
                reg.free += 1
                note(reg.release)
                if reg.again and reg.free == 1:  # was full: its producer may act again
                    other = reg.producer
                    if not other.missing and not other.busy and other.step < other.steps:
                        offer(other)
            if actor.gated:
                for edge in actor.controls:
                    if edge.reads_per_slot > 1:
                        edge.reads += 1
                        if edge.reads < edge.reads_per_slot:
                            continue
                        edge.reads = 0
                    edge.queue.popleft()  # a control token: no register, no value
            actor.step = step = step + 1
            actor.busy = False
            acts += 1
            if actor.comm:  # its stream's turn passes on first: offer() checks it, for this actor too
                seq = streams[actor.lane]
                i = heads[actor.lane] = heads[actor.lane] + 1
                if i < len(seq):
                    other = seq[i][0]
                    if other is not actor and not other.missing and not other.busy and other.step < other.steps:
                        offer(other)
            if step >= actor.steps:
                finished += 1
            elif not actor.missing:  # most often an input is missing now: no call
                offer(actor)
    except BaseException:
        board.failed = (actor, step)
        raise
    finally:
        board._stats.acts += acts
        board.finished += finished
        board._unsettled = log  # counted when stats or live_bytes are read (most steps, nobody asks)
