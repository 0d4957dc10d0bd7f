"""sbpflow: distribution as a property of tensors.

A global tensor has a logical shape, a :func:`placement` and an SBP per mesh
axis; ops pick SBP signatures and the framework inserts the data movement.

>>> import sbpflow
>>> from sbpflow import sbp
>>> p = sbpflow.placement("cpu", [0, 1])
>>> x = sbpflow.randn(4, 5, placement=p, sbp=sbp.split(0))
>>> w = sbpflow.randn(5, 8, placement=p, sbp=sbp.broadcast)
>>> (x @ w).sbp
(Split(dim=0),)
"""

from __future__ import annotations

from . import amp, boxing, checkpoint, comm, nn, optim, sbp, utils
from .amp import GradScaler, autocast
from .autograd import enable_grad, is_grad_enabled, no_grad
from .autograd import engine as _engine  # noqa: F401  # binds Tensor.backward
from .autoparallel.apply import auto_parallel
from .checkpoint import load, save
from .creation import (
    arange,
    full,
    full_like,
    meta_tensor,
    ones,
    ones_like,
    rand,
    rand_like,
    randn,
    randn_like,
    tensor,
    uniform,
    zeros,
    zeros_like,
)
from .distributed import print0, rank, world_size
from .errors import (
    ArgumentError,
    AutocastWarning,
    AutogradError,
    BoxingError,
    CheckpointError,
    CommError,
    DTypeError,
    IndexOutOfRangeError,
    LocalGlobalError,
    MetaTensorError,
    OpError,
    PlacementError,
    SbpError,
    SbpflowError,
    ShapeError,
)
from .meta import meta_init
from .ops import functional

# the tensor functions at the top level, where torch.* and oneflow.* have them with the same arguments (losses,
# embedding, batch_norm: nn.functional); sum, max, abs ... shadow the builtins inside this module only, as in torch
from .ops.functional import (
    abs,
    add,
    all,
    amax,
    amin,
    any,
    argmax,
    argmin,
    bmm,
    cast,
    cat,
    ceil,
    clamp,
    clip,
    clone,
    conv2d,
    cos,
    cumsum,
    div,
    dropout,
    eq,
    erf,
    exp,
    floor,
    gather,
    ge,
    gelu,
    gt,
    index_select,
    isfinite,
    isnan,
    layer_norm,
    le,
    log,
    log_softmax,
    logical_and,
    logical_not,
    logical_or,
    lt,
    masked_fill,
    masked_select,
    matmul,
    max,
    max_pool2d,
    maximum,
    mean,
    min,
    minimum,
    mm,
    mul,
    ne,
    neg,
    pow,
    randint,
    relu,
    rms_norm,
    round,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    softmax,
    sqrt,
    square,
    stack,
    std,
    sub,
    sum,
    tanh,
    to_global,
    topk,
    var,
    where,
)
from .ops.views import (  # the view functions: like torch's, their results pass in-place writes on to x
    chunk,
    flatten,
    narrow,
    permute,
    reshape,
    split,
    squeeze,
    t,
    transpose,
    unflatten,
    unsqueeze,
)
from .placement import Placement, placement
from .random import manual_seed
from .sbp import normalize as _normalize_sbp  # explain()'s sbp argument shadows the sbp module
from .tensor import Tensor

__version__ = "0.1.0"


def explain(x: Tensor, placement: Placement | None = None, sbp: object = None) -> str:
    """The boxing plan that ``x.to_global(placement, sbp)`` would run, as text (also printed).

    >>> import sbpflow
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> x = sbpflow.zeros(4, 4, placement=p, sbp=sbpflow.sbp.split(0))
    >>> text = sbpflow.explain(x, sbp=sbpflow.sbp.broadcast)
    boxing (4, 4) float32: cpu:[0, 1] (S(0)) -> cpu:[0, 1] (B)
      1. all_gather axis 0            (S(0)) -> (B)  32 B/rank, 64 B total, 100.0 us
      total: 32 B/rank, 64 B, 100.0 us
    """
    placement = placement or x.placement
    nd = x.sbp if sbp is None else _normalize_sbp(sbp, placement, x.ndim)
    text = str(boxing.plan(tuple(x.shape), x.dtype, boxing.Layout(x.placement, x.sbp), boxing.Layout(placement, nd)))
    print(text)
    return text


__all__ = [
    "auto_parallel",
    "ArgumentError", "AutocastWarning", "AutogradError", "BoxingError", "CheckpointError", "CommError", "DTypeError",
    "IndexOutOfRangeError", "LocalGlobalError", "MetaTensorError", "OpError", "Placement",
    "PlacementError", "SbpError", "SbpflowError", "ShapeError", "Tensor", "arange", "boxing", "comm", "enable_grad",
    "explain", "full", "full_like", "functional", "is_grad_enabled", "manual_seed", "nn", "no_grad", "ones",
    "ones_like", "optim", "placement", "rand", "rand_like", "randint", "randn", "randn_like", "sbp", "tensor",
    "uniform", "zeros", "zeros_like", "print0", "rank", "world_size",
    "checkpoint", "load", "save", "meta_init", "meta_tensor", "utils", "amp", "autocast", "GradScaler",
    # tensor functions
    "abs", "add", "all", "amax", "amin", "any", "argmax", "argmin", "bmm", "cast", "cat", "ceil", "chunk", "clamp",
    "clip", "clone", "conv2d", "cos", "cumsum", "div", "dropout", "eq", "erf", "exp", "flatten", "floor", "gather",
    "ge", "gelu", "gt", "index_select", "isfinite", "isnan", "layer_norm", "le", "log", "log_softmax", "logical_and",
    "logical_not", "logical_or", "lt", "masked_fill", "masked_select", "matmul", "max", "max_pool2d", "maximum",
    "mean", "min", "minimum", "mm", "mul", "narrow", "ne", "neg", "permute", "pow", "relu", "reshape", "rms_norm",
    "round", "rsqrt", "sigmoid", "sign", "silu", "sin", "softmax", "split", "sqrt", "square", "squeeze", "stack",
    "std", "sub", "sum", "t", "tanh", "to_global", "topk", "transpose", "unflatten", "unsqueeze", "var", "where",
]
