"""Fused segments (``GraphConfig.enable_fused_segments``, on by default): each maximal run of plain compute
nodes becomes one node whose kernel is straight-line Python generated from the run, so the executor pays one
act per run instead of one per node (what torch.fx's ``GraphModule`` does for a traced graph)::

    matmul -> add -> gelu        def segment(b3, b7):     # the run's inputs
                                     b9 = k0(b3, **a0)    # k0: REGISTRY["matmul"].kernel
                                     b10 = k1(b9, b7)
                                     del b9               # dies after its last reader
                                     return (k2(b10),)

A run ends at any other node (communication, boxing, update) and keeps to one stage and schedule part; around
a collective it keeps the overlap unfused nodes have (:func:`_runs`). Intermediates never reach a register:
:func:`transient_bytes` adds them to the act's peak. ``attrs`` keeps the sub-nodes, so errors, ``explain()`` and
the timeline (``SegmentCode.timed``) still name the original nodes.
"""

from __future__ import annotations

import dataclasses
import linecache
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..ops.inplace import OVERWRITING
from ..ops.schema import REGISTRY, shard_kernel
from .physical import COMPUTE_STREAM, PhysicalPlan, PNode, Register

FUSED = "fused_segment"  # the op (and name) of a fused node
STATIC_ARGS = ("t", "c")  # argument kinds a fused kernel takes: tensor inputs and constants


def fusable(node: PNode) -> bool:
    """Whether ``node`` may join a segment (see the module docstring)."""
    return (node.kind == "compute" and node.stream == COMPUTE_STREAM and node.op is not None and node.op != FUSED
            and all(how in STATIC_ARGS for how, _ in node.args))


def fuse_segments(plan: PhysicalPlan, torch_compile: bool = False) -> PhysicalPlan:
    """``plan`` with each run of two or more fusable nodes made one :data:`FUSED` node; ``torch_compile`` is
    recorded on those nodes for the executor (``torch.compile(kernel, dynamic=False)``). Node ids are renumbered
    to list positions; registers of buffers that became internal are dropped."""
    pipe = plan.pipeline
    runs = _runs(plan.nodes, _place_in_schedule(pipe))
    if not runs:
        return plan
    readers = _readers(plan.nodes)
    watched = {b for bufs in plan.watch.values() for b in bufs}
    first = {run[0].id: run for run in runs}
    inside = {n.id for run in runs for n in run}
    nodes: list[PNode] = []
    for n in plan.nodes:
        if n.id in first:
            nodes.append(_fused(first[n.id], readers, watched, torch_compile))
        elif n.id not in inside:
            nodes.append(n)
    return with_merged_nodes(plan, nodes, {n.id: f.id for f in nodes if f.op == FUSED for n in sub_nodes(f)})


def with_merged_nodes(plan: PhysicalPlan, nodes: list[PNode], owner: dict[int, int]) -> PhysicalPlan:
    """``plan`` with its node list replaced by ``nodes``, where some nodes stand for several old ones (``owner``:
    old node id -> the id of the node now standing for it): ids renumbered to list positions, control edges and
    the pipeline's node maps following, registers kept for the buffers still passed between nodes. Used by the
    passes that merge nodes (fused segments, grouped accumulation)."""
    renumber = {n.id: i for i, n in enumerate(nodes)}
    nodes = [_renumbered(n, renumber, owner) for n in nodes]
    out = dataclasses.replace(plan, nodes=nodes, registers={})
    out.registers = _registers(plan, nodes)
    if plan.pipeline is not None:
        out.pipeline = _renumbered_pipeline(plan.pipeline, renumber, owner)
    return out


def _place_in_schedule(pipe: Any) -> Callable[[PNode], Any]:
    """A node's (stage, part) in a pipeline's schedule, which a run keeps to (nothing without a pipeline)."""
    if pipe is None:
        return lambda n: None
    return lambda n: (pipe.stage_of.get(n.id), pipe.part_of.get(n.id))


def _runs(nodes: list[PNode], place: Callable[[PNode], Any]) -> list[list[PNode]]:
    """The maximal runs of consecutive fusable nodes with one phase, one rank set and one ``place`` (pipeline
    stage and part), of two nodes or more. Around communication, runs stop where unfused nodes would let the
    transfer overlap compute: a node that makes what a communication node sends ends a run (the collective is
    issued as soon as its input is made, not after the rest of the run), and a node that reads what one made
    starts a run (a collective may still be in flight when its reader acts; the executor waits there, and the
    nodes before the reader keep computing meanwhile)."""
    comm = [n for n in nodes if n.kind in ("boxing", "route")]
    communicated = {b for n in comm for b in n.outputs}
    sent = {b for n in comm for b in n.inputs}
    runs: list[list[PNode]] = []
    run: list[PNode] = []
    for n in nodes:
        same = (n.phase, n.ranks, place(n)) == (run[0].phase, run[0].ranks, place(run[0])) if run else True
        if run and not (fusable(n) and same and communicated.isdisjoint(n.inputs)):
            runs.append(run)
            run = []
        if fusable(n):
            run.append(n)
            if not sent.isdisjoint(n.outputs):
                runs.append(run)
                run = []
    runs.append(run)
    return [r for r in runs if len(r) > 1]


def _readers(nodes: list[PNode]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for n in nodes:
        for b in n.inputs:
            out.setdefault(b, []).append(n.id)
    return out


def _fused(run: list[PNode], readers: dict[int, list[int]], watched: set[int], torch_compile: bool) -> PNode:
    """One node for ``run``: inputs in order of first read, outputs the buffers read outside the run (or watched),
    control the run's edges from outside it."""
    ids = {n.id for n in run}
    made = [b for n in run for b in n.outputs]
    made_set = set(made)
    inputs = tuple(dict.fromkeys(b for n in run for b in n.inputs if b not in made_set))
    outputs = tuple(b for b in made if b in watched or any(r not in ids for r in readers.get(b, ())))
    edges: dict[int, int] = {}  # the run's control edges from outside it -> their largest lead (GPipe's m - 1)
    for n in run:
        for c, lead in zip(n.control, n.control_lead or (0,) * len(n.control), strict=True):
            if c not in ids:
                edges[c] = max(lead, edges.get(c, lead))
    control = tuple(sorted(edges))
    control_lead = tuple(edges[c] for c in control) if any(n.control_lead for n in run) else ()
    head = run[0]
    sbp_of = {b: s for n in run for b, s in zip(n.inputs, n.in_sbps, strict=False)}
    sbp_of.update({b: s for n in run for b, s in zip(n.outputs, n.out_sbps, strict=False)})
    return PNode(head.id, "compute", FUSED, inputs, outputs, head.ranks, head.phase, op=FUSED,
                 args=tuple(("t", i) for i in range(len(inputs))),
                 attrs=(("nodes", tuple(run)), ("torch_compile", torch_compile)),
                 in_sbps=tuple(sbp_of.get(b) for b in inputs), out_sbps=tuple(sbp_of.get(b) for b in outputs),
                 control=control, control_lead=control_lead, logical=head.logical)


def _renumbered(n: PNode, renumber: dict[int, int], owner: dict[int, int]) -> PNode:
    """``n`` with its id and control edges in the new numbering (an edge to a fused node's member goes to it).
    Control leads stay per edge; two edges that now meet one fused node keep the larger lead."""
    edges: dict[int, int] = {}
    leads = n.control_lead or (0,) * len(n.control)
    for c, lead in zip(n.control, leads, strict=True):
        target = renumber[owner.get(c, c)]
        edges[target] = max(lead, edges.get(target, lead))
    control = tuple(sorted(edges))
    control_lead = tuple(edges[c] for c in control) if n.control_lead else ()
    return dataclasses.replace(n, id=renumber[n.id], control=control, control_lead=control_lead)


def _renumbered_pipeline(pipe: Any, renumber: dict[int, int], owner: dict[int, int]) -> Any:
    """``pipe`` with its node-keyed maps (stage, part) in the new numbering: a fused node takes its members'
    stage and part (one run keeps to one of each). Buffer-keyed fields are unchanged."""
    def moved(by_id: dict[int, Any]) -> dict[int, Any]:
        return {renumber[owner.get(i, i)]: v for i, v in by_id.items() if owner.get(i, i) in renumber}

    return dataclasses.replace(pipe, stage_of=moved(pipe.stage_of), part_of=moved(pipe.part_of))


def _registers(plan: PhysicalPlan, nodes: list[PNode]) -> dict[int, Register]:
    """The registers of buffers the new nodes still pass between them, with their new consumers (register
    counts and bytes as they were)."""
    consumers: dict[int, list[int]] = {}
    for n in nodes:
        for b in n.inputs:
            consumers.setdefault(b, []).append(n.id)
    live = {b for n in nodes for b in (*n.inputs, *n.outputs)}
    return {b: dataclasses.replace(reg, consumers=tuple(consumers.get(b, ())))
            for b, reg in plan.registers.items() if b in live}


def sub_nodes(node: PNode) -> tuple[PNode, ...]:
    """The original nodes of a fused node, in order (empty for any other node)."""
    if node.op != FUSED:
        return ()
    return dict(node.attrs)["nodes"]  # type: ignore[no-any-return]


def members(nodes: Iterable[PNode]) -> list[PNode]:
    """``nodes`` with each fused node replaced by its sub-nodes: the plan's nodes as the passes before fusion left
    them, in order (their buffers are the plan's; their ids are those from before renumbering)."""
    return [m for n in nodes for m in (sub_nodes(n) if n.op == FUSED else (n,))]


def uses_torch_compile(node: PNode) -> bool:
    return bool(dict(node.attrs).get("torch_compile", False))


# ----------------------------------------------------------------------------- code generation


@dataclass(frozen=True)
class SegmentCode:
    """A fused node's generated kernel: ``function(*input shards of one rank) -> tuple of output shards``."""

    function: Callable[..., tuple[Any, ...]]
    source: str
    line_node: dict[int, PNode]  # source line number -> the sub-node it runs (for errors)
    # the same code with a clock read after each sub-node: ``timed(marks, *inputs)`` appends one time.time() per
    # sub-node to ``marks`` (the caller puts the start first), for the timeline's per-op spans
    timed: Callable[..., tuple[Any, ...]] | None = None
    timed_line_node: dict[int, PNode] = dataclasses.field(default_factory=dict)  # the same for ``timed``

    def node_at(self, lineno: int, timed: bool = False) -> PNode | None:
        return (self.timed_line_node if timed else self.line_node).get(lineno)


def shard_aware_subs(node: PNode) -> list[int]:
    """The positions of a fused node's sub-nodes whose kernel takes a ``ShardCtx`` first."""
    return [k for k, sub in enumerate(sub_nodes(node))
            if sub.overwrites is None and REGISTRY[sub.op or sub.name].shard_aware]


def codegen(node: PNode, contexts: dict[int, Any] | None = None) -> SegmentCode:
    """The straight-line function of fused node ``node`` (see the module docstring), compiled with its own
    code object; its source is registered with :mod:`linecache`, so tracebacks show the failing line.
    ``contexts``: sub-node position -> the ``ShardCtx`` of one rank, for each of :func:`shard_aware_subs`
    (the function is then that rank's)."""
    subs = sub_nodes(node)
    contexts = contexts or {}
    missing = [k for k in shard_aware_subs(node) if k not in contexts]
    if missing:
        raise ValueError(f"{node.label()}: codegen needs the ShardCtx of its shard-aware sub-nodes {missing}")
    if not subs:
        raise ValueError(f"{node.label()} is not a fused segment (op {node.op!r})")
    names: dict[str, Any] = {}
    params = ", ".join(f"b{b}" for b in node.inputs)
    lines, timed = [f"def segment({params}):"], [f"def segment_timed(_marks, {params}):"]
    line_node: dict[int, PNode] = {}
    timed_line_node: dict[int, PNode] = {}
    last_read = _last_reads(subs)
    keep = set(node.inputs) | set(node.outputs)
    for k, sub in enumerate(subs):
        for text in _call_lines(k, sub, names, keep, last_read, contexts.get(k)):
            lines.append(text)
            line_node[len(lines)] = sub
            timed.append(text)
            timed_line_node[len(timed)] = sub
        timed.append("    _marks.append(_clock())")
    ret = f"    return ({''.join(f'b{b}, ' for b in node.outputs)})"
    source = "\n".join([*lines, ret]) + "\n"
    filename = f"<sbpflow {FUSED} #{node.id}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), names)  # noqa: S102 - our own generated source, no user text
    names["_clock"] = time.time
    exec(compile("\n".join([*timed, ret]) + "\n", f"{filename} (timed)", "exec"), names)  # noqa: S102
    return SegmentCode(names["segment"], source, line_node, names["segment_timed"], timed_line_node)


def _last_reads(subs: Iterable[PNode]) -> dict[int, int]:
    """Buffer id -> the sub-node (index) that reads it last."""
    out: dict[int, int] = {}
    for k, sub in enumerate(subs):
        for b in sub.inputs:
            out[b] = k
    return out


def _call_lines(k: int, sub: PNode, names: dict[str, Any], keep: set[int], last_read: dict[int, int],
                context: Any) -> list[str]:
    """Sub-node ``k``'s lines: the kernel call, its outputs bound, then ``del`` of the intermediates it read last
    (``keep``: the segment's inputs and outputs, which outlive it anyway)."""
    args = []
    if sub.overwrites is not None:  # into input i's storage, as the executor's own act (runtime.inorder)
        names[f"k{k}"] = OVERWRITING[sub.op or sub.name]
        sub = dataclasses.replace(sub, args=(("t", sub.overwrites), ("t", 1 - sub.overwrites)), attrs=())
    else:
        names[f"k{k}"] = shard_kernel(REGISTRY[sub.op or sub.name])  # a talking node never joins (lower's stream)
    if context is not None:
        names[f"x{k}"] = context
        args.append(f"x{k}")
    for j, (how, v) in enumerate(sub.args):
        if how == "t":
            args.append(f"b{sub.inputs[v]}")
        else:
            names[f"c{k}_{j}"] = v
            args.append(f"c{k}_{j}")
    if sub.attrs:
        names[f"a{k}"] = dict(sub.attrs)
        args.append(f"**a{k}")
    call = f"k{k}({', '.join(args)})"
    outs = [f"b{b}" if b in keep or b in last_read else "_" for b in sub.outputs]
    if len(outs) == 1:
        lines = [f"    {outs[0]} = {call}"]
    else:  # a kernel of several outputs returns a sequence (the executor reads its first len(outputs) items)
        lines = [f"    _t = {call}", *(f"    {o} = _t[{j}]" for j, o in enumerate(outs) if o != "_"), "    del _t"]
    dead = [b for b in dict.fromkeys(sub.inputs) if last_read.get(b) == k and b not in keep]
    if dead:
        lines.append(f"    del {', '.join(f'b{b}' for b in dead)}")
    return lines


def transient_bytes(plan: PhysicalPlan, node: PNode, rank: int) -> int:
    """The most bytes a fused node's intermediates (buffers made and read inside it) hold at once on ``rank``:
    what its act holds besides its registers. 0 for any other node."""
    subs = sub_nodes(node)
    exposed, inputs = set(node.outputs), set(node.inputs)
    last_read = _last_reads(subs)
    live = peak = 0
    for k, sub in enumerate(subs):
        live += sum(plan.bufs[b].nbytes(rank) for b in sub.outputs if b not in exposed and b in last_read)
        peak = max(peak, live)
        live -= sum(plan.bufs[b].nbytes(rank) for b in set(sub.inputs)
                    if last_read[b] == k and b not in exposed and b not in inputs)
    return peak
