"""A local tensor turned global on virtual ranks: every rank contributes it; gradients are its derivative.

The same rule holds on processes: tests/proc/test_collectives_proc.py checks P(sum) there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from harness import PLACEMENTS, randn
from sbpflow import sbp as S

B, PSUM, PMAX = S.broadcast, S.partial_sum, S.partial_max


def _logical(local: torch.Tensor, placement: sbpflow.Placement, nd: tuple) -> torch.Tensor:
    """What every virtual rank contributing ``local`` means: split axes tile copies, P(sum) adds them up,
    B and P(max) keep one."""
    out = local
    for axis in reversed(range(placement.ndim)):
        s = nd[axis]
        if isinstance(s, S.Split):
            out = torch.cat([out] * placement.hierarchy[axis], dim=s.dim)
        elif s == PSUM:
            out = out * placement.hierarchy[axis]
    return out


def test_partial_sum_adds_every_virtual_ranks_contribution() -> None:
    """The issue-13 case: [1, 1] onto P(sum) over 2 ranks is [2, 2], as on 2 processes."""
    y = sbpflow.tensor([1.0, 1.0]).to_global(PLACEMENTS["2"], PSUM)
    assert y.tolist() == [2.0, 2.0]
    assert [t.tolist() for t in y.local_tensors().values()] == [[1.0, 1.0], [1.0, 1.0]]


CASES = [
    ("2", (S.split(0),)), ("3", (S.split(1),)), ("2", (B,)), ("3", (PSUM,)), ("2", (PMAX,)),
    ("2x2", (S.split(0), B)), ("2x2", (B, S.split(1))), ("2x2", (PSUM, S.split(0))), ("2x2", (B, B)),
]


@pytest.mark.parametrize(("pname", "nd"), CASES, ids=[f"{p}-{'_'.join(map(str, n))}" for p, n in CASES])
def test_value_and_gradient_match_the_logical_function(pname: str, nd: tuple) -> None:
    p = PLACEMENTS[pname]
    value = randn(3, 4)
    x = sbpflow.tensor(value, requires_grad=True)
    y = x.to_global(placement=p, sbp=nd)
    ref_x = value.clone().requires_grad_(True)
    ref_y = _logical(ref_x, p, nd)
    np.testing.assert_allclose(y.numpy(), ref_y.detach().numpy(), rtol=1e-6)
    weight = randn(*ref_y.shape, seed=1)
    (y * sbpflow.tensor(weight, placement=p, sbp=(B,) * p.ndim)).sum().backward()
    (ref_y * weight).sum().backward()
    assert x.grad is not None and not x.grad.is_global
    np.testing.assert_allclose(x.grad.numpy(), ref_x.grad.numpy(), rtol=1e-5, atol=1e-6)
