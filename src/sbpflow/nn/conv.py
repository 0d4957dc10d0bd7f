"""Convolution and pooling layers over (N, C, H, W) inputs."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ShapeError
from ..ops import functional as F
from ..placement import Placement
from ..tensor import Tensor
from . import init
from ._build import empty_param, weight_and_bias
from .module import Module


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    pair = tuple(int(n) for n in v)
    if len(pair) != 2:
        raise ShapeError(f"expected an int or a pair of ints, but got {v!r}")
    return pair  # type: ignore[return-value]


class Conv2d(Module):
    """2-D convolution with weight (out, in / groups, kh, kw); torch's default init (kaiming-uniform a=sqrt(5))."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int], stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True, *,
                 placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ShapeError(f"Conv2d needs in_channels ({in_channels}) and out_channels ({out_channels}) divisible "
                             f"by groups ({groups})")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.dilation = _pair(kernel_size), _pair(stride), _pair(dilation)
        self.padding = padding if isinstance(padding, str) else _pair(padding)
        shape = (out_channels, in_channels // groups) + self.kernel_size
        weight_and_bias(self, shape, bias, placement, sbp, "Conv2d", dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.default_linear_(self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        return s + f", bias={self.bias is not None}"


class MaxPool2d(Module):
    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                 ceil_mode: bool = False) -> None:
        super().__init__()
        self.kernel_size, self.padding, self.dilation = _pair(kernel_size), _pair(padding), _pair(dilation)
        self.stride = self.kernel_size if stride is None else _pair(stride)
        self.ceil_mode = ceil_mode

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(Module):
    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True) -> None:
        super().__init__()
        self.kernel_size, self.padding = _pair(kernel_size), _pair(padding)
        self.stride = self.kernel_size if stride is None else _pair(stride)
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size: Any) -> None:
        super().__init__()
        self.output_size = _pair(output_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.adaptive_avg_pool2d(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class Conv1d(Module):
    """1-D convolution with weight (out, in / groups, k), run as a 2-D one over a height of 1 (torch's default init)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: Any = 0,
                 dilation: int = 1, groups: int = 1, bias: bool = True, *, placement: Placement | None = None,
                 sbp: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ShapeError(f"Conv1d needs in_channels ({in_channels}) and out_channels ({out_channels}) divisible "
                             f"by groups ({groups})")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.dilation = _single(kernel_size), _single(stride), _single(dilation)
        self.padding = padding if isinstance(padding, str) else _single(padding)
        weight_and_bias(self, (out_channels, in_channels // groups) + self.kernel_size, bias, placement, sbp,
                        "Conv1d", dtype)
        init.default_linear_(self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        padding = self.padding if isinstance(self.padding, str) else (0, self.padding[0])
        y = F.conv2d(F.unsqueeze(x, 2), F.unsqueeze(self.weight, 2), self.bias, (1, self.stride[0]), padding,
                     (1, self.dilation[0]), self.groups)  # (N, out, 1, L'), global
        return F.squeeze(y, 2)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"


def _single(v: int | tuple[int, ...]) -> tuple[int]:
    return (int(v),) if isinstance(v, int) else (int(tuple(v)[0]),)


class ConvTranspose2d(Module):
    """2-D transposed convolution with weight (in, out / groups, kh, kw); torch's default init."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int], stride: Any = 1,
                 padding: Any = 0, output_padding: Any = 0, groups: int = 1, bias: bool = True, dilation: Any = 1, *,
                 placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ShapeError(f"ConvTranspose2d needs in_channels ({in_channels}) and out_channels ({out_channels}) "
                             f"divisible by groups ({groups})")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.dilation = _pair(kernel_size), _pair(stride), _pair(dilation)
        self.padding, self.output_padding = _pair(padding), _pair(output_padding)
        weight_and_bias(self, (in_channels, out_channels // groups) + self.kernel_size, False, placement, sbp,
                        "ConvTranspose2d", dtype)
        self.register_parameter("bias", None)
        if bias:
            self.bias = empty_param((out_channels,), "bias", placement, sbp, "ConvTranspose2d", dtype)
        init.default_linear_(self.weight, self.bias)  # torch's fan_in here is weight.shape[1] * kh * kw, as ours

    def forward(self, x: Tensor) -> Tensor:
        return F.conv_transpose2d(x, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                                  self.groups, self.dilation)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
