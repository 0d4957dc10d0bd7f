"""Sharding propagation: an op's output metadata and the cheapest n-D signature for its inputs' SBPs.

Eager dispatch caches a decision per (op, input metadata); the tracer asks :func:`decide_traced`, whose
cache ignores a shift of the placement by whole nodes (pipeline stages of repeated layers decide once).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import boxing
from ..errors import OpError, SbpflowError
from ..placement import Placement
from ..sbp import SBP_TYPES, Broadcast, NdSbp, Partial, Split, format_nd, zigzag_valid
from ..tensor import Tensor
from .schema import DYNAMIC, Meta, OpDef, Scalar, ShardCtx, Sig


def describe_args(args: Sequence[Any]) -> str:
    parts = []
    for i, a in enumerate(args):
        parts.append(f"arg {i}: {a._describe()}" if isinstance(a, Tensor) else f"arg {i}: {type(a).__name__} {a!r}")
    return "; ".join(parts)


def arg_meta(a: Any) -> Any:
    if isinstance(a, Tensor):
        return Meta(tuple(a.shape), a.dtype)
    return Scalar(type(a))


def attrs_key(attrs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    # In call order, unsorted: a call site passes its keywords in one order, and another order only makes a second
    # (equal) cache entry, where sorting would cost every dispatch.
    return tuple(attrs.items()) if attrs else ()


def infer(opdef: OpDef, args: Sequence[Any], metas: Sequence[Any], attrs: dict[str, Any]) -> tuple[Meta, ...]:
    try:
        out = opdef.meta(*metas, **attrs)
    except SbpflowError as e:
        raise type(e)(f"op {opdef.name!r}: {e}; inputs: {describe_args(args)}") from None
    return out if isinstance(out, tuple) else (out,)


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


def decide(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], placement: Placement) -> Decision:
    """Meta inference plus the cheapest n-D signature for the inputs' current SBPs."""
    metas = tuple(arg_meta(a) for a in args)
    out_metas = infer(opdef, args, metas, attrs)
    tensors = [a for a in args if isinstance(a, Tensor)]
    in_metas = tuple(m for m in metas if isinstance(m, Meta))
    extra = {"mesh": placement.hierarchy} if opdef.mesh_aware else {}
    sigs = [s for s in opdef.sbp(*metas, outs=out_metas, **extra, **attrs) if sig_fits(s, tensors, out_metas)]
    if not sigs:
        raise OpError(f"op {opdef.name!r} has no SBP signature for {describe_args(args)}")
    sigs += zigzag_twins(opdef, sigs, [t.sbp for t in tensors], in_metas, out_metas, attrs)
    if opdef.data_dependent:
        _check_dynamic_not_split(opdef, sigs, out_metas)
    current = tuple(t.sbp for t in tensors)
    positions = tuple(i for i, a in enumerate(args) if isinstance(a, Tensor))
    exact = _exact_match(sigs, current, placement.ndim)
    if exact is not None:
        in_sbps, out_sbps = exact
        return Decision(out_metas, in_sbps, out_sbps, (None,) * len(tensors), in_metas, positions)
    has_partial = any(isinstance(s, Partial) for sbp in current for s in sbp)
    zigzag = any(isinstance(s, Split) and s.zigzag for sig in sigs for s in sig.ins + sig.outs)
    best: tuple[Any, ...] | None = None
    for combo in itertools.product(sigs, repeat=placement.ndim):
        in_sbps = tuple(tuple(sig.ins[i] for sig in combo) for i in range(len(tensors)))
        if zigzag and not _zigzags_valid(combo, in_sbps):
            continue
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


def sig_fits(sig: Sig, tensors: Sequence[Tensor], outs: Sequence[Meta]) -> bool:
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
    return (in_sbps, out_sbps) if all(zigzag_valid(nd) for nd in out_sbps) else None


def zigzag_twins(opdef: OpDef, sigs: Sequence[Sig], in_sbps: Sequence[NdSbp], in_metas: Sequence[Meta],
                 out_metas: Sequence[Meta], attrs: dict[str, Any]) -> list[Sig]:
    """:func:`zigzag_sigs` of an op whose inputs hold ``in_sbps``: none unless one is zigzag and the op declares
    where it reads box offsets (eager dispatch and nn.Graph's selection both ask)."""
    if opdef.box_offsets is None or not any(isinstance(s, Split) and s.zigzag for nd in in_sbps for s in nd):
        return []
    return zigzag_sigs(sigs, in_sbps, in_metas, out_metas, _offset_places(opdef.box_offsets, attrs))


def zigzag_sigs(sigs: Sequence[Sig], in_sbps: Sequence[NdSbp], in_metas: Sequence[Meta],
                out_metas: Sequence[Meta], box_offsets: tuple[tuple[int | None, int | None], ...] = ()) -> list[Sig]:
    """Zigzag twins of a kernel's signatures, offered when an input is split zigzag, so that it runs on as is.

    A kernel that never learns which rows its shard holds (no ShardCtx, or one whose ``box_offsets`` it reads
    are not split) has ``S`` rules that hold for any cut, down to one row per rank: it treats rows one by one
    along a split, so it treats a zigzag shard (two chunks end to end) right too. The twin turns every split of
    one signature into a zigzag when all of them cut dims of the zigzag input's length (one index space: the
    sequence); any other (a reshape merging it into a longer dim) keeps plain splits, and the input is boxed.
    ``box_offsets``: (tensor, dim) places where the kernel reads offsets, None for any; no twin splits them.
    """
    lengths = {m.shape[s.dim] for nd, m in zip(in_sbps, in_metas, strict=True) for s in nd
               if isinstance(s, Split) and s.zigzag}
    out = []
    for sig in sigs:
        splits = [(i, s, m) for i, (s, m) in enumerate(zip(sig.ins + sig.outs, (*in_metas, *out_metas), strict=True))
                  if isinstance(s, Split)]
        cut = {m.shape[s.dim] for _, s, m in splits}
        read = any(t in (i, None) and (d is None or d % m.ndim == s.dim) for i, s, m in splits
                   for t, d in box_offsets)
        if len(cut) == 1 and cut <= lengths and not read:
            out.append(Sig(tuple(_zigzag(s) for s in sig.ins), tuple(_zigzag(s) for s in sig.outs)))
    return out


def _offset_places(box_offsets: tuple[int | str | tuple[int, int], ...],
                   attrs: dict[str, Any]) -> tuple[tuple[int | None, int | None], ...]:
    """An op's ``box_offsets`` as (tensor, dim) places, None for any: a tensor index reads every dim, an
    attribute's dim is read in every tensor, a pair is one place (a negative dim counts from the end)."""
    return tuple(b if isinstance(b, tuple) else (b, None) if isinstance(b, int) else (None, attrs[b])
                 for b in box_offsets)


def _zigzag(s: Any) -> Any:
    return Split(s.dim, zigzag=True) if isinstance(s, Split) else s


def _zigzags_valid(combo: Sequence[Sig], in_sbps: tuple[NdSbp, ...]) -> bool:
    """Whether a combination of 1-D signatures gives every input and output a valid zigzag layout."""
    outs = (tuple(sig.outs[j] for sig in combo) for j in range(len(combo[0].outs)))
    return all(zigzag_valid(nd) for nd in in_sbps) and all(zigzag_valid(nd) for nd in outs)


def describe_decision(opdef: OpDef, decision: Decision) -> str:
    ins = ", ".join(format_nd(s) for s in decision.in_sbps)
    outs = ", ".join(format_nd(s) for s in decision.out_sbps)
    return f"{opdef.name}: ({ins}) -> ({outs})"


def decide_traced(opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any], placement: Placement,
                  factors: tuple[Any, ...]) -> Decision:
    """:func:`decide` for the tracer, under the target's collective cost ``factors``, cached by the key below."""
    key = _decision_key(opdef, args, attrs, placement, factors)
    decision = _TRACED.get(key)
    if decision is None:
        with boxing.target_factors(factors):
            decision = _TRACED[key] = decide(opdef, args, attrs, placement)
    return decision


# (op, placement up to a shift by whole nodes, (shape, dtype, sbp) or type per arg, attrs, cost model, factors)
# -> Decision. Tracing keeps only a decision's metadata and SBPs, which a shift of every rank by whole nodes
# leaves alone (the cost model tells links apart by node only): repeated layers on the stages of a pipeline
# (each its own placement) decide once. Of the decision's boxing plans, which name the placement, nothing is used.
_TRACED: dict[Any, Decision] = {}


def _decision_key(opdef: Any, args: Sequence[Any], attrs: dict[str, Any], placement: Placement,
                  factors: tuple[Any, ...]) -> tuple[Any, ...]:
    model = boxing.get_cost_model()
    key_args = tuple((a._shape, a._dtype, a._sbp) if isinstance(a, Tensor) else type(a) for a in args)
    return (opdef.name, _shape_of_placement(placement, model.ranks_per_node), key_args, attrs_key(attrs),
            model, factors)


def _shape_of_placement(placement: Placement, ranks_per_node: int) -> tuple[Any, ...]:
    """``placement`` with its ranks shifted down by whole nodes: what the cost of a boxing on it depends on."""
    ranks = placement.flat_ranks
    base = min(ranks) // ranks_per_node * ranks_per_node
    return (placement.type, placement.hierarchy, tuple(r - base for r in ranks))
