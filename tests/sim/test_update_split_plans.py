"""graph.update_split on a small data-parallel MLP whose gradients each go out alone: the pieces of the update and
where they sit in the plan (the numbers of split updates are checked against whole ones in test_update_split.py).
"""

from __future__ import annotations

from typing import Any

import sbpflow
from harness import MeanSquareStep
from sbpflow import boxing, nn, optim
from sbpflow import sbp as S
from sbpflow.boxing import CostModel
from sbpflow.graph.fuse import members

P2 = sbpflow.placement("cpu", [0, 1])
# a link of near-zero latency: every gradient is all-reduced alone (graph.bucket's solo rule)
FAST = CostModel().with_link("cpu", "intra", alpha=1e-9, beta=1 / 2e9)


def _plan(*widths: int) -> Any:
    sbpflow.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).to_global(P2, S.broadcast)
    step = MeanSquareStep(model, optim.AdamW(model.parameters(), lr=1e-3))
    x = sbpflow.zeros(8, widths[0], placement=P2, sbp=S.split(0))
    with boxing.cost_model(FAST):
        step.compile_only(x)
    return step.plan


def _updates(plan: Any) -> list[Any]:
    return [n for n in plan.nodes if n.kind == "update" and n.op == "adam_update_multi"]


def test_two_collectives_make_two_pieces() -> None:
    """One Linear: its weight and its bias are all-reduced alone, so the one update becomes two, one per
    parameter, each reading one all-reduce's result."""
    plan = _plan(4, 4)
    producer = {b: n for n in plan.nodes for b in n.outputs}
    reductions = [n for n in plan.nodes if n.kind == "boxing" and n.boxing.steps[0].kind == "all_reduce"]
    assert len(reductions) == 2
    pieces = _updates(plan)
    assert len(pieces) == 2 and all(len(p.inputs) == 4 for p in pieces)  # (param, grad, m, v) of one parameter
    assert {producer[p.inputs[1]].id for p in pieces} == {n.id for n in reductions}


def test_pieces_wait_for_the_end_of_backward() -> None:
    """Each piece sits after its all-reduce and after backward's last compute node: a gradient all-reduced during
    backward must not pull its update among backward's nodes, where it would wait for the collective while
    backward's work is ready."""
    plan = _plan(4, 8, 8, 4)
    pieces = _updates(plan)
    assert len(pieces) == 6
    backward = max(i for i, n in enumerate(plan.nodes)
                   if any(m.op in ("linear_weight_grad", "matmul_nd") for m in members([n])))
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    assert min(position[p.id] for p in pieces) > backward


def test_small_gradients_share_one_bucket_read_where_first_needed() -> None:
    """Under the default (gloo-like) link the 4 gradients of a Linear(4, 8), Linear(8, 4) MLP fill one bucket: one
    all-reduce, labelled as the one step of its plan, and one split placed right before the first node that reads
    a gradient it gives back (the optimizer), not later."""
    sbpflow.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).to_global(P2, S.broadcast)
    step = MeanSquareStep(model, optim.AdamW(model.parameters(), lr=1e-3))
    step.compile_only(sbpflow.zeros(8, 4, placement=P2, sbp=S.split(0)))
    plan = step.plan
    reductions = [n for n in plan.nodes if n.kind == "boxing" and n.boxing.steps[0].kind == "all_reduce"]
    assert len(reductions) == 1
    assert reductions[0].name.startswith("all_reduce for bucket of 4 ") and reductions[0].name.endswith("(1/1)")
    split = next(i for i, n in enumerate(plan.nodes) if n.op == "bucket_split")
    first_reader = min(i for i, n in enumerate(plan.nodes) if set(n.inputs) & set(plan.nodes[split].outputs))
    assert first_reader == split + 1
