"""2-D convolution and pooling on (N, C, H, W) shards: data, channel and partial signatures (tables at the rules).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as TF
from torch.nn import grad as torch_grad

from .._layout import box_shape
from ..errors import DTypeError, ShapeError
from ..sbp import Partial, Split, broadcast
from ..tensor import Tensor
from . import _rules as R
from .reduction import sum_
from .schema import Meta, ShardCtx, Sig, op

__all__ = ["conv2d", "conv_transpose2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "interpolate"]

B = broadcast
PSUM, PMAX = Partial("sum"), Partial("max")
Pair = tuple[int, int]


def _pair(name: str, what: str, value: Any) -> Pair:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in pair):
        raise ShapeError(f"{name} needs {what} as an int or a pair of ints, but got {value!r}")
    return pair  # type: ignore[return-value]


def _meta_shape(name: str, fn: Any, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    """Output shape from torch's own shape rules, run on meta tensors (no data, no compute)."""
    try:
        return tuple(fn(*(torch.empty(s, device="meta") for s in shapes)).shape)
    except RuntimeError as e:
        raise ShapeError(f"{name} cannot take input {list(shapes[0])}: {str(e).splitlines()[0]}") from None


# -- conv2d ----------------------------------------------------------------------------------------


def _conv_meta(x: Meta, w: Meta, *bias: Meta, stride: Pair, padding: Pair, dilation: Pair, groups: int) -> Meta:
    if x.ndim != 4 or w.ndim != 4:
        raise ShapeError(f"conv2d needs input (N, C, H, W) and weight (O, C/groups, kH, kW), but got input "
                         f"{list(x.shape)} and weight {list(w.shape)}")
    if x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        raise ShapeError(f"conv2d needs input channels = weight.shape[1] * groups and output channels divisible by "
                         f"groups, but got input {list(x.shape)} ({x.shape[1]} channels), weight {list(w.shape)}, "
                         f"groups {groups}")
    if bias and tuple(bias[0].shape) != (w.shape[0],):
        raise ShapeError(f"conv2d needs bias of shape [{w.shape[0]}], but got {list(bias[0].shape)}")
    R.check_dtypes_equal("conv2d", x, w, *bias)
    if not x.dtype.is_floating_point:
        raise DTypeError(f"conv2d needs floating-point tensors, but got {x.dtype}")
    shape = _meta_shape("conv2d", lambda a, b: TF.conv2d(a, b, None, stride, padding, dilation, groups),
                        x.shape, w.shape)
    return Meta(shape, x.dtype)


# conv2d signatures (x, weight, bias -> out; channel splits only for groups=1):
#
#   x        weight   bias     out       why
#   S(0)     B        B        S(0)      data parallel: samples are independent
#   B        S(0)     S(0)     S(1)      output channels: each rank owns some filters
#   S(1)     S(1)     P(sum)   P(sum)    input channels: the contraction, bias counted once
#   P(sum)   B        P(sum)   P(sum)    linear in x
#   B        P(sum)   P(sum)   P(sum)    linear in weight
#   B        B        B        B
#
# The gradients are ops of their own (torch's backward kernels on shards) with the matching signatures: the
# weight gradient of x S(0), weight B is P(sum), one all-reduce to reach the weight's B.
def _conv_sigs(x: Meta, w: Meta, *bias: Meta, outs: tuple[Meta, ...], groups: int, **_: Any) -> list[Sig]:
    def sig(xs: Any, ws: Any, bs: Any, out: Any) -> Sig:
        return Sig((xs, ws, bs) if bias else (xs, ws), (out,))

    sigs = [sig(B, B, B, B), sig(Split(0), B, B, Split(0)), sig(PSUM, B, PSUM, PSUM), sig(B, PSUM, PSUM, PSUM)]
    if groups == 1:
        sigs += [sig(B, Split(0), Split(0), Split(1)), sig(Split(1), Split(1), PSUM, PSUM)]
    return sigs


@op("conv2d", meta=_conv_meta, sbp=_conv_sigs)
def _conv2d(x: torch.Tensor, w: torch.Tensor, *bias: torch.Tensor, stride: Pair, padding: Pair, dilation: Pair,
            groups: int) -> torch.Tensor:
    if x.shape[1] == 0 and groups == 1:
        # A rank holding no input channel (S(1) x S(1) -> P(sum), 2 channels over 3 ranks) adds nothing but its
        # bias piece; torch gives (N, 0, H, W) for 0 channels, so run the kernel on one zero channel instead.
        n, _, h, wd = x.shape  # local (N, 0, H, W)
        x = x.new_zeros((n, 1, h, wd))
        w = w.new_zeros((w.shape[0], 1) + tuple(w.shape[2:]))
    if w.shape[0] == 0:
        # A rank holding no output channel (B x S(0) -> S(1), 2 channels over 3 ranks): its piece is (N, 0, H', W'),
        # which torch's kernel refuses to make from an empty weight; make one channel and keep none of it.
        one = w.new_zeros((1,) + tuple(w.shape[1:]))
        return TF.conv2d(x, one, None, stride, padding, dilation, groups)[:, :0]
    return TF.conv2d(x, w, bias[0] if bias else None, stride, padding, dilation, groups)


@_conv2d.grad
def _conv2d_grad(ctx: Any, dy: Any) -> Any:
    x, w = ctx.inputs[:2]
    needs = ctx.needs_input_grad
    dx = conv2d_input_grad(dy, w, input_shape=tuple(x.shape), **ctx.attrs) if needs[0] else None
    dw = conv2d_weight_grad(dy, x, weight_shape=tuple(w.shape), **ctx.attrs) if needs[1] else None
    if len(ctx.inputs) == 2:
        return dx, dw
    return dx, dw, sum_(dy, dim=(0, 2, 3)) if needs[2] else None


def _input_grad_meta(dy: Meta, w: Meta, input_shape: tuple[int, ...], **_: Any) -> Meta:
    return Meta(input_shape, dy.dtype)


def _input_grad_sigs(dy: Meta, w: Meta, outs: tuple[Meta, ...], groups: int, **_: Any) -> list[Sig]:
    sigs = [Sig((B, B), (B,)), Sig((Split(0), B), (Split(0),)), Sig((PSUM, B), (PSUM,)), Sig((B, PSUM), (PSUM,))]
    if groups == 1:
        sigs += [Sig((Split(1), Split(0)), (PSUM,)), Sig((B, Split(1)), (Split(1),))]
    return sigs


@op("conv2d_input_grad", meta=_input_grad_meta, sbp=_input_grad_sigs, shard_aware=True, differentiable=False)
def conv2d_input_grad(ctx: ShardCtx, dy: torch.Tensor, w: torch.Tensor, input_shape: tuple[int, ...], stride: Pair,
                      padding: Pair, dilation: Pair, groups: int) -> torch.Tensor:
    """d(conv2d)/d(input) on the shard: torch's backward kernel for this shard's input box."""
    local_shape = box_shape(ctx.out_boxes[0])
    if w.shape[0] == 0 or 0 in local_shape:  # a shard of no output channel (S(1) x S(0) -> P(sum)) adds nothing
        return dy.new_zeros(local_shape)
    return torch_grad.conv2d_input(local_shape, w, dy, stride, padding, dilation, groups)


def _weight_grad_meta(dy: Meta, x: Meta, weight_shape: tuple[int, ...], **_: Any) -> Meta:
    return Meta(weight_shape, dy.dtype)


def _weight_grad_sigs(dy: Meta, x: Meta, outs: tuple[Meta, ...], groups: int, **_: Any) -> list[Sig]:
    sigs = [Sig((B, B), (B,)), Sig((Split(0), Split(0)), (PSUM,)), Sig((PSUM, B), (PSUM,)), Sig((B, PSUM), (PSUM,))]
    if groups == 1:
        sigs += [Sig((Split(1), B), (Split(0),)), Sig((B, Split(1)), (Split(1),))]
    return sigs


@op("conv2d_weight_grad", meta=_weight_grad_meta, sbp=_weight_grad_sigs, shard_aware=True, differentiable=False)
def conv2d_weight_grad(ctx: ShardCtx, dy: torch.Tensor, x: torch.Tensor, weight_shape: tuple[int, ...], stride: Pair,
                       padding: Pair, dilation: Pair, groups: int) -> torch.Tensor:
    """d(conv2d)/d(weight) on the shard, summed over the shard's samples (a partial sum under a batch split)."""
    local_shape = box_shape(ctx.out_boxes[0])
    if x.shape[0] == 0 or 0 in local_shape:  # an empty batch shard adds nothing; a weight shard of no channel is empty
        return x.new_zeros(local_shape)
    return torch_grad.conv2d_weight(x, local_shape, dy, stride, padding, dilation, groups)


def _conv_padding(padding: Any, w: Tensor, dilation: Pair) -> Pair:
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, w.shape[2:], strict=True)]
        if any(t % 2 for t in total):
            raise ShapeError(f"conv2d padding='same' needs an odd effective kernel size, but got weight "
                             f"{w._describe()} with dilation {dilation}; pad explicitly instead")
        return (total[0] // 2, total[1] // 2)
    return _pair("conv2d", "padding", padding)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """2-D convolution of ``x`` (N, C, H, W) with ``weight`` (O, C/groups, kH, kW), as torch's.

    ``padding`` is an int, a pair, ``"valid"`` or ``"same"`` (odd effective kernels).

    >>> import sbpflow
    >>> x, w = sbpflow.randn(2, 3, 8, 8), sbpflow.randn(4, 3, 3, 3)
    >>> sbpflow.functional.conv2d(x, w, stride=2, padding=1).shape
    torch.Size([2, 4, 4, 4])
    """
    dilation = _pair("conv2d", "dilation", dilation)
    attrs = dict(stride=_pair("conv2d", "stride", stride), padding=_conv_padding(padding, weight, dilation),
                 dilation=dilation, groups=int(groups))
    args = (x, weight) if bias is None else (x, weight, bias)
    return _conv2d(*args, **attrs)


# -- pooling ---------------------------------------------------------------------------------------


# Pooling works per (sample, channel) plane, so splits of those dims pass through; P(max) passes through max
# pooling, P(sum) through the (linear) average poolings.
def _pool_sigs(partial: Partial):  # type: ignore[no-untyped-def]
    """Batch and channel dims (all but the last two) pass through; ``partial`` passes through too."""

    def sigs(x: Meta, outs: tuple[Meta, ...], **_: Any) -> list[Sig]:
        out = [Sig((B,), (B,)), Sig((partial,), (partial,))]
        return out + [Sig((Split(d),), (Split(d),)) for d in range(x.ndim - 2)]

    return sigs


def _check_pool_input(name: str, x: Meta) -> None:
    if x.ndim not in (3, 4):
        raise ShapeError(f"{name} needs an input of shape (N, C, H, W) or (C, H, W), but got {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise DTypeError(f"{name} needs a floating-point input, but got {x.dtype}")


def _max_pool_meta(x: Meta, kernel_size: Pair, stride: Pair, padding: Pair, dilation: Pair, ceil_mode: bool) -> Meta:
    _check_pool_input("max_pool2d", x)
    fn = lambda a: TF.max_pool2d(a, kernel_size, stride, padding, dilation, ceil_mode)  # noqa: E731
    return Meta(_meta_shape("max_pool2d", fn, x.shape), x.dtype)


@op("max_pool2d", meta=_max_pool_meta, sbp=_pool_sigs(PMAX))
def _max_pool2d(x: torch.Tensor, kernel_size: Pair, stride: Pair, padding: Pair, dilation: Pair,
                ceil_mode: bool) -> torch.Tensor:
    return TF.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)


@_max_pool2d.grad
def _max_pool2d_grad(ctx: Any, dy: Any) -> Any:
    return (max_pool2d_backward(dy, ctx.inputs[0], **ctx.attrs),)


def _backward_meta(dy: Meta, x: Meta, **_: Any) -> Meta:
    return x


def _max_pool_backward_sigs(dy: Meta, x: Meta, outs: tuple[Meta, ...], **_: Any) -> list[Sig]:
    sigs = [Sig((B, B), (B,)), Sig((PSUM, B), (PSUM,))]  # linear in dy once x (the arg-max) is whole
    return sigs + [Sig((Split(d), Split(d)), (Split(d),)) for d in range(x.ndim - 2)]


@op("max_pool2d_backward", meta=_backward_meta, sbp=_max_pool_backward_sigs, differentiable=False)
def max_pool2d_backward(dy: torch.Tensor, x: torch.Tensor, kernel_size: Pair, stride: Pair, padding: Pair,
                        dilation: Pair, ceil_mode: bool) -> torch.Tensor:
    """Routes ``dy`` to each window's arg-max (recomputed from ``x`` on the shard)."""
    _, indices = TF.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)
    return torch.ops.aten.max_pool2d_with_indices_backward(dy, x, kernel_size, stride, padding, dilation, ceil_mode,
                                                           indices)


def max_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
               ceil_mode: bool = False) -> Tensor:
    """Max over ``kernel_size`` windows of each (sample, channel) plane, as torch's (stride defaults to the kernel).

    >>> import sbpflow
    >>> sbpflow.functional.max_pool2d(sbpflow.randn(2, 3, 8, 8), 2).shape
    torch.Size([2, 3, 4, 4])
    """
    kernel = _pair("max_pool2d", "kernel_size", kernel_size)
    step = kernel if stride is None or stride == () else _pair("max_pool2d", "stride", stride)
    return _max_pool2d(x, kernel_size=kernel, stride=step, padding=_pair("max_pool2d", "padding", padding),
                       dilation=_pair("max_pool2d", "dilation", dilation), ceil_mode=bool(ceil_mode))


def _avg_pool_meta(x: Meta, kernel_size: Pair, stride: Pair, padding: Pair, ceil_mode: bool,
                   count_include_pad: bool) -> Meta:
    _check_pool_input("avg_pool2d", x)
    fn = lambda a: TF.avg_pool2d(a, kernel_size, stride, padding, ceil_mode, count_include_pad)  # noqa: E731
    return Meta(_meta_shape("avg_pool2d", fn, x.shape), x.dtype)


@op("avg_pool2d", meta=_avg_pool_meta, sbp=_pool_sigs(PSUM))
def _avg_pool2d(x: torch.Tensor, kernel_size: Pair, stride: Pair, padding: Pair, ceil_mode: bool,
                count_include_pad: bool) -> torch.Tensor:
    return TF.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad)


@_avg_pool2d.grad
def _avg_pool2d_grad(ctx: Any, dy: Any) -> Any:
    return (avg_pool2d_backward(dy, input_shape=tuple(ctx.inputs[0].shape), **ctx.attrs),)


def _shape_meta(dy: Meta, input_shape: tuple[int, ...], **_: Any) -> Meta:
    return Meta(input_shape, dy.dtype)


@op("avg_pool2d_backward", meta=_shape_meta, sbp=_pool_sigs(PSUM), shard_aware=True, differentiable=False)
def avg_pool2d_backward(ctx: ShardCtx, dy: torch.Tensor, input_shape: tuple[int, ...], kernel_size: Pair,
                        stride: Pair, padding: Pair, ceil_mode: bool, count_include_pad: bool) -> torch.Tensor:
    """Spreads ``dy`` evenly over each window; only the shard's input shape matters, not its values."""
    shape_only = dy.new_empty(box_shape(ctx.out_boxes[0]))
    return torch.ops.aten.avg_pool2d_backward(dy, shape_only, kernel_size, stride, padding, ceil_mode,
                                              count_include_pad, None)


def avg_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
               count_include_pad: bool = True) -> Tensor:
    """Mean over ``kernel_size`` windows of each (sample, channel) plane, as torch's.

    >>> import sbpflow
    >>> sbpflow.functional.avg_pool2d(sbpflow.randn(2, 3, 8, 8), 3, stride=2, padding=1).shape
    torch.Size([2, 3, 4, 4])
    """
    kernel = _pair("avg_pool2d", "kernel_size", kernel_size)
    step = kernel if stride is None or stride == () else _pair("avg_pool2d", "stride", stride)
    return _avg_pool2d(x, kernel_size=kernel, stride=step, padding=_pair("avg_pool2d", "padding", padding),
                       ceil_mode=bool(ceil_mode), count_include_pad=bool(count_include_pad))


def _adaptive_meta(x: Meta, output_size: Pair) -> Meta:
    _check_pool_input("adaptive_avg_pool2d", x)
    return Meta(x.shape[:-2] + output_size, x.dtype)


@op("adaptive_avg_pool2d", meta=_adaptive_meta, sbp=_pool_sigs(PSUM))
def _adaptive_avg_pool2d(x: torch.Tensor, output_size: Pair) -> torch.Tensor:
    return TF.adaptive_avg_pool2d(x, output_size)


@_adaptive_avg_pool2d.grad
def _adaptive_avg_pool2d_grad(ctx: Any, dy: Any) -> Any:
    return (adaptive_avg_pool2d_backward(dy, input_shape=tuple(ctx.inputs[0].shape)),)


@op("adaptive_avg_pool2d_backward", meta=_shape_meta, sbp=_pool_sigs(PSUM), shard_aware=True, differentiable=False)
def adaptive_avg_pool2d_backward(ctx: ShardCtx, dy: torch.Tensor, input_shape: tuple[int, ...]) -> torch.Tensor:
    """Spreads ``dy`` over each adaptive window; only the shard's input shape matters."""
    shape_only = dy.new_empty(box_shape(ctx.out_boxes[0]))
    return torch.ops.aten._adaptive_avg_pool2d_backward(dy, shape_only)


def adaptive_avg_pool2d(x: Tensor, output_size: Any) -> Tensor:
    """Mean pooling of each (sample, channel) plane to ``output_size`` (an int, a pair; None keeps that size).

    >>> import sbpflow
    >>> sbpflow.functional.adaptive_avg_pool2d(sbpflow.randn(2, 3, 7, 5), (1, None)).shape
    torch.Size([2, 3, 1, 5])
    """
    sizes = (output_size, output_size) if output_size is None or isinstance(output_size, int) else tuple(output_size)
    if len(sizes) != 2 or not all(s is None or (isinstance(s, int) and s > 0) for s in sizes):
        raise ShapeError(f"adaptive_avg_pool2d needs output_size as a positive int, a pair or None, but got "
                         f"{output_size!r}; input {x._describe()}")
    if x.ndim < 2:
        raise ShapeError(f"adaptive_avg_pool2d needs an input of shape (N, C, H, W) or (C, H, W), got {x._describe()}")
    full = tuple(x.shape[-2 + i] if s is None else s for i, s in enumerate(sizes))
    return _adaptive_avg_pool2d(x, output_size=full)


# -- interpolate ---------------------------------------------------------------------------------------------------
#
# Resizing the spatial dims of (N, C, *spatial) is linear in the input and works plane by plane: the batch and channel
# dims may be split, and a P(sum) passes (each piece resized, the pieces still add up). Its gradient is the adjoint
# resize, with the same signatures.


def _interpolate_meta(x: Meta, size: tuple[int, ...], mode: str, align_corners: bool | None) -> Meta:
    if x.ndim != len(size) + 2:
        raise ShapeError(f"interpolate needs (N, C, *spatial) with {len(size)} spatial dims, but got shape "
                         f"{list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise DTypeError(f"interpolate needs a floating-point input, but got {str(x.dtype).replace('torch.', '')}")
    return Meta(x.shape[:2] + tuple(size), x.dtype)


def _interpolate_sigs(x: Meta, outs: tuple[Meta, ...], **_: Any) -> list[Sig]:
    return [Sig((B,), (B,)), Sig((Split(0),), (Split(0),)), Sig((Split(1),), (Split(1),)), Sig((PSUM,), (PSUM,))]


@op("interpolate", meta=_interpolate_meta, sbp=_interpolate_sigs, grad_reads=())
def _interpolate(x: torch.Tensor, size: tuple[int, ...], mode: str, align_corners: bool | None) -> torch.Tensor:
    return TF.interpolate(x, size=size, mode=mode, align_corners=align_corners)


def _interpolate_backward_meta(dy: Meta, input_shape: tuple[int, ...], **_: Any) -> Meta:
    return Meta(tuple(input_shape), dy.dtype)


@op("interpolate_backward", meta=_interpolate_backward_meta, sbp=_interpolate_sigs, shard_aware=True,
    differentiable=False)
def interpolate_backward(ctx: ShardCtx, dy: torch.Tensor, input_shape: tuple[int, ...], size: tuple[int, ...],
                         mode: str, align_corners: bool | None) -> torch.Tensor:
    """The adjoint of the resize on this shard (torch's own backward, through a vjp of its kernel)."""
    shard = torch.zeros(box_shape(ctx.out_boxes[0]), dtype=dy.dtype, device=dy.device)
    adjoint = torch.func.vjp(lambda t: TF.interpolate(t, size=size, mode=mode, align_corners=align_corners), shard)[1]
    return adjoint(dy)[0]


@_interpolate.grad
def _interpolate_grad(ctx: Any, dy: Any) -> Any:
    return (interpolate_backward(dy, input_shape=tuple(ctx.inputs[0].shape), **ctx.attrs),)


def interpolate(x: Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                antialias: bool = False) -> Tensor:
    """torch's F.interpolate by ``size`` or ``scale_factor`` (nearest, linear, bilinear, bicubic, trilinear, area).

    >>> import sbpflow
    >>> sbpflow.nn.functional.interpolate(sbpflow.ones(1, 2, 3, 3), scale_factor=2, mode="bicubic").shape
    torch.Size([1, 2, 6, 6])
    """
    spatial = x.ndim - 2
    if antialias:
        raise ShapeError("interpolate(antialias=True) is not supported; resize without it")
    if size is None:
        if scale_factor is None:
            raise ShapeError("interpolate needs size= or scale_factor=")
        factors = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * spatial
        size = tuple(int(n * f) for n, f in zip(x.shape[2:], factors, strict=True))  # floor, as torch
    size = (size,) * spatial if isinstance(size, int) else tuple(int(n) for n in size)
    return _interpolate(x, size=size, mode=mode, align_corners=align_corners)


# -- conv_transpose2d ----------------------------------------------------------------------------------------------
#
# The transposed convolution is conv2d's input gradient with weight (C_in, C_out / groups, kH, kW): the batch may be
# split, the input channels with the weight's rows give P(sum), the weight's columns give output channels (groups
# 1), and it is linear in the input and in the weight. Its gradients are conv2d (input) and conv2d's weight
# gradient with the roles of input and output swapped.


def _transpose_meta(x: Meta, w: Meta, *bias: Meta, stride: Pair, padding: Pair, output_padding: Pair, groups: int,
                    dilation: Pair) -> Meta:
    if x.ndim != 4 or w.ndim != 4 or x.shape[1] != w.shape[0]:
        raise ShapeError(f"conv_transpose2d needs input (N, C, H, W) and weight (C, O/groups, kH, kW), but got input "
                         f"{list(x.shape)} and weight {list(w.shape)}")
    if bias and tuple(bias[0].shape) != (w.shape[1] * groups,):
        raise ShapeError(f"conv_transpose2d needs bias of shape [{w.shape[1] * groups}], but got "
                         f"{list(bias[0].shape)}")
    R.check_dtypes_equal("conv_transpose2d", x, w, *bias)
    shape = _meta_shape("conv_transpose2d", lambda a, b: TF.conv_transpose2d(a, b, None, stride, padding,
                                                                            output_padding, groups, dilation),
                        x.shape, w.shape)
    return Meta(shape, x.dtype)


def _transpose_sigs(x: Meta, w: Meta, *bias: Meta, outs: tuple[Meta, ...], groups: int, **_: Any) -> list[Sig]:
    def sig(xs: Any, ws: Any, bs: Any, out: Any) -> Sig:
        return Sig((xs, ws, bs) if bias else (xs, ws), (out,))

    sigs = [sig(B, B, B, B), sig(Split(0), B, B, Split(0)), sig(PSUM, B, PSUM, PSUM), sig(B, PSUM, PSUM, PSUM)]
    if groups == 1:
        sigs += [sig(B, Split(1), Split(0), Split(1)), sig(Split(1), Split(0), PSUM, PSUM)]
    return sigs


@op("conv_transpose2d", meta=_transpose_meta, sbp=_transpose_sigs)
def _conv_transpose2d(x: torch.Tensor, w: torch.Tensor, *bias: torch.Tensor, stride: Pair, padding: Pair,
                      output_padding: Pair, groups: int, dilation: Pair) -> torch.Tensor:
    return TF.conv_transpose2d(x, w, bias[0] if bias else None, stride, padding, output_padding, groups, dilation)


@_conv_transpose2d.grad
def _conv_transpose2d_grad(ctx: Any, dy: Any) -> Any:
    x, w = ctx.inputs[:2]
    a = ctx.attrs
    conv = dict(stride=a["stride"], padding=a["padding"], dilation=a["dilation"], groups=a["groups"])
    needs = ctx.needs_input_grad
    dx = _conv2d(dy, w, **conv) if needs[0] else None
    dw = conv2d_weight_grad(x, dy, weight_shape=tuple(w.shape), **conv) if needs[1] else None
    if len(ctx.inputs) == 2:
        return dx, dw
    return dx, dw, sum_(dy, dim=(0, 2, 3)) if needs[2] else None


def conv_transpose2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
                     output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Tensor:
    """2-D transposed convolution of ``x`` (N, C, H, W) with ``weight`` (C, O/groups, kH, kW), as torch's.

    >>> import sbpflow
    >>> sbpflow.functional.conv_transpose2d(sbpflow.randn(1, 4, 5, 5), sbpflow.randn(4, 2, 3, 3), stride=2).shape
    torch.Size([1, 2, 11, 11])
    """
    attrs = dict(stride=_pair("conv_transpose2d", "stride", stride),
                 padding=_pair("conv_transpose2d", "padding", padding),
                 output_padding=_pair("conv_transpose2d", "output_padding", output_padding), groups=int(groups),
                 dilation=_pair("conv_transpose2d", "dilation", dilation))
    args = (x, weight) if bias is None else (x, weight, bias)
    return _conv_transpose2d(*args, **attrs)
