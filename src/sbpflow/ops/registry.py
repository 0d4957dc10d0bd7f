"""The op registry: one decorator, one definition per op, serving eager and traced execution.

An op declares

* ``meta(*args, **attrs)``: output :class:`Meta` from input metadata, never data;
* ``sbp(*args, outs, **attrs)``: its valid 1-D signatures (:class:`Sig`), one
  SBP per tensor input and output; n-D signatures are their product;
* the kernel (the decorated function) on local torch tensors;
* ``@op.grad``: its gradient, written in sbpflow ops.

A ``data_dependent`` op (boolean-mask indexing) has an output size that only
its input *values* decide: its meta gives :data:`DYNAMIC` for that size, its
signatures never split that dim (ranks would hold pieces of sizes nobody
planned), and eager dispatch reads the size off the kernel's result. Graph
mode needs every shape from metadata alone, so tracing such an op fails with
:meth:`OpDef.check_traceable`'s error.

Positional arguments are tensors or *dynamic* scalars (their type is part of
the dispatch cache key, their value is not); keyword arguments are static
attributes and are part of the key.

>>> import torch
>>> from sbpflow.ops.registry import op, Sig, Meta
>>> from sbpflow.sbp import broadcast, split
>>> @op("twice", meta=lambda x: x, sbp=lambda x, outs: [Sig((split(d),), (split(d),)) for d in range(len(x.shape))])
... def twice(x: torch.Tensor) -> torch.Tensor:
...     return 2 * x
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import amp, boxing
from .. import comm as _comm
from .. import meta as _meta
from .._layout import Box, shard_box
from ..autograd import Node
from ..autograd import _mode as _grad_mode
from ..boxing.plan import _cost_model as _cost_model_stack
from ..comm import get_backend
from ..distributed import activity
from ..errors import AutocastWarning, OpError, SbpflowError
from ..graph import trace as _trace
from ..placement import DEVICE_TYPES, Placement
from ..sbp import SBP_TYPES, Broadcast, NdSbp, Partial, SbpParallel, Split, format_nd
from ..tensor import Tensor
from .views import refresh

DYNAMIC = -1  # an output size that only the data gives (see data_dependent ops in the module docstring)


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


REGISTRY: dict[str, OpDef] = {}


class OpDef:
    """A registered op; calling it dispatches (see :func:`apply`)."""

    def __init__(self, name: str, kernel: Callable[..., Any], meta: Callable[..., Any], sbp: Callable[..., Any],
                 shard_aware: bool, save_outputs: bool, differentiable: bool, mesh_aware: bool,
                 data_dependent: bool = False, diff_outputs: int | None = None,
                 grad_reads: tuple[int, ...] | None = None) -> None:
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
        self.backward_fn: Callable[..., Any] | None = None
        self.activity = f"op {name!r}"  # what comm errors name while this op boxes its inputs

    def grad(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: registers this op's gradient ``fn(ctx, *grad_outputs) -> input grads``."""
        self.backward_fn = fn
        return fn

    def __call__(self, *args: Any, **attrs: Any) -> Any:
        return apply(self, args, attrs)

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
       grad_reads: tuple[int, ...] | None = None) -> Callable[[Callable[..., Any]], OpDef]:
    """Registers the decorated kernel as op ``name``.

    ``shard_aware`` kernels get a :class:`ShardCtx` first; ``mesh_aware`` SBP
    rules get ``mesh=`` (the placement's hierarchy) for rules that hold only
    for some mesh sizes, such as a reshape of an unevenly split dim;
    ``save_outputs`` keeps the outputs for the gradient; ``data_dependent`` ops
    have output sizes that depend on input values (see the module docstring);
    ``diff_outputs=n`` makes only the first ``n`` outputs differentiable, the
    rest being saved statistics for the gradient (attention's logsumexp, a
    norm's mean and rstd) that get no gradient and no zeros filled in for one.
    ``grad_reads`` lists the tensor inputs (by position among the tensor
    arguments) whose values the gradient reads; of the others, eager autograd
    keeps only metadata (shape, dtype, layout), so that their memory is freed
    as soon as nothing else holds them, as torch frees what no backward saves
    (``()`` for add, views, casts, log_softmax; None, the default: all).
    """

    def register(kernel: Callable[..., Any]) -> OpDef:
        if name in REGISTRY:
            raise OpError(f"op {name!r} is registered twice")
        if data_dependent and shard_aware:  # a ShardCtx holds output boxes, which need the sizes up front
            raise OpError(f"op {name!r} cannot be both data_dependent and shard_aware: output boxes need sizes")
        definition = OpDef(name, kernel, meta, sbp, shard_aware, save_outputs, differentiable, mesh_aware,
                           data_dependent, diff_outputs, grad_reads)
        REGISTRY[name] = definition
        return definition

    return register


# ----------------------------------------------------------------------------- dispatch


def apply(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """Runs ``opdef`` on ``args``: meta, signature choice, boxing, kernels, autograd record."""
    if amp._state.dtype is not None:  # inside sbpflow.autocast: the op's policy casts its inputs first
        args = amp.cast_inputs(opdef.name, args)
    # One pass over the args: local or global (never both), whether any needs a gradient, and the argument part
    # of the dispatch cache key (_local_key / _global_key, built here so that the args are walked once).
    is_global: bool | None = None
    needs_grad = False
    has_torch = False
    placement = None
    where_token = None  # the placement's token (see _token)
    one_placement = True
    key_args: list[Any] = []
    values: list[Any] = []  # what a local kernel takes: each tensor's torch tensor, scalars as they are
    for a in args:
        if isinstance(a, Tensor):
            if a._view_of is not None:  # a view whose base was written since reads the base's new values
                refresh(a)
            local = a._local
            values.append(local)
            here = local is None
            if is_global is None:
                is_global = here
            elif here != is_global:
                raise OpError(
                    f"op {opdef.name!r} got local and global tensors together: {_describe_args(args)}; "
                    "convert the local ones with .to_global(placement, sbp)"
                )
            if not needs_grad and a.requires_grad:
                needs_grad = True
            if here:
                where = a._placement
                entry = _tokens.get(id(where))
                if entry is None or entry[0] is not where:
                    entry = _token(where)
                if placement is None:
                    placement, where_token = where, entry[1]
                elif entry[1] != where_token:
                    one_placement = False  # _apply_global raises, naming the args as it sees them
                sbp = a._sbp
                entry = _tokens.get(id(sbp))
                key_args.append((a._shape, a._dtype, (entry if entry is not None and entry[0] is sbp
                                                      else _token(sbp))[1]))
            else:
                key_args.append((local.shape, local.dtype))  # type: ignore[union-attr]
        elif isinstance(a, torch.Tensor):
            has_torch = True
        else:
            key_args.append(type(a))
            values.append(a)
    if has_torch:
        args = _adopt_torch_tensors(opdef, args, bool(is_global))
        is_global = bool(is_global)
        key = None  # the adopted tensors change the key: built again from the new args
    elif is_global is None:
        raise OpError(f"op {opdef.name!r} needs at least one tensor argument")
    else:
        key = tuple(key_args) if one_placement else None
    if _autocast_active():
        _warn_autocast()
        with _autocast_off():  # else torch would cast inside some kernels (matmul), off the dtypes the meta promised
            outputs = (_apply_global(opdef, args, attrs, key, placement, where_token) if is_global
                       else _apply_local(opdef, args, attrs, key, None if key is None else values))
    elif is_global:
        outputs = _apply_global(opdef, args, attrs, key, placement, where_token)
    else:
        outputs = _apply_local(opdef, args, attrs, key, None if key is None else values)
    if needs_grad and opdef.differentiable and _grad_mode.grad_enabled:
        _record(opdef, args, attrs, outputs if isinstance(outputs, tuple) else (outputs,))
    return outputs


# The dispatch caches key a placement and an nd-SBP by a small int, not by value: hashing or comparing them runs
# Python __hash__/__eq__ methods (dataclasses) on every dispatch. id(value) -> (value, token): the entry holds the
# value itself, so its id is never reused while the entry lives; equal values share one token (_token_of), so
# tokens compare as the values do.
_tokens: dict[int, tuple[Any, int]] = {}
_token_of: dict[Any, int] = {}


def _token(value: Any) -> tuple[Any, int]:
    """``value``'s (value, token) entry, made on first sight of this object."""
    if len(_tokens) >= 65536:  # bounded: SBP tuples built once and dropped (to_global calls) come and go
        _tokens.clear()
    token = _token_of.setdefault(value, len(_token_of))
    entry = _tokens[id(value)] = (value, token)
    return entry


_autocast_active = torch._C._is_any_autocast_enabled  # one C call per op: cheap enough for every dispatch

# Shown once per process (the "once" action keys on the message alone), unless the user's filters say otherwise:
# appended, so that filters set before or after import (pytest's "error", warnings.simplefilter) come first.
warnings.filterwarnings("once", category=AutocastWarning, append=True)


@contextmanager
def _autocast_off() -> Iterator[None]:
    """Turns off every active torch.autocast (cpu, cuda) for one op's kernels."""
    with ExitStack() as stack:
        for device in DEVICE_TYPES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


# the registry of the autocast warning: the same key for every call, so that the filters "default" and "once"
# (IPython, pytest and -W default put "default" first) both show it once; warnings clears it when filters change
_AUTOCAST_SEEN: dict[Any, Any] = {}


def _warn_autocast() -> None:
    """torch.autocast only rewrites torch's own dispatch: sbpflow ops keep their dtypes, so say so instead of letting
    users believe they train in mixed precision. One message for every op, so that "once" means once."""
    warnings.warn_explicit(
        "torch.autocast is active, but it has no effect on sbpflow ops: they run in their inputs' dtypes. "
        "Use sbpflow.autocast(dtype=torch.bfloat16) for mixed precision, or cast explicitly (x.bfloat16())",
        AutocastWarning, filename=__file__, lineno=1, module="sbpflow", registry=_AUTOCAST_SEEN,
    )


def _adopt_torch_tensors(opdef: OpDef, args: Sequence[Any], is_global: bool) -> tuple[Any, ...]:
    """Plain torch tensors become sbpflow tensors holding their value as the *logical* value.

    Beside global tensors a torch tensor is broadcast (B) on their placement, as torch broadcasting treats a
    second operand: ``x + torch.tensor([10., 20.])`` then gets torch's shape check and torch's numbers. Applied
    per shard instead, it would meet each rank's slice of ``x`` and silently add to the wrong columns. With one
    process per rank every process must pass the same value, as it must for a Python scalar.
    """
    from ..creation import tensor as make_tensor

    placement = next((a._placement for a in args if isinstance(a, Tensor)), None) if is_global else None
    out: list[Any] = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and not isinstance(a, Tensor):
            if a.requires_grad:
                raise OpError(
                    f"op {opdef.name!r}: arg {i} is a torch tensor that requires grad ({list(a.shape)} "
                    f"{str(a.dtype).replace('torch.', '')}); its gradient would be lost, so build it with "
                    "sbpflow.tensor(..., requires_grad=True) instead"
                )
            out.append(make_tensor(a, placement=placement) if placement is not None else Tensor._from_local(a))
        else:
            out.append(a)
    return tuple(out)


def _record(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], outs: tuple[Tensor, ...]) -> None:
    node = Node(opdef, args, outs, attrs, opdef.save_outputs)
    for i, o in enumerate(outs if opdef.diff_outputs is None else outs[:opdef.diff_outputs]):
        local = o._local
        dtype = o._dtype if local is None else local.dtype
        if dtype.is_floating_point or dtype.is_complex:  # type: ignore[union-attr]
            o.requires_grad = True
            o.grad_fn = node
            o._out_index = i


def _describe_args(args: Sequence[Any]) -> str:
    parts = []
    for i, a in enumerate(args):
        parts.append(f"arg {i}: {a._describe()}" if isinstance(a, Tensor) else f"arg {i}: {type(a).__name__} {a!r}")
    return "; ".join(parts)


def _arg_meta(a: Any) -> Any:
    if isinstance(a, Tensor):
        return Meta(tuple(a.shape), a.dtype)
    return Scalar(type(a))


def _attrs_key(attrs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    # In call order, unsorted: a call site passes its keywords in one order, and another order only makes a second
    # (equal) cache entry, where sorting would cost every dispatch.
    return tuple(attrs.items()) if attrs else ()


def _infer(opdef: OpDef, args: Sequence[Any], metas: Sequence[Any], attrs: dict[str, Any]) -> tuple[Meta, ...]:
    try:
        out = opdef.meta(*metas, **attrs)
    except SbpflowError as e:
        raise type(e)(f"op {opdef.name!r}: {e}; inputs: {_describe_args(args)}") from None
    return out if isinstance(out, tuple) else (out,)


# -- local tensors --------------------------------------------------------------------------

# (op name, (shape, dtype) or scalar type per arg, attrs) -> (output metas, ShardCtx for shard-aware kernels)
_local_cache: dict[Any, tuple[tuple[Meta, ...], ShardCtx | None]] = {}


def _apply_local(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], key_args: Any = None,
                 values: list[Any] | None = None) -> Any:
    """``values``: the kernel's arguments (apply collects them in its own pass over ``args``)."""
    # the key is built from torch's own Size and dtype: no Meta objects on the hot path
    if key_args is None:  # every tensor argument is local here (apply checked), so _local is set
        key_args = tuple([(a._local.shape, a._local.dtype) if isinstance(a, Tensor) else type(a)  # type: ignore[union-attr]
                          for a in args])
    key = (opdef.name, key_args, tuple(attrs.items()) if attrs else ())  # attrs as _attrs_key gives them
    cached = _local_cache.get(key)
    if cached is None:
        metas = tuple(_arg_meta(a) for a in args)
        out_metas = _infer(opdef, args, metas, attrs)
        ctx = None
        if opdef.shard_aware:
            in_metas = tuple(m for m in metas if isinstance(m, Meta))
            ctx = ShardCtx(0, None, tuple(_full(m) for m in in_metas), tuple(_full(m) for m in out_metas), in_metas,
                           out_metas, (), ())
        cached = _local_cache[key] = (out_metas, ctx)
    if values is None:
        values = [a._local if isinstance(a, Tensor) else a for a in args]
    if cached[1] is not None:
        result = opdef.kernel(cached[1], *values, **attrs)
    else:
        result = opdef.kernel(*values, **attrs)
    if isinstance(result, tuple):
        return tuple(Tensor._from_local(r) for r in result)
    return Tensor._from_local(result)


def _full(m: Meta) -> Box:
    return tuple((0, n) for n in m.shape)


# -- global tensors -------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """The cached outcome of dispatch for one (op, input metadata) key."""

    out_metas: tuple[Meta, ...]
    in_sbps: tuple[NdSbp, ...]
    out_sbps: tuple[NdSbp, ...]
    plans: tuple[boxing.Plan | None, ...]  # per tensor input; None when it is already in place
    in_metas: tuple[Meta, ...] = ()  # per tensor input, for shard-aware kernels
    positions: tuple[int, ...] = ()  # where the tensor inputs sit among the args (fixed by the cache key)
    boxes: bool = False  # whether any input needs boxing
    # rank -> ShardCtx for shard-aware kernels: a function of (decision, placement, rank) alone, built once
    shard_ctxs: dict[int, ShardCtx] = field(default_factory=dict, compare=False, repr=False)


# (op name, placement token, (shape, dtype, sbp token) or scalar type per arg, attrs, cost model, collective cost
# factors in force) -> Decision
_global_cache: dict[Any, Decision] = {}


def _apply_global(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], key_args: Any = None,
                  placement: Placement | None = None, where: int | None = None) -> Any:
    if _trace.ACTIVE:  # nn.Graph is tracing build(): record a node, run nothing
        return _trace.record_op(opdef, args, attrs)
    if key_args is None:
        placement, where, key_args = _global_key(opdef, args)
    assert placement is not None  # apply() saw a global tensor
    key = (opdef.name, where, key_args, _attrs_key(attrs) if attrs else (), id(_cost_model_stack[-1]),
           boxing.current_factors())
    decision = _global_cache.get(key)
    if decision is None:
        _keep_cost_model_alive()
        decision = decide(opdef, args, attrs, placement)
        _global_cache[key] = decision
    for pos in decision.positions:
        if args[pos]._shards is None:  # a meta tensor (sbpflow.meta_init): metadata in, metadata out
            return _meta_outputs(opdef, decision, placement, args)
    if decision.boxes:
        with activity(opdef.activity):  # named in comm errors raised while its inputs are boxed
            return run(opdef, decision, args, attrs, placement, where)
    if opdef.data_dependent:
        return run(opdef, decision, args, attrs, placement, where)
    owned = _owned(placement, where)  # type: ignore[arg-type]
    if len(owned) != 1:
        return run(opdef, decision, args, attrs, placement, where)
    # the common case, run and _wrap inlined: inputs in place, one rank in this process
    r = owned[0]
    values = list(args)
    for pos in decision.positions:
        values[pos] = args[pos]._shards[r]  # type: ignore[index]  # global tensors always hold a shard dict
    if opdef.shard_aware:
        result = opdef.kernel(_shard_ctx(r, placement, decision, args), *values, **attrs)
    else:
        result = opdef.kernel(*values, **attrs)
    metas, sbps = decision.out_metas, decision.out_sbps
    if len(metas) == 1:
        meta = metas[0]
        out = _from_shards(Tensor, meta.shape, meta.dtype, placement, sbps[0], {r: result})
        out._boxed = {}
        return out
    outs = []
    for m, sbp, shard in zip(metas, sbps, result, strict=True):
        o = _from_shards(Tensor, m.shape, m.dtype, placement, sbp, {r: shard})
        o._boxed = {}
        outs.append(o)
    return tuple(outs)


def _global_key(opdef: OpDef, args: Sequence[Any]) -> tuple[Placement | None, int | None, tuple[Any, ...]]:
    """The common placement and the argument part of the dispatch key (what apply builds in its own pass)."""
    placement = None
    key_args: list[Any] = []
    for a in args:
        if isinstance(a, Tensor):
            here = a._placement
            if placement is None:
                placement = here
            elif here is not placement and here != placement:
                raise OpError(
                    f"op {opdef.name!r} needs all inputs on one placement, but got {placement} and {here} "
                    f"({_describe_args(args)}); move one with .to_global(placement=...)"
                )
            sbp = a._sbp
            entry = _tokens.get(id(sbp))
            key_args.append((a._shape, a._dtype, (entry if entry is not None and entry[0] is sbp
                                                  else _token(sbp))[1]))
        else:
            key_args.append(type(a))
    return placement, None if placement is None else _token(placement)[1], tuple(key_args)


_cost_models: dict[int, boxing.CostModel] = {}  # keeps every model that keyed a decision alive, so ids stay unique


def _keep_cost_model_alive() -> None:
    """Decisions are keyed by the cost model in force (its id) and the backend's cost factors (gloo's
    reduce-scatter costs an all-reduce): a ``boxing.cost_model(...)`` block, or another installed backend,
    must not reuse others'. A model that keys a decision is kept alive, so that its id is never reused."""
    model = boxing.get_cost_model()
    _cost_models.setdefault(id(model), model)


def decide(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], placement: Placement) -> Decision:
    """Meta inference plus the cheapest n-D signature for the inputs' current SBPs."""
    metas = tuple(_arg_meta(a) for a in args)
    out_metas = _infer(opdef, args, metas, attrs)
    tensors = [a for a in args if isinstance(a, Tensor)]
    in_metas = tuple(m for m in metas if isinstance(m, Meta))
    extra = {"mesh": placement.hierarchy} if opdef.mesh_aware else {}
    sigs = [s for s in opdef.sbp(*metas, outs=out_metas, **extra, **attrs) if _sig_fits(s, tensors, out_metas)]
    if not sigs:
        raise OpError(f"op {opdef.name!r} has no SBP signature for {_describe_args(args)}")
    if opdef.data_dependent:
        _check_dynamic_not_split(opdef, sigs, out_metas)
    current = tuple(t.sbp for t in tensors)
    positions = tuple(i for i, a in enumerate(args) if isinstance(a, Tensor))
    exact = _exact_match(sigs, current, placement.ndim)
    if exact is not None:
        in_sbps, out_sbps = exact
        return Decision(out_metas, in_sbps, out_sbps, (None,) * len(tensors), in_metas, positions)
    has_partial = any(isinstance(s, Partial) for sbp in current for s in sbp)
    best: tuple[Any, ...] | None = None
    for combo in itertools.product(sigs, repeat=placement.ndim):
        in_sbps = tuple(tuple(sig.ins[i] for sig in combo) for i in range(len(tensors)))
        plans = tuple(
            None if in_sbps[i] == t.sbp else boxing.plan(
                tuple(t.shape), t.dtype, boxing.Layout(placement, t.sbp), boxing.Layout(placement, in_sbps[i]))
            for i, t in enumerate(tensors)
        )
        cost = _boxing_cost(plans, has_partial)
        if best is None or cost < best[0]:
            out_sbps = tuple(tuple(sig.outs[j] for sig in combo) for j in range(len(out_metas)))
            best = (cost, in_sbps, out_sbps, plans)
    assert best is not None
    plans = tuple(None if p is not None and p.is_relabel else p for p in best[3])  # one-rank axes: no work
    return Decision(out_metas, best[1], best[2], plans, in_metas, positions, any(p is not None for p in plans))


def _boxing_cost(plans: Sequence[boxing.Plan | None], has_partial: bool) -> tuple[Any, ...]:
    """Orders boxing options: modelled time, then collectives, local steps into a partial, bytes, steps.

    Padding a split input into a partial is free locally but only moves a reduction (an all-reduce,
    dearer than the all-gather it avoids) to the consumer, on a full-size buffer. So when no input is
    partial yet, such options rank after every other one, and the all-B fallback is taken instead.
    Zeroing a B input into a partial stays cheap and right: the bias of a row-parallel linear, or the
    B side of P + B. Ties after time matter too: on one rank every plan is free, yet a local slice must
    beat a trivial all-gather. Equal costs keep the earlier signature.
    """
    real = [p for p in plans if p is not None]
    local_steps = [st for p in real for st in p.steps if st.kind == "local"]
    pads = sum(1 for st in local_steps if _adds_partial(st, Split))
    to_partial = sum(1 for st in local_steps if _adds_partial(st, SBP_TYPES))
    return (pads > 0 and not has_partial, sum(p.time for p in real), sum(len(p.collectives()) for p in real),
            to_partial, sum(p.bytes for p in real), sum(len(p.steps) for p in real))


def _adds_partial(step: boxing.Step, source: Any) -> bool:
    """Whether a local step turns a mesh axis holding an SBP of type ``source`` into a partial."""
    return any(isinstance(b, Partial) and not isinstance(a, Partial) and isinstance(a, source)
               for a, b in zip(step.src.sbp, step.dst.sbp, strict=True))


def _sig_fits(sig: Sig, tensors: Sequence[Tensor], outs: Sequence[Meta]) -> bool:
    for s, t in zip(sig.ins, tensors, strict=False):  # lengths are checked below
        if not isinstance(s, Broadcast) and hasattr(s, "dim") and s.dim >= t.ndim:
            return False
    for s, m in zip(sig.outs, outs, strict=False):
        if hasattr(s, "dim") and s.dim >= m.ndim:
            return False
    return len(sig.ins) == len(tensors) and len(sig.outs) == len(outs)


def _check_dynamic_not_split(opdef: OpDef, sigs: Sequence[Sig], outs: Sequence[Meta]) -> None:
    """A data-dependent size may differ between shards, which no split layout describes: a rule bug if listed."""
    for sig in sigs:
        for s, m in zip(sig.outs, outs, strict=True):
            if isinstance(s, Split) and m.shape[s.dim] == DYNAMIC:
                raise OpError(f"op {opdef.name!r} lists signature {sig} that splits output dim {s.dim}, whose size "
                              "depends on the data; data-dependent dims may only be B or P")


def _exact_match(sigs: Sequence[Sig], current: tuple[NdSbp, ...], ndim: int) -> tuple[Any, Any] | None:
    chosen = []
    for axis in range(ndim):
        here = tuple(sbp[axis] for sbp in current)
        match = next((s for s in sigs if s.ins == here), None)
        if match is None:
            return None
        chosen.append(match)
    in_sbps = current
    out_sbps = tuple(tuple(sig.outs[j] for sig in chosen) for j in range(len(chosen[0].outs)))
    return in_sbps, out_sbps


def run(opdef: OpDef, decision: Decision, args: Sequence[Any], attrs: dict[str, Any], placement: Placement,
        where: int | None = None) -> Any:
    """Boxes the inputs as decided and runs the kernel on every owned shard (``where``: the placement's token)."""
    positions = decision.positions
    kernel = opdef.kernel
    owned = _owned(placement, _token(placement)[1] if where is None else where)
    values = list(args)
    if len(owned) == 1 and not decision.boxes and not opdef.shard_aware:  # one rank here, inputs in place
        r = owned[0]
        for pos in positions:
            values[pos] = args[pos]._shards[r]  # type: ignore[index]  # global tensors always hold a shard dict
        results: dict[int, Any] = {r: kernel(*values, **attrs)}
    else:
        if decision.boxes:
            shard_maps = [args[pos]._shards if plan is None else _boxed(args[pos], plan)
                          for pos, plan in zip(positions, decision.plans, strict=True)]
        else:
            shard_maps = [args[pos]._shards for pos in positions]
        results = {}
        shard_aware = opdef.shard_aware
        for r in owned:
            for pos, shards in zip(positions, shard_maps, strict=True):
                values[pos] = shards[r]  # type: ignore[index]  # global tensors always hold a shard dict
            if shard_aware:
                results[r] = kernel(_shard_ctx(r, placement, decision, args), *values, **attrs)
            else:
                results[r] = kernel(*values, **attrs)
    if opdef.data_dependent:
        decision = _resolved(opdef, decision, results)
    return _wrap(decision, placement, results)


# The ranks of a placement this process owns, for the backend in force: asked on every dispatch, and a function of
# (backend, placement) alone. Keyed by the placement's token; rebuilt when another backend is installed.
_owned_ranks: dict[int, list[int]] = {}
_owned_backend: list[Any] = [None]


def _owned(placement: Placement, where: int) -> list[int]:
    backend = _comm._backend or get_backend()
    if backend is not _owned_backend[0]:
        _owned_ranks.clear()
        _owned_backend[0] = backend
    ranks = _owned_ranks.get(where)
    if ranks is None:
        ranks = _owned_ranks[where] = backend.owned(placement.flat_ranks)
    return ranks


def _resolved(opdef: OpDef, decision: Decision, results: dict[int, Any]) -> Decision:
    """The decision with each DYNAMIC output size read off a shard (never split, so a shard holds it whole)."""
    if not results:
        raise OpError(f"op {opdef.name!r} has a data-dependent output size, but this process holds no shard of "
                      "its placement to read it from")
    first = next(iter(results.values()))
    shards = first if isinstance(first, tuple) else (first,)
    metas = tuple(
        Meta(tuple(t.shape[d] if n == DYNAMIC else n for d, n in enumerate(m.shape)), m.dtype)
        for m, t in zip(decision.out_metas, shards, strict=True)
    )
    return Decision(metas, decision.in_sbps, decision.out_sbps, decision.plans, decision.in_metas, decision.positions,
                    decision.boxes)


def _boxed(t: Tensor, plan: boxing.Plan) -> dict[int, torch.Tensor]:
    """``t``'s shards converted by ``plan``, reusing a conversion another consumer of ``t`` already ran.

    Without this, a tensor read by several ops in one layout (x feeding q, k and v projections) would be
    gathered once per consumer, and a B parameter read by S(0) data sliced again on every step. An entry
    holds the source shards' torch version counters: any in-place update of a shard (an sbpflow in-place op,
    an optimizer's foreach kernel on the shards, a user's ``copy_``) invalidates it, as does ``t._version``.

    Op outputs cache every conversion. Leaves (parameters) cache only conversions with no collective: a
    process decides alone whether its copy is still valid, and a collective skipped on one process alone
    would leave its peers waiting.
    """
    source = t._shards or {}
    cache = t._boxed
    if cache is None:
        if not _local_only(plan):
            return boxing.execute(plan, source)
        cache = t._boxed = {}
    key = (plan.dst, t._version)
    versions = tuple([s._version for s in source.values()])
    entry = cache.get(key)
    if entry is not None and entry[0] == versions:
        return entry[1]
    shards = boxing.execute(plan, source)
    cache[key] = (versions, shards)
    return shards


def _local_only(plan: boxing.Plan) -> bool:
    return all(step.kind in ("local", "relabel") for step in plan.steps)


def _shard_ctx(rank: int, placement: Placement, decision: Decision, args: Sequence[Any]) -> ShardCtx:
    ctx = decision.shard_ctxs.get(rank)
    if ctx is None:
        ctx = decision.shard_ctxs[rank] = _new_shard_ctx(rank, placement, decision)
    return ctx


def _new_shard_ctx(rank: int, placement: Placement, decision: Decision) -> ShardCtx:
    in_metas, out_metas = decision.in_metas, decision.out_metas
    return ShardCtx(
        rank, placement,
        tuple(shard_box(m.shape, placement, s, rank) for m, s in zip(in_metas, decision.in_sbps, strict=True)),
        tuple(shard_box(m.shape, placement, s, rank) for m, s in zip(out_metas, decision.out_sbps, strict=True)),
        in_metas, out_metas, decision.in_sbps, decision.out_sbps,
    )


def _meta_outputs(opdef: OpDef, decision: Decision, placement: Placement, args: Sequence[Any]) -> Any:
    """The outputs of an op on meta tensors: the decision's metadata, no shards (see :mod:`sbpflow.meta`)."""
    if opdef.data_dependent:
        meta_arg = next(a for a in args if isinstance(a, Tensor) and a._shards is None)
        _meta.refuse(meta_arg, f"op {opdef.name!r}, whose output size depends on the data,")
    outs = tuple(Tensor._meta(m.shape, m.dtype, placement, s)
                 for m, s in zip(decision.out_metas, decision.out_sbps, strict=True))
    return outs[0] if len(outs) == 1 else outs


def _wrap(decision: Decision, placement: Placement, results: dict[int, Any]) -> Any:
    metas, sbps = decision.out_metas, decision.out_sbps
    if len(metas) == 1:
        meta = metas[0]
        out = _from_shards(Tensor, meta.shape, meta.dtype, placement, sbps[0], results)
        out._boxed = {}
        return out
    outs = []
    for j, m in enumerate(metas):
        shards = {r: res[j] for r, res in results.items()}
        outs.append(_from_shards(Tensor, m.shape, m.dtype, placement, sbps[j], shards))
        outs[-1]._boxed = {}
    return tuple(outs)


_from_shards = Tensor._from_shards.__func__  # type: ignore[attr-defined]  # the classmethod's function: one call less


def describe_decision(opdef: OpDef, decision: Decision) -> str:
    ins = ", ".join(format_nd(s) for s in decision.in_sbps)
    outs = ", ".join(format_nd(s) for s in decision.out_sbps)
    return f"{opdef.name}: ({ins}) -> ({outs})"
