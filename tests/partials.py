"""Partial inputs from random per-rank pieces: each piece is wrong alone, only the reduction is right.

A harness that builds a partial as the whole value on one rank and zeros (or copies) elsewhere cannot tell a
rule that treats a partial as complete from a right one; these pieces can.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import sbpflow
from harness import PLACEMENTS
from sbpflow import sbp as S
from sbpflow.tensor import Tensor


def pieces(value: torch.Tensor, pname: str, sbp: tuple[Any, ...], seed: int = 0,
           requires_grad: bool = False) -> Tensor:
    """A global tensor of logical ``value`` whose partial mesh axes hold random pieces.

    P(sum): zero-sum noise along the axis; P(max)/P(min): every rank but a random one per element
    holds a smaller/larger value. Other axes (S, B) are laid out as usual.
    """
    p = PLACEMENTS[pname]
    base = sbpflow.tensor(value, placement=p, sbp=sbp)
    gen = torch.Generator().manual_seed(seed)
    shards = {r: t.clone() for r, t in base.local_tensors().items()}
    for axis, s in enumerate(sbp):
        if isinstance(s, S.Partial) and p.hierarchy[axis] > 1:
            _perturb(shards, p, axis, s.op, gen)
    return Tensor._from_shards(tuple(value.shape), value.dtype, p, base.sbp, shards, requires_grad=requires_grad)


def _perturb(shards: dict[int, torch.Tensor], p: sbpflow.Placement, axis: int, op: str,
             gen: torch.Generator) -> None:
    size = p.hierarchy[axis]
    for group in p.axis_groups(axis):
        shape = shards[group[0]].shape
        if op == "sum":
            noise = torch.randn((size, *shape), generator=gen).to(shards[group[0]].dtype) * 3
            noise -= noise.mean(0, keepdim=True) if noise.dtype.is_floating_point else 0
            if not noise.dtype.is_floating_point:
                noise[-1] -= noise.sum(0)
        else:
            winner = torch.randint(0, size, shape, generator=gen)
            if shards[group[0]].dtype == torch.bool:  # a losing piece is False under max, True under min
                for k, r in enumerate(group):
                    lose = winner != k
                    shards[r] = torch.where(lose.to(shards[r].device), torch.tensor(op == "min"), shards[r])
                continue
            gap = torch.rand((size, *shape), generator=gen) + 0.5
            noise = torch.where(winner == torch.arange(size).reshape(-1, *[1] * len(shape)), 0.0, gap)
            noise = -noise if op == "max" else noise
        for k, r in enumerate(group):
            shards[r] = shards[r] + noise[k].to(shards[r].device, shards[r].dtype)  # noise drawn on CPU: seeded alike


def check_pieces(fn: Any, torch_fn: Any, values: list[torch.Tensor], pname: str, sbps: list[tuple[Any, ...]],
                 seed: int = 0, rtol: float = 1e-5, atol: float = 1e-5) -> tuple[Any, Any]:
    """Like ``harness.check`` with partial inputs from random pieces: forward values, then the gradients of the
    floating-point inputs (through a random upstream gradient) against torch's. Returns (output, forward log)."""
    from sbpflow.comm import record

    ours = [pieces(v, pname, s, seed=seed + i, requires_grad=v.dtype.is_floating_point)
            for i, (v, s) in enumerate(zip(values, sbps, strict=True))]
    theirs = [v.clone().requires_grad_(v.dtype.is_floating_point) for v in values]
    with record() as log:
        out = fn(*ours)
    ref = torch_fn(*theirs)
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=rtol, atol=atol)
    if ref.requires_grad:
        upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=ref.dtype)
        rank_sbp = (S.broadcast,) * PLACEMENTS[pname].ndim
        out.backward(sbpflow.tensor(upstream, placement=PLACEMENTS[pname], sbp=rank_sbp))
        ref.backward(upstream)
        for o, t in zip(ours, theirs, strict=True):
            if t.requires_grad:
                assert o.grad is not None and o.grad.sbp == o.sbp, "leaf gradient missing or in another layout"
                np.testing.assert_allclose(o.grad.numpy(), t.grad.numpy(), rtol=rtol, atol=atol)
    return out, log
