"""A small ResNet-style CNN and a training loop for data-parallel equivalence checks (BatchNorm's statistics
are reduced over every shard, so a data-parallel step equals the single-device step).

>>> import sbpflow
>>> from sbpflow.models.cnn import ResNet
>>> ResNet(channels=4, num_classes=3)(sbpflow.randn(2, 3, 8, 8)).shape
torch.Size([2, 3])
"""

from __future__ import annotations

from typing import Any

import torch

import sbpflow
from sbpflow import nn
from sbpflow.ops import functional as F
from sbpflow.placement import Placement
from sbpflow.tensor import Tensor


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus a shortcut (identity, or 1x1 conv-BN when the shape changes), then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))  # (N, out, H / stride, W / stride), logical
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    """stem (conv-BN-ReLU) -> block(c, c) -> block(c, 2c, stride 2, 1x1 conv-BN shortcut) -> avg pool ->
    flatten -> linear."""

    # tensor parallel: each block's first conv split by output channels, its second by input channels (a
    # partial sum before BatchNorm), the classifier by classes
    parallel_plan = {"layer*.conv1": "colwise", "layer*.conv2": "rowwise", "head": "colwise"}

    def __init__(self, in_channels: int = 3, channels: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        self.layer1 = BasicBlock(channels, channels)
        self.layer2 = BasicBlock(channels, 2 * channels, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.head = nn.Linear(2 * channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.layer2(self.layer1(self.stem(x)))  # (N, 2c, H / 2, W / 2), logical
        return self.head(self.flatten(self.pool(h)))  # (N, num_classes)


def _batch(step: int, batch: int, image: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic batch for ``step`` (the same on every process)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, 3, image, image, generator=g), torch.randint(0, classes, (batch,), generator=g)


def train_cnn(placement: Placement | None, steps: int, *, batch: int = 8, image: int = 8, channels: int = 4,
              classes: int = 5, lr: float = 0.05, momentum: float = 0.9, seed: int = 0,
              graph: bool = False) -> tuple[list[float], dict[str, Any]]:
    """Trains :class:`ResNet` for ``steps`` SGD-momentum steps; returns (losses, parameters as NumPy arrays).

    With ``placement=None`` everything is local (single device). With a
    placement the model is data parallel: parameters and buffers broadcast,
    each batch split on dim 0. The same seed gives the same initial weights
    either way, so the two runs should agree to float32 rounding; this is the
    function a real-process test calls with its own placement.
    """
    sbpflow.manual_seed(seed)
    model = ResNet(channels=channels, num_classes=classes)
    if placement is not None:
        model.to_global(placement)
    opt = sbpflow.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    compiled = _TrainStep(model, opt, loss_fn) if graph else None
    for step in range(steps):
        images, labels = _batch(step, batch, image, classes)
        x, y = _place(images, placement), _place(labels, placement)
        if compiled is not None:
            losses.append(float(compiled(x, y).item()))
            continue
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    state = {name: t.numpy() for name, t in model.state_dict().items()}
    return losses, state


class _TrainStep(nn.Graph):
    """The same step compiled with nn.Graph (running statistics are variables updated by the plan)."""

    def __init__(self, model: ResNet, opt: Any, loss_fn: Any) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.add_optimizer(opt)

    def build(self, x: Tensor, y: Tensor) -> Tensor:
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def _place(value: torch.Tensor, placement: Placement | None) -> Tensor:
    if placement is None:
        return sbpflow.tensor(value)
    sbp = (sbpflow.sbp.split(0),) + (sbpflow.sbp.broadcast,) * (placement.ndim - 1)
    return sbpflow.tensor(value, placement=placement, sbp=sbp)


__all__ = ["BasicBlock", "ResNet", "train_cnn"]
