"""Optimizer updates as ops, for compiled steps (nn.Graph): pure functions of (parameter, gradient, state).

Eager optimizers update shards in place with foreach kernels (:mod:`sbpflow.optim`); a compiled step instead
traces these ops, whose outputs are assigned back to the variables after the whole step succeeded. The
arithmetic is the same elementwise sequence as the eager rules, so both give the same numbers. Every update
is elementwise: any split or broadcast signature shared by all operands works, never a partial one.
The learning rate and step count are per-step scalars (fed each step, not baked into the plan).
"""

from __future__ import annotations

from typing import Any

import torch

from ..sbp import broadcast, split
from .registry import Meta, Sig, op


def _same_metas(*metas: Any, n_out: int, **_: Any) -> tuple[Meta, ...]:
    first = next(m for m in metas if isinstance(m, Meta))  # every output is shaped like the parameter
    return (first,) * n_out


def _elementwise_sigs(*metas: Any, outs: Any, **_: Any) -> list[Sig]:
    n_in = sum(isinstance(m, Meta) for m in metas)
    ndim = len(outs[0].shape)
    sbps = [broadcast] + [split(d) for d in range(ndim)]
    return [Sig((s,) * n_in, (s,) * len(outs)) for s in sbps]


@op("sgd_update", meta=lambda *m, **a: _same_metas(*m, n_out=1), sbp=_elementwise_sigs, differentiable=False)
def sgd_update(p: torch.Tensor, g: torch.Tensor, lr: float, *, weight_decay: float = 0.0,
               maximize: bool = False) -> torch.Tensor:
    """``p - lr * (g + wd p)`` (``-g`` when maximizing)."""
    g = -g if maximize else g
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    return p.add(g, alpha=-lr)


@op("sgd_momentum_update", meta=lambda *m, **a: _same_metas(*m, n_out=2), sbp=_elementwise_sigs,
    differentiable=False)
def sgd_momentum_update(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float, started: float, *,
                        momentum: float, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                        maximize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SGD with momentum; the first step's buffer is the gradient itself (``started == 0``), as torch."""
    g = -g if maximize else g
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    new_buf = g.clone() if not started else (buf * momentum).add(g, alpha=1 - dampening)
    step = g.add(new_buf, alpha=momentum) if nesterov else new_buf
    return p.add(step, alpha=-lr), new_buf


@op("adam_update", meta=lambda *m, **a: _same_metas(*m, n_out=3), sbp=_elementwise_sigs, differentiable=False)
def adam_update(p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, lr: float,
                step: float, *, beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                decoupled: bool = False, maximize: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam (AdamW with ``decoupled``), the same operation sequence as :class:`sbpflow.optim.Adam`."""
    g = -g if maximize else g
    if weight_decay != 0:
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m = torch.lerp(exp_avg, g, 1 - beta1)
    v = (exp_avg_sq * beta2).addcmul(g, g, value=1 - beta2)
    step_size = -(lr / (1 - beta1**step))
    denom = (v.sqrt() / ((1 - beta2**step) ** 0.5)).add(eps)
    return p.addcdiv(m, denom, value=step_size), m, v
