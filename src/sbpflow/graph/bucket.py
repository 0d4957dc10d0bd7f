"""Gradient buckets: a pass after lowering that packs all-reduces of whole tensors into buckets.

A data-parallel plan ends with one all-reduce per gradient in parameter order, the first for the gradient
backward makes last: nothing goes out before backward ends, and each parameter pays a collective's latency.
Packed in backward's order, each bucket goes out as soon as its last gradient is made, while backward goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from .. import boxing
from ..sbp import Split
from .costs import FIRST_BUCKET
from .lower import registers, stream_of
from .physical import Buf, PhysicalPlan, PNode
from .select import solo_bytes as select_solo_bytes

# DDP's 25 MiB cap suits a framework that cannot see the step; here the plan is known, and a bucket need only be
# big enough that its latency is a small share of its transfer: cap = alpha / beta / LATENCY_SHARE bytes of the
# group's link. Smaller buckets go out earlier, and the last one, which nothing hides, is smaller.
LATENCY_SHARE = 0.05  # a bucket's latency at most this share of its transfer time


@dataclass
class Bucket:
    members: list[PNode] = field(default_factory=list)
    nbytes: int = 0
    reached: set[int] = field(default_factory=set)  # nodes a member's reduced value reaches
    first_reader: int = 1 << 62  # the earliest plan position among them
    last_producer: int = -1  # the plan position after which the bucket goes out


def bucket_all_reduces(plan: PhysicalPlan, model: boxing.CostModel, factors: tuple[Any, ...],
                       first: int = FIRST_BUCKET, cap: int | None = None) -> PhysicalPlan:
    """``plan`` with its all-reduces of whole tensors packed into buckets, each issued right after its last
    member is made; the same plan if there are none. ``cap``: bytes per bucket after the first (None: from the
    link's latency and bandwidth, see :func:`bucket_cap`); <= 0 turns the pass off.

    Neighbours (in the order backward makes their inputs) with the same phase, stream, layouts and dtype share
    a bucket of ``first`` bytes (DDP's 1 MiB), then ``cap`` bytes. A bucket closes before a tensor that a
    member's reduced value reaches (a cycle), or whose producer comes after a member's reader (that reader
    would wait). Each bucket is ``bucket_flatten``, one all-reduce and ``bucket_split`` writing the members'
    old buffers, so their readers are unchanged; a bucket of one is its own all-reduce, moved. Sums are
    elementwise the members' own."""
    if cap is not None and cap <= 0:
        return plan
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    producer = {b: n.id for n in plan.nodes for b in n.outputs}
    readers = readers_of(plan)
    sizes = Sizes(model, first, cap)
    buckets = pack_buckets(plan, _candidates(plan, producer, position), producer, position, readers, sizes)
    buckets = [b for b in buckets if len(b.members) > 1 or b.last_producer + 1 < position[b.members[0].id]]
    if not buckets:
        return plan
    return rebuild_buckets(plan, buckets, lambda b, bufs, ids: _bucket_nodes(b, bufs, ids, model, factors))


def bucket_cap(model: boxing.CostModel, n: PNode) -> int:
    """Bytes of a bucket after the first on all-reduce ``n``'s link: its latency :data:`LATENCY_SHARE` of its
    transfer time."""
    link = link_of(model, n)
    return max(FIRST_BUCKET, int(link.alpha / link.beta / LATENCY_SHARE))


def solo_bytes(model: boxing.CostModel, n: PNode) -> int:
    """A gradient of at least these bytes goes out alone: copying it into a bucket would cost more than the
    collective's latency that sharing saves (the SBP selection prices gradients by the same rule)."""
    assert n.boxing is not None
    return select_solo_bytes(model, n.boxing.src.placement)


def link_of(model: boxing.CostModel, n: PNode) -> boxing.LinkCost:
    """The α-β cost of all-reduce ``n``'s link."""
    assert n.boxing is not None
    placement = n.boxing.src.placement
    return model.link(placement.type, tuple(placement.flat_ranks))


@dataclass(frozen=True)
class Sizes:
    """Bucket sizes: ``first`` bytes, then ``cap`` (None: :func:`bucket_cap`); gradients of :func:`solo_bytes`
    go alone."""

    model: boxing.CostModel
    first: int
    cap: int | None

    def limit(self, n: PNode, first: bool) -> int:
        if first:
            return self.first
        return self.cap if self.cap is not None else bucket_cap(self.model, n)

    def solo(self, plan: PhysicalPlan, n: PNode) -> bool:
        return plan.bufs[n.inputs[0]].nbytes(n.ranks[0]) >= solo_bytes(self.model, n)


def _candidates(plan: PhysicalPlan, producer: dict[int, int], position: dict[int, int]) -> list[PNode]:
    """All-reduces of whole tensors, in the order their inputs are made."""
    found = [n for n in plan.nodes if whole_all_reduce(n) and n.inputs[0] in producer]
    return sorted(found, key=lambda n: (position[producer[n.inputs[0]]], position[n.id]))


def whole_all_reduce(n: PNode) -> bool:
    """A boxing node that is one all-reduce of whole tensors (no split on either side), on one placement and
    with no control edge: what a bucket may pack (and graph.late_reduce may move after an accumulate)."""
    if n.kind != "boxing" or n.boxing is None or n.control or len(n.boxing.steps) != 1:
        return False
    step = n.boxing.steps[0]
    return (step.kind == "all_reduce" and step.src.placement == step.dst.placement
            and not any(isinstance(s, Split) for s in (*step.src.sbp, *step.dst.sbp)))


def bucket_key(plan: PhysicalPlan, n: PNode) -> tuple[Any, ...]:
    """What all-reduces share to share a bucket: phase, stream, ranks, layouts and dtype."""
    assert n.boxing is not None
    return (n.phase, n.stream, n.ranks, n.boxing.src, n.boxing.dst, plan.bufs[n.inputs[0]].dtype)


def pack_buckets(plan: PhysicalPlan, candidates: list[PNode], producer: dict[int, int], position: dict[int, int],
          readers: dict[int, list[int]], sizes: Sizes) -> list[Bucket]:
    """Greedy buckets in production order, one open bucket per key (a group, its layouts and dtype); a big
    gradient is a bucket of its own (it goes out at once, and the open bucket stays open)."""
    done: list[Bucket] = []
    open_: dict[tuple[Any, ...], Bucket] = {}
    closed: set[tuple[Any, ...]] = set()  # keys whose first (smaller) bucket went out
    packed = {n.id for n in candidates}
    for n in candidates:
        key, made = bucket_key(plan, n), position[producer[n.inputs[0]]]
        if producer[n.inputs[0]] in packed:  # the result of another all-reduce (P, P -> B, P -> B, B): when
            made = position[n.id]  # bucketed, its split lands as late as its first reader, n itself
        if sizes.solo(plan, n):
            done.append(Bucket([n], plan.bufs[n.inputs[0]].nbytes(n.ranks[0]), last_producer=made))
            continue
        bucket = open_.get(key)
        if bucket is not None and (producer[n.inputs[0]] in bucket.reached or made >= bucket.first_reader):
            done.append(open_.pop(key))  # the tensor waits for a member's result, or a member's reader waits
            closed.add(key)
            bucket = None
        if bucket is None:
            bucket = open_[key] = Bucket()
        bucket.members.append(n)
        bucket.nbytes += plan.bufs[n.inputs[0]].nbytes(n.ranks[0])
        bucket.last_producer = max(bucket.last_producer, made)
        _reach(bucket, n, readers, position)
        if bucket.nbytes >= sizes.limit(n, first=key not in closed):
            done.append(open_.pop(key))
            closed.add(key)
    return done + list(open_.values())


def readers_of(plan: PhysicalPlan) -> dict[int, list[int]]:
    """Node id -> the nodes that read one of its outputs or wait for it on a control edge."""
    by_buf: dict[int, list[int]] = {}
    for n in plan.nodes:
        for b in n.inputs:
            by_buf.setdefault(b, []).append(n.id)
    out: dict[int, list[int]] = {n.id: [r for b in n.outputs for r in by_buf.get(b, [])] for n in plan.nodes}
    for n in plan.nodes:
        for c in n.control:
            out.setdefault(c, []).append(n.id)
    return out


def _reach(bucket: Bucket, n: PNode, readers: dict[int, list[int]], position: dict[int, int]) -> None:
    """Adds every node that ``n``'s result reaches to the bucket's set (each node visited once per bucket)."""
    todo = list(readers.get(n.id, []))
    while todo:
        nid = todo.pop()
        if nid in bucket.reached:
            continue
        bucket.reached.add(nid)
        bucket.first_reader = min(bucket.first_reader, position[nid])
        todo.extend(readers.get(nid, []))


BuildBucket = Callable[[Bucket, dict[int, Buf], "Ids"], Iterable[PNode]]


def rebuild_buckets(plan: PhysicalPlan, buckets: list[Bucket], build: BuildBucket) -> PhysicalPlan:
    """The plan with each bucket's flatten and collectives (``build``'s nodes but the last) right after its last
    member is made, and its split (the last) right before the first node that reads a member's result (an
    executor that issues the collective without waiting, runtime.inorder, then waits there: backward runs on
    meanwhile). A bucket of one is its own collective, moved there."""
    gone = {n.id for b in buckets for n in b.members}
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    after: dict[int, list[Bucket]] = {}
    for b in buckets:
        after.setdefault(b.last_producer, []).append(b)
    bufs = dict(plan.bufs)
    ids = Ids(max(n.id for n in plan.nodes) + 1, max(bufs) + 1)
    nodes: list[PNode] = []
    before: dict[int, list[PNode]] = {}  # plan position -> bucket splits to place before that node
    for i, n in enumerate(plan.nodes):
        nodes.extend(before.pop(i, ()))
        if n.id not in gone:
            nodes.append(n)
        for b in after.get(i, []):
            *issued, split = build(b, bufs, ids)
            nodes.extend(issued)
            if len(b.members) > 1:
                before.setdefault(max(i + 1, _first_direct_reader(plan, b, position)), []).append(split)
            else:
                nodes.append(split)  # a bucket of one: its own all-reduce
    nodes.extend(n for i in sorted(before) for n in before[i])
    out = replace(plan, nodes=nodes, bufs=bufs, registers={})
    out.registers = registers(out)
    return out


def _first_direct_reader(plan: PhysicalPlan, bucket: Bucket, position: dict[int, int]) -> int:
    """The plan position of the first node reading a member's result (the end of the plan if none does)."""
    outs = {n.outputs[0] for n in bucket.members}
    return min((position[n.id] for n in plan.nodes if outs.intersection(n.inputs)), default=len(plan.nodes))


@dataclass
class Ids:
    node: int
    buf: int

    def next_node(self) -> int:
        self.node += 1
        return self.node - 1

    def next_buf(self) -> int:
        self.buf += 1
        return self.buf - 1


def _bucket_nodes(bucket: Bucket, bufs: dict[int, Buf], ids: Ids, model: boxing.CostModel,
                  factors: tuple[Any, ...]) -> Iterable[PNode]:
    """flatten -> the flat buffer's boxing steps -> split into the members' old output buffers (a bucket of one:
    its own all-reduce)."""
    head = bucket.members[0]
    assert head.boxing is not None
    if len(bucket.members) == 1:
        yield head
        return
    src, dst = head.boxing.src, head.boxing.dst
    flat = flatten_members(bucket, bufs, ids, "bucket")
    yield flat.node
    total, dtype = flat.total, flat.dtype
    with boxing.target_factors(factors):
        steps = boxing.plan((total,), dtype, src, dst, model).steps
    current = flat.buf
    for i, step in enumerate(steps):
        out = ids.next_buf()
        bufs[out] = Buf(out, (total,), dtype, step.dst)
        one = boxing.Plan((total,), dtype, step.src, step.dst, (step,))
        yield PNode(ids.next_node(), "boxing", f"{step.kind} for {flat.label} ({i + 1}/{len(steps)})", (current,),
                    (out,), head.ranks, head.phase, stream=stream_of(step), boxing=one)
        current = out
    yield PNode(ids.next_node(), "compute", "bucket_split", (current,), flat.outs, dst.placement.flat_ranks,
                head.phase, op="bucket_split", args=(("t", 0),), attrs=(("shapes", flat.shapes),), in_sbps=(dst.sbp,),
                out_sbps=(dst.sbp,) * len(flat.outs))


@dataclass(frozen=True)
class Flat:
    """A bucket's members packed into one flat buffer ``buf`` by ``node`` (bucket_flatten), on the source layout."""

    node: PNode
    buf: int
    outs: tuple[int, ...]  # the members' old output buffers, which the bucket's last node writes
    shapes: tuple[tuple[int, ...], ...]
    dtype: Any
    total: int  # the flat buffer's logical numel
    label: str


def flatten_members(bucket: Bucket, bufs: dict[int, Buf], ids: Ids, kind: str) -> Flat:
    """The bucket_flatten node that packs ``bucket``'s inputs (each member's boxing source) into a new flat buffer;
    adds that buffer to ``bufs``. ``kind`` names the bucket in the collective's label."""
    head = bucket.members[0]
    assert head.boxing is not None
    src = head.boxing.src
    ins = tuple(n.inputs[0] for n in bucket.members)
    outs = tuple(n.outputs[0] for n in bucket.members)
    shapes = tuple(bufs[b].shape for b in ins)
    dtype = bufs[ins[0]].dtype
    total = sum(_numel(s) for s in shapes)
    label = f"{kind} of {len(ins)} ({', '.join(f'%{b}' for b in ins[:3])}{', ...' if len(ins) > 3 else ''})"
    flat = ids.next_buf()
    bufs[flat] = Buf(flat, (total,), dtype, src)
    node = PNode(ids.next_node(), "compute", "bucket_flatten", ins, (flat,), src.placement.flat_ranks, head.phase,
                 op="bucket_flatten", args=tuple(("t", i) for i in range(len(ins))), in_sbps=(src.sbp,) * len(ins),
                 out_sbps=(src.sbp,))
    return Flat(node, flat, outs, shapes, dtype, total, label)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
