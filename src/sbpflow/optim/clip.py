"""Gradient clipping by global norm, correct under any mix of layouts and placements (pipeline stages).

>>> import sbpflow
>>> w = sbpflow.nn.Parameter(sbpflow.ones(4, placement=sbpflow.placement("cpu", [0, 1]), sbp=sbpflow.sbp.split(0)))
>>> (w * 3.0).sum().backward()
>>> round(sbpflow.nn.utils.clip_grad_norm_([w], max_norm=1.0), 5)  # float32 norms, as torch's
6.0
>>> round(float(w.grad.numpy().sum()), 4)
2.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..autograd import no_grad
from ..errors import SbpflowError
from ..ops import functional as F
from ..ops.optimizer import grad_norm_multi, scale_multi
from ..sbp import Partial, Split, broadcast
from ..tensor import Tensor


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> float:
    """Scales all gradients in place so their joint ``norm_type``-norm is at most ``max_norm``; returns the norm.

    The scale is ``max_norm / (norm + 1e-6)`` when below 1, as in torch.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm_type = float(norm_type)
    if any(g._lazy is not None for g in grads):  # inside a compiled step: no Python float exists
        return _clip_traced(grads, max_norm, norm_type)
    with no_grad():
        total = _total_norm(grads, norm_type)
        if error_if_nonfinite and not math.isfinite(total):
            raise SbpflowError(f"clip_grad_norm_: the total {norm_type}-norm of the gradients is {total}")
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            _scale_(grads, coef)
    return total


def _clip_traced(grads: list[Tensor], max_norm: float, norm_type: float) -> Any:
    """The compiled form: the norm stays a (broadcast, 0-d) tensor and every gradient is scaled by
    ``min(1, max_norm / (norm + 1e-6))``, computed on the first placement and moved to each other one.
    Gradients of one layout make one norm op and one scale op (foreach kernels), partial ones one op each."""
    with no_grad():
        groups = _layout_groups(grads)
        combined, home = _combined_pieces(groups, norm_type)
        total = combined if math.isinf(norm_type) or norm_type == 1.0 else F.pow(combined, 1.0 / norm_type)
        coef = F.clamp(F.div(F.full_like(total, max_norm), F.add(total, 1e-6)), max=1.0)
        on: dict[Any, Tensor] = {home: coef}
        for (placement, sbp, _), members in groups.items():
            if placement not in on:
                on[placement] = F.to_global(coef, placement, (broadcast,) * placement.ndim)
            if _is_partial(sbp):
                for g in members:
                    g.mul_(on[placement])  # type: ignore[attr-defined]  # bound by sbpflow.ops.methods
                continue
            scaled = scale_multi(*members, on[placement])
            for g, new in zip(members, scaled if isinstance(scaled, tuple) else (scaled,), strict=True):
                g._assign(new)
    return total


def _layout_groups(grads: list[Tensor]) -> dict[tuple[Any, ...], list[Tensor]]:
    groups: dict[tuple[Any, ...], list[Tensor]] = {}
    for g in grads:
        groups.setdefault(_group_key(g), []).append(g)
    return groups


def _is_partial(sbp: Any) -> bool:
    return sbp is not None and any(isinstance(s, Partial) for s in sbp)


def _combined_pieces(groups: dict[tuple[Any, ...], list[Tensor]], norm_type: float) -> tuple[Tensor, Any]:
    """Every layout group's ``sum(|g|^p)`` (or max), combined per placement, then on the first placement (B)."""
    # A piece is P(sum) over split mesh axes (each shard counted once) and B over broadcast ones (not counted
    # once per rank); partial pieces stay partial while summed per placement, so each placement reduces once,
    # and the placements (pipeline stages) add up on the first one.
    combine = F.maximum if math.isinf(norm_type) else F.add
    per_placement: dict[Any, Tensor] = {}
    for (placement, sbp, _), members in groups.items():
        pieces = [_piece(g, norm_type) for g in members] if _is_partial(sbp) else \
            [grad_norm_multi(*members, norm_type=norm_type)]
        for piece in pieces:
            per_placement[placement] = piece if placement not in per_placement else \
                combine(per_placement[placement], piece)
    home = next(iter(per_placement))
    moved = [F.to_global(t, home, (broadcast,) * home.ndim) for t in per_placement.values()]
    combined = moved[0]
    for t in moved[1:]:
        combined = combine(combined, t)
    return combined, home


def _scale_(grads: list[Tensor], coef: float) -> None:
    """Multiplies every gradient in place by ``coef``: one foreach kernel over all their shards.

    An elementwise scale needs no layout logic (any SBP scales shard by shard, partial sums included), so it
    skips dispatch; the version bump invalidates boxed copies, as an in-place op would.
    """
    shards = [t for g in grads for t in g.local_tensors().values()]
    if shards:
        torch._foreach_mul_(shards, coef)
    for g in grads:
        g._version += 1


def _group_key(g: Tensor) -> tuple[Any, ...]:
    return (g.placement, g.sbp, g.dtype) if g.is_global else (None, None, g.dtype)


def _total_norm(grads: list[Tensor], norm_type: float) -> float:
    """The ``norm_type``-norm over every element of every gradient, as a Python float.

    Gradients of one (placement, SBP, dtype) give one piece through foreach norms over their shards; pieces on
    one placement are combined first (a partial sum plus a partial sum stays partial), so each placement
    reduces once, and only one scalar per placement moves to the first placement.
    """
    combine = F.maximum if math.isinf(norm_type) else F.add
    groups: dict[tuple[Any, ...], list[Tensor]] = {}
    for g in grads:
        groups.setdefault(_group_key(g), []).append(g)
    per_placement: dict[Any, Tensor] = {}
    for (placement, sbp, _), members in groups.items():
        for piece in _pieces(members, sbp, norm_type):
            key = placement
            per_placement[key] = piece if key not in per_placement else combine(per_placement[key], piece)
    values = [float(per_placement.pop(None).item())] if None in per_placement else []
    if per_placement:
        home = next(iter(per_placement))
        moved = [F.to_global(t, home, (broadcast,) * home.ndim) for t in per_placement.values()]
        combined = moved[0]
        for t in moved[1:]:
            combined = combine(combined, t)
        values.append(float(combined.item()))
    if math.isinf(norm_type):
        return max(values)
    total = sum(values)
    return total ** (1.0 / norm_type) if norm_type != 1.0 else total


def _pieces(members: list[Tensor], sbp: Any, norm_type: float) -> list[Tensor]:
    """The contribution of same-layout gradients: one foreach piece, or one piece each where partial."""
    if sbp is not None and any(isinstance(s, Partial) for s in sbp):
        return [_piece(g, norm_type) for g in members]  # |g|^p of a partial value needs the reduced value first
    return [_foreach_piece(members, sbp, norm_type)]


def _foreach_piece(members: list[Tensor], sbp: Any, norm_type: float) -> Tensor:
    """``sum |g|^p`` (or ``max |g|``) over split/broadcast gradients of one layout, on their shards directly.

    Each rank's value covers its own boxes, so the scalar is ``P(sum)`` (``P(max)``) over split mesh axes and
    ``B`` over broadcast ones: the same SBP an sbpflow reduction would give, without one dispatch per gradient.
    """
    first = members[0]
    ranks = list(first.local_tensors())
    values = {r: _shard_value([g.local_tensors()[r] for g in members], norm_type) for r in ranks}
    if not first.is_global:
        return Tensor._from_local(values[0])
    reduced = Partial("max") if math.isinf(norm_type) else Partial("sum")
    scalar_sbp = tuple(reduced if isinstance(s, Split) else s for s in sbp)
    dtype = next(iter(values.values())).dtype if values else first.dtype
    return Tensor._from_shards((), dtype, first.placement, scalar_sbp, values)


def _shard_value(shards: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """One rank's ``sum |g|^p`` (``max |g|``) over its shards: torch's foreach norms, then their p-th powers."""
    norms = torch.stack(torch._foreach_norm(shards, norm_type))
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()


def _piece(g: Tensor, norm_type: float) -> Tensor:
    """One gradient's contribution: ``max |g|`` (P(max) over splits) or ``sum |g|^p`` (P(sum) over splits)."""
    if math.isinf(norm_type):
        return F.amax(F.abs(g))
    if norm_type == 2.0:
        return F.sum(F.square(g))
    if norm_type == 1.0:
        return F.sum(F.abs(g))
    return F.sum(F.pow(F.abs(g), norm_type))


def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float) -> None:
    """Clamps every gradient element into ``[-clip_value, clip_value]`` in place."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    with no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.clamp_(-clip_value, clip_value)  # type: ignore[attr-defined]


__all__ = ["clip_grad_norm_", "clip_grad_value_"]
