"""The in-order executor: runs a physical plan node by node. The reference the actor runtime is checked against.

``run_plan(plan, feeds, variables)`` executes one step:

* ``feeds``: ``{input name: {rank: shard}}`` for the ranks this process owns (the whole batch: ``unpack``
  nodes cut the micro-batches);
* ``variables``: ``{name: {rank: shard}}``: read by ``variable`` nodes, written by ``assign`` nodes only after
  every node of the step has run, so a failing step leaves them as they were;
* returns ``{output name: {rank: shard}}``.

Node semantics are in :mod:`sbpflow.graph.physical`; :func:`act` is shared with the actor runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import boxing
from .._layout import shard_box
from ..comm import Backend, get_backend
from ..distributed import activity
from ..errors import SbpflowError
from ..graph.physical import PhysicalPlan, PNode
from ..ops.registry import REGISTRY, Meta, ShardCtx
from ..random import mix_key

Shards = dict[int, torch.Tensor]
RANDOM_FEED = "__random__"  # feeds[RANDOM_FEED] = (seed, counter at step start, keys drawn per micro-batch)


class ExecutionError(SbpflowError):
    """A node of a physical plan failed; the message names the node and its op."""


class StepState:
    """Per-step values: buffers by id (per micro-batch where they vary) and pending variable writes."""

    def __init__(self, plan: PhysicalPlan, feeds: dict[str, Shards], variables: dict[str, Shards]) -> None:
        self.plan = plan
        self.feeds = feeds
        self.variables = variables
        self.assigns: dict[str, Shards] = {}
        self.outputs: dict[str, Shards] = {}


def act(node: PNode, inputs: Sequence[Any], state: StepState, micro: int, backend: Backend) -> list[Any]:
    """Runs ``node`` once (micro-batch ``micro``); ``inputs`` are its input values: shards, or for
    ``accumulate``/``pack`` the list of the m micro-batch shards. Returns its output values."""
    owned = backend.owned(node.ranks)
    kind = node.kind
    if kind == "input":
        return [_check_feed(node, state)]
    if kind == "variable":
        return [state.variables[node.name]]
    if kind == "unpack":
        m = state.plan.micro_batches
        return [{r: t.chunk(m, 0)[micro] if m > 1 else t for r, t in inputs[0].items()}]
    if kind == "repeat":
        return [inputs[0]]
    if kind == "compute":
        return _compute(node, inputs, state, micro, owned)
    if kind == "boxing":
        assert node.boxing is not None
        return [boxing.execute(node.boxing, inputs[0], backend)]
    if kind == "accumulate":
        return [_accumulate(inputs[0])]
    if kind == "pack":
        return [_pack(node, inputs[0])]
    if kind == "route":
        from . import route

        return route.act(node, list(inputs), backend)
    if kind == "assign":
        state.assigns[node.name] = inputs[0]
        return []
    if kind == "output":
        state.outputs[node.name] = inputs[0]
        return []
    raise ExecutionError(f"unknown node kind {kind!r} in {node.label()}")


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


def _compute(node: PNode, inputs: Sequence[Any], state: StepState, micro: int, owned: list[int]) -> list[Any]:
    plan = state.plan
    opdef = REGISTRY[node.op or node.name]
    attrs = dict(node.attrs)
    results: dict[int, Any] = {}
    scalars = [_scalar(how, v, state, micro) for how, v in node.args]
    for r in owned:
        values = [inputs[v][r] if how == "t" else s for (how, v), s in zip(node.args, scalars, strict=True)]
        if opdef.shard_aware:
            results[r] = opdef.kernel(_shard_ctx(node, plan, r), *values, **attrs)
        else:
            results[r] = opdef.kernel(*values, **attrs)
    if len(node.outputs) == 1:
        return [results]
    return [{r: res[j] for r, res in results.items()} for j in range(len(node.outputs))]


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


def _accumulate(values: Sequence[Shards]) -> Shards:
    total = {r: t.clone() for r, t in values[0].items()}
    for v in values[1:]:
        for r, t in v.items():
            total[r] += t
    return total


def _pack(node: PNode, values: Sequence[Shards]) -> Shards:
    if node.mode == "mean":
        return {r: torch.stack([v[r] for v in values]).mean(0) for r in values[0]}
    return {r: torch.cat([v[r] for v in values], 0) for r in values[0]}


def commit(state: StepState) -> None:
    """Writes the step's variable updates in place (after every node succeeded)."""
    for name, shards in state.assigns.items():
        target = state.variables[name]
        for r, t in shards.items():
            if t is not target[r]:
                target[r].copy_(t)


def prepare_groups(plan: PhysicalPlan, backend: Backend) -> None:
    """Creates the process groups of every communication node, in plan order, on every process: group creation
    is collective over the whole job, also for processes outside the group (torch.distributed)."""
    from . import route

    for node in plan.nodes:
        if node.kind == "boxing" and node.boxing is not None and not node.boxing.is_relabel:
            backend.prepare(node.boxing)
        elif node.kind == "route":
            backend.prepare(route.group_plan(plan.bufs[node.outputs[0]]))


def run_plan(plan: PhysicalPlan, feeds: dict[str, Shards], variables: dict[str, Shards],
             backend: Backend | None = None) -> dict[str, Shards]:
    """Runs one step of ``plan`` in list order: pre, then micro-batches 0..m-1, then post."""
    backend = backend or get_backend()
    prepare_groups(plan, backend)  # cheap once done: backends cache their groups
    state = StepState(plan, feeds, variables)
    values: dict[int, Any] = {}  # buf id -> shards (micro bufs: this micro-batch's)
    gathered: dict[int, list[Any]] = {}  # micro buf id -> the m micro-batch values (accumulate, pack inputs)
    consumers_of_many = {n.inputs[0] for n in plan.nodes if n.kind in ("accumulate", "pack")}
    for phase, micros in (("pre", [0]), ("micro", range(plan.micro_batches)), ("post", [0])):
        for k in micros:
            for node in plan.phase(phase):
                if not any(backend.owns(r) for r in node.ranks):
                    continue
                if node.kind in ("accumulate", "pack"):
                    inputs: list[Any] = [gathered.get(node.inputs[0], [])]
                else:  # a buffer made by another process's node holds no shard here
                    inputs = [values.get(b, {}) for b in node.inputs]
                outs = _act_named(node, inputs, state, k, backend)
                for b, v in zip(node.outputs, outs, strict=True):
                    values[b] = v
                    if b in consumers_of_many:
                        gathered.setdefault(b, []).append(v)
    commit(state)
    return state.outputs


def _act_named(node: PNode, inputs: Sequence[Any], state: StepState, micro: int, backend: Backend) -> list[Any]:
    try:
        with activity(lambda: f"{node.label()} (micro-batch {micro})"):
            return act(node, inputs, state, micro, backend)
    except SbpflowError:
        raise
    except Exception as e:  # a kernel's own error: say which node of the plan ran it
        raise ExecutionError(f"{node.label()} (op {node.op or node.name}, micro-batch {micro}) failed: "
                             f"{type(e).__name__}: {e}") from e
