"""nn.MoE's all-to-all expert exchange on 2 gloo processes, on a mesh in rank order and on a permuted one (member
j is not rank j: gloo's all_to_all_single sends split i to the i-th lowest rank, so the pieces are reordered),
against the same layer on one device computed in each process; and one nn.Graph step (the exchange as one
communicating node that moves only routed rows)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from procrun import run_ranks

import sbpflow
from harness import per_expert
from sbpflow import nn
from sbpflow.nn.moe import split_experts

TIMEOUT = 90.0
HIDDEN, INTER, EXPERTS, TOKENS = 8, 12, 4, 10


def _layer() -> nn.MoE:
    moe = nn.MoE(HIDDEN, INTER, num_experts=EXPERTS, top_k=2)
    rng = np.random.default_rng(0)
    for _, p in moe.named_parameters():
        p._take_storage(sbpflow.tensor((0.5 * rng.standard_normal(tuple(p.shape))).astype(np.float32)))
    return moe


def _run(moe: nn.MoE, x: Any) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    out = moe(x)
    sbpflow.functional.sum(sbpflow.functional.square(out)).backward()
    return out.numpy(), x.grad.numpy(), per_expert(moe, lambda p: p.grad.numpy())


def exchange_job(ranks: list[int]) -> dict[str, Any]:
    x = np.random.default_rng(1).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    want = _run(_layer(), sbpflow.tensor(x, requires_grad=True))
    mesh = sbpflow.placement("cpu", ranks)
    moe = _layer().to_global(mesh, sbpflow.sbp.broadcast)
    split_experts(moe, mesh, 0)
    xs = sbpflow.tensor(x, placement=mesh, sbp=sbpflow.sbp.split(0), requires_grad=True)
    with sbpflow.comm.record() as log:
        got = _run(moe, xs)
    return {"want": want, "got": got, "collectives": log.counts()}


@pytest.mark.parametrize("ranks", [[0, 1], [1, 0]], ids=["in_order", "permuted"])
def test_exchange_on_two_processes_equals_one_device(ranks: list[int]) -> None:
    for result in run_ranks(exchange_job, 2, args=(ranks,), timeout=TIMEOUT):
        (out, dx, grads), (w_out, w_dx, w_grads) = result["got"], result["want"]
        np.testing.assert_allclose(out, w_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dx, w_dx, rtol=1e-4, atol=1e-5)
        for name, g in grads.items():
            np.testing.assert_allclose(g, w_grads[name], rtol=1e-4, atol=1e-5, err_msg=name)
        assert result["collectives"]["all_to_all"] >= 5  # counts, rows there and back, then two in backward


class _Step(nn.Graph):
    def __init__(self, moe: nn.MoE) -> None:
        super().__init__()
        self.moe = moe
        self.add_optimizer(sbpflow.optim.SGD(moe.parameters(), lr=1.0))

    def build(self, x: Any) -> Any:
        out = self.moe(x)
        sbpflow.functional.sum(sbpflow.functional.square(out)).backward()
        return out


def graph_job() -> dict[str, Any]:
    """One nn.Graph SGD step (lr 1) with the experts split over 2 processes: the output, and each weight's move."""
    x = np.random.default_rng(1).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    want = _run(_layer(), sbpflow.tensor(x, requires_grad=True))
    mesh = sbpflow.placement("cpu", [0, 1])
    moe = _layer().to_global(mesh, sbpflow.sbp.broadcast)
    split_experts(moe, mesh, 0)
    before = per_expert(moe, lambda p: p.numpy().copy())
    step = _Step(moe)
    with sbpflow.comm.record() as log:
        out = step(sbpflow.tensor(x, placement=mesh, sbp=sbpflow.sbp.split(0))).numpy()
    after = per_expert(moe, lambda p: p.numpy())
    nodes = [n.name for n in step.plan.nodes if n.kind == "compute" and n.name.startswith("expert_exchange")]
    return {"want": want, "out": out, "moved": {n: before[n] - after[n] for n in before},
            "collectives": log.counts(), "nodes": nodes}


def test_graph_exchange_on_two_processes_equals_one_device() -> None:
    for result in run_ranks(graph_job, 2, timeout=TIMEOUT):
        # one communicating node each way; the forward's counts and rows there and back are all-to-alls
        assert result["nodes"] == ["expert_exchange", "expert_exchange_backward"]
        assert result["collectives"]["all_to_all"] >= 3 and "broadcast" not in result["collectives"]
        w_out, _, w_grads = result["want"]
        np.testing.assert_allclose(result["out"], w_out, rtol=1e-4, atol=1e-5)
        for name, g in result["moved"].items():
            np.testing.assert_allclose(g, w_grads[name], rtol=1e-4, atol=1e-5, err_msg=name)
