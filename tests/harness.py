"""The op autotest harness: run an sbpflow function on global tensors and compare with torch.

A case is a function over sbpflow tensors, the same function over torch tensors,
the logical input values, and a placement with one SBP per input. The harness
checks forward values, input gradients (through a random upstream gradient),
that every leaf gradient has its leaf's layout, and returns the comm log so
the caller can assert which collectives ran.

    out, log = check(lambda a, b: a @ b, lambda a, b: a @ b, [x, w], P2, [S(0), B])

Partial inputs are built from random per-rank pieces (:func:`partial_shards`):
each piece is wrong on its own and only their reduction is the value, so a
wrong partial rule (``abs`` declared linear, ``log`` of ``P(max)``) gives
wrong numbers here instead of passing on "whole value on rank 0, zeros
elsewhere".
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow._layout import shard_box
from sbpflow.comm import CommLog, get_backend, record
from sbpflow.models.hf import checkpoint_names
from sbpflow.sbp import Partial

# SBPFLOW_TEST_DEVICE=cuda runs the same cases on GPU shards (every virtual rank on cuda:(r % count)),
# against torch on CPU; TF32 is off so that matmuls and convolutions keep float32's precision.
DEVICE = os.environ.get("SBPFLOW_TEST_DEVICE", "cpu")
if DEVICE == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
PLACEMENTS = {
    "1": sbpflow.placement(DEVICE, [0]),
    "2": sbpflow.placement(DEVICE, [0, 1]),
    "3": sbpflow.placement(DEVICE, [0, 1, 2]),
    "2x2": sbpflow.placement(DEVICE, [[0, 1], [2, 3]]),
}
B = S.broadcast
PSUM = S.partial_sum


@dataclass
class Result:
    out: Any
    forward_log: CommLog
    backward_log: CommLog
    grads: list[Any]


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, (tuple, list)) else (x,)


def check(
    fn: Callable[..., Any],
    torch_fn: Callable[..., Any],
    values: Sequence[np.ndarray | torch.Tensor],
    placement: sbpflow.Placement | None,
    sbps: Sequence[Any] | None = None,
    *,
    grad: bool | Sequence[bool] = True,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
) -> Result:
    """Compares ``fn`` on sbpflow tensors with ``torch_fn`` on torch tensors, forward and backward."""
    values = [torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in values]
    needs = [grad] * len(values) if isinstance(grad, bool) else list(grad)
    needs = [n and v.dtype.is_floating_point for n, v in zip(needs, values, strict=True)]
    sbps = list(sbps) if sbps is not None else [B] * len(values)
    ours = [
        global_tensor(v, placement, s, seed=seed + 1000 * i, requires_grad=n)
        for i, (v, s, n) in enumerate(zip(values, sbps, needs, strict=True))
    ]
    theirs = [v.clone().requires_grad_(n) for v, n in zip(values, needs, strict=True)]
    with record() as flog:
        out = fn(*ours)
    ref = torch_fn(*theirs)
    outs, refs = _as_tuple(out), _as_tuple(ref)
    assert len(outs) == len(refs), f"{len(outs)} outputs, torch gives {len(refs)}"
    for o, r in zip(outs, refs, strict=True):
        assert tuple(o.shape) == tuple(r.shape), f"shape {tuple(o.shape)} != torch {tuple(r.shape)}"
        assert o.dtype == r.dtype, f"dtype {o.dtype} != torch {r.dtype}"
        np.testing.assert_allclose(_np(o.numpy()), _np(r.detach()), rtol=rtol, atol=atol)
    blog = CommLog()
    grads: list[Any] = []
    if any(needs):
        float_outs = [(o, r) for o, r in zip(outs, refs, strict=True) if r.dtype.is_floating_point and r.requires_grad]
        if float_outs:
            gen = torch.Generator().manual_seed(seed)
            upstream = [torch.randn(r.shape, generator=gen, dtype=r.dtype) for _, r in float_outs]
            with record() as blog:
                for (o, _), u in zip(float_outs, upstream, strict=True):
                    g = sbpflow.tensor(u, placement=placement, sbp=(B,) * placement.ndim if placement else None)
                    o.backward(g, retain_graph=True)
            torch.autograd.backward([r for _, r in float_outs], upstream)
            for o_in, t_in, n in zip(ours, theirs, needs, strict=True):
                if not n:
                    grads.append(None)
                    continue
                assert o_in.grad is not None, "missing gradient"
                if placement is not None:
                    assert o_in.grad.placement == o_in.placement and o_in.grad.sbp == o_in.sbp, (
                        f"leaf grad layout {o_in.grad.sbp} != leaf {o_in.sbp}"
                    )
                expected = t_in.grad if t_in.grad is not None else torch.zeros_like(t_in)
                np.testing.assert_allclose(_np(o_in.grad.numpy()), _np(expected), rtol=rtol, atol=atol)
                grads.append(o_in.grad)
    return Result(out, flog, blog, grads)


def global_tensor(value: Any, placement: sbpflow.Placement | None, sbp: Any, *, seed: int = 0,
                  requires_grad: bool = False, empty_share: float = 0.25) -> sbpflow.Tensor:
    """``sbpflow.tensor(value, placement, sbp)``, with every partial axis held as random pieces (seeded)."""
    t = sbpflow.tensor(value, placement=placement, sbp=sbp if placement is not None else None)
    if placement is not None and any(isinstance(s, Partial) for s in t.sbp):
        t._shards = partial_shards(torch.as_tensor(value), placement, t.sbp, seed=seed, empty_share=empty_share)
    return t.requires_grad_(requires_grad) if requires_grad else t


def partial_shards(value: torch.Tensor, placement: sbpflow.Placement, nd_sbp: tuple[Any, ...],
                   seed: int = 0, empty_share: float = 0.25) -> dict[int, torch.Tensor]:
    """``{rank: shard}`` of ``value`` where each partial mesh axis holds random pieces.

    Pieces are drawn axis by axis (mesh axis 0 first, then each piece again along axis 1), so the
    value is the reduction along the last partial axis, then the previous one. Split axes cut every
    piece like the value. Seeded, so a failure reproduces. ``empty_share``: the share of losing
    ``P(max)``/``P(min)`` elements that hold ±inf, as from an empty shard (0: finite pieces only).
    """
    gen = torch.Generator().manual_seed(seed)
    pieces: dict[tuple[int, ...], torch.Tensor] = {(): value}
    for axis, s in enumerate(nd_sbp):
        grown: dict[tuple[int, ...], torch.Tensor] = {}
        for key, v in pieces.items():
            n = placement.hierarchy[axis]
            parts = split_into_pieces(v, s.op, n, gen, empty_share) if isinstance(s, Partial) else [v]
            grown.update({key + (c,): piece for c, piece in enumerate(parts)})
        pieces = grown
    out = {}
    for r in get_backend().owned(placement.flat_ranks):
        coords = placement.coords(r)
        key = tuple(c if isinstance(s, Partial) else 0 for s, c in zip(nd_sbp, coords, strict=True))
        box = shard_box(tuple(value.shape), placement, nd_sbp, r)
        device = get_backend().device_for(placement.type, r)
        out[r] = pieces[key][tuple(slice(a, b) for a, b in box)].clone().to(device)
    return out


def split_into_pieces(value: torch.Tensor, op: str, n: int, gen: torch.Generator,
                      empty_share: float = 0.25) -> list[torch.Tensor]:
    """``n`` random tensors whose reduction by ``op`` ("sum", "max", "min") is ``value``, none equal to it alone."""
    if n == 1:
        return [value.clone()]
    if op == "sum":
        return _sum_pieces(value, n, gen)
    sign = 1 if op == "max" else -1
    # per element one rank holds the value; the others hold something below it (above, for min)
    winner = torch.randint(0, n, value.shape, generator=gen)
    return [torch.where(winner == i, value, _loser(value, sign, gen, empty_share)) for i in range(n)]


def _sum_pieces(value: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Noise pieces of the value's own magnitude, and a last piece completing the sum."""
    if value.dtype == torch.bool or value.dtype.is_complex:
        return [value.clone()] + [torch.zeros_like(value) for _ in range(n - 1)]
    if value.dtype.is_floating_point:
        wide = value.double()
        scale = 1 + torch.where(wide.isfinite(), wide.abs(), 0)
        noise = [(torch.randn(value.shape, generator=gen, dtype=torch.float64) * scale).to(value.dtype)
                 for _ in range(n - 1)]
        last = (wide - sum((x.double() for x in noise), torch.zeros_like(wide))).to(value.dtype)
    else:
        noise = [torch.randint(-100, 101, value.shape, generator=gen).to(value.dtype) for _ in range(n - 1)]
        last = value - sum(noise, torch.zeros_like(value))
    return noise + [last]


def _loser(value: torch.Tensor, sign: int, gen: torch.Generator, empty_share: float) -> torch.Tensor:
    """A piece at or below ``value`` (``sign=1``) or at or above it (``sign=-1``): never the winner's."""
    if value.dtype == torch.bool:
        coin = torch.rand(value.shape, generator=gen) < 0.5
        return value & coin if sign == 1 else value | coin
    if value.dtype.is_floating_point:
        wide = value.double()
        scale = 1 + torch.where(wide.isfinite(), wide.abs(), 0)
        gap = torch.rand(value.shape, generator=gen, dtype=torch.float64) * scale
        empty = torch.rand(value.shape, generator=gen) < empty_share  # as from an empty shard: the identity
        loser = torch.where(empty, -sign * float("inf"), wide - sign * (gap + 0.5))
        return loser.to(value.dtype)
    info = torch.iinfo(value.dtype)
    gap = torch.randint(1, 100, value.shape, generator=gen)
    wide = value.long() - sign * gap
    return wide.clamp(info.min, info.max).to(value.dtype)


def _np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


def random_sbp(shape: Sequence[int], placement: sbpflow.Placement, rng: random.Random, partial: bool = False,
               split: bool = True) -> tuple[Any, ...]:
    """A random valid n-D SBP for a tensor of ``shape``."""
    options: list[Any] = [B]
    if split:
        options += [S.split(d) for d in range(len(shape))]
    if partial:
        options.append(PSUM)
    return tuple(rng.choice(options) for _ in range(placement.ndim))


def assert_own_memory(x: sbpflow.Tensor) -> None:
    """An in-place update on one rank's shard must not change another rank's."""
    local = x.local_tensors()
    for r, t in local.items():
        if t.numel() == 0:
            continue
        before = {q: u.clone() for q, u in local.items() if q != r}
        t.add_(1)
        assert all(torch.equal(local[q], u) for q, u in before.items()), f"rank {r}'s shard is shared"
        t.sub_(1)


def all_reduce_payloads(log: CommLog) -> list[int]:
    """Bytes of the tensor each all-reduce call reduced, in call order: the bucket plan of a backward.

    The log counts ring traffic over the group's ranks, ``2 (p - 1)`` times the payload.
    """
    return [e.bytes // (2 * (len(e.ranks) - 1)) for e in log.events if e.kind == "all_reduce"]


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


class MeanSquareStep(sbpflow.nn.Graph):
    """A compiled training step whose loss is the mean square of ``model(x)``, or of ``model(x) - y`` given a
    target (MSE): the ZeRO and SBP-selection graph tests' step, on virtual ranks and on processes alike."""

    def __init__(self, model: Any, opt: Any) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x: Any, y: Any = None) -> Any:
        out = self.model(x)
        loss = (out if y is None else out - y).square().mean()
        loss.backward()
        return loss


class LossStep(sbpflow.nn.Graph):
    """A compiled training step for a model whose forward returns the loss: ``model(*inputs)``, backward, step."""

    def __init__(self, model: Any, opt: Any) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, *inputs: Any) -> Any:
        loss = self.model(*inputs)
        loss.backward()
        return loss


def per_expert(module: sbpflow.nn.Module, values: Callable[[Any], Any]) -> dict[str, np.ndarray]:
    """``values(p)`` (a numpy array) of every parameter by its unsplit name: the stacked experts' weights
    (``experts.w1``, split over an ep axis) as one ``experts.{e}.w1.weight`` per expert."""
    out = {}
    for name, p in module.named_parameters():
        names, value = checkpoint_names(module)[name], values(p)
        out.update({names[0]: value} if len(names) == 1 else dict(zip(names, value, strict=True)))
    return out
