"""nn.MoE's router as one op (``topk_router``: softmax, top-k, renormalisation) and its one-op gradient equal
torch autograd over the same three steps, on one device and with the tokens split over two ranks (no
collective), with the gradient reaching the logits through the routing weights, the probabilities, or both."""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow.comm import record
from sbpflow.nn.moe import topk_router

TOKENS, EXPERTS, K = 10, 5, 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _torch_router(logits: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1)
    top, index = torch.topk(probs, K, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    return top, probs, index


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("through", ["top", "probs", "both"])
@pytest.mark.parametrize("ranks", [None, [0, 1]], ids=["one_device", "rows_split"])
def test_router_op_and_its_gradient_equal_torch(normalize: bool, through: str, ranks: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen, dtype=torch.float64)
    d_top = torch.randn(TOKENS, K, generator=gen, dtype=torch.float64) * (through != "probs")
    d_probs = torch.randn(TOKENS, EXPERTS, generator=gen, dtype=torch.float64) * (through != "top")
    want = logits.clone().requires_grad_()
    w_top, w_probs, w_index = _torch_router(want, normalize)
    ((w_top * d_top).sum() + (w_probs * d_probs).sum()).backward()

    def placed(t: torch.Tensor) -> sbpflow.Tensor:
        if ranks is None:
            return sbpflow.tensor(t)
        return sbpflow.tensor(t, placement=sbpflow.placement("cpu", ranks), sbp=sbpflow.sbp.split(0))

    x = placed(logits)
    x.requires_grad = True
    F = sbpflow.functional
    with record() as log:
        top, probs, index = topk_router(x, k=K, normalize=normalize)
        loss = F.sum(F.mul(top, placed(d_top))) if through == "top" else F.sum(F.mul(probs, placed(d_probs)))
        if through == "both":
            loss = F.add(F.sum(F.mul(top, placed(d_top))), loss)
        loss.backward()
    torch.testing.assert_close(torch.as_tensor(top.numpy()), w_top.detach())
    torch.testing.assert_close(torch.as_tensor(probs.numpy()), w_probs.detach())
    assert torch.equal(torch.as_tensor(index.numpy()), w_index)
    assert x.grad is not None and want.grad is not None
    torch.testing.assert_close(torch.as_tensor(x.grad.numpy()), want.grad)
    if ranks is not None:  # rows stay where they are: only the loss's scalar sum is reduced
        assert set(log.kinds()) <= {"all_reduce"}, log.kinds()


def test_routing_runs_in_fp32_under_autocast() -> None:
    """As softmax under autocast: the bf16 router logits are routed in fp32 (Mixtral routes in fp32 too)."""
    moe = sbpflow.nn.MoE(8, 16, num_experts=EXPERTS, top_k=K)
    x = sbpflow.randn(TOKENS, 8)
    with sbpflow.autocast(torch.bfloat16):
        probs, top, _ = moe._gate(x)
        logits = moe.gate(x)
    assert probs.dtype == top.dtype == torch.float32 and logits.dtype == torch.bfloat16
    want = torch.softmax(torch.as_tensor(logits.float().numpy()), dim=-1)
    torch.testing.assert_close(torch.as_tensor(probs.numpy()), want)
