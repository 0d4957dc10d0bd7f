"""Parallel plans: tensor and data parallelism as SBPs on parameters and inputs, with no new layer classes.

A plan maps module-name patterns to styles that only set the SBP of the module's own parameters on one mesh
axis; the ops' signatures do the rest, so the Megatron MLP falls out of them.

>>> import sbpflow
>>> mlp = sbpflow.nn.Sequential(sbpflow.nn.Linear(4, 8), sbpflow.nn.ReLU(), sbpflow.nn.Linear(8, 4))
>>> p = sbpflow.placement("cpu", [0, 1])
>>> _ = apply_plan(mlp, {"0": ColwiseParallel(), "2": RowwiseParallel()}, p)
>>> mlp(sbpflow.randn(3, 4, placement=p, sbp=sbpflow.sbp.broadcast)).sbp
(Partial(op='sum'),)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..autograd import no_grad
from ..distributed import rank, world_size
from ..errors import AutogradError, SbpError
from ..ops import functional as F
from ..placement import Placement
from ..sbp import Broadcast, SbpParallel, Split, broadcast, normalize, partial_sum
from ..tensor import Tensor, shards_from_full
from .conv import Conv2d
from .layers import Embedding, Linear
from .module import Module, relayout_

# -- styles (pure data) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ColwiseParallel:
    """Split the output features: Linear/Conv2d weight and bias S(0); Embedding weight S(1)."""


@dataclass(frozen=True)
class RowwiseParallel:
    """Split the input features: Linear/Conv2d weight S(1), bias B; Embedding weight S(0) (the vocabulary)."""


@dataclass(frozen=True)
class VocabParallelEmbedding(RowwiseParallel):
    """An embedding split over its vocabulary (rows): weight S(0)."""


@dataclass(frozen=True)
class Replicate:
    """Every parameter of the module broadcast on the mesh axis."""


@dataclass(frozen=True)
class DataParallelInput:
    """The module's tensor inputs are converted to S(dim) on the mesh axis before its forward runs."""

    dim: int = 0


Style = ColwiseParallel | RowwiseParallel | Replicate | DataParallelInput


def _check_style_fits(module: Module, where: str, style: Any) -> None:
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(module, (Linear, Conv2d, Embedding)):
        raise SbpError(
            f"apply_plan: {type(style).__name__} applies to Linear, Conv2d and Embedding modules, but {where} is a "
            f"{type(module).__name__}; use Replicate() or leave it out of the plan"
        )


def _param_sbp(module: Module, name: str, style: Any) -> SbpParallel:
    """The SBP ``style`` gives parameter ``name`` of ``module`` (checked by :func:`_check_style_fits`)."""
    if isinstance(style, Replicate):
        return broadcast
    column = isinstance(style, ColwiseParallel)
    if isinstance(module, Embedding):
        return Split(1) if column else Split(0)
    if name == "weight":  # Linear (out, in) and Conv2d (out, in, kh, kw)
        return Split(0) if column else Split(1)
    return Split(0) if column else broadcast


# -- applying a plan -------------------------------------------------------------------------------


def apply_plan(module: Module, plan: Mapping[str, Any], placement: Placement, mesh_axis: int = 0) -> Module:
    """Places every parameter and buffer of ``module`` on ``placement`` with the SBPs ``plan`` asks for.

    Patterns are ``fnmatch`` globs on ``named_modules()`` names (the root is
    ``""``); the first matching one (in the plan's order) wins, and modules
    matched by none get broadcast parameters on ``mesh_axis``. Other mesh axes
    keep their SBPs. Parameters stay the same objects (leaves with
    ``requires_grad``). Returns ``module``.

    A column-parallel Linear gives an output split on its last dim, and a
    row-parallel Linear fed that output gives a partial sum: one all-reduce
    where a consumer needs it.

    >>> import sbpflow
    >>> mlp = sbpflow.nn.Sequential(sbpflow.nn.Linear(4, 8), sbpflow.nn.ReLU(), sbpflow.nn.Linear(8, 4))
    >>> _ = apply_plan(mlp, {"0": ColwiseParallel(), "2": RowwiseParallel()}, sbpflow.placement("cpu", [0, 1]))
    >>> mlp[0].weight.sbp, mlp[2].weight.sbp, mlp[2].bias.sbp
    ((Split(dim=0),), (Split(dim=1),), (Broadcast(),))
    """
    _check_plan_args(module, plan, placement, mesh_axis)
    named = list(module.named_modules())
    chosen = _match(named, plan)
    for name, m in named:  # check everything before touching anything
        _check_style_fits(m, name or "the root module", chosen.get(id(m), Replicate()))
    for _, m in named:
        style = chosen.get(id(m), Replicate())
        if isinstance(style, DataParallelInput):
            m.register_forward_pre_hook(data_parallel_input(placement, style.dim, mesh_axis))
            style = Replicate()
        place_own_tensors(m, style, placement, mesh_axis)
    return module


def _match(named: list[tuple[str, Module]], plan: Mapping[str, Any]) -> dict[int, Any]:
    """``{id(module): style}``; the first pattern (in plan order) that matches a module's name wins."""
    chosen: dict[int, Any] = {}
    for pattern, style in plan.items():
        hits = [m for name, m in named if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            names = [n or "''" for n, _ in named]
            raise SbpError(f"apply_plan: pattern {pattern!r} matches no module; the module names are {names}")
        for m in hits:
            chosen.setdefault(id(m), style)
    return chosen


def _check_plan_args(module: Module, plan: Mapping[str, Any], placement: Placement, mesh_axis: int) -> None:
    if not isinstance(module, Module):
        raise SbpError(f"apply_plan needs an nn.Module, but got {type(module).__name__}")
    if not isinstance(placement, Placement):
        raise SbpError(f"apply_plan needs an sbpflow.placement, but got {placement!r}")
    if not 0 <= mesh_axis < placement.ndim:
        raise SbpError(f"apply_plan: mesh_axis must be in [0, {placement.ndim}) for placement {placement}, "
                       f"but got {mesh_axis}")
    for pattern, style in plan.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel, Replicate, DataParallelInput)):
            raise SbpError(
                f"apply_plan: the style for {pattern!r} must be ColwiseParallel(), RowwiseParallel(), "
                f"VocabParallelEmbedding(), Replicate() or DataParallelInput(dim), but got {style!r}"
            )


def place_own_tensors(m: Module, style: Any, placement: Placement, mesh_axis: int) -> None:
    """Places ``m``'s own parameters (``style``'s SBP on ``mesh_axis``) and buffers (B) on ``placement``."""
    for name, p in m._parameters.items():
        if p is not None:
            relayout_(p, placement, _with_axis(p, placement, mesh_axis, _param_sbp(m, name, style)))
    for b in m._buffers.values():
        if b is not None:
            relayout_(b, placement, _with_axis(b, placement, mesh_axis, broadcast))


def _with_axis(t: Tensor, placement: Placement, mesh_axis: int, s: SbpParallel) -> tuple[SbpParallel, ...]:
    """``t``'s current SBP on ``placement`` (all B if it lives elsewhere) with ``s`` on ``mesh_axis``."""
    base: list[SbpParallel] = list(t.sbp) if t.is_global and t.placement == placement else [broadcast] * placement.ndim
    base[mesh_axis] = s
    return tuple(base)


# -- inputs ----------------------------------------------------------------------------------------


def data_parallel_input(placement: Placement, dim: int = 0, mesh_axis: int = 0) -> Callable[..., tuple[Any, ...]]:
    """A forward pre-hook that lays out tensor inputs S(dim) on ``mesh_axis`` (B on the other axes).

    A local input is taken as the whole logical batch and cut into shards; a
    global one is boxed. Non-tensor arguments pass through.
    """

    def convert(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        nd: list[SbpParallel] = [Broadcast()] * placement.ndim
        nd[mesh_axis] = Split(dim)
        sbp = normalize(tuple(nd), placement, x.ndim, what=f"DataParallelInput of input with {x._describe()}")
        if x.is_global:
            return x.to_global(placement, sbp)
        if x.requires_grad:
            raise AutogradError(
                f"DataParallelInput cuts a local input into shards, which would cut it from the graph, but the "
                f"input ({x._describe()}) requires grad; pass a global tensor instead"
            )
        value = x.to_local()
        return Tensor._from_shards(tuple(value.shape), value.dtype, placement, sbp,
                                   shards_from_full(value, placement, sbp))

    def hook(module: Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(convert(a) for a in args)

    return hook


__all__ = [
    "ColwiseParallel", "DataParallelInput", "Replicate", "RowwiseParallel", "Style", "VocabParallelEmbedding",
    "apply_plan", "data_parallel_input", "DistributedDataParallel", "place_own_tensors",
]


class DistributedDataParallel(Module):
    """OneFlow's and torch's data parallel wrapper over a *local* model: every process runs the model on its own
    local batch, and each gradient is averaged over the processes when backward computes it.

    The averaging is sbpflow's own boxing: a process's local gradient becomes its piece of a ``P(sum)`` tensor on
    every process (``placement.all``), which goes to ``B`` (one all-reduce) and is divided by the process count.
    At construction every parameter and buffer takes process 0's value the same way. On one process (virtual
    ranks included) it changes nothing. For a model laid out globally, pass global batches instead (``S(0)``):
    sbpflow reduces those gradients by itself.

    >>> import sbpflow
    >>> ddp = sbpflow.nn.parallel.DistributedDataParallel(sbpflow.nn.Linear(3, 2))
    >>> ddp(sbpflow.ones(4, 3)).shape
    torch.Size([4, 2])
    """

    def __init__(self, module: Module, **_: Any) -> None:  # torch's and OneFlow's options (buckets ...) ignored
        super().__init__()
        tensors = list(module.parameters()) + [b for b in module.buffers() if b is not None]
        glob = [t for t in tensors if t.is_global]
        if glob:
            raise SbpError(f"DistributedDataParallel wraps a local model, but it holds a global tensor "
                           f"({glob[0]._describe()}); a global model is data parallel through its inputs' S(0)")
        self.module = module
        self._processes = Placement(tensors[0].device.type if tensors else "cpu", range(world_size()))
        with no_grad():  # every process starts from process 0's values, as torch's DDP
            for t in tensors:
                t._assign(self._from_first(t))
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(self._averaged)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _from_first(self, t: Tensor) -> Tensor:
        """``t``'s value on process 0, on every process (a P(sum) of process 0's value and zeros elsewhere)."""
        piece = t.detach() if rank() == 0 else F.zeros_like(t.detach())
        return _local(piece.to_global(self._processes, partial_sum).to_global(sbp=broadcast))

    def _averaged(self, grad: Tensor) -> Tensor:
        with no_grad():
            total = grad.to_global(self._processes, partial_sum).to_global(sbp=broadcast)
            return F.div(_local(total), self._processes.size)


def _local(t: Tensor) -> Tensor:
    return Tensor._from_local(t.to_local())
