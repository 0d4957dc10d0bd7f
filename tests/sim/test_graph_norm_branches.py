"""A norm whose output feeds two Linears laid out differently trains under nn.Graph as one device does.

Issue 28: with one Linear column- or row-split and the other whole, the SBP selection splits the norm's
backward on a row dim (the sum of the two branches' input gradients is reduce-scattered, not all-reduced), so
the forward's saved statistics reach the backward kernel through a local ``B -> S`` slice, a strided view.
torch's CPU layer-norm backward read those as row-major memory: the norm weight's gradient was wrong on the
first step. Each case compares a compiled step with eager training on one device (rtol 1e-5).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import LossStep
from sbpflow import nn
from sbpflow.nn.module import relayout_
from sbpflow.ops import functional as F
from sbpflow.sbp import Split, broadcast, split

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RTOL, ATOL = 1e-5, 1e-6
STEPS = 2
P2 = sbpflow.placement("cpu", [0, 1])
P22 = sbpflow.placement("cpu", [[0, 1], [2, 3]])
B, S0, S1 = broadcast, split(0), split(1)


class TwoBranches(nn.Module):
    """norm(x) read by two Linears, whose products are summed: each branch adds to the norm's gradient."""

    def __init__(self, width: int, norm: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm == "layer" else nn.RMSNorm(width)
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: Any) -> Any:
        h = self.norm(x)  # logical (B, T, C)
        return F.sum(self.a(h) * self.b(h))


def _lay_out(model: TwoBranches, placement: Any, weights: dict[str, tuple[Any, ...]]) -> None:
    """Every tensor B, then each named Linear's weight as given (a column split's bias split alike)."""
    model.to_global(placement, (B,) * placement.ndim)
    for name, sbp in weights.items():
        linear = getattr(model, name)
        relayout_(linear.weight, placement, sbp)
        if sbp[-1] == S0:
            relayout_(linear.bias, placement, sbp)


def train(norm: str, shape: tuple[int, ...], layout: tuple[Any, dict[str, Any], tuple[Any, ...]] | None = None
          ) -> tuple[list[float], dict[str, np.ndarray], Any]:
    """Losses and parameters after STEPS SGD-momentum steps: eager on one device (``layout`` None), else
    compiled, with (placement, weight SBPs, input SBP); also the compiled plan."""
    sbpflow.manual_seed(0)
    model = TwoBranches(shape[-1], norm)
    if layout is not None:
        _lay_out(model, layout[0], layout[1])
    opt = sbpflow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = LossStep(model, opt) if layout is not None else None
    losses = []
    for i in range(STEPS):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(i)).numpy()
        if step is not None:
            losses.append(float(step(sbpflow.tensor(x, placement=layout[0], sbp=layout[2])).item()))  # type: ignore[index]
            continue
        opt.zero_grad()
        loss = model(sbpflow.tensor(x))
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    plan = step._compiled().plan if step is not None else None
    return losses, {n: p.numpy() for n, p in model.named_parameters()}, plan


def assert_same(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    for name, value in want[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_row_split_layer_norm_backward_matches_one_device() -> None:
    """The smallest program of issue 28: one column-split Linear beside a whole one, on 2 ranks."""
    got = train("layer", (2, 8, 16), (P2, {"a": (S0,)}, (B,)))
    assert_same(got, train("layer", (2, 8, 16)))
    # the mean's slice is a strided view only when it splits a dim after the first (the tokens)
    backward = [n for n in got[2].nodes if n.op == "layer_norm_backward"]
    assert any(isinstance(s, Split) and s.dim > 0 for n in backward for s in n.in_sbps[2]), \
        "the selection no longer splits the norm's backward on the tokens: this test lost the case it is about"


CASES = {
    "colwise+whole": (P2, {"a": (S0,)}, (B,)),
    "rowwise+whole": (P2, {"a": (S1,)}, (B,)),  # a's output P(sum), b's B
    "colwise+rowwise": (P2, {"a": (S0,), "b": (S1,)}, (B,)),
    "whole+whole": (P2, {}, (B,)),
    "2d-tp-colwise": (P22, {"a": (B, S0)}, (B, B)),
    "2d-dp-tp-rowwise": (P22, {"a": (B, S1)}, (S0, B)),  # batch split on the data axis
    "2d-tp-both": (P22, {"a": (S0, S0), "b": (B, S1)}, (B, B)),
}


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_differently_laid_out_readers_of_a_norm_match_one_device(case: str, norm: str) -> None:
    assert_same(train(norm, (2, 8, 16), CASES[case]), train(norm, (2, 8, 16)))
