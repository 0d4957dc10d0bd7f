"""The pipeline pass: stages, forward/backward parts, and the register counts that make a schedule.

As in OneFlow, the schedule is not a hand-written loop: it comes from how many micro-batches each register
may hold (everything else keeps 1)::

    schedule          held buffers of stage s       cross-stage buffer from stage a to b
    1f1b              p - s                         |b - a|  (it is in flight that many stages)
    gpipe             m                             |b - a|
    zero_bubble       p (B to W buffers: s + 1)     |b - a|
    interleaved_1f1b  its peak along its rank's     in flight in the dry run
                      order (virtual stage s)

With p - s slots, stage s runs p - s forwards ahead, then one forward per finished backward: 1F1B.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

from .physical import GATHERING, PhysicalPlan, PNode, Register
from .schedule import Schedule, ScheduleError, action_steps, bubble_theory, check, grid, make

LAST = 1 << 30  # the priority of post-phase steps: after every micro-batch


class PipelineWarning(UserWarning):
    """A pipeline whose micro-batches cannot keep its stages busy."""


@dataclass
class Pipeline:
    """What the pass found and decided, for the runtime, ``explain()`` and tests."""

    schedule: Schedule
    stages: tuple[tuple[int, ...], ...]  # ranks of each stage (of each placement, under interleaved 1F1B)
    stage_of: dict[int, int]  # node id -> (virtual) stage (a cross-stage boxing node: its source stage)
    part_of: dict[int, str]  # micro node id -> "F" or "B"
    held: dict[int, tuple[int, ...]]  # stage -> buffers held from F to B (activations and weight views)
    activations: dict[int, tuple[int, ...]]  # stage -> the held buffers that depend on micro-batch data
    cells: list[list[str]] = field(default_factory=list)  # the schedule's dry run (unit steps)
    _order: list[dict[tuple[str, int, int], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._order = [self.schedule.compute_order(s) for s in range(len(self.stages))]

    @property
    def virtual(self) -> int:
        """Stages per placement: 1, or v under interleaved 1F1B (virtual stage k on placement k mod p)."""
        return self.schedule.virtual

    def key(self, node: PNode, step: int, feeder: int | None = None) -> int:
        """Priority of ``node``'s ``step``: its action's index in its rank's list (lower acts first)."""
        if node.phase == "pre":
            return -1
        nid = feeder if feeder is not None else node.id
        part = self.part_of.get(nid)
        if part is None:
            return LAST
        if part == "W" and not self.schedule.splits_backward:
            part = "B"
        stage = self.stage_of[nid]
        return self._order[stage % len(self.stages)][(part, stage, step)]

    def grid(self) -> str:
        """The schedule as a rank x step grid (unit steps; '.' is idle)."""
        return grid(self.schedule, self.cells, self.stages)


def plan_pipeline(plan: PhysicalPlan, seeds: Iterable[int], schedule: str = "1f1b") -> Pipeline | None:
    """Sets ``plan``'s registers and ``plan.pipeline`` for ``schedule``; None when the plan has one stage.

    ``plan`` is lowered, its compute nodes on several disjoint placements; ``seeds`` are the buffers where
    backward starts (the loss's implicit gradient). Stages: one per placement, in order of first use by a
    micro compute node. Parts: a micro node is B if it reads a seed transitively, else F; a cross-stage boxing
    belongs to its source stage (a send). Under ``zero_bubble`` a B node whose outputs only feed W nodes or the
    accumulation is W (weight gradients), found backwards. Held buffers of stage s: written by F and read by B
    on s; those that depend on a micro-batch's data are its activations. Each actor step's priority is its
    action's index in its stage's list (:mod:`.schedule`).

    >>> from sbpflow.graph.schedule import make
    >>> make("1f1b", 4, 8).bounds
    (4, 3, 2, 1)
    """
    stages = find_stages(plan)
    if len(stages) < 2:
        return None
    p, m = len(stages), plan.micro_batches
    if m < p:
        _warn_few_micro_batches(p, m)
    seeds = set(seeds)
    part_of = _parts(plan, seeds)
    stage_of = _virtual_stage_of(plan, stages, part_of, seeds)
    count = max(stage_of.values()) + 1
    if count == p:
        stage_of = _stage_of(plan, stages)
    elif count % p:
        raise ScheduleError(f"the model's {count} pipeline stages (a new one each time the forward moves to another "
                            f"placement) must sit on {p} placements as stage k on placement k mod {p}, so their "
                            f"number must be a multiple of {p}")
    sched = make(schedule, p, m, count // p)
    cells = check(sched)
    if sched.splits_backward:
        part_of.update(dict.fromkeys(_weight_gradients(plan, part_of, stage_of), "W"))
    held = _held(plan, stage_of, part_of)
    data = _data_dependent(plan)
    activations = {s: tuple(b for b in bufs if b in data) for s, bufs in held.items()}
    pipe = Pipeline(sched, stages, stage_of, part_of, held, activations, cells)
    plan.registers = _registers(plan, pipe) if pipe.virtual == 1 else _interleaved_registers(plan, pipe)
    if schedule == "gpipe" and m > 1:
        plan.nodes = _gpipe_controls(plan, pipe)
        plan._index = {}  # nodes were replaced: plan.node() rebuilds its index
    plan.pipeline = pipe
    return pipe


# ----------------------------------------------------------------------------- stages and parts


def find_stages(plan: PhysicalPlan) -> tuple[tuple[int, ...], ...]:
    """Rank sets of the ``micro`` compute nodes, in order of first use; () unless they are disjoint."""
    seen: list[tuple[int, ...]] = []
    for n in plan.nodes:
        if n.phase == "micro" and n.kind == "compute" and n.ranks not in seen:
            seen.append(n.ranks)
    flat = [r for ranks in seen for r in ranks]
    if len(flat) != len(set(flat)):
        return ()  # placements that share ranks: one program, not a pipeline
    return tuple(seen)


def _stage_of(plan: PhysicalPlan, stages: tuple[tuple[int, ...], ...]) -> dict[int, int]:
    """Each node's stage by its first buffer's ranks (a boxing node's input: the sending stage)."""
    index = {r: s for s, ranks in enumerate(stages) for r in ranks}
    out = {}
    for n in plan.nodes:
        bufs = n.inputs + n.outputs
        ranks = plan.bufs[bufs[0]].layout.placement.flat_ranks if bufs else n.ranks
        if ranks and ranks[0] in index:
            out[n.id] = index[ranks[0]]
    return out


def _virtual_stage_of(plan: PhysicalPlan, stages: tuple[tuple[int, ...], ...],
                      part_of: dict[int, str], seeds: set[int]) -> dict[int, int]:
    """Each micro node's virtual stage, from the data flow: the forward starts a new stage each time it moves to
    another placement (stage k on placement k mod p), the backward goes back through them.

    An F node's stage is the latest of its inputs' stages, lifted to the first stage on its placement at or
    after it; a B node's the earliest of its inputs', lowered to the last stage on its placement at or before
    it (so a tied weight's gradient, summed with the embedding's, lands on stage 0). A cross-placement boxing
    node stays on its source's stage; its output is on the receiving one. Nodes that read no staged value
    (per-micro-batch views of weights, inputs such as the targets and what is computed from them alone) take
    the earliest stage of their readers; the first placement's micro-batch inputs start stage 0.

    A B node that reads a gradient (a B node's output, or the loss's seed, which is on the last forward stage so
    far) follows the gradients alone: a forward value it also reads (labels moved to the last placement, first
    lifted to that placement's earliest stage) says where the value was made, not where the backward is."""
    p = len(stages)
    place = {r: s for s, ranks in enumerate(stages) for r in ranks}
    at: dict[int, int] = {}  # buffer -> virtual stage of its value
    grads: set[int] = set()  # buffers of the backward: seeds and B nodes' outputs
    out: dict[int, int] = {}
    last_forward = 0
    for n in plan.nodes:
        part = part_of.get(n.id)
        if part is None:
            continue
        here = _placement(plan, n, place)
        staged = [at[b] for b in n.inputs if b in at] or ([0] if n.kind == "unpack" and here == 0 else [])
        if part == "B":
            grads.update(n.outputs)
            backward = [at[b] for b in n.inputs if b in grads and b in at] + [last_forward for b in n.inputs
                                                                              if b in seeds]
            staged = backward or staged
        if not staged:
            continue
        lift = _lift if part == "F" else _lower
        stage = (max if part == "F" else min)(lift(k, here, p) for k in staged)
        out[n.id] = stage
        if part == "F":
            last_forward = max(last_forward, stage)
        for b in n.outputs:
            there = place[plan.bufs[b].layout.placement.flat_ranks[0]]
            at[b] = lift(stage, there, p)
    return _stage_unstaged(plan, part_of, out, place, p)


def _stage_unstaged(plan: PhysicalPlan, part_of: dict[int, str], out: dict[int, int],
                    place: dict[int, int], p: int) -> dict[int, int]:
    """Nodes that read no staged value take their readers' earliest stage, lowered to their own placement (a
    boxing node's: its source's, whose rank sends it in its own order); their placement's first if none."""
    readers: dict[int, list[int]] = {}
    for n in plan.nodes:
        for b in n.inputs:
            readers.setdefault(b, []).append(n.id)
    for n in reversed(plan.nodes):
        if n.id in part_of and n.id not in out:
            here = _placement(plan, n, place)
            mine = [out[r] for b in n.outputs for r in readers.get(b, []) if r in out]
            stage = _lower(min(mine), here, p) if mine else here
            out[n.id] = stage if stage >= 0 else here
    return out


def _placement(plan: PhysicalPlan, n: PNode, place: dict[int, int]) -> int:
    """The placement a node acts for: its first input's (a boxing node's source), else its ranks'."""
    return place[plan.bufs[n.inputs[0]].layout.placement.flat_ranks[0]] if n.inputs else place[n.ranks[0]]


def _lift(stage: int, placement: int, p: int) -> int:
    """The first virtual stage at or after ``stage`` that sits on ``placement``."""
    return stage + (placement - stage) % p


def _lower(stage: int, placement: int, p: int) -> int:
    """The last virtual stage at or before ``stage`` that sits on ``placement``."""
    return stage - (stage - placement) % p


def _parts(plan: PhysicalPlan, seeds: set[int]) -> dict[int, str]:
    """F or B for every micro node: B reads the implicit gradient of the loss, transitively, or waits for a B node
    on a control edge (ZeRO-3's gather of a weight for the backward, held back until the backward reaches it:
    ordered as F on its stream, it came before the B nodes it waits for and the plan could not finish)."""
    backward = set(seeds)
    parts: dict[int, str] = {}
    for n in plan.nodes:
        if n.phase != "micro":
            continue
        is_b = any(b in backward for b in n.inputs) or any(parts.get(c) == "B" for c in n.control)
        parts[n.id] = "B" if is_b else "F"
        if is_b:
            backward.update(n.outputs)
    return parts


def _data_dependent(plan: PhysicalPlan) -> set[int]:
    """Buffers computed from a micro-batch's data (an ``unpack`` output), transitively."""
    data: set[int] = set()
    for n in plan.nodes:
        if n.kind == "unpack" or any(b in data for b in n.inputs):
            data.update(n.outputs)
    return data


def _weight_gradients(plan: PhysicalPlan, part_of: dict[int, str], stage_of: dict[int, int]) -> set[int]:
    """B nodes whose every output is read only by W nodes or accumulate/pack (the weight gradients)."""
    consumers: dict[int, list[PNode]] = {}
    for n in plan.nodes:
        for b in n.inputs:
            consumers.setdefault(b, []).append(n)
    weight: set[int] = set()
    for n in reversed(plan.nodes):
        if part_of.get(n.id) != "B" or not n.outputs or _crosses_stages(plan, n, stage_of):
            continue
        readers = [c for b in n.outputs for c in consumers.get(b, [])]
        if readers and all(c.id in weight or c.kind in GATHERING for c in readers):
            weight.add(n.id)
    return weight


def _crosses_stages(plan: PhysicalPlan, n: PNode, stage_of: dict[int, int]) -> bool:
    ranks = {r for b in n.inputs + n.outputs for r in plan.bufs[b].layout.placement.flat_ranks}
    return n.kind == "boxing" and not ranks <= set(plan.bufs[n.inputs[0]].layout.placement.flat_ranks)


def _held(plan: PhysicalPlan, stage_of: dict[int, int], part_of: dict[int, str]) -> dict[int, tuple[int, ...]]:
    """Per stage, the F-written buffers that a B node of that stage reads (a buffer that B nodes of several
    stages read, as ids that two stages embed, is held by each: it needs the most slots of theirs)."""
    producer = plan.producers()
    out: dict[int, list[int]] = {}
    for b, reg in plan.registers.items():
        writer = producer.get(b)
        if writer is None or part_of.get(writer) != "F":
            continue
        for stage in sorted({stage_of[r] for r in reg.consumers if part_of.get(r) in ("B", "W")}):
            out.setdefault(stage, []).append(b)
    return {s: tuple(bufs) for s, bufs in sorted(out.items())}


def _held_counts(pipe: Pipeline) -> dict[int, int]:
    """Each held buffer's register count: the largest bound of the stages that hold it."""
    counts: dict[int, int] = {}
    for s, bufs in pipe.held.items():
        for b in bufs:
            counts[b] = max(counts.get(b, 1), pipe.schedule.bounds[s])
    return counts


# ----------------------------------------------------------------------------- registers and controls


def _registers(plan: PhysicalPlan, pipe: Pipeline) -> dict[int, Register]:
    counts = _held_counts(pipe)
    for n in plan.nodes:
        if n.kind != "boxing" or n.phase != "micro":
            continue
        distance = abs(_stage_of_buf(plan, pipe, n.outputs[0]) - _stage_of_buf(plan, pipe, n.inputs[0]))
        for b in n.outputs:
            counts[b] = max(counts.get(b, 1), distance)
    if pipe.schedule.splits_backward:
        counts.update(_weight_gradient_inputs(plan, pipe))
    return {b: dataclasses.replace(reg, register_num=counts.get(b, 1)) for b, reg in plan.registers.items()}


def _weight_gradient_inputs(plan: PhysicalPlan, pipe: Pipeline) -> dict[int, int]:
    """Zero bubble: a buffer that B writes and W reads (the output gradient a weight gradient needs) is held
    from B k to W k, which ZB-H1 runs up to s micro-batches later on stage s: as many slots as its dry run
    has in flight between the two."""
    steps = action_steps(pipe.schedule)
    producer = plan.producers()
    out: dict[int, int] = {}
    for b, reg in plan.registers.items():
        writer = producer.get(b, -1)
        if pipe.part_of.get(writer) != "B" or not any(pipe.part_of.get(r) == "W" for r in reg.consumers):
            continue
        stage = pipe.stage_of[writer]
        out[b] = _in_flight(steps, ("B", stage), ("W", stage), plan.micro_batches)
    return out


def _interleaved_registers(plan: PhysicalPlan, pipe: Pipeline) -> dict[int, Register]:
    """Register counts: a stage's held buffers (received activations too) get its bound; any other buffer written
    by one action (F or B of a virtual stage) and read by another holds what the schedule's dry run has in
    flight between the two at any unit step (a cross-stage message, a tied weight's gradient).

    A held buffer sent past a stage (ids sent in stage 0's forward for stage 3's backward) gets that many too: its
    send waits for a slot in its channel's order, ahead of the activations stage 3's backward needs first, so
    stage 3's bound alone deadlocks. One from the stage before (an activation) keeps the bound."""
    steps = action_steps(pipe.schedule)
    producer = plan.producers()
    counts = _held_counts(pipe)
    for b, reg in plan.registers.items():
        writer = producer.get(b)
        if writer not in pipe.part_of:
            continue
        source = (_action(pipe, writer), pipe.stage_of[writer])
        for reader in reg.consumers:
            if reader not in pipe.part_of or (_action(pipe, reader), pipe.stage_of[reader]) == source:
                continue
            if b in counts and pipe.stage_of[reader] - pipe.stage_of[writer] <= 1:
                continue
            target = (_action(pipe, reader), pipe.stage_of[reader])
            counts[b] = max(counts.get(b, 1), _in_flight(steps, source, target, plan.micro_batches))
    return {b: dataclasses.replace(reg, register_num=counts.get(b, 1)) for b, reg in plan.registers.items()}


def _action(pipe: Pipeline, nid: int) -> str:
    part = pipe.part_of[nid]
    return "B" if part == "W" and not pipe.schedule.splits_backward else part


def _in_flight(steps: dict[tuple[str, int, int], int], source: tuple[str, int], target: tuple[str, int],
               m: int) -> int:
    """The most micro-batches whose ``source`` action has run and whose ``target`` action has not ended."""
    spans = [(steps[(*source, k)], steps[(*target, k)]) for k in range(m)]
    return max(sum(1 for a, b in spans if a <= t <= b) for t, _ in spans)


def _stage_of_buf(plan: PhysicalPlan, pipe: Pipeline, buf: int) -> int:
    first = plan.bufs[buf].layout.placement.flat_ranks[0]
    return next(s for s, ranks in enumerate(pipe.stages) if first in ranks)


# GPipe's m slots would still let the last stage start B 0 before F m-1 when F m-1 is late, so one control edge
# (with a lead of m - 1 micro-batches) orders the last stage's backward after its m-th forward.
def _gpipe_controls(plan: PhysicalPlan, pipe: Pipeline) -> list[PNode]:
    """The last stage's first backward nodes wait for its last forward node of micro-batch m - 1 (a lead of
    m - 1 micro-batches on a control edge): its backward may start only after every forward."""
    last = len(pipe.stages) - 1
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    on_last = [n for n in plan.nodes if pipe.stage_of.get(n.id) == last and n.phase == "micro"]
    backward = [n for n in on_last if pipe.part_of[n.id] == "B"]
    if not backward:
        return plan.nodes
    first_b = position[backward[0].id]
    forwards = [n for n in on_last if pipe.part_of[n.id] == "F" and n.kind == "compute" and position[n.id] < first_b]
    if not forwards:
        return plan.nodes
    tail = forwards[-1].id
    b_outputs = {b for n in backward for b in n.outputs}
    roots = {n.id for n in backward if not b_outputs.intersection(n.inputs)}
    lead = plan.micro_batches - 1
    return [dataclasses.replace(n, control=(*n.control, tail), control_lead=(*_leads(n), lead))
            if n.id in roots else n for n in plan.nodes]


def _leads(n: PNode) -> tuple[int, ...]:
    return n.control_lead or (0,) * len(n.control)


def _warn_few_micro_batches(p: int, m: int) -> None:
    warnings.warn(
        f"pipeline of {p} stages with only {m} micro-batch(es): at most {m} stage(s) work at any time, and each "
        f"stage idles {bubble_theory(p, m):.0%} of the step ((p-1)/(m+p-1)). Set "
        f"config.set_gradient_accumulation_steps(m) with m >= {p} (the number of stages), ideally m >= {4 * p}",
        PipelineWarning, stacklevel=4)


def activation_peaks(pipe: Pipeline, peak_slots: dict[int, int]) -> dict[int, int]:
    """Per stage, the most micro-batches of activations held at once, from a run's register counters."""
    return {s: max((peak_slots.get(b, 0) for b in bufs), default=0) for s, bufs in pipe.activations.items()}


def _fed_by_first_input(plan: PhysicalPlan, pipe: Pipeline) -> set[int]:
    """Micro node ids that read, transitively, an ``unpack`` of stage 0 (the model's input, not its targets)."""
    data: set[int] = set()
    fed: set[int] = set()
    for n in plan.nodes:
        first = n.kind == "unpack" and pipe.stage_of.get(n.id) == 0
        if first or any(b in data for b in n.inputs):
            data.update(n.outputs)
            if n.id in pipe.part_of:
                fed.add(n.id)
    return fed


def balanced_durations(plan: PhysicalPlan, forward_s: float, backward_s: float,
                       weight_s: float = 0.0) -> dict[int, float]:
    """Synthetic-time durations (node id -> seconds) where every stage's forward takes ``forward_s`` and its
    backward ``backward_s``, spread evenly over its compute nodes; everything else takes no time. Under
    ``zero_bubble`` W nodes take ``weight_s`` (a stage with no B nodes, the first one, whose input gradient
    nobody needs, gives its W nodes both times, so stages stay equal).

    Only nodes fed, transitively, by the first stage's micro-batch input carry time: what depends on the
    targets alone (the loss's scale, the target mask) could run before the stage's activation arrives.
    Balanced stages with no communication time are what the bubble formula (p - 1) / (m + p - 1) assumes,
    so a synthetic run with these durations measures the schedule, not the model's stage imbalance.
    Use as ``ActorRuntime(plan, synthetic=lambda node: durations.get(node.id, 0.0))``."""
    pipe = plan.pipeline
    if pipe is None:
        raise ValueError("balanced_durations needs a plan with pipeline stages (plan.pipeline is None)")
    nodes: dict[tuple[int, str], list[int]] = {}
    fed = _fed_by_first_input(plan, pipe)
    for n in plan.nodes:
        if n.kind == "compute" and n.id in fed:
            nodes.setdefault((pipe.stage_of[n.id], pipe.part_of[n.id]), []).append(n.id)
    v = pipe.virtual  # a placement's v virtual stages share its times
    total = {"F": forward_s / v, "B": backward_s / v, "W": weight_s / v}
    for stage in range(len(pipe.stages)):
        if (stage, "W") in nodes and (stage, "B") not in nodes:
            total_w = (backward_s + weight_s) / v
            nodes[(stage, "W*")] = nodes.pop((stage, "W"))
            total["W*"] = total_w
    return {nid: total[part] / len(ids) for (_, part), ids in nodes.items() for nid in ids}
