"""nn.MoE with split experts under nn.Graph: the traced step carries the exchange as plan nodes (each ep member
receives its group's tokens and routing by a transfer node, computes its experts on their routed rows only, and
its output returns by another), and one SGD step equals the eager exchange and one device (outputs and every
gradient, the tokens' through a Linear in front) for ep2, dp2 x ep2 and ep2 x tp2."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
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
def counted_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token rows each expert kernel computes, one entry per call (forward and backward recomputation)."""
    rows: list[int] = []
    swiglu = expert_parallel._swiglu

    def counting(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        rows.append(int(x.shape[0]))
        return swiglu(x, *weights)

    monkeypatch.setattr(expert_parallel, "_swiglu", counting)
    return rows


@pytest.mark.parametrize("capacity", [None, 0.75], ids=["dropless", "capacity"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graph_step_equals_eager_and_one_device(layout: str, capacity: float | None,
                                                counted_rows: list[int]) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    dy = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    want_out, want_grads, kept = _one_device(capacity, x, dy)

    block, mesh, sbp = _parallel(layout, capacity)  # eager exchange
    out = block(sbpflow.tensor(x, placement=mesh, sbp=sbp))
    sbpflow.functional.sum(sbpflow.functional.mul(out, sbpflow.tensor(dy, placement=mesh, sbp=sbp))).backward()
    np.testing.assert_allclose(out.numpy(), want_out, rtol=RTOL, atol=ATOL)
    eager_grads = {n: p.grad.numpy() for n, p in block.named_parameters()}

    block, mesh, sbp = _parallel(layout, capacity)
    before = {n: p.numpy().copy() for n, p in block.named_parameters()}
    step = Step(block)
    counted_rows.clear()
    out = step(sbpflow.tensor(x, placement=mesh, sbp=sbp), sbpflow.tensor(dy, placement=mesh, sbp=sbp))
    np.testing.assert_allclose(out.numpy(), want_out, rtol=RTOL, atol=ATOL)
    for name, p in block.named_parameters():  # SGD at lr 1: the step moved each weight by minus its gradient
        grad = before[name] - p.numpy()
        np.testing.assert_allclose(grad, want_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(grad, eager_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)

    # each member ran its experts on their routed rows only (forward, and once more in backward), on each of
    # its ranks' tokens: over the tp axis every rank of a member computes the same rows
    tp = LAYOUTS[layout][2]
    copies = 1 if tp is None else mesh.hierarchy[tp]
    assert sum(counted_rows) == 2 * copies * kept, counted_rows
    assert kept == TOKENS * K if capacity is None else kept < TOKENS * K

    plan = step.plan
    members = [n for n in plan.nodes if n.kind == "compute" and n.name == "member_experts"]
    ep = mesh.hierarchy[LAYOUTS[layout][1]]
    assert len(members) == ep and all(len(n.ranks) == mesh.size // ep for n in members)
    transfers = [n for n in plan.nodes if n.kind == "boxing" and n.name.startswith("send_recv for to_global")]
    assert len(transfers) >= 2 * 3 * ep  # tokens, top, index to each member, and back (again in backward)
    # a dropless capacity buffer holds every token: no boxing of the tokens moves more than them once to a rank
    # (the selection may gather them on the mesh first, for the router, and the transfers then move nothing)
    for n in plan.nodes:
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
    before = {n: p.numpy().copy() for n, p in block.named_parameters()}
    step = Step(block)
    step.config.set_gradient_accumulation_steps(2)
    out = step(sbpflow.tensor(x, placement=mesh, sbp=sbp), sbpflow.tensor(dy, placement=mesh, sbp=sbp))
    np.testing.assert_allclose(out.numpy(), want_out, rtol=RTOL, atol=ATOL)
    for name, p in block.named_parameters():  # (sums of terms up to ~10 in another order: atol at their scale)
        want = want_grads[name]
        np.testing.assert_allclose(before[name] - p.numpy(), want, rtol=RTOL, atol=ATOL * np.abs(want).max(),
                                   err_msg=name)


def test_graph_refuses_experts_split_on_their_input_dim() -> None:
    """The traced exchange checks the layouts as the eager one does, naming the expert and its SBPs."""
    block, mesh, sbp = _parallel("ep2xtp2", None)
    w1 = block.moe.experts[0].w1.weight
    relayout_(w1, w1.placement, (broadcast, split(1)))
    step = Step(block)
    x = sbpflow.tensor(np.ones((TOKENS, HIDDEN), np.float32), placement=mesh, sbp=sbp)
    with pytest.raises(SbpflowError, match=r"must be whole \(B\) or Megatron .* but expert 0 has"):
        step(x, x)
