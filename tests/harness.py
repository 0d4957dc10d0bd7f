"""The op autotest harness: run an sbpflow function on global tensors and compare with torch.

A case is a function over sbpflow tensors, the same function over torch tensors,
the logical input values, and a placement with one SBP per input. The harness
checks forward values, input gradients (through a random upstream gradient),
that every leaf gradient has its leaf's layout, and returns the comm log so
the caller can assert which collectives ran.

    out, log = check(lambda a, b: a @ b, lambda a, b: a @ b, [x, w], P2, [S(0), B])
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import CommLog, record

PLACEMENTS = {
    "1": sbpflow.placement("cpu", [0]),
    "2": sbpflow.placement("cpu", [0, 1]),
    "3": sbpflow.placement("cpu", [0, 1, 2]),
    "2x2": sbpflow.placement("cpu", [[0, 1], [2, 3]]),
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
        sbpflow.tensor(v, placement=placement, sbp=s if placement is not None else None, requires_grad=n)
        for v, s, n in zip(values, sbps, needs, strict=True)
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


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
