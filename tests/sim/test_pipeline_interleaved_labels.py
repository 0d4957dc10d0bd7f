"""Interleaved 1F1B with labels moved to the last placement inside build() (found by the program generator)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import sbpflow
import sbpflow.nn.functional as F
from sbpflow import nn
from sbpflow import sbp as S


class Alternating(nn.Module):
    """Four Linear blocks on placements p0, p1, p0, p1: two virtual stages on each."""

    def __init__(self, p0: Any, p1: Any) -> None:
        super().__init__()
        self.places = [p0, p1, p0, p1]
        self.layers = nn.ModuleList([nn.Linear(4, 4, placement=p, sbp=S.broadcast) for p in self.places])

    def forward(self, x: Any) -> Any:
        for p, layer in zip(self.places, self.layers, strict=True):
            x = layer(x.to_global(p, S.split(0))).tanh()
        return x


def _run(p0: Any, p1: Any, graph: bool) -> tuple[list[float], list[np.ndarray]]:
    sbpflow.manual_seed(0)
    model = Alternating(p0, p1)
    opt = sbpflow.optim.SGD(model.parameters(), lr=0.1)

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(2)
            self.config.set_pipeline_schedule("interleaved_1f1b")

        def build(self, x: Any, y: Any) -> Any:
            loss = F.cross_entropy(self.model(x), y.to_global(p1, S.split(0)))  # the labels move to the last stage
            loss.backward()
            return loss

    step, gen, losses = Step(), torch.Generator().manual_seed(1), []
    for _ in range(2):
        x = sbpflow.tensor(torch.randn(4, 4, generator=gen), placement=p0, sbp=S.split(0))
        y = sbpflow.tensor(torch.randint(0, 4, (4,), generator=gen), placement=p0, sbp=S.split(0))
        if graph:
            losses.append(float(step(x, y).numpy()))
        else:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y.to_global(p1, S.split(0)))
            loss.backward()
            opt.step()
            losses.append(float(loss.numpy()))
    return losses, [p.detach().numpy() for p in model.parameters()]


def test_interleaved_backward_follows_the_gradients_not_the_moved_labels() -> None:
    """The labels, moved from the first placement to the last, were staged on that placement's first virtual stage;
    the loss's backward read them, so the whole backward chain was put there and lowered below stage 0 (KeyError
    ('B', -1, 0) at compile). A backward node now follows its gradient inputs."""
    p0, p1 = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    one = sbpflow.placement("cpu", [0])
    want, got = _run(one, one, graph=False), _run(p0, p1, graph=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
