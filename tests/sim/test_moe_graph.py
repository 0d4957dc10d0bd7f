"""nn.MoE with split experts under nn.Graph: the traced step carries the exchange as one communicating node on the
mesh (expert_exchange, and its backward), which moves only the routed rows: each rank receives exactly the slots
routed to its experts, never its group's every token. One SGD step equals the eager exchange and one device
(outputs and every gradient, the tokens' through a Linear in front) for ep2, dp2 x ep2 and ep2 x tp2."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import per_expert
from sbpflow import nn
from sbpflow._layout import shard_box
from sbpflow.errors import SbpflowError
from sbpflow.nn import expert_parallel
from sbpflow.nn.module import relayout_
from sbpflow.nn.moe import split_experts
from sbpflow.sbp import broadcast, split

RTOL, ATOL = 1e-4, 1e-5
HIDDEN, INTER, EXPERTS, K, TOKENS = 8, 12, 4, 2, 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# name -> (mesh ranks, ep axis, Megatron tp axis or None)
LAYOUTS: dict[str, tuple[Any, int, int | None]] = {
    "ep2": ([0, 1], 0, None),
    "dp2xep2": ([[0, 1], [2, 3]], 1, None),
    "ep2xtp2": ([[0, 1], [2, 3]], 0, 1),
}


class Block(nn.Module):
    """A Linear in front of the MoE, so that the tokens' gradient shows in a weight's."""

    def __init__(self, capacity: float | None) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.moe = nn.MoE(HIDDEN, INTER, num_experts=EXPERTS, top_k=K, capacity_factor=capacity)

    def forward(self, x: Any) -> Any:
        return self.moe(self.inp(x))


def _block(capacity: float | None) -> Block:
    block = Block(capacity)
    rng = np.random.default_rng(0)
    for _, p in block.named_parameters():
        p._take_storage(sbpflow.tensor(0.5 * rng.standard_normal(tuple(p.shape)).astype(np.float32)))
    return block


def _one_device(capacity: float | None, x: np.ndarray,
                dy: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """The output, every weight's gradient, and the slots the experts keep."""
    block = _block(capacity)
    out = block(sbpflow.tensor(x))
    sbpflow.functional.sum(sbpflow.functional.mul(out, sbpflow.tensor(dy))).backward()
    kept = int((block.moe.route(block.inp(sbpflow.tensor(x))).numpy() != 0).sum())
    return out.numpy(), {n: p.grad.numpy() for n, p in block.named_parameters()}, kept


def _parallel(layout: str, capacity: float | None) -> tuple[Block, Any, Any]:
    ranks, axis, tp = LAYOUTS[layout]
    mesh = sbpflow.placement("cpu", ranks)
    block = _block(capacity)
    block.to_global(mesh, (broadcast,) * mesh.ndim)
    if tp is not None:  # Megatron on the tp axis: w1, w3 column-parallel, w2 row-parallel
        for expert in block.moe.experts:
            for p, dim in ((expert.w1.weight, 0), (expert.w3.weight, 0), (expert.w2.weight, 1)):
                relayout_(p, mesh, tuple(split(dim) if a == tp else broadcast for a in range(mesh.ndim)))
    split_experts(block.moe, mesh, axis)
    sbp = tuple(broadcast if a == tp else split(0) for a in range(mesh.ndim))
    return block, mesh, sbp


class Step(nn.Graph):
    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block
        self.add_optimizer(sbpflow.optim.SGD(block.parameters(), lr=1.0))

    def build(self, x: Any, dy: Any) -> Any:
        out = self.block(x)
        sbpflow.functional.sum(sbpflow.functional.mul(out, dy)).backward()
        return out


@pytest.fixture
def received_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows a rank's experts compute, one entry per rank and call (forward, and the backward's recompute)."""
    rows: list[int] = []
    experts = expert_parallel._experts

    def counting(x: torch.Tensor, *args: Any) -> torch.Tensor:
        rows.append(int(x.shape[0]))
        return experts(x, *args)

    monkeypatch.setattr(expert_parallel, "_experts", counting)
    return rows


def _routing(block: Block, layout: str, x: np.ndarray, mesh: Any, sbp: Any) -> tuple[list[int], int]:
    """Per rank of the mesh, the kept slots of its ep group's tokens routed to its experts; and over all ranks,
    the kept slots of a rank's own tokens routed to another member's experts (the rows that leave it)."""
    _, axis, _ = LAYOUTS[layout]
    one = _block(block.moe.capacity_factor)
    kept = one.moe.route(one.inp(sbpflow.tensor(x))).numpy() != 0  # (N, E): the kept slots
    per = EXPERTS // mesh.hierarchy[axis]
    received, leaving = [], 0
    for r in mesh.flat_ranks:
        j = mesh.coords(r)[axis]
        group = {t for q in mesh.axis_group_of(r, axis) for t in range(*shard_box((TOKENS, HIDDEN), mesh, sbp, q)[0])}
        received.append(int(kept[sorted(group), j * per:(j + 1) * per].sum()))
        own = range(*shard_box((TOKENS, HIDDEN), mesh, sbp, r)[0])
        leaving += int(kept[own].sum() - kept[own, j * per:(j + 1) * per].sum())
    return received, leaving


@pytest.mark.parametrize("capacity", [None, 0.75], ids=["dropless", "capacity"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graph_step_equals_eager_and_one_device(layout: str, capacity: float | None,
                                                received_rows: list[int]) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    dy = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    want_out, want_grads, kept = _one_device(capacity, x, dy)

    block, mesh, sbp = _parallel(layout, capacity)  # eager exchange
    out = block(sbpflow.tensor(x, placement=mesh, sbp=sbp))
    sbpflow.functional.sum(sbpflow.functional.mul(out, sbpflow.tensor(dy, placement=mesh, sbp=sbp))).backward()
    np.testing.assert_allclose(out.numpy(), want_out, rtol=RTOL, atol=ATOL)
    eager_grads = per_expert(block, lambda p: p.grad.numpy())

    block, mesh, sbp = _parallel(layout, capacity)
    before = per_expert(block, lambda p: p.numpy().copy())
    step = Step(block)
    received_rows.clear()
    with sbpflow.comm.record() as log:
        out = step(sbpflow.tensor(x, placement=mesh, sbp=sbp), sbpflow.tensor(dy, placement=mesh, sbp=sbp))
    np.testing.assert_allclose(out.numpy(), want_out, rtol=RTOL, atol=ATOL)
    after = per_expert(block, lambda p: p.numpy())
    for name in want_grads:  # SGD at lr 1: the step moved each weight by minus its gradient
        grad = before[name] - after[name]
        np.testing.assert_allclose(grad, want_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(grad, eager_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)

    # the forward: each rank's experts ran on the slots routed to them only; the backward recomputes them on the
    # rows its own signature routes (the selection may gather the tokens over the data axis there, for instance)
    received, leaving = _routing(block, layout, x, mesh, sbp)
    forward, backward = received_rows[:mesh.size], received_rows[mesh.size:]
    assert Counter(forward) == Counter(received), (forward, received)
    tp = LAYOUTS[layout][2]
    copies = 1 if tp is None else mesh.hierarchy[tp]  # over the tp axis every rank of a member has the rows
    assert sum(received) == copies * kept and kept == (TOKENS * K if capacity is None else kept)
    p = mesh.hierarchy[LAYOUTS[layout][1]]
    assert len(backward) == mesh.size and max(backward) <= kept * p // EXPERTS * 2  # (at most its experts' slots)
    # only routed rows travel: the forward's count exchange (one all-to-all per ep group), then its rows there
    # and back (C wide), exactly the slots that leave their rank
    groups = mesh.size // p
    exchanges = [e.bytes for e in log.events if e.kind == "all_to_all"][:3 * groups]
    if capacity is None:  # (with a capacity the selection may gather the tokens for the queue, a cumsum over
        # them, and each member then computes its experts' rows with no exchange)
        assert sum(exchanges[:groups]) == mesh.size * 8 * (EXPERTS // p) * (p - 1)
        assert sum(exchanges[groups:]) == 2 * leaving * HIDDEN * 4, log.events

    plan = step.plan
    axis = LAYOUTS[layout][1]
    for name in ("expert_exchange", "expert_exchange_backward"):
        nodes = [n for n in plan.nodes if n.kind == "compute" and n.name == name]
        assert len(nodes) == 1 and nodes[0].ranks == tuple(sorted(mesh.flat_ranks)), nodes
        first = 1 if name.endswith("backward") else 0  # (dy comes first)
        tokens, w1 = nodes[0].in_sbps[first], nodes[0].in_sbps[first + 3]
        assert w1[axis] == split(0)  # the experts never move
        if name == "expert_exchange" and capacity is None:  # (the backward's selection may gather the tokens
            assert tokens[axis] == split(0)  # where that moves fewer bytes than 3C + 2 per routed row: top-2, ep2)
    for n in plan.nodes:  # the tokens are never broadcast or gathered whole onto a rank
        if n.kind == "boxing" and plan.bufs[n.inputs[0]].shape == (TOKENS, HIDDEN):
            assert all(s.kind != "broadcast" and s.bytes_per_rank <= TOKENS * HIDDEN * 4 for s in n.boxing.steps), n


@pytest.mark.parametrize("layout", ["ep2", "dp2xep2"])
def test_graph_step_over_micro_batches_equals_one_device(layout: str) -> None:
    """Two micro-batches: each exchanges its own tokens; the summed gradients are the whole batch's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    dy = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    want_out, want_grads, _ = _one_device(None, x, dy)
    block, mesh, sbp = _parallel(layout, None)
    before = per_expert(block, lambda p: p.numpy().copy())
    step = Step(block)
    step.config.set_gradient_accumulation_steps(2)
    out = step(sbpflow.tensor(x, placement=mesh, sbp=sbp), sbpflow.tensor(dy, placement=mesh, sbp=sbp))
    np.testing.assert_allclose(out.numpy(), want_out, rtol=RTOL, atol=ATOL)
    after = per_expert(block, lambda p: p.numpy())
    for name, want in want_grads.items():  # (sums of terms up to ~10 in another order: atol at their scale)
        np.testing.assert_allclose(before[name] - after[name], want, rtol=RTOL, atol=ATOL * np.abs(want).max(),
                                   err_msg=name)


def test_graph_boxes_experts_split_on_their_input_dim() -> None:
    """The eager exchange refuses experts split on their input dim (C); the traced op has no such signature
    either, so the step boxes them to one it has, and still trains as one device."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    dy = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    want_out, want_grads, _ = _one_device(None, x, dy)
    block, mesh, sbp = _parallel("ep2xtp2", None)
    w1 = block.moe.experts.w1  # stacked (E, I, C): S(0) on the ep axis, now its input dim split on the tp axis
    relayout_(w1, w1.placement, (split(0), split(2)))
    with pytest.raises(SbpflowError, match=r"must be whole \(B\) or Megatron"):
        block(sbpflow.tensor(x, placement=mesh, sbp=sbp))
    before = per_expert(block, lambda p: p.numpy().copy())
    out = Step(block)(sbpflow.tensor(x, placement=mesh, sbp=sbp), sbpflow.tensor(dy, placement=mesh, sbp=sbp))
    np.testing.assert_allclose(out.numpy(), want_out, rtol=RTOL, atol=ATOL)
    after = per_expert(block, lambda p: p.numpy())
    for name, want in want_grads.items():
        np.testing.assert_allclose(before[name] - after[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
