"""Loss modules over the functional losses."""

from __future__ import annotations

from ..ops import functional as F
from ..tensor import Tensor
from .module import Module

_REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction: str, name: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name} reduction must be one of {_REDUCTIONS}, but got {reduction!r}")
    return reduction


class CrossEntropyLoss(Module):
    """Softmax cross entropy of logits (N, C) or (N, C, ...) against class indices."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        self.reduction = _check_reduction(reduction, "CrossEntropyLoss")

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits, target, self.ignore_index, self.reduction, self.label_smoothing)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


class MSELoss(Module):
    """Mean (or summed) squared error."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction, "MSELoss")

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(input, target, self.reduction)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"
