"""The op schema: one decorator, one definition per op (what op families import; dispatch runs them).

An op declares its ``meta`` (output metadata from input metadata), its valid 1-D ``sbp`` signatures (n-D
ones are their product), the kernel on local torch tensors, and ``@op.grad`` written in sbpflow ops.

>>> import torch
>>> from sbpflow.ops.schema import op, Sig
>>> from sbpflow.sbp import split
>>> @op("twice", meta=lambda x: x, sbp=lambda x, outs: [Sig((split(d),), (split(d),)) for d in range(len(x.shape))])
... def twice(x: torch.Tensor) -> torch.Tensor:
...     return 2 * x
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .._layout import Box
from ..errors import OpError
from ..placement import Placement
from ..sbp import NdSbp, SbpParallel

# Positional arguments are tensors or dynamic scalars (their type is part of the dispatch cache key, their value is
# not); keyword arguments are static attributes, part of the key.
DYNAMIC = -1  # an output size that only the data gives (see data_dependent in op())


@dataclass(frozen=True)
class Meta:
    """Logical metadata of a tensor argument or result."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        """Whether every size is known from metadata (no :data:`DYNAMIC` size)."""
        return DYNAMIC not in self.shape


@dataclass(frozen=True)
class Scalar:
    """A dynamic scalar argument as meta inference sees it: only its Python type."""

    type: type


@dataclass(frozen=True)
class Sig:
    """A 1-D SBP signature: one SBP per tensor input, one per output."""

    ins: tuple[SbpParallel, ...]
    outs: tuple[SbpParallel, ...]


@dataclass(frozen=True)
class ShardCtx:
    """What a shard-aware kernel learns about the shard it computes."""

    rank: int
    placement: Placement | None
    in_boxes: tuple[Box, ...]  # logical box of each tensor input's shard
    out_boxes: tuple[Box, ...]
    in_metas: tuple[Meta, ...]
    out_metas: tuple[Meta, ...]
    in_sbps: tuple[NdSbp, ...]
    out_sbps: tuple[NdSbp, ...]


# A communicating op's messages: (input metas, chosen input n-D SBPs, placement) -> (messages, bytes) one rank
# sends in its kernel; (0, 0) when this signature keeps the kernel to its own shards.
Talks = Callable[[tuple[Meta, ...], tuple[NdSbp, ...], Placement], tuple[int, int]]

REGISTRY: dict[str, OpDef] = {}


class OpDef:
    """A registered op; calling it dispatches (see :func:`apply`)."""

    def __init__(self, name: str, kernel: Callable[..., Any], meta: Callable[..., Any], sbp: Callable[..., Any],
                 shard_aware: bool, save_outputs: bool, differentiable: bool, mesh_aware: bool,
                 data_dependent: bool = False, diff_outputs: int | None = None,
                 grad_reads: tuple[int, ...] | None = None, talks: Talks | None = None,
                 box_offsets: tuple[int | str | tuple[int, int], ...] | None = None) -> None:
        self.name = name
        self.kernel = kernel
        self.meta = meta
        self.sbp = sbp
        self.shard_aware = shard_aware
        self.save_outputs = save_outputs
        self.differentiable = differentiable
        self.mesh_aware = mesh_aware
        self.data_dependent = data_dependent
        self.diff_outputs = diff_outputs  # outputs that get gradients (the first n); None: all of them
        self.grad_reads = grad_reads  # tensor inputs whose values the gradient reads; None: all of them
        self.talks = talks  # a communicating kernel's messages and bytes per rank (see op); None: it never talks
        # where the kernel reads box offsets (see op); None: anywhere (a kernel without a ShardCtx reads none)
        self.box_offsets = box_offsets if shard_aware else ()
        self.communicating = talks is not None  # one kernel call for all owned ranks (run_shards)
        self.backward_fn: Callable[..., Any] | None = None
        self.activity = f"op {name!r}"  # what comm errors name while this op boxes its inputs

    def grad(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: registers this op's gradient ``fn(ctx, *grad_outputs) -> input grads``."""
        self.backward_fn = fn
        return fn

    def __call__(self, *args: Any, **attrs: Any) -> Any:
        return apply(self, args, attrs)  # ops.dispatch.apply, once dispatch is imported

    def check_traceable(self) -> None:
        """Raises unless the op's output shapes follow from input metadata alone (what graph tracing needs)."""
        if self.data_dependent:
            raise OpError(
                f"op {self.name!r} has a data-dependent output shape: its size is known only once the input values "
                "are, so graph mode cannot trace it; run it eagerly, or keep shapes fixed (masked_fill or where "
                "instead of boolean-mask indexing)"
            )

    def __repr__(self) -> str:
        return f"<sbpflow op {self.name}>"


def op(name: str, *, meta: Callable[..., Any], sbp: Callable[..., Any], shard_aware: bool = False,
       save_outputs: bool = False, differentiable: bool = True, mesh_aware: bool = False,
       data_dependent: bool = False, diff_outputs: int | None = None,
       grad_reads: tuple[int, ...] | None = None,
       communicating: Talks | None = None,
       box_offsets: tuple[int | str | tuple[int, int], ...] | None = None) -> Callable[[Callable[..., Any]], OpDef]:
    """Registers the decorated kernel as op ``name``.

    ``shard_aware`` kernels get a :class:`ShardCtx` first; ``mesh_aware`` SBP
    rules get ``mesh=`` (the placement's hierarchy) for rules that hold only
    for some mesh sizes, such as a reshape of an unevenly split dim;
    ``save_outputs`` keeps the outputs for the gradient; ``data_dependent`` ops
    have output sizes that depend on input values (boolean-mask indexing): their
    meta gives :data:`DYNAMIC` for that size, their signatures never split that
    dim (ranks would hold pieces of sizes nobody planned), eager dispatch reads
    the size off the kernel's result, and tracing them fails with
    :meth:`OpDef.check_traceable`'s error (graph mode needs every shape from
    metadata alone);
    ``diff_outputs=n`` makes only the first ``n`` outputs differentiable, the
    rest being saved statistics for the gradient (attention's logsumexp, a
    norm's mean and rstd) that get no gradient and no zeros filled in for one.
    ``grad_reads`` lists the tensor inputs (by position among the tensor
    arguments) whose values the gradient reads; of the others, eager autograd
    keeps only metadata (shape, dtype, layout), so that their memory is freed
    as soon as nothing else holds them, as torch frees what no backward saves
    (``()`` for add, views, casts, log_softmax; None, the default: all).
    ``communicating`` kernels (shard-aware only) are called once per process for
    all its ranks and may exchange shards with their peers (see :func:`run_shards`);
    the value is their :data:`Talks` function, which the graph compiler reads to
    price a signature's messages and to give a talking node a stream of its own.
    ``box_offsets`` (shard-aware kernels) lists the tensors, inputs by position
    and then outputs, where the kernel reads *where* its box lies (not only its
    shape): ``()`` for reshapes, ``(1,)`` for embedding's weight rows, a
    (tensor, dim) pair (``((0, -1),)``: the classes of pick's input), or the
    attribute naming the one dim where it reads them (``("dim",)``). A zigzag
    split passes through the other tensors with no boxing
    (:func:`sbpflow.ops.propagation.zigzag_sigs`); None (the default): none.
    """

    def register(kernel: Callable[..., Any]) -> OpDef:
        if name in REGISTRY:
            raise OpError(f"op {name!r} is registered twice")
        if communicating is not None and not shard_aware:  # its peers and their boxes come from the ShardCtx
            raise OpError(f"op {name!r} is communicating, so it must be shard_aware")
        if data_dependent and shard_aware:  # a ShardCtx holds output boxes, which need the sizes up front
            raise OpError(f"op {name!r} cannot be both data_dependent and shard_aware: output boxes need sizes")
        definition = OpDef(name, kernel, meta, sbp, shard_aware, save_outputs, differentiable, mesh_aware,
                           data_dependent, diff_outputs, grad_reads, communicating, box_offsets)
        REGISTRY[name] = definition
        return definition

    return register


def run_shards(opdef: OpDef, ctxs: dict[int, ShardCtx], values: dict[int, list[Any]],
               attrs: dict[str, Any]) -> dict[int, Any]:
    """A shard-aware kernel on every owned rank's arguments: ``{rank: result}``.

    A *communicating* kernel talks to its peers (ring attention passes K/V blocks around a mesh axis). One
    process may own every rank of the ring (virtual ranks), where a kernel run rank after rank would wait for a
    peer that has not started, so it is called once with every owned rank's arguments:
    ``kernel({rank: ctx}, *({rank: arg} per argument), **attrs) -> {rank: result}``, and it exchanges shards
    through the comm backend, which moves them between virtual ranks or processes alike.
    """
    if opdef.talks is not None:
        if not values:  # this process owns no rank of the placement: no part in the exchange, nothing to run
            return {}
        n = len(next(iter(values.values())))
        columns = [{r: args[i] for r, args in values.items()} for i in range(n)]
        return opdef.kernel(ctxs, *columns, **attrs)  # type: ignore[no-any-return]
    return {r: opdef.kernel(ctxs[r], *args, **attrs) for r, args in values.items()}


def shard_kernel(opdef: OpDef) -> Callable[..., Any]:
    """``opdef``'s kernel as one shard's call, ``kernel(ctx, *args, **attrs)``, for a caller that runs shards one by
    one (a fused segment): a communicating kernel is wrapped, and must then be under a signature that talks not."""
    if opdef.talks is None:
        return opdef.kernel

    def one(ctx: ShardCtx, *args: Any, **attrs: Any) -> Any:
        return opdef.kernel({ctx.rank: ctx}, *({ctx.rank: a} for a in args), **attrs)[ctx.rank]

    return one


def apply(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """Runs ``opdef`` on ``args``: ops.dispatch (a layer above) puts its ``apply`` here when it is imported."""
    raise OpError(f"op {opdef.name!r} was called before sbpflow.ops.dispatch was imported; import sbpflow first")


@contextmanager
def counting() -> Iterator[collections.Counter[str]]:
    """Counts, by op name, the ops dispatched inside the block (a benchmark's or calibration's op census).

    >>> import sbpflow
    >>> x = sbpflow.ones(2)
    >>> with counting() as ops:
    ...     _ = x * 2 + 1
    >>> sum(ops.values())
    2
    """
    counts: collections.Counter[str] = collections.Counter()
    global apply
    inner = apply

    def counted(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
        counts[opdef.name] += 1
        return inner(opdef, args, attrs)

    apply = counted
    try:
        yield counts
    finally:
        apply = inner
