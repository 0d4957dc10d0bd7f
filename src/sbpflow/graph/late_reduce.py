"""Reduce after accumulating: a data-parallel gradient stays partial over the micro-batches, reduced once a step.

Autograd converts each parameter's gradient to the parameter's own layout where it is made (``to_global`` to
``B`` over the data axis), so with m micro-batches lowering gives, per gradient::

    micro:  g_k = all_reduce(p_k)        # p_k: this rank's P(sum) part of micro-batch k's gradient
    post:   G   = accumulate(g_k)        # sum over k

m all-reduces of the whole gradient per step, where DDP under ``no_sync`` (and Megatron) sends one. A sum
over ranks commutes with the sum over micro-batches, so this pass, on the physical plan after lowering, turns
each such pair into::

    post:   A = accumulate(p_k)          # a P(sum) running sum, as large as the gradient: no memory added
            G = all_reduce(A)            # once a step

The partial value stays partial until its consumer, the optimizer, needs it whole. The all-reduce is then a
post-phase node that reads only the sum: the actor runtime issues it as soon as the last micro-batch's
gradient is added, in backward's order, so the gradient buckets (``graph.bucket``, which runs next) still go
out while the last backward runs. Only one-step all-reduces of P(sum) on whole tensors move (what
``graph.bucket`` packs). A reduce-scatter (ZeRO) stays per micro-batch: accumulating before it would hold the
whole gradient where the plan holds a shard. A P(max) or P(min) conversion does not commute with a sum and is
never one of them. Results differ from the per-micro-batch plan by rounding only (the sums are associated
differently).

>>> from sbpflow.graph.physical import PhysicalPlan
>>> reduce_after_accumulating(PhysicalPlan([], {}, {}, micro_batches=4)).nodes
[]
"""

from __future__ import annotations

import dataclasses

from .bucket import whole_all_reduce
from .lower import registers
from .physical import Buf, PhysicalPlan, PNode
from .select import gradient_all_reduce


def reduce_after_accumulating(plan: PhysicalPlan) -> PhysicalPlan:
    """``plan`` with every ``accumulate(all_reduce(p))`` of a gradient made ``all_reduce(accumulate(p))`` (see
    the module docstring); the same plan if there is none."""
    if plan.micro_batches == 1:
        return plan
    pairs = _pairs(plan)
    if not pairs:
        return plan
    moved = {reduce.id for reduce in pairs.values()}
    bufs = dict(plan.bufs)
    next_buf = max(bufs) + 1
    nodes: list[PNode] = []
    for n in plan.nodes:
        if n.id in moved:
            continue
        reduce = pairs.get(n.id)
        if reduce is None:
            nodes.append(n)
            continue
        partial = bufs[reduce.inputs[0]]
        summed = Buf(next_buf, partial.shape, partial.dtype, partial.layout)  # the P(sum) running sum
        bufs[summed.id] = summed
        next_buf += 1
        del bufs[n.inputs[0]]  # the per-micro-batch reduced gradient is gone
        nodes.append(dataclasses.replace(n, inputs=reduce.inputs, outputs=(summed.id,)))
        nodes.append(dataclasses.replace(reduce, inputs=(summed.id,), outputs=n.outputs, phase=n.phase))
    out = dataclasses.replace(plan, nodes=nodes, bufs=bufs, registers={})
    out.registers = registers(out)
    return out


def _pairs(plan: PhysicalPlan) -> dict[int, PNode]:
    """Accumulate node id -> the micro-batch all-reduce that is the only producer-consumer link into it."""
    readers: dict[int, list[PNode]] = {}
    producer: dict[int, PNode] = {}
    for n in plan.nodes:
        for b in n.inputs:
            readers.setdefault(b, []).append(n)
        for b in n.outputs:
            producer[b] = n
    found = {}
    for n in plan.nodes:
        if n.kind != "accumulate" or len(n.inputs) != 1 or n.control:
            continue
        reduce = producer.get(n.inputs[0])
        if reduce is not None and _sum_all_reduce(reduce) and len(readers[n.inputs[0]]) == 1:
            found[n.id] = reduce
    return found


def _sum_all_reduce(n: PNode) -> bool:
    """A micro-batch node that is one all-reduce of whole tensors from P(sum), with nothing else tied to it."""
    return (n.phase == "micro" and whole_all_reduce(n) and n.boxing is not None
            and gradient_all_reduce(n.boxing.steps[0].src.sbp, n.boxing.steps[0].dst.sbp))
