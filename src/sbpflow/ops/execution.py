"""Execution of a decided op: box the inputs as decided, run the kernel on every owned shard, wrap the results.

Dispatch (ops.dispatch) decides once per input metadata and calls :func:`run`; the common case (one rank
here, inputs in place) it inlines itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import boxing
from .. import comm as _comm
from .. import meta as _meta
from .._layout import shard_box
from ..comm import get_backend
from ..errors import OpError
from ..placement import Placement
from ..tensor import Tensor
from .propagation import Decision
from .schema import DYNAMIC, Meta, OpDef, ShardCtx, run_shards

# The dispatch caches key a placement and an nd-SBP by a small int, not by value: hashing or comparing them runs
# Python __hash__/__eq__ methods (dataclasses) on every dispatch. id(value) -> (value, token): the entry holds the
# value itself, so its id is never reused while the entry lives; equal values share one token (_token_of), so
# tokens compare as the values do.
tokens: dict[int, tuple[Any, int]] = {}
_token_of: dict[Any, int] = {}


def token(value: Any) -> tuple[Any, int]:
    """``value``'s (value, token) entry, made on first sight of this object."""
    if len(tokens) >= 65536:  # bounded: SBP tuples built once and dropped (to_global calls) come and go
        tokens.clear()
    token = _token_of.setdefault(value, len(_token_of))
    entry = tokens[id(value)] = (value, token)
    return entry


def run(opdef: OpDef, decision: Decision, args: Sequence[Any], attrs: dict[str, Any], placement: Placement,
        where: int | None = None) -> Any:
    """Boxes the inputs as decided and runs the kernel on every owned shard (``where``: the placement's token)."""
    positions = decision.positions
    kernel = opdef.kernel
    owned = owned_ranks(placement, token(placement)[1] if where is None else where)
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
        per_rank: dict[int, list[Any]] = {}
        for r in owned:
            for pos, shards in zip(positions, shard_maps, strict=True):
                values[pos] = shards[r]  # type: ignore[index]  # global tensors always hold a shard dict
            if opdef.shard_aware:
                per_rank[r] = list(values)
            else:
                results[r] = kernel(*values, **attrs)
        if opdef.shard_aware:
            ctxs = {r: shard_ctx(r, placement, decision, args) for r in owned}
            results = run_shards(opdef, ctxs, per_rank, attrs)
    if opdef.data_dependent:
        decision = _resolved(opdef, decision, results)
    return _wrap(decision, placement, results)


# The ranks of a placement this process owns, for the backend in force: asked on every dispatch, and a function of
# (backend, placement) alone. Keyed by the placement's token; rebuilt when another backend is installed.
_owned_ranks: dict[int, list[int]] = {}
_owned_backend: list[Any] = [None]


def owned_ranks(placement: Placement, where: int) -> list[int]:
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


def shard_ctx(rank: int, placement: Placement, decision: Decision, args: Sequence[Any]) -> ShardCtx:
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


def meta_outputs(opdef: OpDef, decision: Decision, placement: Placement, args: Sequence[Any]) -> Any:
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
        out = from_shards(Tensor, meta.shape, meta.dtype, placement, sbps[0], results)
        out._boxed = {}
        return out
    outs = []
    for j, m in enumerate(metas):
        shards = {r: res[j] for r, res in results.items()}
        outs.append(from_shards(Tensor, m.shape, m.dtype, placement, sbps[j], shards))
        outs[-1]._boxed = {}
    return tuple(outs)


from_shards = Tensor._from_shards.__func__  # type: ignore[attr-defined]  # the classmethod's function: one call less
