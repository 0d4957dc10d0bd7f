"""Dispatch: every op call enters :func:`apply`, which runs it on local tensors, or decides and runs it on
global ones, and records it for autograd.

Dispatch owns an interpreter stack (eager, meta, and the tracer pushed while nn.Graph traces) and an input
hook list (autocast's), so this module imports neither the tracer nor amp: they register here from above.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol

import torch

from .. import boxing
from .._layout import Box
from ..autograd.node import Node
from ..boxing.plan import _cost_model as _cost_model_stack
from ..creation import tensor as make_tensor
from ..distributed import activity
from ..errors import AutocastWarning, LocalGlobalError, OpError
from ..placement import DEVICE_TYPES, Placement
from ..sbp import NdSbp, broadcast
from ..tensor import Tensor
from . import schema
from .execution import from_shards, meta_outputs, owned_ranks, run, shard_ctx, token, tokens
from .propagation import Decision, arg_meta, attrs_key, decide, describe_args, infer
from .schema import Meta, OpDef, ShardCtx, run_shards
from .views import refresh


class Interpreter(Protocol):
    """What runs global ops and conversions instead of eager dispatch while it is pushed (graph.trace.Tracer)."""

    def apply_global(self, opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Any: ...

    def to_global(self, x: Tensor, placement: Placement, sbp: NdSbp) -> Tensor: ...

    def root_grad(self, root: Tensor) -> Tensor: ...


INTERPRETERS: list[Interpreter] = []  # pushed ones (the tracer); the last is in force, and empty means Eager


class EagerInterpreter:
    """The interpreter when none is pushed: global ops run on their shards, conversions box them."""

    def apply_global(self, opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
        return _eager_global(opdef, args, attrs)

    def to_global(self, x: Tensor, placement: Placement, sbp: NdSbp) -> Tensor:
        plan = boxing.plan(tuple(x.shape), x.dtype, boxing.Layout(x.placement, x.sbp), boxing.Layout(placement, sbp))
        return Tensor._from_shards(tuple(x.shape), x.dtype, placement, sbp, boxing.execute(plan, x._shards or {}))

    def root_grad(self, root: Tensor) -> Tensor:
        """Ones, broadcast on every rank: B rather than the root's own SBP, since a partial root would make every
        gradient below it partial too."""
        shape = tuple(root.shape)
        shards = {r: torch.ones(shape, dtype=root.dtype, device=t.device) for r, t in (root._shards or {}).items()}
        return Tensor._from_shards(shape, root.dtype, root.placement, (broadcast,) * root.placement.ndim, shards)


class MetaInterpreter:
    """Tensors built under :func:`sbpflow.meta_init` (no shards) take it by their data, not a push: metadata in,
    metadata out, with the same decisions as eager."""

    def apply_global(self, opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
        return _eager_global(opdef, args, attrs)  # the decision is eager's; the first meta input ends it in outputs

    def outputs(self, opdef: OpDef, decision: Decision, placement: Placement, args: Sequence[Any]) -> Any:
        return meta_outputs(opdef, decision, placement, args)

    def to_global(self, x: Tensor, placement: Placement, sbp: NdSbp) -> Tensor:
        return Tensor._meta(tuple(x.shape), x.dtype, placement, sbp)

    def root_grad(self, root: Tensor) -> Tensor:
        return Tensor._meta(tuple(root.shape), root.dtype, root.placement, (broadcast,) * root.placement.ndim)


EAGER, META = EagerInterpreter(), MetaInterpreter()


def interpreter_for(x: Tensor) -> Interpreter:
    """The interpreter that runs what ``x`` takes part in: a pushed one (tracing), else META for a meta tensor,
    else EAGER."""
    if INTERPRETERS:
        return INTERPRETERS[-1]
    return META if x.is_meta else EAGER

InputHook = Callable[[str, Sequence[Any]], Sequence[Any]]  # (op name, args) -> args, e.g. autocast's casts


class _InputHooks(threading.local):
    def __init__(self) -> None:
        self.stack: list[InputHook] = []


INPUT_HOOKS = _InputHooks()  # per thread, as autocast's own state: amp.autocast pushes its casting here


class _Implicit(threading.local):
    def __init__(self) -> None:
        self.depth = 0


_IMPLICIT = _Implicit()


@contextmanager
def implicit_broadcast() -> Iterator[None]:
    """Inside, a local tensor that meets global ones is taken as broadcast (B) on their placement.

    For model files written for one device, such as nanoGPT's ``pos = torch.arange(0, t)`` added to a global
    embedding: the local value must be the same on every process, as a Python scalar's is (DTensor's
    ``implicit_replication``). Outside, mixing raises :class:`LocalGlobalError`, since a local tensor that differs
    per process would silently become a different global value on each.
    """
    _IMPLICIT.depth += 1
    try:
        yield
    finally:
        _IMPLICIT.depth -= 1


# Pipelines' stage orders, earliest stage first, entered from above (sbpflow.parallelize, for its model's
# forward): an op whose global inputs lie on different stages of one pipeline runs on the latest of them.
_STAGE_ORDERS: list[tuple[Placement, ...]] = []


@contextmanager
def stage_order(stages: Sequence[Placement]) -> Iterator[None]:
    """Inside the block, an op whose inputs lie on several of ``stages`` runs on the latest: the earlier inputs
    move there.

    A residual added in a parent's forward (``x = x + blk(x)``) meets ``x`` on one stage and ``blk(x)`` on the
    next; the earlier one moves as a pipeline send would (SBP kept, the gradient moves back). Placements on no
    entered pipeline, on two different ones, or outside the block still raise :class:`OpError`.
    """
    _STAGE_ORDERS.append(tuple(stages))
    try:
        yield
    finally:
        _STAGE_ORDERS.pop()


def _to_latest_stage(args: Sequence[Any]) -> tuple[Any, ...] | None:
    """``args`` with each global tensor moved to the latest of their stages, if one pipeline holds them all."""
    places = {a._placement for a in args if isinstance(a, Tensor) and a._placement is not None}
    for order in _STAGE_ORDERS:
        if places.issubset(order):
            latest = max(places, key=order.index)
            return tuple(a.to_global(placement=latest) if isinstance(a, Tensor) and a._placement is not None
                         and a._placement != latest else a for a in args)
    return None


def _broadcast_locals(args: Sequence[Any]) -> tuple[Any, ...]:
    """``args`` with each local tensor made global, broadcast on the first global tensor's placement."""
    placement = next(a._placement for a in args if isinstance(a, Tensor) and a._placement is not None)
    sbp = (broadcast,) * placement.ndim
    return tuple(a.to_global(placement, sbp) if isinstance(a, Tensor) and a._local is not None else a
                 for a in args)


def apply(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """Runs ``opdef`` on ``args``: meta, signature choice, boxing, kernels, autograd record."""
    hooks = INPUT_HOOKS.stack
    if hooks:  # inside sbpflow.autocast: the op's policy casts its inputs first
        args = hooks[-1](opdef.name, args)
    # One pass over the args: local or global (never both), whether any needs a gradient, and the argument part
    # of the dispatch cache key (_local_key / _global_key, built here so that the args are walked once).
    is_global: bool | None = None
    needs_grad = False
    has_torch = False
    placement = None
    where_token = None  # the placement's token (see token)
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
                if _IMPLICIT.depth:
                    return apply(opdef, _broadcast_locals(args), attrs)
                raise LocalGlobalError(
                    f"op {opdef.name!r} got local and global tensors together: {describe_args(args)}; "
                    "convert the local ones with .to_global(placement, sbp), or run under "
                    "sbpflow.implicit_broadcast() if they hold the same values on every process"
                )
            if not needs_grad and a.requires_grad:
                needs_grad = True
            if here:
                where = a._placement
                entry = tokens.get(id(where))
                if entry is None or entry[0] is not where:
                    entry = token(where)
                if placement is None:
                    placement, where_token = where, entry[1]
                elif entry[1] != where_token:
                    one_placement = False  # _apply_global raises, naming the args as it sees them
                sbp = a._sbp
                entry = tokens.get(id(sbp))
                key_args.append((a._shape, a._dtype, (entry if entry is not None and entry[0] is sbp
                                                      else token(sbp))[1]))
            else:
                key_args.append((local.shape, local.dtype))  # type: ignore[union-attr]
        elif isinstance(a, torch.Tensor):
            has_torch = True
        else:
            key_args.append(type(a))
            values.append(a)
    if not one_placement and _STAGE_ORDERS:
        moved = _to_latest_stage(args)
        if moved is not None:
            return apply(opdef, moved, attrs)
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
    if needs_grad and opdef.differentiable and torch.is_grad_enabled():  # sbpflow's grad mode is torch's
        record(opdef, args, attrs, outputs if isinstance(outputs, tuple) else (outputs,))
    return outputs


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


def record(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], outs: tuple[Tensor, ...]) -> None:
    node = Node(opdef, args, outs, attrs, opdef.save_outputs)
    for i, o in enumerate(outs if opdef.diff_outputs is None else outs[:opdef.diff_outputs]):
        local = o._local
        dtype = o._dtype if local is None else local.dtype
        if dtype.is_floating_point or dtype.is_complex:  # type: ignore[union-attr]
            o.requires_grad = True
            o.grad_fn = node
            o._out_index = i


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
    key = (opdef.name, key_args, tuple(attrs.items()) if attrs else ())  # attrs as attrs_key gives them
    cached = _local_cache.get(key)
    if cached is None:
        metas = tuple(arg_meta(a) for a in args)
        out_metas = infer(opdef, args, metas, attrs)
        ctx = None
        if opdef.shard_aware:
            in_metas = tuple(m for m in metas if isinstance(m, Meta))
            ctx = ShardCtx(0, None, tuple(_full(m) for m in in_metas), tuple(_full(m) for m in out_metas), in_metas,
                           out_metas, (), ())
        cached = _local_cache[key] = (out_metas, ctx)
    if values is None:
        values = [a._local if isinstance(a, Tensor) else a for a in args]
    if cached[1] is not None:
        result = run_shards(opdef, {0: cached[1]}, {0: values}, attrs)[0]
    else:
        result = opdef.kernel(*values, **attrs)
    if isinstance(result, tuple):
        return tuple(Tensor._from_local(r) for r in result)
    return Tensor._from_local(result)


def _full(m: Meta) -> Box:
    return tuple((0, n) for n in m.shape)


# (op name, placement token, (shape, dtype, sbp token) or scalar type per arg, attrs, cost model, collective cost
# factors in force) -> Decision
_global_cache: dict[Any, Decision] = {}


def _apply_global(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], key_args: Any = None,
                  placement: Placement | None = None, where: int | None = None) -> Any:
    if INTERPRETERS:  # nn.Graph is tracing build(): the tracer records a node, runs nothing
        return INTERPRETERS[-1].apply_global(opdef, args, attrs)
    return _eager_global(opdef, args, attrs, key_args, placement, where)


def _eager_global(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], key_args: Any = None,
                  placement: Placement | None = None, where: int | None = None) -> Any:
    """:class:`EagerInterpreter`'s global op: decide (cached), box the inputs, run the kernel on every owned rank."""
    if key_args is None:
        placement, where, key_args = _global_key(opdef, args)
    assert placement is not None  # apply() saw a global tensor
    key = (opdef.name, where, key_args, attrs_key(attrs) if attrs else (), id(_cost_model_stack[-1]),
           boxing.current_factors())
    decision = _global_cache.get(key)
    if decision is None:
        _keep_cost_model_alive()
        decision = decide(opdef, args, attrs, placement)
        _global_cache[key] = decision
    for pos in decision.positions:
        if args[pos]._shards is None:  # a meta tensor (sbpflow.meta_init): metadata in, metadata out
            return META.outputs(opdef, decision, placement, args)
    if decision.boxes:
        with activity(opdef.activity):  # named in comm errors raised while its inputs are boxed
            return run(opdef, decision, args, attrs, placement, where)
    if opdef.data_dependent:
        return run(opdef, decision, args, attrs, placement, where)
    owned = owned_ranks(placement, where)  # type: ignore[arg-type]
    if len(owned) != 1:
        return run(opdef, decision, args, attrs, placement, where)
    # the common case, run and _wrap inlined: inputs in place, one rank in this process
    r = owned[0]
    values = list(args)
    for pos in decision.positions:
        values[pos] = args[pos]._shards[r]  # type: ignore[index]  # global tensors always hold a shard dict
    if opdef.shard_aware:
        result = run_shards(opdef, {r: shard_ctx(r, placement, decision, args)}, {r: values}, attrs)[r]
    else:
        result = opdef.kernel(*values, **attrs)
    metas, sbps = decision.out_metas, decision.out_sbps
    if len(metas) == 1:
        meta = metas[0]
        out = from_shards(Tensor, meta.shape, meta.dtype, placement, sbps[0], {r: result})
        out._boxed = {}
        return out
    outs = []
    for m, sbp, shard in zip(metas, sbps, result, strict=True):
        o = from_shards(Tensor, m.shape, m.dtype, placement, sbp, {r: shard})
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
                    f"({describe_args(args)}); move one with .to_global(placement=...)"
                )
            sbp = a._sbp
            entry = tokens.get(id(sbp))
            key_args.append((a._shape, a._dtype, (entry if entry is not None and entry[0] is sbp
                                                  else token(sbp))[1]))
        else:
            key_args.append(type(a))
    return placement, None if placement is None else token(placement)[1], tuple(key_args)


_cost_models: dict[int, boxing.CostModel] = {}  # keeps every model that keyed a decision alive, so ids stay unique


def _keep_cost_model_alive() -> None:
    """Decisions are keyed by the cost model in force (its id) and the backend's cost factors (gloo's
    reduce-scatter costs an all-reduce): a ``boxing.cost_model(...)`` block, or another installed backend,
    must not reuse others'. A model that keys a decision is kept alive, so that its id is never reused."""
    model = boxing.get_cost_model()
    _cost_models.setdefault(id(model), model)


schema.apply = apply  # OpDef.__call__ dispatches here
