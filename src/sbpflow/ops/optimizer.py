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


def _multi_metas(*metas: Any, **_: Any) -> tuple[Meta, ...]:
    tensors = [m for m in metas if isinstance(m, Meta)]
    k = len(tensors) // 4
    return tuple(tensors[:k]) * 3  # new parameters, first and second moments, shaped like the parameters


def _multi_sigs(*metas: Any, outs: Any, **_: Any) -> list[Sig]:
    n_in = sum(isinstance(m, Meta) for m in metas)
    ndim = min(len(m.shape) for m in outs)
    return [Sig((s,) * n_in, (s,) * len(outs)) for s in [broadcast] + [split(d) for d in range(ndim)]]


@op("adam_update_multi", meta=_multi_metas, sbp=_multi_sigs, differentiable=False)
def adam_update_multi(*args: Any, beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                      decoupled: bool = False, maximize: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`adam_update` over k parameters at once with foreach kernels: ``(p..., g..., m..., v..., lr, step)``
    -> ``(p'..., m'..., v'...)``. The moments' fresh outputs are updated in place (they are new tensors), the
    inputs never: the variables are written only when the whole step has succeeded."""
    *tensors, lr, step = args
    k = len(tensors) // 4
    ps, gs, ms, vs = (list(tensors[i * k:(i + 1) * k]) for i in range(4))
    if maximize:
        gs = list(torch._foreach_neg(gs))
    if weight_decay != 0:
        if decoupled:
            ps = list(torch._foreach_mul(ps, 1 - lr * weight_decay))
        else:
            gs = list(torch._foreach_add(gs, ps, alpha=weight_decay))
    m = list(torch._foreach_lerp(ms, gs, 1 - beta1))
    v = list(torch._foreach_mul(vs, beta2))
    torch._foreach_addcmul_(v, gs, gs, 1 - beta2)
    denom = list(torch._foreach_sqrt(v))
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    new_p = list(torch._foreach_addcdiv(ps, m, denom, -(lr / (1 - beta1**step))))
    return tuple(new_p + m + v)
