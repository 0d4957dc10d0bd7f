"""sbpflow: distribution as a property of tensors. Ops pick SBP signatures, and the framework moves the data.

>>> import sbpflow
>>> from sbpflow import sbp
>>> p = sbpflow.placement("cpu", [0, 1])
>>> x = sbpflow.randn(4, 5, placement=p, sbp=sbp.split(0))
>>> w = sbpflow.randn(5, 8, placement=p, sbp=sbp.broadcast)
>>> (x @ w).sbp
(Split(dim=0),)
"""

from __future__ import annotations

import torch
from torch import backends

from . import amp, boxing, checkpoint, comm, cuda, distributed, env, jit, nn, optim, sbp, utils
from .amp import GradScaler, autocast
from .autograd import enable_grad, is_grad_enabled, no_grad
from .autograd import engine as _engine  # noqa: F401  # binds Tensor.backward
from .checkpoint import load, save
from .creation import (
    arange,
    as_tensor,
    empty,
    empty_like,
    from_numpy,
    full,
    full_like,
    meta_tensor,
    multinomial,
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
from .nn.parallelize import parallelize
from .nn.trace_step import auto_parallel
from .ops import functional
from .ops.dispatch import implicit_broadcast

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
    argsort,
    baddbmm,
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
    einsum,
    eq,
    erf,
    exp,
    flip,
    floor,
    gather,
    ge,
    gelu,
    greater,
    gt,
    histc,
    index_add,
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
    logsumexp,
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
    nonzero,
    norm,
    outer,
    pow,
    randint,
    relu,
    repeat_interleave,
    rms_norm,
    roll,
    round,
    rsqrt,
    scatter_add,
    sigmoid,
    sign,
    silu,
    sin,
    softmax,
    sort,
    sqrt,
    square,
    stack,
    std,
    sub,
    sum,
    tanh,
    to_global,
    topk,
    tril,
    triu,
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

# dtypes and devices under torch's and OneFlow's names (they are torch's own objects)
float32 = float = torch.float32
float64 = double = torch.float64
float16 = half = torch.float16
bfloat16 = torch.bfloat16
int8, uint8, int16 = torch.int8, torch.uint8, torch.int16
int32 = int = torch.int32
int64 = long = torch.int64
bool = torch.bool
device = torch.device


class _TypedTensor(Tensor):
    """``torch.LongTensor`` and the like: names for annotations (``x: torch.LongTensor``), and ``LongTensor([1, 2])``
    builds a local tensor of that dtype."""

    dtype_of: torch.dtype = torch.float32
    __slots__ = ()

    def __new__(cls, *data: object) -> Tensor:  # type: ignore[misc]
        return Tensor(*data).to(cls.dtype_of)  # type: ignore[attr-defined,no-any-return]


class FloatTensor(_TypedTensor):
    __slots__ = ()


class LongTensor(_TypedTensor):
    __slots__ = ()
    dtype_of = torch.int64


class BoolTensor(_TypedTensor):
    __slots__ = ()
    dtype_of = torch.bool


def compile(model: object, *args: object, **kwargs: object) -> object:
    """torch.compile's place in a ported script: returns ``model`` unchanged, to run eagerly. sbpflow compiles
    with ``nn.Graph`` (a plan over the whole placement, with its own SBP choice), which needs a build function and
    an optimizer, not a model alone; see docs/api.md."""
    return model


class Explanation(str):
    """Text that a REPL shows as itself (its repr is the text, not a quoted string)."""

    def __repr__(self) -> str:
        return str(self)


def explain(x: Tensor, placement: Placement | None = None, sbp: object = None) -> Explanation:
    """The boxing plan that ``x.to_global(placement, sbp)`` would run, as text: a ``str`` whose repr is the text
    itself, so that a REPL shows it once and readably (print it in a script).

    >>> import sbpflow
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> x = sbpflow.zeros(4, 4, placement=p, sbp=sbpflow.sbp.split(0))
    >>> sbpflow.explain(x, sbp=sbpflow.sbp.broadcast)
    boxing (4, 4) float32: cpu:[0, 1] (S(0)) -> cpu:[0, 1] (B)
      1. all_gather axis 0            (S(0)) -> (B)  32 B/rank, 64 B total, 100.0 us
      total: 32 B/rank, 64 B, 100.0 us
    """
    placement = placement or x.placement
    nd = x.sbp if sbp is None else _normalize_sbp(sbp, placement, x.ndim)
    plan = boxing.plan(tuple(x.shape), x.dtype, boxing.Layout(x.placement, x.sbp), boxing.Layout(placement, nd))
    return Explanation(str(plan))


__all__ = [
    "auto_parallel", "parallelize",
    "ArgumentError", "AutocastWarning", "AutogradError", "BoxingError", "CheckpointError", "CommError", "DTypeError",
    "IndexOutOfRangeError", "LocalGlobalError", "MetaTensorError", "OpError", "Placement",
    "PlacementError", "SbpError", "SbpflowError", "ShapeError", "Tensor", "arange", "boxing", "comm", "enable_grad",
    "explain", "full", "full_like", "functional", "is_grad_enabled", "manual_seed", "nn", "no_grad", "ones",
    "ones_like", "optim", "placement", "rand", "rand_like", "randint", "randn", "randn_like", "sbp", "tensor",
    "uniform", "zeros", "zeros_like", "print0", "rank", "world_size",
    "as_tensor", "from_numpy", "backends", "distributed", "jit", "compile", "FloatTensor", "LongTensor", "BoolTensor",
    "empty", "empty_like", "multinomial", "baddbmm", "greater", "histc", "index_add", "nonzero", "repeat_interleave",
    "scatter_add", "cuda", "env", "device", "Explanation", "float32", "float64", "float16", "bfloat16",
    "int8", "uint8", "int16", "int32", "int64",  # float, int, bool ... exist too, but a star import must not shadow
    # the builtins
    "argsort", "einsum", "flip", "logsumexp", "norm", "outer", "roll", "sort", "tril", "triu",
    "checkpoint", "load", "save", "implicit_broadcast",
    "meta_init", "meta_tensor", "utils", "amp", "autocast", "GradScaler",
    # tensor functions
    "abs", "add", "all", "amax", "amin", "any", "argmax", "argmin", "bmm", "cast", "cat", "ceil", "chunk", "clamp",
    "clip", "clone", "conv2d", "cos", "cumsum", "div", "dropout", "eq", "erf", "exp", "flatten", "floor", "gather",
    "ge", "gelu", "gt", "index_select", "isfinite", "isnan", "layer_norm", "le", "log", "log_softmax", "logical_and",
    "logical_not", "logical_or", "lt", "masked_fill", "masked_select", "matmul", "max", "max_pool2d", "maximum",
    "mean", "min", "minimum", "mm", "mul", "narrow", "ne", "neg", "permute", "pow", "relu", "reshape", "rms_norm",
    "round", "rsqrt", "sigmoid", "sign", "silu", "sin", "softmax", "split", "sqrt", "square", "squeeze", "stack",
    "std", "sub", "sum", "t", "tanh", "to_global", "topk", "transpose", "unflatten", "unsqueeze", "var", "where",
]
