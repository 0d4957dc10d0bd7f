"""Normalization layers: LayerNorm, RMSNorm, BatchNorm1d/2d (weights ones, biases zeros)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..autograd import no_grad
from ..creation import zeros
from ..errors import ShapeError
from ..ops import functional as F
from ..placement import Placement
from ..tensor import Tensor
from . import init
from ._build import empty_buffer, empty_param, layout_for
from .module import Module, check_input_layout


def _shape_tuple(shape: int | Sequence[int]) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, int) else tuple(int(n) for n in shape)


class LayerNorm(Module):
    """Normalises over the last ``len(normalized_shape)`` dims, then scales and shifts elementwise."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, placement: Placement | None = None, sbp: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.normalized_shape = _shape_tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = empty_param(self.normalized_shape, "weight", placement, sbp, "LayerNorm", dtype)
            if bias:
                self.bias = empty_param(self.normalized_shape, "bias", placement, sbp, "LayerNorm", dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(Module):
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dims; ``eps=None`` is the dtype's epsilon (as torch)."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None, elementwise_affine: bool = True,
                 *, placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.normalized_shape = _shape_tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self.register_parameter("weight", None)
        if elementwise_affine:
            self.weight = empty_param(self.normalized_shape, "weight", placement, sbp, "RMSNorm", dtype)
            init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return F.rms_norm(x, self.normalized_shape, self.weight, eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class _BatchNorm(Module):
    """Batch statistics over every dim but the channel dim (1); running statistics as buffers.

    Under data parallelism (input split on the batch dim) the op reduces the
    statistics over all shards, so they equal single-device ones.
    """

    expected_ndims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, placement: Placement | None = None, sbp: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        name = type(self).__name__
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if affine:
            self.weight = empty_param((num_features,), "weight", placement, sbp, name, dtype)
            self.bias = empty_param((num_features,), "bias", placement, sbp, name, dtype)
        if track_running_stats:
            self.register_buffer("running_mean", empty_buffer((num_features,), "running_mean", placement, name, dtype))
            self.register_buffer("running_var", empty_buffer((num_features,), "running_var", placement, name, dtype))
            self.register_buffer("num_batches_tracked", zeros(
                (), dtype=torch.int64, **layout_for("num_batches_tracked", placement, None, name)))
        else:
            for buf in ("running_mean", "running_var", "num_batches_tracked"):
                self.register_buffer(buf, None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with no_grad():
            if self.track_running_stats:
                init.zeros_(self.running_mean)
                init.ones_(self.running_var)
                if not self.num_batches_tracked.is_meta:  # meta_init: metadata only, nothing to zero
                    self.num_batches_tracked.zero_()
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim not in self.expected_ndims:
            raise ShapeError(f"{type(self).__name__} needs a {' or '.join(map(str, self.expected_ndims))}-D input, "
                             f"but got {x._describe()}")
        check_input_layout(self, x)  # before num_batches_tracked and the running statistics change
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            with no_grad():
                self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch
                factor = 1.0 / float(self.num_batches_tracked.item())
        # Without running statistics (buffers None) batch statistics are used even in eval, as in torch.
        use_batch_stats = self.training or not self.track_running_stats
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, use_batch_stats, factor,
                            self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """BatchNorm over (N, C) or (N, C, L) inputs."""

    expected_ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """BatchNorm over (N, C, H, W) inputs."""

    expected_ndims = (4,)


class GroupNorm(Module):
    """Normalises each of ``num_groups`` channel groups of (N, C, *) over its channels and positions, then scales and
    shifts per channel (see ``functional.group_norm``: a channel split reduces across the ranks of a group)."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, *,
                 placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_channels % num_groups:
            raise ShapeError(f"GroupNorm needs num_channels ({num_channels}) divisible by num_groups ({num_groups})")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if affine:
            self.weight = empty_param((num_channels,), "weight", placement, sbp, "GroupNorm", dtype)
            self.bias = empty_param((num_channels,), "bias", placement, sbp, "GroupNorm", dtype)
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
