"""Dynamic routing on the actor runtime: a top-1 mixture of experts, one expert per rank, forward and backward.

Tokens go to their expert by a data-dependent all-to-all (runtime.route); the backward pass routes the
gradients through the forward's routing record. The hand-written plan must match torch autograd on one
device. The same plan runs on 2 gloo processes in tests/proc/test_runtime_proc.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend, record
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.runtime import ActorRuntime, ExecutionError
from sbpflow.runtime.builder import PlanBuilder

TOKENS, DIM, EXPERTS = 12, 4, 2  # logical; tokens split over the ranks, one expert per rank


def moe_plan(experts: int = EXPERTS) -> PhysicalPlan:
    """y = gate * relu(x @ W[expert]) with expert = argmax softmax(x @ wg), and its backward for upstream dy.

    Outputs: y, dx, dwg (all-reduced), dw (each rank its own expert's gradient)."""
    p = sbpflow.placement("cpu", list(range(experts)))
    b = PlanBuilder()
    x = b.input("x", (TOKENS, DIM), p, (S.split(0),))
    dy = b.input("dy", (TOKENS, DIM), p, (S.split(0),))
    wg = b.variable("wg", (DIM, experts), p, (S.broadcast,))
    w = b.variable("w", (experts * DIM, DIM), p, (S.split(0),))  # rank e holds expert e's (DIM, DIM)
    probs = b.compute("softmax", b.compute("matmul", x, wg), dim=-1)
    gate, expert = b.compute_n("max_dim", probs, dim=-1)
    tokens, routing = b.route_dispatch(x, expert)
    tokens_bound = b.bufs[tokens].shape  # data-dependent rows: buffers have the bound shape, ops no logical meta
    h = b.compute("matmul", tokens, w, out_shape=tokens_bound)
    out = b.compute("relu", h)
    back = b.route_back(out, routing, like=x)
    g = b.compute("unsqueeze", gate, dim=-1)
    b.output("y", b.compute("mul", back, g))
    # backward
    d_back = b.compute("mul", dy, g)
    d_gate = b.compute("sum", b.compute("mul", dy, back), dim=-1)
    d_out = b.route_back(d_back, routing, like=out, mode="redispatch")
    d_h = b.compute("relu_backward", d_out, out)
    t_tokens = b.compute("permute", tokens, dims=(1, 0), out_shape=(DIM, tokens_bound[0]))
    b.output("dw", b.compute("matmul", t_tokens, d_h, out_shape=(experts * DIM, DIM)))
    d_tokens = b.compute("matmul", d_h, b.compute("permute", w, dims=(1, 0), out_shape=(DIM, DIM)),
                         out_shape=tokens_bound)
    d_x_experts = b.route_back(d_tokens, routing, like=x)
    d_probs = b.compute("unpick", d_gate, expert, num_classes=experts, ignore_index=-100, class_split=False)
    dot = b.compute("sum", b.compute("mul", d_probs, probs), dim=-1, keepdim=True)
    d_logits = b.compute("mul", probs, b.compute("sub", d_probs, dot))  # softmax backward
    x_t = b.compute("permute", x, dims=(1, 0), out_sbp=(S.split(1),))
    b.output("dwg", b.boxing(b.compute("matmul", x_t, d_logits, out_sbp=(S.partial_sum,)), (S.broadcast,)))
    wg_t = b.compute("permute", wg, dims=(1, 0))
    b.output("dx", b.compute("add", d_x_experts, b.compute("matmul", d_logits, wg_t)))
    return b.build()


def moe_data(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(TOKENS, DIM, generator=gen), "dy": torch.randn(TOKENS, DIM, generator=gen),
            "wg": torch.randn(DIM, EXPERTS, generator=gen), "w": torch.randn(EXPERTS * DIM, DIM, generator=gen)}


def moe_shards(data: dict[str, torch.Tensor], ranks: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = TOKENS // EXPERTS
    split = {name: {r: data[name][r * rows:(r + 1) * rows] for r in ranks} for name in ("x", "dy")}
    variables = {"wg": {r: data["wg"].clone() for r in ranks},
                 "w": {r: data["w"][r * DIM:(r + 1) * DIM].clone() for r in ranks}}
    return split, variables


def torch_moe(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One device: the same layer in torch autograd."""
    x, wg, w = (data[k].clone().requires_grad_() for k in ("x", "wg", "w"))
    gate, expert = torch.softmax(x @ wg, dim=-1).max(dim=-1)
    experts = w.view(EXPERTS, DIM, DIM)
    out = torch.stack([torch.relu(x[j] @ experts[int(expert[j])]) for j in range(TOKENS)])
    y = out * gate.unsqueeze(-1)
    y.backward(data["dy"])
    assert x.grad is not None and wg.grad is not None and w.grad is not None
    return {"y": y.detach(), "dx": x.grad, "dwg": wg.grad, "dw": w.grad, "expert": expert}


def gather_rows(shards: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.cat([shards[r] for r in sorted(shards)])


def test_top1_moe_forward_and_backward_match_one_device() -> None:
    data = moe_data()
    expected = torch_moe(data)
    counts = torch.bincount(expected["expert"], minlength=EXPERTS)
    assert counts.min() > 0 and counts[0] != counts[1]  # both experts used, unevenly: sizes depend on the data
    feeds, variables = moe_shards(data, (0, 1))
    with ActorRuntime(moe_plan(), SimulatedBackend(), timeout=20) as rt, record() as log:
        got = rt.run(feeds, variables)
    torch.testing.assert_close(gather_rows(got["y"]), expected["y"])
    torch.testing.assert_close(gather_rows(got["dx"]), expected["dx"])
    torch.testing.assert_close(got["dwg"][0], expected["dwg"])
    torch.testing.assert_close(got["dwg"][1], expected["dwg"])
    torch.testing.assert_close(gather_rows(got["dw"]), expected["dw"])
    # dispatch: counts then rows; combine, redispatch, combine: rows; the gate's gradient: one all-reduce
    assert log.kinds() == ["all_to_all"] * 5 + ["all_reduce"]


def test_a_destination_outside_the_group_names_the_route_actor() -> None:
    b = PlanBuilder()
    p = sbpflow.placement("cpu", [0, 1])
    x = b.input("x", (4, 2), p, (S.split(0),))
    dest = b.input("dest", (4,), p, (S.split(0),), dtype=torch.int64)
    rows, _ = b.route_dispatch(x, dest)
    b.output("rows", rows)
    feeds = {"x": {0: torch.ones(2, 2), 1: torch.ones(2, 2)},
             "dest": {0: torch.tensor([0, 1]), 1: torch.tensor([1, 2])}}
    with ActorRuntime(b.build(), SimulatedBackend(), timeout=20) as rt, pytest.raises(ExecutionError) as info:
        rt.run(feeds, {})
    assert "route dispatch on rank 1: destinations must lie in [0, 2) (group members), but they span [1, 2]" \
        in str(info.value)
