"""Lowering: the logical graph with chosen SBPs -> one physical plan for every rank.

Every op becomes a compute node on its placement's ranks, and where a consumer needs another layout the
boxing planner's steps become nodes of their own, shared by every consumer of that layout in the phase.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import boxing
from ..boxing import Layout
from ..boxing.plan import MOVES_NOTHING
from ..ops.inplace import FRESH_OUTPUTS, OVERWRITING
from ..ops.optimizer import IN_PLACE
from ..ops.schema import REGISTRY, Meta
from ..placement import Placement
from .ir import LNode, LogicalGraph
from .physical import COMPUTE_STREAM, Buf, PhysicalPlan, PNode, Register


def stream_of(step: boxing.Step) -> str:
    """The communication stream (one per process group family) of a boxing step; local steps compute."""
    if step.kind in MOVES_NOTHING:
        return COMPUTE_STREAM
    if step.src.placement == step.dst.placement:
        return f"comm:{step.src.placement}:axis{step.axis}"
    return f"comm:{step.src.placement}->{step.dst.placement}"


# Micro-batches: a step input is cut by an unpack node; a variable (any step constant) is read by the micro-batch
# nodes straight from its one slot (the runtime lets each reader read it m times: a repeat node per micro-batch
# would only add acts); gradients are summed by accumulate and results joined by pack; with one micro-batch
# they are left out. A step constant going to another pipeline stage (a tied weight) is sent once, before.
class _Lowerer:
    def __init__(self, g: LogicalGraph, model: boxing.CostModel, factors: tuple[Any, ...]) -> None:
        self.g = g
        self.model = model
        self.factors = factors
        self.m = g.micro_batches
        self.nodes: list[PNode] = []
        self.bufs: dict[int, Buf] = {}
        self.at: dict[tuple[int, str], int] = {}  # (value id, phase) -> buf id holding it in that phase
        self.boxed: dict[tuple[int, Layout, str], int] = {}  # (buf id, layout, phase) -> boxed buf id (CSE)
        self.made_in: dict[int, str] = {}  # buf id -> phase of its producer
        self.producer: dict[int, int] = {}  # buf id -> node id

    # -- buffers and nodes ---------------------------------------------------------------------------

    def new_buf(self, shape: tuple[int, ...], dtype: Any, layout: Layout) -> int:
        b = Buf(len(self.bufs), shape, dtype, layout)
        self.bufs[b.id] = b
        return b.id

    def emit(self, kind: str, name: str, inputs: tuple[int, ...], outputs: tuple[int, ...],
             ranks: tuple[int, ...], phase: str, **extra: Any) -> PNode:
        node = PNode(len(self.nodes), kind, name, inputs, outputs, ranks, phase, **extra)
        self.nodes.append(node)
        for b in outputs:
            self.made_in[b] = phase
            self.producer[b] = node.id
        return node

    def value_buf(self, vid: int, layout: Layout) -> int:
        v = self.g.values[vid]
        return self.new_buf(v.shape, v.dtype, layout)

    # -- reading a value in a phase and layout ------------------------------------------------------

    def read(self, vid: int, phase: str, layout: Layout, label: str) -> int:
        pre = self.at.get((vid, "pre"))
        if phase == "micro" and self.m > 1 and pre is not None and self.step_constant(vid) and \
                self.bufs[pre].layout.placement != layout.placement:
            # a step constant (a tied weight) read on another pipeline stage: sent once before the micro-batches
            # (its copy read there m times), rather than sent again for every micro-batch
            return self.box(pre, layout, "pre", label)
        buf = self.at_phase(vid, phase)
        return self.box(buf, layout, phase, label)

    def step_constant(self, vid: int) -> bool:
        """Whether ``vid`` is the same in every micro-batch: a variable, a constant or a value computed before the
        micro-batches (a whole step's count), never a step input, whose micro-batches are its own slices (an
        ``unpack`` each) wherever it is read, on this stage or another."""
        producer = self.g.values[vid].producer
        return producer < 0 or (self.g.nodes[producer].phase == "pre" and self.g.nodes[producer].kind != "input")

    def at_phase(self, vid: int, phase: str) -> int:
        key = (vid, phase)
        if key in self.at:
            return self.at[key]
        pre = self.at.get((vid, "pre"))
        if pre is None or phase != "micro" or self.m == 1:
            if pre is not None:
                return pre
            raise AssertionError(f"value %{vid} is read in phase {phase} but never defined there")
        producer = self.g.nodes[self.g.values[vid].producer]
        if producer.kind != "input":
            return pre  # a step constant: micro-batch actors read its one slot m times (no per-micro-batch copy)
        src = self.bufs[pre]
        out = self.new_buf(src.shape, src.dtype, src.layout)
        self.emit("unpack", producer.name, (pre,), (out,), src.layout.placement.flat_ranks, "micro")
        self.at[key] = out
        return out

    def box(self, buf: int, layout: Layout, phase: str, label: str, control: tuple[int, ...] = ()) -> int:
        """``buf`` in ``layout``: boxed once per layout and phase (shared), unless ``control`` asks for a fresh
        copy that waits for those nodes (ZeRO-3's gather again in backward)."""
        src = self.bufs[buf]
        if src.layout == layout:
            return buf
        key = (buf, layout, phase)  # a step constant may be boxed per micro-batch and again after them
        if key in self.boxed and not control:
            return self.boxed[key]
        with boxing.target_factors(self.factors):
            plan = boxing.plan(src.shape, src.dtype, src.layout, layout, self.model)
        current = buf
        for i, step in enumerate(plan.steps):
            out = self.new_buf(src.shape, src.dtype, step.dst)
            one = boxing.Plan(src.shape, src.dtype, step.src, step.dst, (step,))
            ranks = _union(step.src.placement, step.dst.placement)
            self.emit("boxing", f"{step.kind} for {label} ({i + 1}/{len(plan.steps)})", (current,), (out,), ranks,
                      phase, stream=stream_of(step), boxing=one, control=control if i == 0 else ())
            current = out
        if not control:
            self.boxed[key] = current
        return current

    # -- logical nodes ------------------------------------------------------------------------------

    def lower(self) -> PhysicalPlan:
        for n in self.g.nodes:
            getattr(self, f"_{n.kind}")(n)
        plan = PhysicalPlan(overwrite_inputs(in_place_updates(self.nodes), self.bufs), self.bufs, {}, self.m)
        plan.registers = registers(plan)
        plan.world = tuple(sorted({r for n in self.nodes for r in n.ranks}))
        plan.watch = {name: self.bufs_of(vids) for name, vids in self.g.watch.items()}
        return plan

    def bufs_of(self, vids: list[int]) -> tuple[int, ...]:
        """The buffers holding values ``vids`` in any phase (values dead code removed have none)."""
        wanted = set(vids)
        return tuple(sorted({b for (vid, _), b in self.at.items() if vid in wanted}))

    def _source(self, n: LNode, kind: str) -> None:
        v = self.g.values[n.outputs[0]]
        out = self.value_buf(v.id, Layout(v.placement, v.sbp))
        self.emit(kind, n.name, (), (out,), v.placement.flat_ranks, "pre", logical=n.id)
        self.at[(v.id, "pre")] = out

    def _input(self, n: LNode) -> None:
        self._source(n, "input")

    def _variable(self, n: LNode) -> None:
        self._source(n, "variable")

    def _constant(self, n: LNode) -> None:
        self._source(n, "variable")  # constants are read-only variables the graph captured

    def _op(self, n: LNode) -> None:
        ins = tuple(self.read(vid, n.phase, Layout(self.g.values[vid].placement, sbp), f"{n.name} input {i}")
                    for i, (vid, sbp) in enumerate(zip(n.inputs, n.in_sbps, strict=True)))
        outs = []
        for vid in n.outputs:
            v = self.g.values[vid]
            outs.append(self.value_buf(vid, Layout(v.placement, v.sbp)))
            self.at[(vid, n.phase)] = outs[-1]
        placement = self.g.values[n.outputs[0]].placement if n.outputs else self.g.values[n.inputs[0]].placement
        stream = f"comm:{placement}:kernel" if self._talks(n, placement) else COMPUTE_STREAM
        self.emit("compute", n.name, ins, tuple(outs), placement.flat_ranks, n.phase, op=n.name, args=n.args,
                  attrs=n.attrs, in_sbps=n.in_sbps, out_sbps=tuple(self.g.values[v].sbp for v in n.outputs),
                  logical=n.id, control=self._control(n), stream=stream)

    def _talks(self, n: LNode, placement: Placement) -> bool:
        """Whether ``n``'s kernel exchanges shards under its chosen SBPs (ops.schema.run_shards): it then runs on
        a stream of its own, in plan order like a collective, and never joins a fused compute segment."""
        op = REGISTRY.get(n.name)
        if op is None or op.talks is None:
            return False
        metas = tuple(Meta(self.g.values[v].shape, self.g.values[v].dtype) for v in n.inputs)
        return op.talks(metas, n.in_sbps, placement)[0] > 0

    def _control(self, n: LNode) -> tuple[int, ...]:
        """The producers of ``n``'s control values in its phase: a recomputed forward op waits for the gradient
        that reaches its checkpointed segment, or the runtime would recompute as soon as the inputs exist."""
        return tuple(sorted({self.producer[self.at_phase(vid, n.phase)] for vid in n.control}))

    def _to_global(self, n: LNode) -> None:
        v = self.g.values[n.outputs[0]]
        if n.control:  # a conversion repeated later on purpose: its own boxing nodes, after the control nodes
            src = self.at_phase(n.inputs[0], n.phase)
            out = self.box(src, Layout(v.placement, v.sbp), n.phase, "to_global after control", self._control(n))
            self.at[(v.id, n.phase)] = out
            return
        self.at[(v.id, n.phase)] = self.read(n.inputs[0], n.phase, Layout(v.placement, v.sbp), "to_global")

    def _micro_to_post(self, n: LNode, kind: str) -> None:
        src = self.at_phase(n.inputs[0], "micro")
        if self.m == 1:
            self.at[(n.outputs[0], "post")] = src
            return
        b = self.bufs[src]
        shape = b.shape
        if n.name == "cat":
            shape = (b.shape[0] * self.m, *b.shape[1:])
        out = self.new_buf(shape, b.dtype, b.layout)
        self.emit(kind, n.name, (src,), (out,), b.layout.placement.flat_ranks, "post", mode=n.name, logical=n.id)
        self.at[(n.outputs[0], "post")] = out

    def _sink(self, n: LNode, kind: str) -> None:
        v = self.g.values[n.inputs[0]]
        buf = self.read(v.id, n.phase, Layout(v.placement, n.in_sbps[0]), f"{kind} {n.name}")
        self.emit(kind, n.name, (buf,), (), v.placement.flat_ranks, n.phase, logical=n.id)

    def _assign(self, n: LNode) -> None:
        self._sink(n, "assign")

    def _output(self, n: LNode) -> None:
        self._sink(n, "output")

    def _accumulate(self, n: LNode) -> None:
        self._micro_to_post(n, "accumulate")

    def _pack(self, n: LNode) -> None:
        self._micro_to_post(n, "pack")


def _union(a: Placement, b: Placement) -> tuple[int, ...]:
    if a == b:
        return a.flat_ranks
    return tuple(sorted(set(a.flat_ranks) | set(b.flat_ranks)))


def in_place_updates(nodes: list[PNode]) -> list[PNode]:
    """Turns each optimizer update that only feeds the assigns of its own variables into an ``update`` node and
    drops those assigns; node ids are renumbered to list positions (control edges follow). The executor then
    writes the variables in place once the step succeeded, instead of making new tensors and copying them."""
    readers: dict[int, list[PNode]] = {}
    for n in nodes:
        for b in n.inputs:
            readers.setdefault(b, []).append(n)
    variable_of = {n.outputs[0]: n.name for n in nodes if n.kind == "variable"}
    replaced: dict[int, PNode] = {}
    dropped: set[int] = set()
    for n in nodes:
        if n.kind != "compute" or n.op not in IN_PLACE:
            continue
        assigns = _own_assigns(n, readers, variable_of)
        if assigns is not None:
            replaced[n.id] = dataclasses.replace(n, kind="update", outputs=(), out_sbps=())
            dropped.update(a.id for a in assigns)
    if not replaced or any(c in dropped for n in nodes for c in n.control):
        return nodes
    kept = [replaced.get(n.id, n) for n in nodes if n.id not in dropped]
    renumber = {n.id: i for i, n in enumerate(kept)}
    return [dataclasses.replace(n, id=renumber[n.id], control=tuple(renumber[c] for c in n.control)) for n in kept]


def overwrite_inputs(nodes: list[PNode], bufs: dict[int, Buf]) -> list[PNode]:
    """Sets ``overwrites`` on each compute node of :data:`~sbpflow.ops.inplace.OVERWRITING` (tensor arguments
    only) that is the only reader of an input made fresh in its phase (:data:`~sbpflow.ops.inplace.FRESH_OUTPUTS`)
    with its output's shape, dtype and layout; the other input must have that dtype too. A residual ``add``
    thus reuses a gradient's memory."""
    readers: dict[int, list[PNode]] = {}
    for n in nodes:
        for b in n.inputs:
            readers.setdefault(b, []).append(n)
    producer = {b: n for n in nodes for b in n.outputs}
    out = []
    for n in nodes:
        if n.kind == "compute" and n.op in OVERWRITING and not n.attrs and len(n.outputs) == 1 and \
                n.args == (("t", 0), ("t", 1)) and len(set(n.inputs)) == 2:
            target = next((i for i in (1, 0) if _overwritable(n, i, readers, producer, bufs)), None)
            if target is not None:
                n = dataclasses.replace(n, overwrites=target)
        out.append(n)
    return out


def donate_inputs(plan: PhysicalPlan) -> PhysicalPlan:
    """Sets ``overwrites = 0`` on each one-step all-reduce whose input it alone reads, made fresh in its phase
    (:data:`~sbpflow.ops.inplace.FRESH_OUTPUTS`: a bucket's flat buffer, a weight gradient), so the collective
    reduces in that buffer instead of in a copy of it (what DDP does with its buckets)."""
    readers: dict[int, int] = {}
    for n in plan.nodes:
        for b in n.inputs:
            readers[b] = readers.get(b, 0) + 1
    producer = {b: n for n in plan.nodes for b in n.outputs}
    nodes = []
    for n in plan.nodes:
        if n.kind == "boxing" and n.boxing is not None and len(n.boxing.steps) == 1 and \
                n.boxing.steps[0].kind == "all_reduce" and readers[n.inputs[0]] == 1:
            made = producer.get(n.inputs[0])
            if made is not None and made.kind == "compute" and made.op in FRESH_OUTPUTS and made.phase == n.phase:
                n = dataclasses.replace(n, overwrites=0)
        nodes.append(n)
    return dataclasses.replace(plan, nodes=nodes)


def _overwritable(n: PNode, i: int, readers: dict[int, list[PNode]], producer: dict[int, PNode],
                  bufs: dict[int, Buf]) -> bool:
    b, out = bufs[n.inputs[i]], bufs[n.outputs[0]]
    made = producer.get(b.id)
    return (made is not None and made.kind == "compute" and made.op in FRESH_OUTPUTS and made.phase == n.phase
            and readers[b.id] == [n] and (b.shape, b.dtype, b.layout) == (out.shape, out.dtype, out.layout)
            and bufs[n.inputs[1 - i]].dtype == out.dtype)


def _own_assigns(n: PNode, readers: dict[int, list[PNode]], variable_of: dict[int, str]) -> list[PNode] | None:
    """The assign nodes that take each output of ``n`` back to the variable its input came from, if that is all
    its outputs feed and each written variable is a different one; else None."""
    writes = IN_PLACE[n.op or n.name].writes(len(n.inputs))
    if len(writes) != len(n.outputs) or len({i for _, i in writes}) != len(writes):
        return None
    assigns = []
    for out, i in writes:
        users = readers.get(n.outputs[out], [])
        name = variable_of.get(n.inputs[i])
        if len(users) != 1 or users[0].kind != "assign" or name is None or users[0].name != name:
            return None
        if n.inputs.count(n.inputs[i]) != 1:  # the variable is also another argument: it must stay as it was
            return None
        assigns.append(users[0])
    return assigns


def lower(g: LogicalGraph, model: boxing.CostModel, factors: tuple[Any, ...]) -> PhysicalPlan:
    """The physical plan of ``g`` (whose values carry their chosen SBPs)."""
    return _Lowerer(g, model, factors).lower()


# ----------------------------------------------------------------------------- registers


def registers(plan: PhysicalPlan) -> dict[int, Register]:
    """One register per buffer (register_num 1): its bytes on each rank and its consumers."""
    consumers: dict[int, list[int]] = {b: [] for b in plan.bufs}
    for n in plan.nodes:
        for b in n.inputs:
            consumers[b].append(n.id)
    out = {}
    sizes: dict[tuple[Any, ...], tuple[tuple[int, int], ...]] = {}  # one tuple per layout (repeated layers share)
    for b, buf in plan.bufs.items():
        key = (buf.shape, buf.dtype, buf.layout)
        per_rank = sizes.get(key)
        if per_rank is None:
            per_rank = sizes[key] = tuple((r, buf.nbytes(r)) for r in buf.layout.placement.flat_ranks)
        out[b] = Register(b, 1, per_rank, tuple(consumers[b]))
    return out
