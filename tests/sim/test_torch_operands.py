"""A plain torch tensor beside sbpflow tensors is a broadcast value of its logical shape (issue 13, part 1).

Before, it reached every shard's kernel as is: ``x(4, 4, S(1)) + torch.tensor([10., 20.])`` gave
``[11, 21, 11, 21]`` where torch raises. Now it gets torch's broadcasting: its shape check and its numbers.
"""

from __future__ import annotations

import pytest
import torch

import sbpflow
import sbpflow.ops.functional as F
from harness import PLACEMENTS, randn
from sbpflow import sbp as S
from sbpflow.errors import OpError, ShapeError

P2 = PLACEMENTS["2"]


def test_wrong_shape_raises_like_torch() -> None:
    x = sbpflow.ones(4, 4, placement=P2, sbp=S.split(1))
    with pytest.raises(RuntimeError):
        torch.ones(4, 4) + torch.tensor([10.0, 20.0])
    with pytest.raises(ShapeError, match=r"shapes \[\[4, 4\], \[2\]\] are not broadcastable"):
        x + torch.tensor([10.0, 20.0])
    with pytest.raises(ShapeError):
        sbpflow.ones(4, 4) + torch.tensor([10.0, 20.0])  # local tensors too


OPS = {
    "add": lambda a, b: a + b, "radd": lambda a, b: b + a, "rsub": lambda a, b: b - a, "mul": lambda a, b: a * b,
    "rdiv": lambda a, b: b / a, "where": lambda a, b: F.where(a > 0, a, b) if not isinstance(a, torch.Tensor)
    else torch.where(a > 0, a, b), "maximum": lambda a, b: F.maximum(a, b) if not isinstance(a, torch.Tensor)
    else torch.maximum(a, b),
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("pname, sbp", [("2", (S.split(1),)), ("2", (S.split(0),)), ("3", (S.broadcast,)),
                                        ("2x2", (S.split(0), S.split(1))), ("2", (S.partial_sum,))])
def test_matching_shape_gives_torch_numbers(name: str, pname: str, sbp: tuple[object, ...]) -> None:
    value, other = randn(5, 4, seed=1), randn(4, seed=2).abs() + 0.5
    x = sbpflow.tensor(value, placement=PLACEMENTS[pname], sbp=sbp)
    out = OPS[name](x, other)
    assert out.placement == x.placement
    torch.testing.assert_close(torch.as_tensor(out.numpy()), OPS[name](value, other))


def test_gradient_reaches_the_sbpflow_operand_only() -> None:
    value = randn(3, 4)
    x = sbpflow.tensor(value, placement=P2, sbp=S.split(1), requires_grad=True)
    (x * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert x.grad is not None
    assert x.grad.numpy().tolist() == [[1.0, 2.0, 3.0, 4.0]] * 3


def test_torch_tensor_that_requires_grad_is_refused() -> None:
    x = sbpflow.ones(2, 2, placement=P2, sbp=S.split(0))
    with pytest.raises(OpError, match="torch tensor that requires grad"):
        x + torch.ones(2, requires_grad=True)


def test_zero_dim_torch_tensor_promotes_like_torch() -> None:
    x = sbpflow.ones(2, 2, placement=P2, sbp=S.split(0))
    assert (x * torch.tensor(2)).dtype == (torch.ones(2, 2) * torch.tensor(2)).dtype == torch.float32
    assert (x * torch.tensor([2.0], dtype=torch.float64)).dtype == torch.float64
