"""Grouped accumulation: the gradients one act of the schedule makes are summed by one node, with one kernel.

Lowering gives every gradient its own ``accumulate`` node acting once per micro-batch, so a pipeline stage
pays m acts per parameter. One group node per act sums k gradients with one ``torch._foreach_add_``,
bitwise as the members would, and only where it raises no memory peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .fuse import with_merged_nodes
from .physical import PhysicalPlan, PNode
from .schedule import COMPUTE


def group_accumulates(plan: PhysicalPlan) -> PhysicalPlan:
    """``plan`` with each group of accumulates made one node; the same plan if no two accumulates group. Node ids
    are renumbered to list positions (the pipeline's maps follow).

    A group node has its members' inputs and outputs in plan order and sits where its first member sat (later
    if a member's gradient is made after that; a member that cannot sit between its group's producers and
    readers starts a new group). It copies the first micro-batch, as a single accumulate does (a sum never
    aliases its input's register), then adds with one ``torch._foreach_add_``: on CPU exactly add_'s loop,
    on CUDA the same one rounding per element, so the sums are bitwise the members'. Its ``attrs`` hold the
    members (:func:`members`), which ``explain()`` lists.

    >>> from sbpflow.graph.physical import PhysicalPlan
    >>> group_accumulates(PhysicalPlan([], {}, {}, micro_batches=4)).nodes
    []
    """
    groups = [g for g in _groups(plan) if len(g.members) > 1]
    if not groups:
        return plan
    slots: dict[int, list[PNode]] = {}  # plan position -> group nodes placed right before the node there
    for g in groups:
        slots.setdefault(g.slot, []).append(_grouped(g))
    inside = {n.id for g in groups for n in g.members}
    nodes: list[PNode] = []
    for i, n in enumerate(plan.nodes):
        nodes.extend(slots.pop(i, ()))
        if n.id not in inside:
            nodes.append(n)
    nodes.extend(n for i in sorted(slots) for n in slots[i])
    return with_merged_nodes(plan, nodes, {n.id: g.members[0].id for g in groups for n in g.members})


def members(node: PNode) -> tuple[PNode, ...]:
    """The accumulates a group node sums for, in plan order (``(node,)`` for a single accumulate)."""
    if node.kind != "accumulate":
        return ()
    return dict(node.attrs).get("members", (node,))  # type: ignore[no-any-return]


@dataclass
class _Group:
    """Accumulates that become one node. It goes before plan position :attr:`slot`: after the last producer of
    their inputs (at ``after``), where its first member was if that is later, and before the first reader of
    their sums (at ``before``; the plan mixes phases, so a micro node may sit between post accumulates)."""

    act: Any  # (stage, part) of the pipeline act making the gradients, or the node making them (one stage)
    members: list[PNode] = field(default_factory=list)
    first: int = 0  # plan position of the first member
    after: int = -1
    before: int = 1 << 62

    @property
    def slot(self) -> int:
        return max(self.first, self.after + 1)


def _groups(plan: PhysicalPlan) -> list[_Group]:
    """The groups, each in plan order: accumulates of one key (:func:`_key`) join the key's open group while it
    can still sit between their producers and readers, else start the next one."""
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    producer = {b: n for n in plan.nodes for b in n.outputs}
    first_reader: dict[int, int] = {}
    for i, n in enumerate(plan.nodes):
        for b in n.inputs:
            first_reader.setdefault(b, i)
    reaches = _collectives_reached(plan)
    targets = {c for n in plan.nodes for c in n.control}  # nodes a control edge waits on: left alone
    open_groups: dict[Any, _Group] = {}
    groups: list[_Group] = []
    for n in plan.nodes:
        if n.kind != "accumulate" or len(n.inputs) != 1 or n.control or n.id in targets:
            continue
        feeder = producer.get(n.inputs[0])
        if feeder is None or feeder.phase != "micro":
            continue
        key = _key(plan, n, feeder, reaches)
        if key is None:
            continue
        after, before = position[feeder.id], first_reader.get(n.outputs[0], len(plan.nodes))
        g = open_groups.get(key)
        if g is None or max(g.after, after) >= min(g.before, before):
            g = open_groups[key] = _Group(key[1], first=position[n.id])
            groups.append(g)
        g.members.append(n)
        g.after, g.before = max(g.after, after), min(g.before, before)
    return groups


# Accumulates group when they run on the same ranks, read gradients made by the same act (the same stage and
# part F/B/W; with one stage, the same node: a bucket reduced per micro-batch) and feed the same collectives.
# The runtime acts them after that act anyway. Without a schedule it acts an accumulate only when its next
# micro-batch needs the slot, so a group of different nodes' gradients would hold all their sums at once:
# they stay single. A bucket's all-reduce still waits for its own members only, and a sum sent or reduced
# alone (a tied weight's part) stays alone, so it goes out as early as before.
def _key(plan: PhysicalPlan, n: PNode, feeder: PNode, reaches: dict[int, frozenset[int]]) -> Any:
    """What members of a group share: ranks, the act that makes their gradients (in a pipeline its stage and part;
    else the one node making them all, a data-parallel bucket's split), the collectives they feed; None for an
    accumulate left alone (in a pipeline, one whose act holds more activations after its first micro-batch than
    after its second: see :func:`_holds_less_later`)."""
    pipe = plan.pipeline
    if pipe is None:  # one stage: the runtime acts each accumulate when its input's register fills (see above)
        return (n.ranks, feeder.id, reaches[n.outputs[0]])
    act = (pipe.stage_of.get(feeder.id), pipe.part_of.get(feeder.id))
    if act[0] is None or act[1] is None or not _holds_less_later(pipe, act):
        return None
    return (n.ranks, act, reaches[n.outputs[0]])


# Memory: each member's register is as it was, but on the first micro-batch the group holds every sum and every
# gradient of the act at once. That raises no peak where the act's rank holds no more activations then than
# after its second micro-batch (1F1B's steady state, zero bubble with m > p); elsewhere (GPipe, a stage whose
# warm-up forwards every micro-batch) accumulates stay single (tests/sim/test_grouped_accumulate.py).
def _holds_less_later(pipe: Any, act: tuple[int, str]) -> bool:
    """Whether the act's rank holds as many micro-batches of activations (forwarded, not yet freed by B, or W
    under zero bubble) right after the act's micro-batch 1 as right after its micro-batch 0.

    A group takes its sums' registers on its first micro-batch, while that act's gradients are all live; single
    accumulates take them one by one, each freeing its gradient. From the second micro-batch on both hold the
    sums and free the gradients at the act's end. So a group raises no peak where the first act holds no more
    activations than the second (1F1B's steady state); under GPipe, or on a stage whose warm-up forwards every
    micro-batch, it would (by up to one micro-batch of the act's gradients), and the accumulates stay single."""
    sched = pipe.schedule
    stage, part = act
    rank = stage % len(pipe.stages)
    frees = "W" if sched.splits_backward else "B"
    held, after = 0, {}
    for a in sched.actions[rank]:
        if a.kind not in COMPUTE:
            continue
        held += 1 if a.kind == "F" else -1 if a.kind == frees else 0
        if a.kind == part and sched.stage(rank, a.chunk) == stage and a.micro in (0, 1):
            after[a.micro] = held
    return len(after) == 2 and after[1] >= after[0]


def _collectives_reached(plan: PhysicalPlan) -> dict[int, frozenset[int]]:
    """Post-phase buffer (an accumulate's sum, what is computed from sums) -> the communication nodes its value
    reaches through compute nodes alone (the first ones on each path: a collective's output is not followed). Only
    post nodes read post buffers, so the micro-batch graph is not walked."""
    readers: dict[int, list[PNode]] = {}
    for n in plan.phase("post"):
        for b in n.inputs:
            readers.setdefault(b, []).append(n)
    reached: dict[int, frozenset[int]] = {}
    for n in reversed(plan.nodes):  # readers come after their producers in the plan
        if n.phase != "post":
            continue
        for b in n.outputs:
            found: set[int] = set()
            for r in readers.get(b, ()):
                if _communicates(r):
                    found.add(r.id)
                else:
                    for out in r.outputs:
                        found |= reached[out]
            reached[b] = frozenset(found)
    return reached


def _communicates(n: PNode) -> bool:
    """A route, or a boxing node that runs a collective or a transfer (not a local slice or relabel)."""
    return n.kind == "route" or (n.kind == "boxing" and (n.is_comm or (n.boxing is not None
                                                                        and bool(n.boxing.collectives()))))


def _grouped(g: _Group) -> PNode:
    """The group's node: named for its size and, in a pipeline, the act making its gradients."""
    head = g.members[0]
    act = f" ({g.act[1]} of stage {g.act[0]})" if isinstance(g.act, tuple) else ""
    return PNode(head.id, "accumulate", f"sum of {len(g.members)} gradients{act}",
                 tuple(n.inputs[0] for n in g.members), tuple(n.outputs[0] for n in g.members), head.ranks,
                 head.phase, attrs=(("members", tuple(g.members)),), logical=head.logical)
