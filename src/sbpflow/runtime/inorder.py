"""The in-order executor: runs a physical plan node by node, the reference the actor runtime is checked against.

Node semantics are in :mod:`sbpflow.graph.physical`; both executors run the same :class:`Program`.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import boxing
from .._layout import shard_box
from ..boxing.execute import InFlight, bind_async, runs_async
from ..comm import Backend, get_backend
from ..comm.base import KERNEL_CHANNEL
from ..distributed import activity
from ..errors import SbpflowError
from ..graph import fuse
from ..graph.physical import GATHERING, PHASES, PhysicalPlan, PNode
from ..host_memory import keep_freed_host_memory
from ..ops.inplace import OVERWRITING
from ..ops.optimizer import IN_PLACE
from ..ops.schema import REGISTRY, Meta, ShardCtx, run_shards
from ..random import mix_key
from . import route
from .errors import ExecutionError

Shards = dict[int, torch.Tensor]
RANDOM_FEED = "__random__"  # feeds[RANDOM_FEED] = (seed, counter at step start, keys drawn per micro-batch)


class StepState:
    """Per-step values: buffers by id (per micro-batch where they vary) and pending variable writes."""

    def __init__(self, plan: PhysicalPlan, feeds: dict[str, Shards], variables: dict[str, Shards]) -> None:
        self.plan = plan
        self.feeds = feeds
        self.variables = variables
        self.assigns: dict[str, Shards] = {}
        self.updates: list[tuple[Callable[..., Any], list[Any], dict[str, Any]]] = []  # (kernel, args, attrs): commit
        self.outputs: dict[str, Shards] = {}


Act = Callable[[Sequence[Any], StepState, int], list[Any]]


def act(node: PNode, inputs: Sequence[Any], state: StepState, micro: int, backend: Backend) -> list[Any]:
    """Runs ``node`` once (micro-batch ``micro``); ``inputs`` are its input values: shards, or for
    ``accumulate``/``pack`` per input the list of its m micro-batch shards. Returns its output values."""
    cached = getattr(state.plan, "_program", None)  # the hot path: one check of this node, not of the whole plan
    if cached is None or cached[0] is not backend or cached[2].nodes.get(node.id) is not node:
        cached = (backend, None, program(state.plan, backend))
    return cached[2].acts[node.id](inputs, state, micro)


@dataclass
class Program:
    """A plan prepared for one process: per node a callable with everything static bound (kernel, attributes,
    owned ranks, shard contexts), and the in-order schedule with the buffers to drop after each node."""

    nodes: dict[int, PNode]  # the nodes it was made from, by id
    acts: dict[int, Act]
    phases: list[tuple[str, list[tuple[PNode, Act, tuple[int, ...]]]]]  # (phase, [(node, act, bufs to drop)])
    after_micro: tuple[int, ...]  # pre buffers last read by micro nodes: dropped after the last micro-batch
    gathered: frozenset[int]  # micro buffers read by accumulate/pack (kept per micro-batch)


def program(plan: PhysicalPlan, backend: Backend, p2p: bool = True) -> Program:
    """``plan``'s :class:`Program` for ``backend`` (made once per plan and backend, then cached on the plan; made
    again if the plan's node list changed). ``p2p``: send/recv of cpu shards issued in flight too (see
    :func:`in_flight_collectives`)."""
    cached = getattr(plan, "_program", None)
    if cached is not None and cached[0] is backend and cached[3] == p2p and len(cached[1]) == len(plan.nodes) and \
            all(map(operator.is_, cached[1], plan.nodes)):
        return cached[2]
    keep_freed_host_memory()  # a step's activations reuse the last step's pages (no page faults)
    prepared = _prepare(plan, backend, p2p)
    plan._program = (backend, list(plan.nodes), prepared, p2p)  # type: ignore[attr-defined]
    return prepared


def _prepare(plan: PhysicalPlan, backend: Backend, p2p: bool) -> Program:
    in_flight = in_flight_collectives(plan, p2p) if backend.in_flight else {}
    acts = {n.id: _bind(n, plan, backend, n.id in in_flight) for n in plan.nodes}
    flying = set(in_flight.values())
    for n in plan.nodes:  # a reader of a collective in flight waits for it first
        waits = tuple(i for i, b in enumerate(n.inputs) if b in flying)
        if waits:
            acts[n.id] = _waiting(acts[n.id], waits)
    mine = [n for n in plan.nodes if any(backend.owns(r) for r in n.ranks)]
    drops, after_micro = _last_reads(plan, mine)
    phases = [(phase, [(n, acts[n.id], drops.get(n.id, ())) for n in mine if n.phase == phase]) for phase in PHASES]
    gathered = frozenset(b for n in plan.nodes if n.kind in GATHERING for b in n.inputs)
    return Program({n.id: n for n in plan.nodes}, acts, phases, after_micro, gathered)


def in_flight_collectives(plan: PhysicalPlan, p2p: bool = True) -> dict[int, int]:
    """Collectives issued without waiting (:func:`~sbpflow.boxing.execute.runs_async`): node id -> its output
    buffer. Its readers wait where they act, so the transport works while the nodes between run (the overlap of
    a data-parallel step's gradient buckets with the rest of backward, as DDP's). Not where an accumulate or a
    pack reads the value: they take it apart from any act. A program issues them so only on a backend whose
    transport moves the bytes meanwhile (``Backend.in_flight``: torch.distributed); on virtual ranks a collective
    completes when issued, and the plain act costs less.

    ``p2p=False`` leaves send/recv out (it blocks): for the actor runtime's threads, whose compute thread would
    commit to an act as soon as its input is posted and wait in it, while a peer waits for an act behind it (the
    one-thread runtime posts every ready transfer first instead: :meth:`~sbpflow.runtime.board.play.play`)."""
    gathering = {b for n in plan.nodes if n.kind in GATHERING for b in n.inputs}
    return {n.id: n.outputs[0] for n in plan.nodes
            if n.kind == "boxing" and n.boxing is not None and runs_async(n.boxing) and n.outputs[0] not in gathering
            and (p2p or n.boxing.steps[0].kind != "send_recv")}


def _waiting(run: Act, waits: tuple[int, ...]) -> Act:
    """``run`` after waiting for its inputs ``waits`` (collectives in flight: :class:`InFlight`)."""
    def waited(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
        values = list(inputs)
        for i in waits:
            value = values[i]
            if value.__class__ is InFlight:  # a buffer another process makes holds no shard here: nothing to wait
                values[i] = value.wait()
        return run(values, state, micro)

    return waited


def _last_reads(plan: PhysicalPlan, mine: list[PNode]) -> tuple[dict[int, tuple[int, ...]], tuple[int, ...]]:
    """Node id -> buffers this process may drop once the node acted (it is their last reader in list order),
    and the pre buffers read last in the micro phase (kept until the last micro-batch has run)."""
    made_in = {b: n.phase for n in mine for b in n.outputs}
    order = sorted(mine, key=lambda n: PHASES.index(n.phase))  # stable: list order within a phase
    last: dict[int, PNode] = {}
    for n in order:
        for b in n.inputs:
            last[b] = n
    drops: dict[int, list[int]] = {}
    after_micro = []
    for b, n in last.items():
        if n.phase == "micro" and made_in.get(b) != "micro" and plan.micro_batches > 1:
            after_micro.append(b)  # read by every micro-batch
        elif n.kind not in GATHERING:  # a gathering node reads the m values, not the buffer
            drops.setdefault(n.id, []).append(b)
    return {k: tuple(v) for k, v in drops.items()}, tuple(after_micro)


def _bind(node: PNode, plan: PhysicalPlan, backend: Backend, in_flight: bool = False) -> Act:
    """The node's action with its static parts bound (see :mod:`sbpflow.graph.physical` for each kind);
    ``in_flight``: a collective that returns once issued (:func:`in_flight_collectives`)."""
    kind = node.kind
    if kind == "compute":
        return _bind_compute(node, plan, backend.owned(node.ranks))
    if kind == "update":
        return _bind_update(node, backend.owned(node.ranks))
    if kind == "input":
        return lambda inputs, state, micro: [_check_feed(node, state)]
    if kind == "variable":
        name = node.name
        return lambda inputs, state, micro: [state.variables[name]]
    if kind == "unpack":
        m = plan.micro_batches
        if m == 1:
            return lambda inputs, state, micro: [inputs[0]]
        return lambda inputs, state, micro: [{r: t.chunk(m, 0)[micro] for r, t in inputs[0].items()}]
    if kind == "repeat":
        return lambda inputs, state, micro: [inputs[0]]
    if kind == "boxing":
        return _bind_boxing(node, backend, in_flight)
    if kind == "accumulate":
        return lambda inputs, state, micro: _accumulate(inputs)
    if kind == "pack":
        return lambda inputs, state, micro: [_pack(node, inputs[0])]
    if kind == "route":
        return lambda inputs, state, micro: route.act(node, list(inputs), backend)
    if kind == "assign":
        return lambda inputs, state, micro: _record(state.assigns, node.name, inputs[0])
    if kind == "output":
        return lambda inputs, state, micro: _record(state.outputs, node.name, inputs[0])
    raise ExecutionError(f"unknown node kind {kind!r} in {node.label()}")


def _record(into: dict[str, Shards], name: str, value: Shards) -> list[Any]:
    into[name] = value
    return []


def _bind_boxing(node: PNode, backend: Backend, in_flight: bool) -> Act:
    assert node.boxing is not None
    plan_step, donate = node.boxing, node.overwrites == 0  # donated: the only reader of a fresh input
    if in_flight:
        start = bind_async(plan_step, backend, donate)

        def issue(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
            with activity(lambda: f"{node.label()} (micro-batch {micro})"):
                return [start(inputs[0])]
        return issue

    def run(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
        with activity(lambda: f"{node.label()} (micro-batch {micro})"):  # comm errors name the node
            return [boxing.execute(plan_step, inputs[0], backend, donate)]

    return run


def _check_feed(node: PNode, state: StepState) -> Shards:
    if node.name not in state.feeds:
        raise ExecutionError(f"{node.label()}: the step was given no value for input {node.name!r}")
    return state.feeds[node.name]


def _scalar(how: str, v: Any, state: StepState, micro: int) -> Any:
    """A non-tensor argument: a constant, a per-step feed (``"s"``), or the step's random key (``"k"``)."""
    if how == "s":
        return state.feeds[v]
    if how == "k":  # the same key eager mode would draw: counter base + micro-batch * keys per micro-batch + v
        seed, base, per_micro = state.feeds[RANDOM_FEED]
        return mix_key(seed, base + micro * per_micro + v + 1)
    return v


def _arguments(node: PNode, owned: list[int]) -> Callable[[Sequence[Any], StepState, int], dict[int, list[Any]]]:
    """The node's positional arguments on each owned rank, from its inputs (``args`` template)."""
    template = node.args
    if all(how == "t" for how, _ in template):  # tensors only: no per-step scalars to look up
        index = [v for _, v in template]
        return lambda inputs, state, micro: {r: [inputs[i][r] for i in index] for r in owned}
    dynamic = any(how in ("s", "k") for how, _ in template)

    def arguments(inputs: Sequence[Any], state: StepState, micro: int) -> dict[int, list[Any]]:
        scalars = [_scalar(how, v, state, micro) for how, v in template] if dynamic else [v for _, v in template]
        return {r: [inputs[v][r] if how == "t" else s for (how, v), s in zip(template, scalars, strict=True)]
                for r in owned}

    return arguments


def _bind_compute(node: PNode, plan: PhysicalPlan, owned: list[int]) -> Act:
    if node.op == fuse.FUSED:
        return _bind_segment(node, plan, owned)
    opdef = REGISTRY[node.op or node.name]
    kernel, attrs, n_out = opdef.kernel, dict(node.attrs), len(node.outputs)
    arguments = _arguments(node, owned)
    if node.overwrites is not None:  # into input i's storage (the node is its only reader: graph.lower)
        into, i, other = OVERWRITING[node.op or node.name], node.overwrites, 1 - node.overwrites

        def run(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
            return [{r: into(inputs[i][r], inputs[other][r]) for r in owned}]
    elif opdef.shard_aware:
        contexts = {r: _shard_ctx(node, plan, r) for r in owned}

        def run(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
            per_rank = arguments(inputs, state, micro)
            return _split_results(run_shards(opdef, contexts, per_rank, attrs), n_out)
    elif len(owned) == 1 and all(how == "t" for how, _ in node.args):  # the common case: one rank, tensors only
        rank, index = owned[0], [v for _, v in node.args]
        if n_out == 1:
            return lambda inputs, state, micro: [{rank: kernel(*[inputs[i][rank] for i in index], **attrs)}]

        def run(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
            result = kernel(*[inputs[i][rank] for i in index], **attrs)
            return [{rank: t} for t in result]
    else:
        def run(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
            results = {r: kernel(*values, **attrs) for r, values in arguments(inputs, state, micro).items()}
            return _split_results(results, n_out)

    return run


# Set by the actor runtime around a fused act while it writes a timeline: ``SEGMENT_MARKS.spans`` is then a list, and
# the act appends ``(rank, [start, end of sub-node 0, end of sub-node 1, ...])`` per rank it ran (graph.fuse's timed
# code; not under torch.compile, whose code is not ours), for the timeline's per-op spans inside the act.
SEGMENT_MARKS = threading.local()


def _bind_segment(node: PNode, plan: PhysicalPlan, owned: list[int]) -> Act:
    """A fused segment (:mod:`sbpflow.graph.fuse`): its generated function on each owned rank's shards (under
    ``torch.compile`` where the node asks for it). A failure names the sub-node that raised. With shard-aware
    sub-nodes each rank has a function of its own (their ``ShardCtx`` are its constants), else ranks share one."""
    aware, subs = fuse.shard_aware_subs(node), fuse.sub_nodes(node)
    shared = None if aware else fuse.codegen(node)
    codes = {r: shared or fuse.codegen(node, {k: _shard_ctx(subs[k], plan, r) for k in aware}) for r in owned}
    compiled = fuse.uses_torch_compile(node)
    functions = {r: torch.compile(c.function, dynamic=False) if compiled else c.function for r, c in codes.items()}

    def on_rank(rank: int, inputs: Sequence[Any], micro: int) -> tuple[Any, ...]:
        values = [v[rank] for v in inputs]
        try:
            spans = getattr(SEGMENT_MARKS, "spans", None)
            if spans is not None and not compiled:  # a timeline is written: the timed twin (rare: looked up here)
                timed = codes[rank].timed
                if timed is not None:
                    marks = [time.time()]
                    out = timed(marks, *values)
                    spans.append((rank, marks))
                    return out  # type: ignore[no-any-return]
            return functions[rank](*values)  # type: ignore[no-any-return]
        except SbpflowError:  # sbpflow's own errors say what failed (as for an unfused node: _run_steps)
            raise
        except Exception as e:  # name the original node, as the unfused plan would have
            raise _segment_error(node, codes[rank], e, values, micro) from e

    if len(owned) == 1:
        rank = owned[0]
        return lambda inputs, state, micro: [{rank: t} for t in on_rank(rank, inputs, micro)]

    def run(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
        results = {r: on_rank(r, inputs, micro) for r in owned}
        return [{r: res[j] for r, res in results.items()} for j in range(len(node.outputs))]

    return run


def _segment_error(node: PNode, code: fuse.SegmentCode, error: Exception, values: list[Any],
                   micro: int) -> ExecutionError:
    """An :class:`ExecutionError` naming the sub-node of fused ``node`` that raised ``error``: found from the
    traceback's line in the generated code, or (under torch.compile, whose frames are not that code) by running
    the plain generated function again on the same inputs (only to find the line: an in-place add may have
    written one of them)."""
    sub, cause = _failing_line(code, error), error
    if sub is None:
        try:
            code.function(*values)
        except Exception as plain:  # noqa: BLE001 - any error locates the sub-node
            sub, cause = _failing_line(code, plain), plain
    where = f"{node.label()} (micro-batch {micro})"
    if sub is None:  # the plain function runs: torch.compile itself failed
        ops = ", ".join(s.op or s.name for s in fuse.sub_nodes(node))
        return ExecutionError(f"{where}: torch.compile of the segment [{ops}] failed: {type(error).__name__}: {error}")
    return ExecutionError(f"{where}: its node {sub.label()} (op {sub.op or sub.name}) failed: "
                          f"{type(cause).__name__}: {cause}")


def _failing_line(code: fuse.SegmentCode, error: BaseException) -> PNode | None:
    """The sub-node whose line of the generated code ``error``'s traceback passes through, if any."""
    tb = error.__traceback__
    found = None
    timed = code.timed.__code__ if code.timed is not None else None
    while tb is not None:
        if tb.tb_frame.f_code is code.function.__code__:
            found = code.node_at(tb.tb_lineno)
        elif tb.tb_frame.f_code is timed:  # the timed twin (a timeline is written)
            found = code.node_at(tb.tb_lineno, timed=True)
        tb = tb.tb_next
    return found


def _split_results(results: dict[int, Any], n_out: int) -> list[Any]:
    if n_out == 1:
        return [results]
    return [{r: res[j] for r, res in results.items()} for j in range(n_out)]


def _bind_update(node: PNode, owned: list[int]) -> Act:
    """An in-place update of variables: its arguments are taken now, the kernel runs in :func:`commit` (with a
    workspace per owned rank that lives as long as the program, where the kernel takes one)."""
    form = IN_PLACE[node.op or node.name]
    attrs = [dict(node.attrs, workspace={}) if form.workspace else dict(node.attrs) for _ in owned]
    arguments = _arguments(node, owned)

    def run(inputs: Sequence[Any], state: StepState, micro: int) -> list[Any]:
        per_rank = arguments(inputs, state, micro)
        state.updates.extend((form.kernel, values, a) for values, a in zip(per_rank.values(), attrs, strict=True))
        return []

    return run


def _shard_ctx(node: PNode, plan: PhysicalPlan, rank: int) -> ShardCtx:
    ins = [plan.bufs[b] for b in node.inputs]
    outs = [plan.bufs[b] for b in node.outputs]
    placement = outs[0].layout.placement if outs else ins[0].layout.placement
    return ShardCtx(
        rank, placement,
        tuple(shard_box(b.shape, b.layout.placement, b.layout.sbp, rank) for b in ins),
        tuple(shard_box(b.shape, b.layout.placement, b.layout.sbp, rank) for b in outs),
        tuple(Meta(b.shape, b.dtype) for b in ins), tuple(Meta(b.shape, b.dtype) for b in outs),
        tuple(b.layout.sbp for b in ins), tuple(b.layout.sbp for b in outs),
    )


def _accumulate(per_input: Sequence[Sequence[Shards]]) -> list[Shards]:
    """Each input's sum over its m micro-batch values, in micro-batch order (as the actor runtime's running sums)."""
    totals = add_into(None, [values[0] for values in per_input])
    for k in range(1, len(per_input[0])):
        add_into(totals, [values[k] for values in per_input])
    return totals


def add_into(totals: list[Shards] | None, values: Sequence[Shards]) -> list[Shards]:
    """One micro-batch of an accumulate node's k inputs added into its k running sums: copies of the first values
    (a sum never aliases its input's register), then one ``torch._foreach_add_`` over every owned shard of every
    input (the same additions as one ``add_`` each, in one call)."""
    if totals is None:
        return [{r: t.clone() for r, t in value.items()} for value in values]
    if len(totals) == 1:  # a single accumulate: its shards' add_ (no lists to build)
        value = values[0]
        for r, t in totals[0].items():
            t.add_(value[r])
        return totals
    torch._foreach_add_([t for total in totals for t in total.values()],
                        [value[r] for total, value in zip(totals, values, strict=True) for r in total])
    return totals


def _pack(node: PNode, values: Sequence[Shards]) -> Shards:
    if node.mode == "mean":
        return {r: torch.stack([v[r] for v in values]).mean(0) for r in values[0]}
    if node.mode == "sum":  # a partial over the micro-batches (graph.micro): a sum over the batch
        return {r: torch.stack([v[r] for v in values]).sum(0) for r in values[0]}
    return {r: torch.cat([v[r] for v in values], 0) for r in values[0]}


def commit(state: StepState) -> None:
    """Writes the step's variable updates in place (after every node succeeded): in-place ``update`` kernels
    first, then the ``assign`` copies."""
    for kernel, values, attrs in state.updates:
        kernel(*values, **attrs)
    for name, shards in state.assigns.items():
        target = state.variables[name]
        for r, t in shards.items():
            if t is not target[r]:
                target[r].copy_(t)


def prepare_groups(plan: PhysicalPlan, backend: Backend) -> None:
    """Creates the process groups of every communication node, in plan order, on every process: group creation
    is collective over the whole job, also for processes outside the group (torch.distributed)."""

    for node in plan.nodes:
        if node.kind == "boxing" and node.boxing is not None and not node.boxing.is_relabel:
            backend.prepare(node.boxing)
        elif node.kind == "route":
            backend.prepare(route.group_plan(plan.bufs[node.outputs[0]]))
        elif node.kind == "compute" and node.op in REGISTRY and REGISTRY[node.op].talks is not None:
            backend.prepare_channel(plan.bufs[node.inputs[0]].layout.placement, KERNEL_CHANNEL)  # a talking kernel


def run_plan(plan: PhysicalPlan, feeds: dict[str, Shards], variables: dict[str, Shards],
             backend: Backend | None = None) -> dict[str, Shards]:
    """Runs one step of ``plan`` in list order: pre, then micro-batches 0..m-1, then post. A buffer is dropped
    after its last reader, so the allocator reuses its memory within the step.

    ``feeds`` is ``{input name: {rank: shard}}`` for the ranks this process owns (whole batches: ``unpack``
    nodes cut the micro-batches); ``variables`` ``{name: {rank: shard}}`` are read by ``variable`` nodes and
    written by ``update``/``assign`` only after the whole step ran (:func:`commit`), so a failing step leaves
    them as they were. Returns ``{output name: {rank: shard}}``."""
    backend = backend or get_backend()
    prepare_groups(plan, backend)  # cheap once done: backends cache their groups
    prog = program(plan, backend)
    state = StepState(plan, feeds, variables)
    values: dict[int, Any] = {}  # buf id -> shards (micro bufs: this micro-batch's)
    gathered: dict[int, list[Any]] = {b: [] for b in prog.gathered}  # the m values of accumulate/pack inputs
    for phase, steps in prog.phases:
        for k in range(plan.micro_batches) if phase == "micro" else (0,):
            _run_steps(steps, values, gathered, state, k)
        if phase == "micro":
            for b in prog.after_micro:
                values.pop(b, None)
    backend.settle_sends()  # sends in flight that no node here waited for
    commit(state)
    return state.outputs


def _run_steps(steps: list[tuple[PNode, Act, tuple[int, ...]]], values: dict[int, Any],
               gathered: dict[int, list[Any]], state: StepState, micro: int) -> None:
    """One pass over a phase's nodes: the tight loop of the in-order executor."""
    node = None
    try:
        for node, run, drop in steps:
            if node.kind in GATHERING:
                inputs: list[Any] = [gathered[b] for b in node.inputs]
            else:  # a buffer made by another process's node holds no shard here
                inputs = [values.get(b, _EMPTY) for b in node.inputs]
            outs = run(inputs, state, micro)
            for b, v in zip(node.outputs, outs, strict=True):
                values[b] = v
                if b in gathered:
                    gathered[b].append(v)
            for b in drop:
                values.pop(b, None)
    except SbpflowError:
        raise
    except Exception as e:  # a kernel's own error: say which node of the plan ran it
        assert node is not None
        raise ExecutionError(f"{node.label()} (op {node.op or node.name}, micro-batch {micro}) failed: "
                             f"{type(e).__name__}: {e}") from e


_EMPTY: Shards = {}
