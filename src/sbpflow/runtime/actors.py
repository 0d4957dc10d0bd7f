"""The actor runtime: worker threads drive the actors of :mod:`.board` through a physical plan.

It returns what :func:`~sbpflow.runtime.inorder.run_plan` returns, from the same bound kernels; only the
order differs: an actor acts as soon as its registers allow, so communication overlaps compute and
back-pressure bounds memory.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..boxing.execute import InFlight
from ..comm import Backend, SimulatedBackend, get_backend
from ..comm.record import CommLog, current_logs, recording_into
from ..distributed import activity, config
from ..errors import CommError, SbpflowError
from ..graph.fuse import FUSED, sub_nodes
from ..graph.physical import PhysicalPlan, PNode
from . import trace as _trace
from ._agree import check_same_plan
from .board import Actor, Board, Stats
from .inorder import (
    SEGMENT_MARKS,
    ExecutionError,
    Program,
    Shards,
    StepState,
    add_into,
    commit,
    in_flight_collectives,
    prepare_groups,
    program,
)
from .play import play
from .workers import CommWorker, ComputeWorker, Worker

IDLE_CHECK = 1.0  # seconds an idle worker waits before checking that its runtime is still in use
REPORT_ACTORS = 200  # the watchdog lists at most this many waiting actors, in plan order


class _Job:
    """One act taken by a worker: the actor's step, its input values and slots, the run it belongs to; then
    what the act gave (its values, CUDA event, wall-clock span for the timeline, or its error)."""

    __slots__ = ("actor", "step", "inputs", "read", "state", "gen", "values", "event", "start", "end", "error",
                 "marks")

    def __init__(self, actor: Actor, step: int, inputs: list[Any], read: list[Any], state: StepState,
                 gen: int) -> None:
        self.actor, self.step, self.inputs, self.read, self.state, self.gen = actor, step, inputs, read, state, gen
        self.values: list[Any] = []
        self.event: Any = None
        self.start = self.end = 0.0
        self.error: BaseException | None = None
        self.marks: list[Any] | None = None  # a fused act's per-rank clock reads, while a timeline is written


@contextlib.contextmanager
def _segment_marks(actor: Actor) -> Any:
    """Around a fused act while a timeline is written: the list its per-rank clock reads go to (see
    ``inorder.SEGMENT_MARKS``); None for any other act."""
    if actor.node.op != FUSED:
        yield None
        return
    marks: list[Any] = []
    SEGMENT_MARKS.spans = marks
    try:
        yield marks
    finally:
        SEGMENT_MARKS.spans = None


class DeadlockError(ExecutionError):
    """No actor acted for ``SBPFLOW_TIMEOUT`` seconds; the message lists what every waiting actor waits for."""


class ActorRuntime:
    """Runs a :class:`PhysicalPlan` on actors.

    Threads. Actors are grouped in lanes, one per (device, stream) (:func:`~sbpflow.runtime.board.lane_for`).
    A compute lane acts ready actors earliest plan position first, so producers run ahead until their
    registers are full; a ``comm:<key>`` lane acts in plan order, so every member of a group issues its
    collectives in one order (no deadlock). Under torch.distributed every lane has a thread and the caller's
    thread acts for the first compute lane; a process whose collectives all run in flight
    (:func:`~sbpflow.runtime.inorder.in_flight_collectives`) needs no comm thread. On virtual ranks the
    caller's thread acts for every lane (:func:`.play.play`, deterministic, :func:`.memory.dry_run`'s
    schedule; ``threads=True`` forces threads). Threads live across runs until :meth:`close`.

    Errors. The first exception in any actor stops the step and is raised in the caller's thread, naming the
    actor and its op (a CommError keeps its type); variables are written only after a step succeeded. On
    torch.distributed the processes first check that they hold the same plan (:mod:`._agree`).

    Watchdog. When no act starts or ends for ``timeout`` seconds (``SBPFLOW_TIMEOUT``), a DeadlockError lists
    every waiting actor, what it waits for, and each thread's last act.

    >>> import torch, sbpflow
    >>> from sbpflow import sbp as S
    >>> from sbpflow.runtime.builder import PlanBuilder
    >>> b = PlanBuilder()
    >>> x = b.input("x", (4,), sbpflow.placement("cpu", [0, 1]), (S.split(0),))
    >>> b.output("y", b.boxing(b.compute("relu", x), (S.broadcast,)))
    >>> with ActorRuntime(b.build()) as rt:
    ...     out = rt.run({"x": {0: torch.tensor([-1.0, 2.0]), 1: torch.tensor([3.0, -4.0])}}, {})
    >>> out["y"][1].tolist()
    [0.0, 2.0, 3.0, 0.0]
    """

    def __init__(self, plan: PhysicalPlan, backend: Backend | None = None, trace: str | None = None,
                 timeout: float | None = None, synthetic: Callable[[PNode], float] | None = None,
                 threads: bool | None = None) -> None:
        self.plan = plan
        self.backend = backend or get_backend()
        self.timeout = timeout if timeout is not None else config().timeout
        self.synthetic = synthetic  # synthetic time: seconds each act sleeps instead of running (see _act)
        check_same_plan(plan, self.backend)
        self._prepare_groups()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self.board = Board(plan, self.backend)
        self.threaded = self._use_threads(threads)
        self._workers: dict[str, Worker] = self._make_workers()
        self._trace = self._make_trace(trace)
        self._gen = 0  # a run's generation: results of acts from an abandoned run are dropped
        self._active = False
        self._closed = False
        self._error: BaseException | None = None
        self._state: StepState | None = None
        self._logs: tuple[CommLog, ...] = ()  # the caller's comm.record() logs: worker threads record into them
        self._progress = time.monotonic()  # when an act last started or ended (the watchdog's clock)
        self._callers = self._caller_lanes()
        self._program: Program | None = None  # the program whose kernels the actors' ``run`` holds
        # one thread: play.play acts for every lane, no queues, locks or hand-offs (on CUDA, every kernel goes
        # to the caller's stream in plan order, which orders them as the messages would)
        self._inline = not self.threaded
        # its kernels: send/recv in flight only on one thread (in_flight_collectives says why not with threads)
        self._prog = program(plan, self.backend, p2p=self._inline)
        if self._inline and self.backend.in_flight:
            # transfers in flight: the one thread posts them before it waits for any (play.play)
            self.board.issue_comm_first(set(in_flight_collectives(plan).values()))
        for worker in self._workers.values():
            if worker not in self._callers:
                worker.start(_thread_main, weakref.ref(self))
        if self._trace is not None:
            weakref.finalize(self, self._trace.close)  # a runtime dropped without close() still closes its file

    # -- set-up ------------------------------------------------------------------------------------

    def _prepare_groups(self) -> None:
        """Process groups for every communication node, on every process, before any thread runs."""
        prepare_groups(self.plan, self.backend)

    def _use_threads(self, threads: bool | None) -> bool:
        """Threads by default with synthetic time (stages overlap) and under torch.distributed where this process
        takes part in a collective that blocks until its peers reach it (one that is not issued in flight:
        :func:`~sbpflow.runtime.inorder.in_flight_collectives`); none on virtual ranks, where a collective is a
        local copy that cannot wait, nor where every collective here is in flight: the transport's threads move
        the bytes while the caller's thread computes, with no hand-off between Python threads (each costs up to
        a GIL switch interval), as DDP's buckets do."""
        if threads is not None:
            return threads
        if self.synthetic is not None:
            return True
        if isinstance(self.backend, SimulatedBackend):
            return False
        flying = in_flight_collectives(self.plan) if self.backend.in_flight else {}
        return any(n.is_comm and n.id not in flying and any(map(self.backend.owns, n.ranks)) for n in self.plan.nodes)

    def _make_workers(self) -> dict[str, Worker]:
        """A worker per lane; with threads, each CUDA lane gets a stream of its own (:mod:`._cuda`)."""
        lanes = sorted({a.lane for a in self.board.actors})
        workers: dict[str, Worker] = {}
        for lane in lanes:
            actors = [a for a in self.board.actors if a.lane == lane]
            cls = CommWorker if "/comm:" in lane else ComputeWorker
            device = self._device(lane) if self.threaded else None
            workers[lane] = cls(lane, self._lock, actors, self.plan.micro_batches, device)
        for actor in self.board.actors:  # CUDA: an act records an event only if another stream reads it
            actor.signals = any(workers[e.consumer.lane] is not workers[actor.lane]
                                for reg in actor.outputs for e in reg.readers)
        return workers

    def _caller_lanes(self) -> list[Worker]:
        """The lanes the caller's thread acts for during :meth:`run`; the others get threads of their own.

        With threads, the caller takes the first compute lane: a step that only computes never changes
        thread, and a run ends without a hand-off back (each costs up to a GIL switch interval). Without,
        the caller acts for every lane, earliest plan position first: deterministic, and the schedule
        :func:`~sbpflow.runtime.memory.dry_run` predicts.
        """
        if not self.threaded:
            return list(self._workers.values())
        compute = [w for lane, w in sorted(self._workers.items()) if "/comm:" not in lane]
        return compute[:1]

    def _device(self, lane: str) -> Any:
        """The CUDA device of a lane's stream: its first rank's (a multi-GPU lane of virtual ranks uses one
        stream on that device; under torch.distributed a process has one device)."""
        if not lane.startswith("cuda") or not self.board.owned_ranks:
            return None
        head = lane.split("/")[0]
        ranks = [int(r) for r in head.split(":")[1].split(",")] if ":" in head else self.board.owned_ranks
        return self.backend.device_for("cuda", ranks[0])

    def _make_trace(self, path: str | None) -> _trace.TraceWriter | None:
        path = path or os.environ.get("SBPFLOW_TRACE") or None
        if path is None:
            return None
        rank, processes = getattr(self.backend, "rank", 0), getattr(self.backend, "world_size", 1)
        return _trace.TraceWriter(_trace.trace_path(path, rank, processes), pid=rank)

    # -- public ------------------------------------------------------------------------------------

    @property
    def stats(self) -> Stats:
        """The last run's counters: acts, peak live bytes per rank, peak live slots per register."""
        return self.board.stats

    @property
    def timeline(self) -> _trace.TraceWriter | None:
        """The timeline this runtime writes (None without one); a source actor feeding it adds its lane there."""
        return self._trace

    def run(self, feeds: dict[str, Shards], variables: dict[str, Shards]) -> dict[str, Shards]:
        """Runs one step; same arguments and result as :func:`~sbpflow.runtime.inorder.run_plan`."""
        if self._closed:
            raise ExecutionError("this ActorRuntime was closed; make a new one to run the plan again")
        self._wait_idle()
        state = StepState(self.plan, feeds, variables)
        start = time.perf_counter()
        with self._lock:
            self._begin(state)
        try:
            self._wait_done()
        finally:
            if self._trace is not None:
                self._trace.flush()
        self.board.timed(time.perf_counter() - start)
        for worker in self._workers.values():
            worker.synchronize()
        self.backend.settle_sends()  # sends in flight that no act here waited for (a stage's activations)
        commit(state)
        return state.outputs

    def close(self) -> None:
        """Stops the worker threads (bounded wait) and closes the timeline file."""
        with self._lock:
            self._closed = True
            self._active = False
            for worker in self._workers.values():
                worker.notify()
        for worker in self._workers.values():
            worker.join(timeout=min(self.timeout, 5.0))
        if self._trace is not None:
            self._trace.close()

    def __enter__(self) -> ActorRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one run (the caller's thread) ------------------------------------------------------------

    def _begin(self, state: StepState) -> None:
        self._gen += 1
        self._state = state
        self._logs = current_logs()
        self._error = None
        self._active = True
        self._progress = time.monotonic()
        self.board.reset()
        self._bind_runs()
        for worker in self._workers.values():
            worker.reset()
        if not self._inline:  # play.play offers the actors itself
            for actor in self.board.actors:
                self._wake(actor)

    def _bind_runs(self) -> None:
        """Sets each actor's ``run`` (see :class:`~sbpflow.runtime.board.Actor`): the node's bound kernel from the
        plan's :class:`Program`, called directly for an act that needs nothing around it, so that such an act costs
        one call, as in the in-order executor; an accumulate or pack gets a closure over its actor. Acts that sleep
        (synthetic time), are recorded (``comm.record``) or traced keep :meth:`_perform`, and so do collectives on
        threads (:func:`activity` names their actor in comm errors; on one thread a collective is a local copy of
        virtual ranks, whose errors the step names by its failed act)."""
        plain = self.synthetic is None and not self._logs and self._trace is None
        prog = self._prog if plain else None
        if prog is self._program:
            return
        self._program = prog
        for actor in self.board.actors:
            actor.run = None if prog is None else _bound(actor, prog, self._inline)

    def _wait_done(self) -> None:
        """Acts for the caller's lanes and waits for the step's end, a failure, or the watchdog; whatever ends
        the wait ends the step (a KeyboardInterrupt too: the threads then take nothing more of this run)."""
        if self._inline:
            self._play()
            return
        lane = self._callers[0].cuda if self._callers else None
        with lane.current() if lane is not None else contextlib.nullcontext():  # the caller acts on its lane's stream
            self._serve_caller()

    def _serve_caller(self) -> None:
        finished: tuple[Worker, _Job] | None = None
        try:
            while True:
                with self._lock:
                    if finished is not None:
                        self._end(*finished)
                        finished = None
                    if self.board.all_done or self._error is not None:
                        error = self._error
                        break
                    worker = self._earliest()
                    job = self._next(worker) if worker is not None else None
                    if job is None:
                        self._idle_wait()
                        continue
                assert worker is not None  # the job came from it
                finished = (worker, self._act_one(worker, job))
        finally:
            with self._lock:
                self._stop()
        if error is not None:
            raise error

    def _play(self) -> None:
        """The step on the caller's thread alone (:func:`.play.play`): the schedule of the lanes' pick rules
        merged by priority, which is :func:`~sbpflow.runtime.memory.dry_run`'s. Nothing else can send a message,
        so when no actor can act before the end, the watchdog's report comes at once."""
        state, trace, workers = self._state, self._trace, self._workers
        assert state is not None
        perform = self._perform
        last: dict[str, Actor] = {}  # each lane's last actor (its act: the step before its next)

        def one(actor: Actor, step: int, inputs: list[Any]) -> list[Any]:
            last[actor.lane] = actor
            if trace is None:
                return perform(actor, step, inputs, state)
            start = time.time()
            with _segment_marks(actor) as marks:
                values = perform(actor, step, inputs, state)
            self._trace_span(workers[actor.lane], actor, step, start, time.time(), values, marks)
            return values

        try:
            try:
                play(self.board, one, state)
            except Exception as e:
                failed = self.board.failed
                if failed is None or failed[0].run is None or isinstance(e, _NAMED):
                    raise  # _perform named it already, or it names where it ran
                raise _named_error(failed[0], failed[1], e) from e
            if not self.board.all_done:
                now = time.monotonic()
                for lane, actor in last.items():
                    workers[lane].last = (actor, actor.step - 1, now)
                for lane, head in self.board.heads.items():
                    workers[lane].seek(head)  # the watchdog says whose turn each comm stream waits for
                report = self._stall_report()
                print(report, file=sys.stderr, flush=True)
                raise DeadlockError(report)
        finally:
            self._stop()

    def _earliest(self) -> Worker | None:
        """The caller's lane whose next act comes first in the plan (the only lane, when there is one)."""
        if len(self._callers) == 1:
            return self._callers[0]
        best: tuple[tuple[int, int, int], Worker] | None = None
        for worker in self._callers:
            head = worker.peek(self.board)
            if head is not None and (best is None or head < best[0]):
                best = (head, worker)
        return best[1] if best is not None else None

    def _idle_wait(self) -> None:
        """Under the lock: nothing to act here now; wait for a message, or raise the watchdog's report.

        When the caller acts for every lane, nothing else can send a message: the report comes at once."""
        left = self._progress + self.timeout - time.monotonic()
        if left <= 0 or not self.threaded:
            report = self._stall_report()
            print(report, file=sys.stderr, flush=True)
            raise DeadlockError(report)
        if self._callers:
            self._callers[0].wait(left)
        else:
            self._done.wait(left)

    def _notify_done(self) -> None:
        """Under the lock: the step ended or failed; wakes the caller wherever it waits."""
        self._done.notify_all()
        for worker in self._callers:
            worker.notify()

    def _stop(self) -> None:
        self._active = False
        self._gen += 1

    def _wait_idle(self) -> None:
        """Waits (bounded) for acts of an abandoned run that are still on their threads."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while any(w.running is not None for w in self._workers.values()):
                if time.monotonic() > deadline:
                    busy = [f"{w.lane}: {w.running[0].label()}" for w in self._workers.values() if w.running]
                    raise ExecutionError(f"acts of a failed step still run after {self.timeout:g} s: {busy}")
                self._done.wait(0.05)

    # -- worker threads -----------------------------------------------------------------------------

    def _serve(self, worker: Worker) -> bool:
        """A worker's loop: takes a job and acts outside the lock; ends one act and takes the next in one locked
        section. Returns when it has nothing to do: True to wait for more, False once closed."""
        finished: _Job | None = None
        while True:
            with self._lock:
                if finished is not None:
                    self._end(worker, finished)
                    finished = None
                job = self._next(worker)
            if job is None:
                return not self._closed
            finished = self._act_one(worker, job)

    def _next(self, worker: Worker) -> _Job | None:
        """The worker's next act, or None if it has none now (it then waits in :func:`_thread_main`)."""
        actor = worker.pick(self.board) if self._active and not self._closed else None
        if actor is None:
            return None
        step = actor.step
        inputs = self.board.take(actor)
        now = time.monotonic()
        worker.running = (actor, step, now)
        self._progress = now
        assert self._state is not None
        read = self.board.input_slots(actor) if worker.cuda is not None else []
        return _Job(actor, step, inputs, read, self._state, self._gen)

    def _act_one(self, worker: Worker, job: _Job) -> _Job:
        clock = time.time if self._trace is not None else _no_clock  # wall-clock times only for the timeline
        job.start = clock()
        try:
            if self._trace is not None and job.actor.node.op == FUSED:
                job.marks = SEGMENT_MARKS.spans = []
            run = job.actor.run
            if run is not None and worker.cuda is None:
                try:
                    job.values = run(job.inputs, job.state, job.step)
                except _NAMED:
                    raise
                except Exception as e:
                    raise _named_error(job.actor, job.step, e) from e
            elif worker.cuda is None:
                job.values = self._perform(job.actor, job.step, job.inputs, job.state)
            else:
                job.values, job.event = worker.cuda.run(
                    lambda: self._perform(job.actor, job.step, job.inputs, job.state), job.read, job.actor.signals)
        except BaseException as e:  # noqa: BLE001 - any failure stops the step; the caller re-raises it
            job.error = e
        finally:
            if job.marks is not None:
                SEGMENT_MARKS.spans = None
        job.end = clock()
        return job

    def _end(self, worker: Worker, job: _Job) -> None:
        """Under the lock: the act's messages (ready to consumers, free to producers), or the step's failure."""
        worker.running = None
        if job.gen != self._gen:
            self._done.notify_all()  # an act of an abandoned run: _wait_idle may be waiting for it
            return
        if job.error is not None:
            if self._error is None:
                self._error = job.error
            self._notify_done()
            return
        woken = self.board.finish(job.actor, job.values, job.event)
        worker.last = (job.actor, job.step, time.monotonic())
        self._progress = worker.last[2]
        if self._trace is not None:
            self._trace_span(worker, job.actor, job.step, job.start, job.end, job.values, job.marks)
        workers, board = self._workers, self.board
        for other in woken:
            if not other.busy and other.step < other.steps:  # most wake-ups end here
                workers[other.lane].wake(other, board)
        if board.finished == board.count:  # all_done
            self._notify_done()

    def _trace_span(self, worker: Worker, actor: Actor, step: int, start: float, end: float,
                    values: Sequence[Any] = (), marks: list[Any] | None = None) -> None:
        """The act's span on its lane; a collective issued in flight spans from its issue to the moment a reader
        has its result (an upper bound of its time on the wire: the reader may come after it ended). A fused
        act's ``marks`` (per rank: its start, then the end of each sub-node) add one span per sub-node inside
        the act's, named after the act and the sub-node's op (and the rank, where the act ran several)."""
        trace = self._trace
        assert trace is not None
        nbytes = sum(sum(r.bytes_by_rank.values()) for r in actor.outputs) if actor.emits(step) else 0
        lane, name, op = worker.lane, actor.node.label(), actor.node.op or actor.node.kind
        if values and values[0].__class__ is InFlight:
            values[0].waited = lambda: trace.span(lane, f"{name} (in flight)", op, micro=step, start=start,
                                                  end=time.time(), nbytes=nbytes)
            return
        trace.span(lane, name, op, micro=step, start=start, end=end, nbytes=nbytes)
        if marks:
            subs = sub_nodes(actor.node)
            for rank, times in marks:
                where = f" rank {rank}" if len(marks) > 1 else ""
                for k, sub in enumerate(subs):
                    sub_op = sub.op or sub.kind
                    trace.span(lane, f"{name}: {sub_op}{where}", sub_op, micro=step, start=times[k],
                               end=times[k + 1], nbytes=0)

    def _wake(self, actor: Actor) -> None:
        self._workers[actor.lane].wake(actor, self.board)

    # -- one act ----------------------------------------------------------------------------------

    def _perform(self, actor: Actor, step: int, inputs: list[Any], state: StepState) -> list[Any]:
        """One act under its name: comm errors say which actor they ran in; other errors are re-raised naming it."""
        try:
            if actor.gathers and self.synthetic is None:
                return self._gather(actor, step, inputs, state)  # local sums and joins: no collective to name
            with activity(_ActName(actor, step)):
                if self.synthetic is None and not self._logs:
                    return self._prog.acts[actor.node.id](inputs, state, step)  # the common case, one call less
                if not self._logs:
                    return self._act(actor, step, inputs, state)
                with recording_into(self._logs):
                    return self._act(actor, step, inputs, state)
        except _NAMED:
            raise  # CommError keeps its type (peer-failure handling reads it); both already name the actor
        except Exception as e:
            raise _named_error(actor, step, e) from e

    def _act(self, actor: Actor, step: int, inputs: list[Any], state: StepState) -> list[Any]:
        if self.synthetic is not None:
            return self._sleep(actor, step)
        if actor.gathers:
            return self._gather(actor, step, inputs, state)
        return self._prog.acts[actor.node.id](inputs, state, step)

    def _gather(self, actor: Actor, step: int, inputs: list[Any], state: StepState) -> list[Any]:
        """accumulate (running sums, one per input) or pack (the values so far) takes one micro-batch; writes on
        the last."""
        if actor.node.kind == "accumulate":
            actor.partial = add_into(actor.partial, inputs)
            return actor.partial if actor.emits(step) else []
        actor.partial = [*(actor.partial or []), inputs[0]]
        return self._prog.acts[actor.node.id]([actor.partial], state, step) if actor.emits(step) else []

    def _sleep(self, actor: Actor, step: int) -> list[Any]:
        """Synthetic time: the act sleeps for its given duration and writes placeholders (no kernel, no
        collective, no outputs or assigns). Sleeping threads overlap like devices, so a schedule's timeline
        and bubble can be measured on a machine with fewer cores than stages (issue 10)."""
        time.sleep(self.synthetic(actor.node) if self.synthetic is not None else 0.0)
        return [None] * len(actor.outputs) if actor.emits(step) else []

    # -- the watchdog's report ------------------------------------------------------------------------

    def _stall_report(self) -> str:
        now = time.monotonic()
        ranks = self.board.owned_ranks
        waiting = [a for a in self.board.actors if not a.done]
        why = (f"no actor acted for {self.timeout:g} s (SBPFLOW_TIMEOUT)" if self.threaded else
               "no actor can act (one thread acts for every actor here, so none can ever be freed)")
        lines = [f"sbpflow actor runtime: {why} on ranks {ranks}; "
                 f"{len(waiting)} of {len(self.board.actors)} actors have not finished:"]
        for a in waiting[:REPORT_ACTORS]:
            lines.append(f"  actor {a.label()} on {a.lane}, micro-batch {a.step}: " + self._waits_for(a))
        if len(waiting) > REPORT_ACTORS:
            lines.append(f"  ... and {len(waiting) - REPORT_ACTORS} more not listed")
        lines.append("last act on each thread:")
        for worker in self._workers.values():
            lines.append(f"  {worker.lane}: {worker.describe_last(now)}")
        return "\n".join(lines)

    def _waits_for(self, actor: Actor) -> str:
        worker = self._workers[actor.lane]
        if worker.running is not None and worker.running[0] is actor:
            return f"acting for {time.monotonic() - worker.running[2]:.1f} s"
        phrases = self.board.waits(actor) + worker.turn(actor)
        return "waits for " + "; ".join(phrases) if phrases else "ready, waiting for its thread"


def _no_clock() -> float:
    return 0.0


def _thread_main(ref: weakref.ref[ActorRuntime], worker: Worker) -> None:
    """A worker thread holds its runtime only while it acts; it waits holding nothing but a weak reference, so
    a runtime nobody uses any more (a Graph that recompiled for new shapes) is collected and its threads end,
    even without ``close()``. A wake-up sent between ``_serve`` and the wait is kept by the worker's signal."""
    if worker.cuda is not None:
        worker.cuda.enter()  # this thread's current stream, for good
    while True:
        runtime = ref()
        if runtime is None or not runtime._serve(worker):
            return
        del runtime
        with worker.cond:
            worker.wait(IDLE_CHECK)


class _ActName:
    """What a comm error says this thread was running; formatted only when an error needs it."""

    __slots__ = ("actor", "step")

    def __init__(self, actor: Actor, step: int) -> None:
        self.actor, self.step = actor, step

    def __call__(self) -> str:
        return f"actor {self.actor.node.label()} (micro-batch {self.step})"


def _bound(actor: Actor, prog: Program, inline: bool) -> Callable[[list[Any], StepState, int], list[Any]] | None:
    """``actor.run`` (see :meth:`ActorRuntime._bind_runs`): its kernel, a gathering closure, or None."""
    kernel = prog.acts[actor.node.id]
    if actor.node.kind == "accumulate":
        last = actor.steps - 1

        def accumulate(inputs: list[Any], state: StepState, step: int) -> list[Any]:
            actor.partial = add_into(actor.partial, inputs)  # running sums: each input slot is freed at once
            return actor.partial if step == last else []
        return accumulate
    if actor.node.kind == "pack":
        last = actor.steps - 1

        def pack(inputs: list[Any], state: StepState, step: int) -> list[Any]:
            actor.partial = [*(actor.partial or []), inputs[0]]
            return kernel([actor.partial], state, step) if step == last else []
        return pack
    if actor.node.kind in ("boxing", "route") and not inline:
        return None
    return kernel


_NAMED = (CommError, ExecutionError)  # errors an act raises as they are: they already say where they ran


def _named_error(actor: Actor, step: int, error: Exception) -> ExecutionError:
    kind = "" if isinstance(error, SbpflowError) else " (a kernel's own error)"
    return ExecutionError(f"actor {actor.label()} failed on micro-batch {step}{kind}: {type(error).__name__}: {error}")

