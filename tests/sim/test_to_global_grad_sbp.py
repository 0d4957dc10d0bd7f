"""``to_global(grad_sbp=...)``: the gradient of the converted tensor gets that SBP in backward (issue 13, part 1).

It used to be accepted and ignored.
"""

from __future__ import annotations

from typing import Any

import pytest

import sbpflow
from harness import PLACEMENTS, randn
from sbpflow import sbp as S
from sbpflow.comm import record
from sbpflow.errors import SbpError

P2 = PLACEMENTS["2"]


def _run(grad_sbp: Any) -> tuple[list[Any], sbpflow.Tensor, Any]:
    x = sbpflow.tensor(randn(4, 3), placement=P2, sbp=S.split(0), requires_grad=True)
    h = x * 2
    seen: list[Any] = []
    h.register_hook(lambda g: seen.append(g.sbp))
    y = h.to_global(sbp=S.broadcast, grad_sbp=grad_sbp)
    weight = sbpflow.tensor(randn(4, 3, seed=1), placement=P2, sbp=S.broadcast)
    with record() as log:
        (y * weight).sum().backward()
    return seen, x, log


@pytest.mark.parametrize("grad_sbp, want", [(None, (S.split(0),)), (S.partial_sum, (S.partial_sum,)),
                                            (S.broadcast, (S.broadcast,)), ("S(1)", (S.split(1),))])
def test_gradient_takes_grad_sbp(grad_sbp: Any, want: tuple[Any, ...]) -> None:
    seen, x, _ = _run(grad_sbp)
    assert seen == [want]
    assert x.grad is not None and x.grad.sbp == (S.split(0),)  # a leaf's gradient still ends in its own layout
    assert x.grad.numpy().tolist() == (2 * randn(4, 3, seed=1)).tolist()


def test_partial_grad_sbp_moves_the_reduction_to_the_leaf() -> None:
    _, _, plain = _run(None)
    _, _, deferred = _run(S.partial_sum)
    assert plain.counts() == {}  # B -> S(0): each rank slices its rows
    assert deferred.counts() == {"reduce_scatter": 1}  # P(sum) -> S(0) at the leaf


def test_grad_sbp_errors() -> None:
    with pytest.raises(SbpError, match=r"grad_sbp=.* its gradient is local"):
        sbpflow.tensor([1.0]).to_global(P2, S.broadcast, grad_sbp=S.broadcast)
    x = sbpflow.zeros(2, placement=P2, sbp=S.split(0))
    with pytest.raises(SbpError, match=r"grad_sbp of tensor .* splits dim 1"):
        x.to_global(sbp=S.broadcast, grad_sbp=S.split(1))
