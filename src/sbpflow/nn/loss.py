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
    """Softmax cross entropy of logits (N, C) or (N, C, ...) against class indices or class probabilities.

    ``weight`` (one entry per class) is a buffer, so ``to_global`` lays it out with the model.
    """

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        self.reduction = _check_reduction(reduction, "CrossEntropyLoss")
        self.register_buffer("weight", weight)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)

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


class NLLLoss(Module):
    """Negative log likelihood of log-probabilities (N, C) against class indices."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean") -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = _check_reduction(reduction, "NLLLoss")
        self.register_buffer("weight", weight)

    def forward(self, logp: Tensor, target: Tensor) -> Tensor:
        return F.nll_loss(logp, target, weight=self.weight, ignore_index=self.ignore_index, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


class BCEWithLogitsLoss(Module):
    """Binary cross entropy of logits, in the stable form (see ``functional.binary_cross_entropy_with_logits``)."""

    def __init__(self, weight: Tensor | None = None, reduction: str = "mean", pos_weight: Tensor | None = None) -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction, "BCEWithLogitsLoss")
        self.register_buffer("weight", weight)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(logits, target, weight=self.weight, reduction=self.reduction,
                                                  pos_weight=self.pos_weight)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"
