"""The compile-time verifier: a plan that could deadlock or lose a message is refused before it runs."""

from __future__ import annotations

from ..boxing.plan import MOVES_NOTHING, transfer_pieces
from ..errors import SbpflowError
from .physical import PhysicalPlan, PNode


class PlanError(SbpflowError):
    """A physical plan failed verification; the message names the first mismatch."""


def groups_of(node: PNode) -> list[tuple[int, ...]]:
    """The rank groups a boxing node's collective runs on."""
    assert node.boxing is not None
    step = node.boxing.steps[0]
    if step.kind in MOVES_NOTHING:
        return []
    if step.src.placement == step.dst.placement and step.axis is not None:
        return step.src.placement.axis_groups(step.axis)
    return [tuple(sorted(set(step.src.placement.flat_ranks) | set(step.dst.placement.flat_ranks)))]


def verify(plan: PhysicalPlan) -> None:
    """Raises :class:`PlanError` naming the first problem; returns quietly for a sound plan.

    On every rank's program: no cycle through data and control edges and every input produced before it is
    read; every group's members issue the same collectives (kind, shape, dtype) in one order; every send has
    its receive."""
    _check_order(plan)
    _check_collectives(plan)
    _check_transfers(plan)


def _check_order(plan: PhysicalPlan) -> None:
    phases = {"pre": 0, "micro": 1, "post": 2}
    made: dict[int, tuple[int, int]] = {}  # buf -> (phase rank, position)
    done: set[int] = set()
    for pos, n in enumerate(plan.nodes):
        for b in n.inputs:
            if b not in made:
                raise PlanError(f"{n.label()} reads buffer %{b} before any node writes it (a cycle or a lost edge)")
            if made[b][0] > phases[n.phase]:
                raise PlanError(f"{n.label()} in phase {n.phase} reads %{b}, written later in the step")
        for c in n.control:
            if c not in done:
                raise PlanError(f"{n.label()} has a control edge from node #{c}, which does not run before it")
        for b in n.outputs:
            if b in made:
                raise PlanError(f"{n.label()} writes buffer %{b} a second time (SSA)")
            made[b] = (phases[n.phase], pos)
        done.add(n.id)


def _signature(n: PNode) -> tuple[object, ...]:
    assert n.boxing is not None
    step = n.boxing.steps[0]
    return (step.kind, tuple(n.boxing.shape), n.boxing.dtype, step.src, step.dst)


def _check_collectives(plan: PhysicalPlan) -> None:
    sequences: dict[tuple[tuple[int, ...], int], list[tuple[int, tuple[object, ...]]]] = {}
    for n in plan.nodes:
        if n.kind != "boxing":
            continue
        entry = (n.id, _signature(n))
        members = set(n.ranks)
        for group in groups_of(n):
            missing = [r for r in group if r not in members]
            for r in group:
                if r not in missing:
                    sequences.setdefault((group, r), []).append(entry)
            if missing and len(missing) < len(group):
                raise PlanError(
                    f"{n.label()}: ranks {missing} of process group {list(group)} do not issue this "
                    f"{n.boxing.steps[0].kind if n.boxing else 'collective'}, so the other members would wait "
                    "forever (deadlock)")
    by_group: dict[tuple[int, ...], dict[int, list[tuple[int, tuple[object, ...]]]]] = {}
    for (group, r), seq in sequences.items():
        by_group.setdefault(group, {})[r] = seq
    for group, per_rank in by_group.items():
        ranks = sorted(per_rank)
        first = per_rank[ranks[0]]
        for r in ranks[1:]:
            _compare(group, ranks[0], first, r, per_rank[r])


def _compare(group: tuple[int, ...], r0: int, a: list[tuple[int, tuple[object, ...]]], r1: int,
             b: list[tuple[int, tuple[object, ...]]]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x[1] != y[1]:
            raise PlanError(f"process group {list(group)}: collective {i} differs between rank {r0} "
                            f"(node #{x[0]}: {x[1][0]}) and rank {r1} (node #{y[0]}: {y[1][0]}); both must issue "
                            "the same collectives in the same order")
    if len(a) != len(b):
        raise PlanError(f"process group {list(group)}: rank {r0} issues {len(a)} collectives but rank {r1} issues "
                        f"{len(b)}")


def _check_transfers(plan: PhysicalPlan) -> None:
    for n in plan.nodes:
        if n.kind != "boxing" or n.boxing is None:
            continue
        step = n.boxing.steps[0]
        if step.kind != "send_recv":
            continue
        for src, dst, _ in transfer_pieces(n.boxing.shape, step.src, step.dst):
            if src not in n.ranks or dst not in n.ranks:
                raise PlanError(f"{n.label()}: a send from rank {src} to rank {dst} has no matching "
                                f"{'receive' if dst not in n.ranks else 'send'} (the node runs on {list(n.ranks)})")
