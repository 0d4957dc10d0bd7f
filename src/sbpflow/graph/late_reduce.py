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

A move adds a collective after the micro-batches where it saves none if the gradients would have shared the
buckets of the micro-batches' own all-reduces: on dp2 x tp2 a small GPT's LayerNorm gradients rode its
tensor-parallel activations' buckets for their bytes alone, and moved they went out in a bucket of their own,
one more collective a step. Given a cost model, the pass leaves such gradients (per group and dtype) where
they are unless the bytes it saves, (m - 1) sends of them, take longer than the latency it adds.

>>> from sbpflow.graph.physical import PhysicalPlan
>>> reduce_after_accumulating(PhysicalPlan([], {}, {}, micro_batches=4)).nodes
[]
"""

from __future__ import annotations

import dataclasses

from .. import boxing
from .bucket import bucket_key, link_of, whole_all_reduce
from .lower import registers
from .physical import Buf, PhysicalPlan, PNode
from .select import gradient_all_reduce


def reduce_after_accumulating(plan: PhysicalPlan, model: boxing.CostModel | None = None) -> PhysicalPlan:
    """``plan`` with every ``accumulate(all_reduce(p))`` of a gradient made ``all_reduce(accumulate(p))`` (see
    the module docstring); the same plan if there is none. With ``model``, only the moves that pay."""
    if plan.micro_batches == 1:
        return plan
    pairs = _pairs(plan)
    if model is not None:
        pairs = _paying(plan, pairs, model)
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


def _paying(plan: PhysicalPlan, pairs: dict[int, PNode], model: boxing.CostModel) -> dict[int, PNode]:
    """``pairs`` less those whose all-reduces would share a bucket with a micro-batch all-reduce that stays (same
    group, layouts and dtype), unless their bytes, sent m - 1 times fewer, outweigh the latency of the post
    phase's own bucket."""
    moving = {reduce.id for reduce in pairs.values()}
    carried = {bucket_key(plan, n) for n in plan.nodes
               if n.phase == "micro" and n.id not in moving and whole_all_reduce(n)}
    by_key: dict[tuple[object, ...], list[int]] = {}
    for accumulate_id, reduce in pairs.items():
        by_key.setdefault(bucket_key(plan, reduce), []).append(accumulate_id)
    kept = {}
    for key, ids in by_key.items():
        reduces = [pairs[i] for i in ids]
        link = link_of(model, reduces[0])
        saved = (plan.micro_batches - 1) * sum(plan.bufs[r.inputs[0]].nbytes(r.ranks[0]) for r in reduces)
        if key not in carried or saved * link.beta >= link.alpha:
            kept.update({i: pairs[i] for i in ids})
    return kept
