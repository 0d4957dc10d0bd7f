"""Gather buckets: a pass that packs the all-gathers of sharded tensors into one flat all-gather per bucket.

ZeRO-1 and 2 update each parameter's shard and all-gather it back into the whole parameter (``S(0) -> B``, after
the step): one collective per parameter, each paying the group's latency. Like the gradient buckets
(:mod:`.bucket`), this pass packs them, here all-gathers whose tensors split evenly on dim 0 over one mesh axis:

    before:  shard_1 -> all_gather -> p_1   ...   shard_k -> all_gather -> p_k
    after:   shard_1 .. shard_k -> bucket_flatten -> all_gather (flat) -> bucket_unshard -> p_1 .. p_k

Each rank's flat buffer is its pieces one after another; the gathered buffer holds the ranks' flat buffers in
rank order, so :func:`~sbpflow.ops.bucket.bucket_unshard` takes each tensor's piece out of every rank's part
(rank ``r``'s piece is the tensor's ``r``-th block of rows). The values are the members' own all-gathers'.
Buckets close as the gradient buckets do (:func:`.bucket.pack_buckets`): before a member that waits for another's
result, and at the link's bucket size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import boxing
from ..sbp import Broadcast, Split
from .bucket import Bucket, Ids, Sizes, flatten_members, pack_buckets, readers_of, rebuild_buckets
from .costs import FIRST_BUCKET
from .lower import stream_of
from .physical import Buf, PhysicalPlan, PNode


def bucket_all_gathers(plan: PhysicalPlan, model: boxing.CostModel, factors: tuple[Any, ...]) -> PhysicalPlan:
    """``plan`` with its all-gathers of evenly sharded tensors packed into buckets (see the module docstring);
    the same plan if fewer than two can share one."""
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    producer = {b: n.id for n in plan.nodes for b in n.outputs}
    found = [n for n in plan.nodes if sharded_all_gather(plan, n) and n.inputs[0] in producer]
    found.sort(key=lambda n: (position[producer[n.inputs[0]]], position[n.id]))
    buckets = pack_buckets(plan, found, producer, position, readers_of(plan), Sizes(model, FIRST_BUCKET, None))
    buckets = [b for b in buckets if len(b.members) > 1]
    if not buckets:
        return plan
    return rebuild_buckets(plan, buckets, lambda b, bufs, ids: _gather_nodes(b, bufs, ids, model, factors))


def sharded_all_gather(plan: PhysicalPlan, n: PNode) -> bool:
    """A boxing node after the step (the post phase: updated parameters) that is one all-gather, ``S(0)`` on one
    mesh axis to ``B`` (broadcast on every other axis), of a tensor whose dim 0 splits evenly there, on one
    placement and with no control edge. (ZeRO-3's gathers before use keep their own per-unit window:
    :mod:`.prefetch`.)"""
    if n.kind != "boxing" or n.boxing is None or n.control or len(n.boxing.steps) != 1 or n.phase != "post":
        return False
    step = n.boxing.steps[0]
    if step.kind != "all_gather" or step.src.placement != step.dst.placement or step.axis is None:
        return False
    src, dst = step.src.sbp, step.dst.sbp
    shape = plan.bufs[n.inputs[0]].shape
    return (all(isinstance(s, Broadcast) for s in dst) and src[step.axis] == Split(0) and len(shape) > 0
            and all(isinstance(s, Broadcast) for i, s in enumerate(src) if i != step.axis)
            and shape[0] % step.src.placement.hierarchy[step.axis] == 0)


def _gather_nodes(bucket: Bucket, bufs: dict[int, Buf], ids: Ids, model: boxing.CostModel,
                  factors: tuple[Any, ...]) -> Iterable[PNode]:
    """flatten (each rank its pieces) -> one all-gather of the flat buffer -> unshard into the members' old
    output buffers."""
    head = bucket.members[0]
    assert head.boxing is not None
    step = head.boxing.steps[0]
    assert step.axis is not None  # sharded_all_gather: one mesh axis
    src, dst = head.boxing.src, head.boxing.dst
    flat = flatten_members(bucket, bufs, ids, "gather bucket")
    yield flat.node
    total, dtype = flat.total, flat.dtype  # the flat buffer's logical size: every rank's pieces
    with boxing.target_factors(factors):
        gather = boxing.plan((total,), dtype, src, dst, model)
    gathered = ids.next_buf()
    bufs[gathered] = Buf(gathered, (total,), dtype, dst)
    yield PNode(ids.next_node(), "boxing", f"all_gather for {flat.label}", (flat.buf,), (gathered,), head.ranks,
                head.phase, stream=stream_of(gather.steps[0]), boxing=gather)
    parts = src.placement.hierarchy[step.axis]
    yield PNode(ids.next_node(), "compute", "bucket_unshard", (gathered,), flat.outs, dst.placement.flat_ranks,
                head.phase, op="bucket_unshard", args=(("t", 0),), attrs=(("parts", parts), ("shapes", flat.shapes)),
                in_sbps=(dst.sbp,), out_sbps=(dst.sbp,) * len(flat.outs))
