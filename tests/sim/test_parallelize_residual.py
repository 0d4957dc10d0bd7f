"""Pipeline stages across a residual added in the parent's forward (``x = x + blk(x)``), on virtual ranks.

``x`` sits on the earlier stage and ``blk(x)`` on the later one: the add moves ``x`` to the later stage (SBP
kept, the gradient moves back), in eager mode and in nn.Graph's traced 1F1B plan, with no change to the user's
model. Both models here are written for one device and train as one device does (rtol 1e-4). A placement
mismatch outside any pipeline still raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow.errors import OpError
from sbpflow.ops import functional as F
from sbpflow.placement import Placement

RTOL, ATOL = 1e-4, 1e-6
STEPS = 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ResidualMLP(nn.Module):
    """A hand-written net whose residuals are added by the parent, not by the blocks."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                     for _ in range(depth)])
        self.head = nn.Linear(width, 5)

    def forward(self, x: Any) -> Any:
        x = self.inp(x)
        for blk in self.blocks:
            x = x + blk(x)
        return self.head(x)


class SkipCNN(nn.Module):
    """ResNet-like: conv-ReLU-conv bodies in a list, the identity skip added in the parent's forward.

    No BatchNorm: 1F1B runs micro-batches, whose batch statistics are not the full batch's (nn.Graph refuses
    that), whatever the stages."""

    def __init__(self, channels: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bodies = nn.ModuleList([nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                                                   nn.Conv2d(channels, channels, 3, padding=1))
                                     for _ in range(depth)])
        self.pool, self.flatten = nn.AdaptiveAvgPool2d(1), nn.Flatten()
        self.head = nn.Linear(channels, 5)

    def forward(self, x: Any) -> Any:
        h = self.stem(x)
        for body in self.bodies:
            h = F.relu(h + body(h))
        return self.head(self.flatten(self.pool(h)))


def _vectors(step: int) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(4, 6, generator=g).numpy(), torch.randint(0, 5, (4,), generator=g).numpy()


def _images(step: int) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 3, 6, 6, generator=g).numpy(), torch.randint(0, 5, (4,), generator=g).numpy()


MODELS: dict[str, tuple[Callable[[], Any], Callable[[int], tuple[np.ndarray, np.ndarray]]]] = {
    "mlp": (ResidualMLP, _vectors),
    "cnn": (SkipCNN, _images),
}
LAYOUTS = {"pp2": {"pipeline": 2}, "dp2xpp2": {"data": 2, "pipeline": 2}}


class Step(nn.Graph):
    def __init__(self, model: Any, opt: Any) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(2)  # 1F1B over 2 micro-batches

    def build(self, x: Any, y: Any) -> Any:
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def train(name: str, parallel: dict[str, Any] | None, graph: bool = False
          ) -> tuple[list[float], dict[str, np.ndarray]]:
    factory, batch = MODELS[name]
    sbpflow.manual_seed(0)
    model = factory()
    strategy = sbpflow.parallelize(model, **parallel) if parallel is not None else None
    opt = sbpflow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = Step(model, opt) if graph else None
    losses = []
    for i in range(STEPS):
        x, y = batch(i)
        xt, yt = strategy.shard_inputs(x, y) if strategy is not None else (sbpflow.tensor(x), sbpflow.tensor(y))
        if step is not None:
            losses.append(float(step(xt, yt).item()))
            continue
        opt.zero_grad()
        loss = F.cross_entropy(model(xt), yt)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_parent_added_residual_trains_as_one_device(name: str, layout: str, graph: bool) -> None:
    want = train(name, None)
    got = train(name, LAYOUTS[layout], graph=graph)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    assert sorted(got[1]) == sorted(want[1])
    for n, value in want[1].items():
        np.testing.assert_allclose(got[1][n], value, rtol=RTOL, atol=ATOL, err_msg=n)


def test_stages_are_crossed_in_eager_mode() -> None:
    """Both blocks' outputs come out on the later stage; the input stays where it was."""
    sbpflow.manual_seed(0)
    model = ResidualMLP(depth=2)
    strategy = sbpflow.parallelize(model, pipeline=2)
    x, _ = strategy.shard_inputs(*_vectors(0))
    assert model(x).placement == strategy.stages[1]
    assert x.placement == strategy.stages[0]


def test_mismatch_outside_a_pipeline_still_raises() -> None:
    strategy = sbpflow.parallelize(ResidualMLP(depth=2), pipeline=2)  # a pipeline on ranks 0 and 1
    b = sbpflow.sbp.broadcast
    first, last = (sbpflow.ones(2, 3, placement=p, sbp=(b,) * p.ndim) for p in strategy.stages)
    with pytest.raises(OpError, match="needs all inputs on one placement"):  # its stages, outside its forward
        F.add(first, last)
    a = sbpflow.ones(2, 3, placement=Placement("cpu", [0]), sbp=b)
    c = sbpflow.ones(2, 3, placement=Placement("cpu", [5]), sbp=b)
    with pytest.raises(OpError, match="needs all inputs on one placement"):
        F.add(a, c)
    d = sbpflow.ones(2, 3, placement=Placement("cpu", [0, 1]), sbp=b)  # ranks of the stages, not a stage
    with pytest.raises(OpError, match="needs all inputs on one placement"):
        F.add(a, d)
