"""Actors and registers: the dependency state of one step, with no threads in it (ActorRuntime drives it).

Each node this process runs is an :class:`Actor`, each output buffer a :class:`RegisterState` of
``register_num`` slots. An actor acts when every input has a ready slot and every output a free one, then
sends "ready" to its consumers and "free" back to its producers: back-pressure comes from that alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..comm import Backend
from ..graph.fuse import FUSED, transient_bytes
from ..graph.physical import COMPUTE_STREAM, GATHERING, PhysicalPlan, PNode
from .errors import ExecutionError


@dataclass(eq=False, slots=True)
class Slot:
    """A written register slot: the value, its micro-batch, and the reads still to come."""

    value: Any
    micro: int
    reads_left: int
    register: RegisterState | None  # None: a control token (no memory, no bound)
    event: Any = None  # CUDA: (stream, event) recorded after the write, if another stream reads it (runtime._cuda)


@dataclass(eq=False, slots=True)
class RegisterState:
    """One buffer's register: ``capacity`` slots, ``free`` of them writable now."""

    buf: int
    capacity: int
    bytes_by_rank: dict[int, int]  # one slot's bytes on each owned rank; {} for a variable (counted as resident)
    producer: Actor
    readers: list[InEdge] = field(default_factory=list)
    free: int = 0
    resident: dict[int, int] = field(default_factory=dict)  # a variable's bytes: live for the whole step
    watch: tuple[str, ...] = ()  # the plan.watch sets this buffer belongs to
    sizes: tuple[tuple[int, int], ...] = ()  # bytes_by_rank's items, for the per-act count (set by Board)
    release: _Release = field(init=False)  # this register's entry for a free in play.play's log
    spare: list[Slot] = field(default_factory=list)  # play.play: slot objects freed by all readers, for reuse
    # set by Board once wired, read by play where a check of a list or another object would cost a memory access:
    again: bool = False  # its producer acts more than once: a freed slot may let it act again
    # play.play queues a value itself (no Slot) when only one can be live for its readers: one reader, or one slot
    # (all readers then read the same value, so the register counts their reads in ``left``)
    direct: bool = False
    shared: bool = False  # direct with several readers (so one slot): ``left`` counts the reads to come
    left: int = 0
    fanout: int = 0  # len(readers)
    targets: tuple[tuple[deque[Any], Actor], ...] = ()  # play.play: each reader's (queue, actor), for a direct send

    def __post_init__(self) -> None:
        self.release = _Release(self)

    @property
    def live(self) -> int:
        return self.capacity - self.free


@dataclass(eq=False, slots=True)
class _Release:
    """A free of ``register``'s slot, as logged by :meth:`play.play`."""

    register: RegisterState


@dataclass(eq=False, slots=True)
class InEdge:
    """One input (or control dependency) of an actor: the queue of slots its producer sent it."""

    consumer: Actor
    buf: int | None  # None: a control edge
    producer: Actor | None  # None: written by a node this process does not run (reads as {})
    reads_per_slot: int  # m for a once-written value read by an m-step actor, else 1
    lead: int = 0  # a control edge: step k waits for the source's step k + lead (pipeline schedules)
    orphan: bool = False  # no node of the plan writes it (a corrupt plan): it never becomes ready
    queue: deque[Any] = field(default_factory=deque)  # Slots; under play.play, values for a ``direct`` edge
    reads: int = 0  # reads of the head slot so far
    register: RegisterState | None = None  # the register it reads (None: a control edge, or nothing here writes it)
    direct: bool = False  # its register is direct: play.play queues the values themselves, no Slot

    @property
    def waits(self) -> bool:
        if self.orphan:
            return True
        if self.producer is None:
            return False
        return len(self.queue) < self.tokens_needed()

    def tokens_needed(self) -> int:
        """Slots (or control tokens) the consumer's next step needs here: 1, or 1 + lead on a lead control edge
        (fewer near the end, when the source has no more steps to give)."""
        if self.lead == 0:
            return 1
        return min(self.lead + 1, self.consumer.steps - self.consumer.step)

    def describe(self) -> str:
        if self.orphan:
            return f"register %{self.buf} (no node of the plan writes it)"
        what = f"register %{self.buf}" if self.buf is not None else "a control token"
        if self.lead:
            what += f" (lead {self.lead}: the source's micro-batch {self.consumer.step + self.lead})"
        source = self.producer.node.label() if self.producer is not None else "no actor of this process"
        return f"{what} from actor {source}"


@dataclass(eq=False, slots=True)
class Actor:
    """A node of the plan as this process runs it.

    A ``micro`` actor acts once per micro-batch (m steps), ``pre``/``post`` ones once. ``accumulate`` and
    ``pack`` take their m inputs one step at a time (each input slot freed at once) and write their output on
    the last step, holding that slot from the first (as the memory count charges them). A value written once
    and read by an actor that acts m times (``repeat``, a micro actor reading a ``pre`` buffer) stays in its
    slot until the m-th read. ``control`` edges are slots with no value and no bound: ordering only. A buffer
    whose producer this process does not run (the source side of a cross-placement boxing) reads as ``{}``.
    """

    node: PNode
    position: int  # index in the plan's list: the compute thread's priority (earlier first)
    steps: int  # acts per run: m for micro actors and for accumulate/pack, else 1
    lane: str  # the worker thread that runs it: "<device type>/<stream>"
    inputs: list[InEdge] = field(default_factory=list)
    controls: list[InEdge] = field(default_factory=list)
    outputs: list[RegisterState] = field(default_factory=list)
    control_out: list[InEdge] = field(default_factory=list)
    step: int = 0  # the next step to act
    busy: bool = False  # acting now, or queued on its thread
    partial: Any = None  # accumulate: the running sums (one per input); pack: the values so far
    keys: tuple[int, ...] | None = None  # per step: its pipeline schedule priority (plan.pipeline), lower first
    gathers: bool = field(init=False)  # accumulate or pack: m reads, one write (checked on every act)
    # Precomputed by Board once wired, so that the per-act checks walk plain lists:
    fed: list[InEdge] = field(default_factory=list)  # inputs written by an actor of this process
    blocked: bool = False  # an input nobody writes (a corrupt plan): never ready
    # fed inputs with an empty queue (+1 if blocked): the next step's inputs are all there when it is 0. Kept by
    # every send (a slot into an empty queue: -1) and every release (a queue emptied: +1), so that a check is O(1)
    # (an optimizer update reads 100+ buffers, and is woken by each of them)
    missing: int = 0
    arity: int = -1  # len(inputs) when every input is fed (the usual case: play.play reads them without a loop)
    gated: bool = False  # it has control inputs
    codes: tuple[int, ...] = ()  # play.play's heap entry per step: key * len(plan.nodes) + position (key 0: none)
    # play.play's short path (see Board._prepare_play): an act with no comm turn, control edge, Slot or absent input
    fast: bool = False
    queues: tuple[deque[Any], ...] = ()  # its inputs' queues, in input order (a fast actor's inputs are all fed)
    drops: tuple[tuple[deque[Any], RegisterState], ...] = ()  # (queue, register) of inputs read once per slot
    repeats: tuple[InEdge, ...] = ()  # inputs read on several steps (reads_per_slot > 1): counted per read
    single: RegisterState | None = None  # its one output register, if it has exactly one
    # play.play: the run of variables this one leads, each with its register
    # (see Board._group_sources)
    sources: list[tuple[Actor, RegisterState]] | None = None
    led: bool = False  # a variable acted by the run's leader, never offered on its own by play.play
    comm: bool = False  # on a communication lane (acts in its stream's fixed order)
    signals: bool = False  # CUDA threads: a reader on another stream waits for this actor's event
    # set by the runtime for a run: the node's bound kernel, ``run(inputs, state, step)``, when an act needs nothing
    # around it (no collective to name, no gathering, no timeline, no synthetic time); None: the runtime's own path
    run: Callable[[list[Any], Any, int], list[Any]] | None = None
    # a fused segment's intermediates (graph.fuse.transient_bytes): bytes its act holds besides its registers,
    # counted as a register claimed for the act alone (buf id -1 - node id, never a slot of the plan); None: none
    transient: RegisterState | None = None

    def __post_init__(self) -> None:
        self.gathers = self.node.kind in GATHERING
        self.comm = "/comm:" in self.lane

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    def emits(self, step: int) -> bool:
        return not self.gathers or step == self.steps - 1

    def acquires(self, step: int) -> bool:
        return not self.gathers or step == 0

    def label(self) -> str:
        op = f" (op {self.node.op})" if self.node.op else ""
        return f"{self.node.label()}{op}"

    def priority(self, step: int) -> tuple[int, int, int]:
        """The compute thread's order: the schedule's action index (if any), then plan position, then step."""
        return (self.keys[step] if self.keys is not None else 0, self.position, step)


@dataclass
class Stats:
    """What the last run did: acts, peak live bytes per rank (in all, and of each ``plan.watch`` set) and peak
    live slots per register.

    A slot's bytes count from when its producer claims it (before the act, so an act's inputs and outputs are
    live together) until its last reader frees it; variables count for the whole step; a fused segment's
    intermediates count while its act runs. :func:`.memory.dry_run` keeps the same account without threads
    or kernels, for the compiler's memory plan."""

    acts: int = 0
    peak_bytes: dict[int, int] = field(default_factory=dict)
    peak_slots: dict[int, int] = field(default_factory=dict)  # buf id -> most slots live at once
    register_num: dict[int, int] = field(default_factory=dict)  # buf id -> capacity
    seconds: float = 0.0
    watch_peak: dict[str, dict[int, int]] = field(default_factory=dict)  # plan.watch name -> rank -> peak bytes


class Board:
    """The actors of one process and their registers; every method runs under the runtime's lock.

    :mod:`.actors` drives it from worker threads (:meth:`take`, :meth:`finish`), or :func:`.play.play` when one
    thread acts for every lane."""

    def __init__(self, plan: PhysicalPlan, backend: Backend) -> None:
        self.plan = plan
        m = plan.micro_batches
        self.actors: list[Actor] = []
        by_node: dict[int, Actor] = {}
        for position, node in enumerate(plan.nodes):
            owned = backend.owned(node.ranks)
            if not owned:
                continue
            actor = Actor(node, position, plan.steps(node), lane_for(node, plan, owned))
            self.actors.append(actor)
            by_node[node.id] = actor
        self.owned_ranks = sorted({r for a in self.actors for r in backend.owned(a.node.ranks)})
        self.registers: dict[int, RegisterState] = {}
        for actor in self.actors:
            self._add_registers(actor, backend)
            actor.transient = _transient(actor, plan, backend)
        producers = plan.producers()
        for actor in self.actors:
            self._wire(actor, producers, by_node)
        if plan.pipeline is not None:
            self._set_keys(producers)
        for actor in self.actors:
            actor.fed = [e for e in actor.inputs if e.producer is not None and not e.orphan]
            actor.blocked = any(e.orphan for e in actor.inputs)
            actor.arity = len(actor.inputs) if len(actor.fed) == len(actor.inputs) else -1
            actor.gated = bool(actor.controls)
            for edge in actor.fed:
                edge.register = self.registers[edge.buf]  # type: ignore[index]  # fed: written here
        for reg in self.registers.values():
            reg.sizes = tuple(reg.bytes_by_rank.items())
            reg.again = reg.producer.steps > 1
            reg.direct = bool(reg.readers) and (len(reg.readers) == 1 or reg.capacity == 1)
            reg.shared = reg.direct and len(reg.readers) > 1
            reg.fanout = len(reg.readers)
            reg.targets = tuple((edge.queue, edge.consumer) for edge in reg.readers)
            for edge in reg.readers:
                edge.direct = reg.direct
        self.resident = self._resident_bytes()
        self._live_bytes = dict(self.resident)
        self.watch_live = {name: dict.fromkeys(self.owned_ranks, 0) for name in plan.watch}
        self._stats = Stats()
        self._unsettled: list[Any] | None = None  # play()'s log of claims and frees, counted when first asked for
        self.finished = 0
        comm_lanes = sorted({a.lane for a in self.actors if a.comm})
        self.streams = {lane: stream_order([a for a in self.actors if a.lane == lane], m) for lane in comm_lanes}
        self.heads = dict.fromkeys(comm_lanes, 0)  # play(): the next act of each comm stream
        self.failed: tuple[Actor, int] | None = None  # play(): the act whose exception ended it
        self.count = len(self.actors)
        self._idle = sum(1 for a in self.actors if a.steps == 0)  # done before they start (no micro-batches)
        self._register_num = {b: r.capacity for b, r in self.registers.items()}
        span = len(plan.nodes)
        for actor in self.actors:
            keys = actor.keys if actor.keys is not None else (0,) * actor.steps
            actor.codes = tuple(key * span + actor.position for key in keys)
        self._by_position: list[Actor | None] = [None] * span
        for actor in self.actors:
            self._by_position[actor.position] = actor
        self._group_sources()
        for actor in self.actors:
            _prepare_play(actor)
        # play's first offers: after a reset, an actor with an input from here waits for it (and a led one is acted
        # by its run's leader)
        self._starters = [a for a in self.actors if not a.fed and not a.blocked and not a.led]
        self._gathering = [a for a in self.actors if a.gathers]

    def issue_comm_first(self, flying: set[int]) -> None:
        """:meth:`play` acts a comm actor as soon as it is ready (its stream's turn and its inputs there), before
        any compute act: under torch.distributed, where a collective or a send/recv is issued in flight and its
        readers wait for it where they act, so the one thread posts every transfer a peer may wait for before it
        blocks on one of its own (issue 10: a stage waiting for its next input must have sent what its
        neighbour needs to make that input). Each stream keeps its fixed order; on virtual ranks the merged
        schedule stays :func:`dry_run`'s (this is not called there).

        ``flying``: the buffers issued in flight. A comm actor that reads one waits for it in its act, so it keeps
        its place in the schedule: first, it would block the thread as soon as its input is posted, before the
        compute and the other transfers that come earlier in the schedule (a peer may wait for them).

        Why not wait only when nothing else can act: gloo's send/recv work objects say they are completed only
        once waited for (``is_completed()`` stays False), so a receive cannot be polled. Waiting where the
        schedule reads is deadlock-free when each process acts its compute in schedule order and posts its
        transfers as soon as they are ready, which is what a verified pipeline schedule assumes."""
        span = len(self.plan.nodes)
        lowest = min((min(a.keys) for a in self.actors if a.keys), default=0)  # the pre phase's key is -1
        base = (min(lowest, 0) - 1) * span  # below every other act's code (key * span + position), still unique
        for actor in self.actors:
            if actor.comm and not any(b in flying for b in actor.node.inputs):
                actor.codes = (base + actor.position,) * actor.steps

    # -- construction -------------------------------------------------------------------------------

    def _add_registers(self, actor: Actor, backend: Backend) -> None:
        for b in actor.node.outputs:
            desc = self.plan.registers.get(b)
            capacity = desc.register_num if desc is not None else 1
            if capacity < 1:
                raise ExecutionError(f"{actor.node.label()}: register %{b} has register_num {capacity}, "
                                     "but a register needs at least 1 slot")
            owned = backend.owned(self.plan.bufs[b].layout.placement.flat_ranks)
            sizes = {r: desc.bytes_on(r) if desc is not None else self.plan.bufs[b].nbytes(r) for r in owned}
            reg = RegisterState(b, capacity, {} if actor.node.kind == "variable" else sizes, actor)
            reg.resident = sizes if actor.node.kind == "variable" else {}
            reg.watch = tuple(name for name, bufs in self.plan.watch.items() if b in bufs)
            self.registers[b] = reg
            actor.outputs.append(reg)

    def _group_sources(self) -> None:
        """Runs of variables next to each other in the plan, on one lane: :meth:`play` acts each run as one pick.

        A variable has no input and acts once, so all of a run are ready from the start, and no actor of this
        process sits between them in priority: play would pick them one after the other anyway (a variable's
        readers come after it in the plan). One pick for the run leaves the schedule, the messages and the
        counts as they were; it saves a heap entry and the general act's checks per variable (an optimizer's
        step reads a hundred of them: its parameters and their moments)."""
        run: list[Actor] = []
        for actor in [*self.actors, None]:
            if actor is not None and _plain_source(actor) and (not run or actor.lane == run[0].lane):
                run.append(actor)
                continue
            if len(run) > 1:
                run[0].sources = [(a, a.outputs[0]) for a in run]
                for follower in run[1:]:
                    follower.led = True
            run = [actor] if actor is not None and _plain_source(actor) else []

    def _set_keys(self, producers: dict[int, int]) -> None:
        """Each step's pipeline priority; accumulate/pack take the priority of the node feeding them."""
        pipe = self.plan.pipeline
        for actor in self.actors:
            node = actor.node
            feeder = producers.get(node.inputs[0]) if actor.gathers and node.inputs else None
            actor.keys = tuple(pipe.key(node, k, feeder) for k in range(actor.steps))

    def _resident_bytes(self) -> dict[int, int]:
        """Variables live across steps: their bytes count from the start of a step to its end, whatever
        their register does (its slot only lends the variable's shards to readers, no copy)."""
        total = dict.fromkeys(self.owned_ranks, 0)
        for reg in self.registers.values():
            for r, n in reg.resident.items():
                total[r] += n
        return total

    def _wire(self, actor: Actor, producers: dict[int, int], by_node: dict[int, Actor]) -> None:
        for b in actor.node.inputs:
            if b not in producers:
                # a buffer nobody writes: a corrupt plan; the watchdog reports the wait rather than a crash here
                actor.inputs.append(InEdge(actor, b, None, 1, orphan=True))
                continue
            source = by_node.get(producers[b])
            edge = InEdge(actor, b, source, self._reads_per_slot(source, actor))
            actor.inputs.append(edge)
            if source is not None:
                self.registers[b].readers.append(edge)
        leads = actor.node.control_lead or (0,) * len(actor.node.control)
        for nid, lead in zip(actor.node.control, leads, strict=True):
            source = by_node.get(nid)
            if source is None:
                continue  # ordering against a node of another process: its own runtime orders it
            edge = InEdge(actor, None, source, self._reads_per_slot(source, actor), lead=lead)
            actor.controls.append(edge)
            source.control_out.append(edge)

    def _reads_per_slot(self, source: Actor | None, consumer: Actor) -> int:
        if source is None:
            return 1
        writes = 1 if source.gathers else source.steps
        if writes == consumer.steps:
            return 1
        if writes == 1:
            return consumer.steps  # written once, read on every micro-batch
        raise ExecutionError(
            f"actor {consumer.label()} ({consumer.node.phase} phase) reads a value that {source.label()} writes on "
            f"each of the {writes} micro-batches; only accumulate and pack nodes may combine micro-batches")

    # -- one run ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Empties every queue and frees every slot, for a new run.

        After a run that ended with every actor done they are so already (each slot was read and freed, every
        queue emptied): only the steps and the peaks start again."""
        settled = self.finished == self.count and self.failed is None and self._stats.acts > 0
        for actor in self.actors:
            actor.step = 0
        for actor in self._gathering:
            actor.partial = None
        if not settled:
            for actor in self.actors:
                actor.busy = False
                actor.missing = len(actor.fed) + actor.blocked
                for edges in (actor.inputs, actor.controls):
                    for edge in edges:
                        edge.queue.clear()
                        edge.reads = 0
            for reg in self.registers.values():
                reg.free = reg.capacity
            for actor in self.actors:
                if actor.transient is not None:
                    actor.transient.free = actor.transient.capacity
        self._unsettled = None  # the last run's log: its counts went with its Stats
        self._live_bytes = dict(self.resident)
        self.watch_live = {name: dict.fromkeys(self.owned_ranks, 0) for name in self.plan.watch}
        self._stats = Stats(peak_bytes=dict(self.resident), register_num=dict(self._register_num),
                            watch_peak={name: dict.fromkeys(self.owned_ranks, 0) for name in self.plan.watch})
        self.finished = self._idle
        self.heads = dict.fromkeys(self.streams, 0)
        self.failed = None

    def _count_bytes(self, log: list[Any]) -> None:
        """Replays :meth:`play`'s log of claims (a register) and frees (its ``release`` twin) into live bytes, live
        slots and their peaks: the counts after every claim, as :meth:`_claim` makes them one by one (the log
        starts at a reset, with every slot free)."""
        live, peak, peak_slots = self._live_bytes, self._stats.peak_bytes, self._stats.peak_slots
        held: dict[int, int] = {}  # buf id -> slots live now
        for entry in log:
            if entry.__class__ is _Release:
                reg = entry.register
                held[reg.buf] -= 1
                for r, n in reg.sizes:
                    live[r] -= n
                for name in reg.watch:
                    watched = self.watch_live[name]
                    for r, n in reg.sizes:
                        watched[r] -= n
                continue
            slots = held[entry.buf] = held.get(entry.buf, 0) + 1
            if slots > peak_slots.get(entry.buf, 0) and entry.buf >= 0:  # (< 0: an act's transient bytes)
                peak_slots[entry.buf] = slots
            for r, n in entry.sizes:
                now = live[r] = live[r] + n
                if now > peak.get(r, -1):
                    peak[r] = now
            if entry.watch:
                self._watch_claim(entry)

    @property
    def stats(self) -> Stats:
        """The counters of the current (or last) run, its live-byte peaks counted."""
        self._settle()
        return self._stats

    @property
    def live_bytes(self) -> dict[int, int]:
        """Bytes live now on each owned rank (variables included)."""
        self._settle()
        return self._live_bytes

    def timed(self, seconds: float) -> None:
        """Records the run's wall-clock time in its :class:`Stats`."""
        self._stats.seconds = seconds

    def _settle(self) -> None:
        if self._unsettled is not None:
            log, self._unsettled = self._unsettled, None
            self._count_bytes(log)

    @property
    def all_done(self) -> bool:
        return self.finished == self.count

    def ready(self, actor: Actor) -> bool:
        """Whether ``actor`` can act its next step now (see the module docstring)."""
        if actor.busy or actor.step >= actor.steps or actor.missing:  # missing: an empty input queue, or blocked
            return False
        for edge in actor.controls:
            if len(edge.queue) < edge.tokens_needed():
                return False
        if actor.gathers and actor.step:
            return True  # accumulate/pack hold their output slot from their first step
        for reg in actor.outputs:
            if reg.free <= 0:
                return False
        return True

    def take(self, actor: Actor) -> list[Any]:
        """Starts ``actor``'s next step: claims its output slots; returns its input values."""
        actor.busy = True
        if actor.outputs and (not actor.gathers or actor.step == 0):
            for reg in actor.outputs:
                self._claim(reg)
        if actor.transient is not None:
            self._claim(actor.transient)
        return [edge.queue[0].value if edge.producer is not None else {} for edge in actor.inputs]

    def input_slots(self, actor: Actor) -> list[Slot]:
        return [edge.queue[0] for edge in actor.inputs if edge.producer is not None]

    def finish(self, actor: Actor, values: list[Any], event: Any = None) -> list[Actor]:
        """Ends ``actor``'s step: writes its outputs, frees its inputs. Returns the actors that may be ready now
        (``actor`` first; some may repeat)."""
        step = actor.step
        woken = [actor]
        if actor.transient is not None:
            self._free(actor.transient)
        if not actor.gathers or step == actor.steps - 1:
            micro = 0 if actor.gathers else step
            for reg, value in zip(actor.outputs, values, strict=True):
                readers = reg.readers
                if not readers:
                    self._free(reg)  # nobody here reads it: the slot is free again at once
                    continue
                slot = Slot(value, micro, len(readers), reg, event)
                for edge in readers:
                    if not edge.queue:
                        edge.consumer.missing -= 1
                    edge.queue.append(slot)
                    woken.append(edge.consumer)
        if actor.control_out:
            for edge in actor.control_out:
                edge.queue.append(Slot(None, step, 1, None))
                woken.append(edge.consumer)
        for edges in (actor.fed, actor.controls):
            for edge in edges:
                if edge.reads_per_slot > 1:
                    edge.reads += 1
                    if edge.reads < edge.reads_per_slot:
                        continue
                    edge.reads = 0
                slot = edge.queue.popleft()
                if not edge.queue and edges is actor.fed:
                    actor.missing += 1
                slot.reads_left -= 1
                if slot.reads_left == 0 and slot.register is not None:
                    self._free(slot.register)
                    woken.append(slot.register.producer)
        actor.step = step + 1
        actor.busy = False
        self._stats.acts += 1
        if actor.step >= actor.steps:
            self.finished += 1
        return woken

    # -- registers ---------------------------------------------------------------------------------

    def _claim(self, reg: RegisterState) -> None:
        reg.free -= 1
        live, peak_slots = reg.capacity - reg.free, self._stats.peak_slots
        if live > peak_slots.get(reg.buf, 0) and reg.buf >= 0:  # (< 0: an act's transient bytes)
            peak_slots[reg.buf] = live
        if reg.sizes:
            live_bytes, peak = self._live_bytes, self._stats.peak_bytes
            for r, n in reg.sizes:
                now = live_bytes[r] = live_bytes[r] + n
                if now > peak.get(r, -1):
                    peak[r] = now
            if reg.watch:
                self._watch_claim(reg)

    def _watch_claim(self, reg: RegisterState) -> None:
        """A claim's bytes in each ``plan.watch`` set its buffer belongs to, and their peaks."""
        for name in reg.watch:
            live, peak = self.watch_live[name], self._stats.watch_peak[name]
            for r, n in reg.sizes:
                live[r] = live.get(r, 0) + n
                peak[r] = max(peak.get(r, 0), live[r])

    def _free(self, reg: RegisterState) -> None:
        reg.free += 1
        if reg.sizes:
            live_bytes = self._live_bytes
            for r, n in reg.sizes:
                live_bytes[r] -= n
            for name in reg.watch:
                live = self.watch_live[name]
                for r, n in reg.sizes:
                    live[r] -= n

    # -- what is stuck -----------------------------------------------------------------------------

    def waits(self, actor: Actor) -> list[str]:
        """What ``actor``'s next step waits for, one phrase per missing message."""
        micro = actor.step
        phrases = [f"{edge.describe()} for micro-batch {micro}" for edge in actor.inputs + actor.controls
                   if edge.waits]
        if actor.acquires(actor.step):
            for reg in actor.outputs:
                if reg.free == 0:
                    holders = sorted({e.consumer.node.label() for e in reg.readers if e.queue})
                    phrases.append(f"a free slot of its register %{reg.buf} ({reg.capacity} of {reg.capacity} held; "
                                   f"not yet freed by {', '.join(holders) or 'anyone'})")
        return phrases


def _slot(reg: RegisterState, value: Any, micro: int) -> Slot:
    """A slot for a value that several readers share: one its readers gave back (no allocation), or a new one."""
    if reg.spare:
        slot = reg.spare.pop()
        slot.value, slot.micro, slot.reads_left = value, micro, len(reg.readers)
        return slot
    return Slot(value, micro, len(reg.readers), reg)


def _plain_source(actor: Actor) -> bool:
    """A variable acted once, with one register, nothing to wait for and no control token to send."""
    return (actor.node.kind == "variable" and actor.steps == 1 and not actor.inputs and not actor.controls
            and not actor.control_out and len(actor.outputs) == 1 and actor.keys is None and not actor.comm)


def _prepare_play(actor: Actor) -> None:
    """The lists :meth:`play.play`'s short path walks, and whether ``actor`` may take it: every input written by an
    actor of this process (no ``{}``, no orphan), each passed as the value itself (``direct``: no :class:`Slot`),
    every output direct with a reader here, no control edge and no comm stream's turn to keep."""
    fed = actor.fed
    actor.queues = tuple(edge.queue for edge in fed)
    actor.drops = tuple((edge.queue, edge.register) for edge in fed if edge.reads_per_slot == 1)  # type: ignore[misc]
    actor.repeats = tuple(edge for edge in fed if edge.reads_per_slot > 1)
    actor.single = actor.outputs[0] if len(actor.outputs) == 1 else None
    actor.fast = (len(fed) == len(actor.inputs) and all(edge.direct for edge in fed)
                  and all(reg.direct for reg in actor.outputs) and not actor.controls and not actor.control_out
                  and not actor.comm and actor.sources is None and actor.transient is None)


def _transient(actor: Actor, plan: PhysicalPlan, backend: Backend) -> RegisterState | None:
    """A fused segment's intermediates as a register its act claims and frees (see :attr:`Actor.transient`)."""
    if actor.node.op != FUSED:
        return None
    sizes = {r: n for r in backend.owned(actor.node.ranks) if (n := transient_bytes(plan, actor.node, r))}
    if not sizes:
        return None
    reg = RegisterState(-1 - actor.node.id, 1 << 30, sizes, actor)
    reg.sizes, reg.free = tuple(sizes.items()), reg.capacity
    return reg


def lane_for(node: PNode, plan: PhysicalPlan, owned: list[int]) -> str:
    """The worker thread of a node: ``<device type>:<owned ranks>/compute`` or ``<device type>/comm:<key>``.

    Compute lanes are per set of ranks this process runs the node on: one per process under
    torch.distributed (it owns one rank), one per placement on virtual ranks, so that pipeline stages
    on different placements act concurrently there as they would on their own devices.

    A boxing node that runs a collective goes to a communication stream even if the plan put it on
    "compute": on one process the compute thread's order depends on timing, and every member of a
    group must issue its collectives in one order (issue 6's verifier checks the stream order).
    """
    bufs = [plan.bufs[b] for b in node.outputs + node.inputs]
    device = bufs[0].layout.placement.type if bufs else "cpu"
    stream = node.stream
    if stream == COMPUTE_STREAM and node.kind == "boxing" and node.boxing is not None and node.boxing.collectives():
        stream = "comm:" + ",".join(map(str, node.ranks))
    if stream == COMPUTE_STREAM:
        return f"{device}:{','.join(map(str, owned))}/{stream}"
    return f"{device}/{stream}"


def stream_order(actors: list[Actor], micro_batches: int) -> list[tuple[Actor, int]]:
    """(actor, step) in the in-order executor's order: pre actors, micro-batches 0..m-1, post actors.

    Under a pipeline schedule (actors with ``keys``) the micro-batch steps follow the schedule's action
    order instead (1F1B: F of micro-batch 2 before B of micro-batch 0), the same on every member."""
    ordered = sorted(actors, key=lambda a: a.position)
    order = [(a, k) for a in ordered if a.node.phase == "pre" for k in range(a.steps)]
    micro = [(a, k) for k in range(micro_batches) for a in ordered if a.node.phase == "micro" and k < a.steps]
    order += sorted(micro, key=_stream_key)
    order += [(a, k) for a in ordered if a.node.phase == "post" for k in range(a.steps)]
    return order


def _stream_key(actor_step: tuple[Actor, int]) -> tuple[int, int]:
    """A micro-batch step's place on a stream: its schedule priority (else its micro-batch), then plan position."""
    actor, step = actor_step
    return (actor.keys[step] if actor.keys is not None else step, actor.position)
