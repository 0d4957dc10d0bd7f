"""Optimizer updates as ops, for compiled steps (nn.Graph): pure functions of (parameter, gradient, state).

The arithmetic is the eager optimizers' (for Adam: torch's fused kernel, else the foreach sequence), so both
give the same numbers; the learning rate and step count are fed each step, not baked into the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..sbp import Partial, broadcast, split
from .schema import Meta, Sig, op


def _same_metas(*metas: Any, n_out: int, **_: Any) -> tuple[Meta, ...]:
    first = next(m for m in metas if isinstance(m, Meta))  # every output is shaped like the parameter
    return (first,) * n_out


# Every update is elementwise: any split or broadcast signature shared by all operands works, never a partial one.
def _elementwise_sigs(*metas: Any, outs: Any, **_: Any) -> list[Sig]:
    n_in = sum(isinstance(m, Meta) for m in metas)
    ndim = len(outs[0].shape)
    sbps = [broadcast] + [split(d) for d in range(ndim)]
    return [Sig((s,) * n_in, (s,) * len(outs)) for s in sbps]


def sgd_update_(p: torch.Tensor, g: torch.Tensor, lr: float, *, weight_decay: float = 0.0,
                maximize: bool = False) -> None:
    """In place: ``p -= lr * (g + wd p)`` (``-g`` when maximizing)."""
    g = -g if maximize else g
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    p.add_(g, alpha=-lr)


@op("sgd_update", meta=lambda *m, **a: _same_metas(*m, n_out=1), sbp=_elementwise_sigs, differentiable=False)
def sgd_update(p: torch.Tensor, g: torch.Tensor, lr: float, *, weight_decay: float = 0.0,
               maximize: bool = False) -> torch.Tensor:
    """``p - lr * (g + wd p)`` (``-g`` when maximizing)."""
    new_p = p.clone()
    sgd_update_(new_p, g, lr, weight_decay=weight_decay, maximize=maximize)
    return new_p


def sgd_momentum_update_(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float, started: float, *,
                         momentum: float, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                         maximize: bool = False) -> None:
    """In place on ``p`` and ``buf``: SGD with momentum; the first step's buffer is the gradient itself
    (``started == 0``), as torch."""
    g = -g if maximize else g
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    if not started:
        buf.copy_(g)
    else:
        buf.mul_(momentum).add_(g, alpha=1 - dampening)
    p.add_(g.add(buf, alpha=momentum) if nesterov else buf, alpha=-lr)


@op("sgd_momentum_update", meta=lambda *m, **a: _same_metas(*m, n_out=2), sbp=_elementwise_sigs,
    differentiable=False)
def sgd_momentum_update(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float, started: float, *,
                        momentum: float, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                        maximize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SGD with momentum: the new parameter and momentum buffer."""
    new_p, new_buf = p.clone(), buf.clone()
    sgd_momentum_update_(new_p, g, new_buf, lr, started, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
    return new_p, new_buf


def _multi_metas(*metas: Any, **_: Any) -> tuple[Meta, ...]:
    tensors = [m for m in metas if isinstance(m, Meta)]
    k = len(tensors) // 4
    return tuple(tensors[:k]) * 3  # new parameters, first and second moments, shaped like the parameters


def _multi_sigs(*metas: Any, outs: Any, **_: Any) -> list[Sig]:
    n_in = sum(isinstance(m, Meta) for m in metas)
    ndim = min(len(m.shape) for m in outs)
    return [Sig((s,) * n_in, (s,) * len(outs)) for s in [broadcast] + [split(d) for d in range(ndim)]]


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def adam_fused_(ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor],
                maxs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, decoupled: bool, maximize: bool) -> bool:
    """Adam's update by torch's fused kernel (``_fused_adam_`` / ``_fused_adamw_``: one pass over each
    parameter's memory, where the foreach sequence makes seven), when every tensor shares one device (cpu or
    cuda) and one floating dtype, and the tensors written are contiguous. ``steps[i]``: parameter i's step
    count as a tensor on that device (read, not advanced). ``maxs``: AMSGrad's running maxima, or empty.
    Returns False, with nothing written, where the kernel does not apply. The moments come out bit-identical
    to the foreach sequence's, the parameters within an ulp."""
    if not ps:
        return False
    device, dtype = ps[0].device, ps[0].dtype
    if device.type not in ("cpu", "cuda") or dtype not in FUSED_DTYPES:
        return False
    if any(t.device != device or t.dtype != dtype for ts in (ps, gs, ms, vs, maxs) for t in ts):
        return False
    if not all(t.is_contiguous() for ts in (ps, ms, vs, maxs) for t in ts):  # written in place, as flat memory
        return False
    gs = [g if g.is_contiguous() else g.contiguous() for g in gs]  # read as flat memory (a sum's grad is expanded)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(ps, gs, ms, vs, maxs, steps, lr=float(lr), beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
           amsgrad=bool(maxs), maximize=maximize)
    return True


def adam_update_multi_(*args: Any, beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                       decoupled: bool = False, maximize: bool = False,
                       workspace: dict[str, Any] | None = None) -> None:
    """In place on the parameters and moments: ``(p..., g..., m..., v..., lr, step)``, k of each, with eager
    Adam's rule (:meth:`sbpflow.optim.Adam._update`): torch's fused kernel where it applies, else the foreach
    sequence. ``workspace``: a dict kept from one call to the next, where the step tensor and the foreach
    denominators live (allocated once instead of every step)."""
    *tensors, lr, step = args
    k = len(tensors) // 4
    ps, gs, ms, vs = (list(tensors[i * k:(i + 1) * k]) for i in range(4))
    if adam_fused_(ps, gs, ms, vs, [], [_step_tensor(step, ps, workspace)] * k, lr=lr, beta1=beta1, beta2=beta2,
                   eps=eps, weight_decay=weight_decay, decoupled=decoupled, maximize=maximize):
        return
    if maximize:
        gs = list(torch._foreach_neg(gs))
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(ps, 1 - lr * weight_decay)
        else:
            gs = list(torch._foreach_add(gs, ps, alpha=weight_decay))
    torch._foreach_lerp_(ms, gs, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
    denom = _sqrt(vs, workspace)
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(ps, ms, denom, -(lr / (1 - beta1**step)))


def _step_tensor(step: float, ps: list[torch.Tensor], workspace: dict[str, Any] | None) -> torch.Tensor:
    """The step count as a 0-d float32 tensor on the parameters' device (the fused kernel's form); a
    workspace's tensor is filled in place, which costs no host-device sync."""
    device = ps[0].device if ps else torch.device("cpu")
    if workspace is None:
        return torch.tensor(float(step), dtype=torch.float32, device=device)
    t = workspace.get("step")
    if t is None or t.device != device:
        t = workspace["step"] = torch.zeros((), dtype=torch.float32, device=device)
    return t.fill_(float(step))


def _sqrt(vs: list[torch.Tensor], workspace: dict[str, Any] | None) -> list[torch.Tensor]:
    """``sqrt(v)`` for each v: new tensors, or the workspace's (the same bits: sqrt is correctly rounded)."""
    if workspace is None:
        return list(torch._foreach_sqrt(vs))
    out = workspace.get("denom")
    if out is None or [t.shape for t in out] != [v.shape for v in vs]:
        out = workspace["denom"] = [torch.empty_like(v) for v in vs]
    for v, o in zip(vs, out, strict=True):
        torch.sqrt(v, out=o)
    return out


@op("adam_update_multi", meta=_multi_metas, sbp=_multi_sigs, differentiable=False)
def adam_update_multi(*args: Any, beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                      decoupled: bool = False, maximize: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`adam_update_multi_` over k parameters on fresh copies: ``(p..., g..., m..., v..., lr, step)`` ->
    ``(p'..., m'..., v'...)``; the inputs are never written."""
    *tensors, lr, step = args
    k = len(tensors) // 4
    ps, gs, ms, vs = (list(tensors[i * k:(i + 1) * k]) for i in range(4))
    new_p, new_m, new_v = ([t.clone() for t in ts] for ts in (ps, ms, vs))
    adam_update_multi_(*new_p, *gs, *new_m, *new_v, lr, step, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay, decoupled=decoupled, maximize=maximize)
    return tuple(new_p + new_m + new_v)


# -- gradient clipping over many gradients at once (compiled clip_grad_norm_) ---------------------------------


def _norm_sigs(*metas: Any, outs: Any, norm_type: float) -> list[Sig]:
    n_in = sum(isinstance(m, Meta) for m in metas)
    ndim = min(len(m.shape) for m in metas if isinstance(m, Meta))
    reduced = Partial("max") if math.isinf(norm_type) else Partial("sum")  # each rank covers its own elements
    return [Sig((broadcast,) * n_in, (broadcast,))] + [Sig((split(d),) * n_in, (reduced,)) for d in range(ndim)]


@op("grad_norm_multi", meta=lambda *m, **a: (Meta((), m[0].dtype),), sbp=_norm_sigs, differentiable=False)
def grad_norm_multi(*grads: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for p = inf) over every element of k gradients: torch's foreach norms, then their
    p-th powers, as eager ``clip_grad_norm_`` (:mod:`sbpflow.optim.clip`)."""
    norms = torch.stack(torch._foreach_norm(list(grads), norm_type))
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()


def _scale_sigs(*metas: Any, outs: Any) -> list[Sig]:
    k = len(outs)
    ndim = min(len(m.shape) for m in outs)
    return [Sig((s,) * k + (broadcast,), (s,) * k) for s in [broadcast] + [split(d) for d in range(ndim)]]


@op("scale_multi", meta=lambda *m, **a: tuple(m[:-1]), sbp=_scale_sigs, differentiable=False)
def scale_multi(*args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``(g..., c)`` -> ``(g * c...)``: k gradients times one 0-d factor, one foreach kernel (one gradient: a
    tensor, as every one-output op)."""
    *grads, coef = args
    out = torch._foreach_mul(grads, coef)
    return out[0] if len(out) == 1 else tuple(out)


@dataclass(frozen=True)
# Each op has an in-place kernel (IN_PLACE) that writes its parameter and state arguments; the op itself is that
# kernel run on fresh copies, so both give the same bits. Where an update's outputs go straight back to their
# variables, the lowering makes the op and its assigns one update node (graph.lower.in_place_updates), run on
# the variables' storage once the step succeeded: no copies, no new buffers.
class InPlace:
    """The in-place form of an update op: its kernel, which tensor input each output overwrites, and whether the
    kernel takes a ``workspace`` dict (temporaries kept between steps, one dict per node and rank)."""

    kernel: Callable[..., None]
    writes: Callable[[int], list[tuple[int, int]]]  # tensor inputs -> [(output index, input index)]
    workspace: bool = False


def _adam_writes(n_in: int) -> list[tuple[int, int]]:
    k = n_in // 4  # inputs (p, g, m, v) x k; outputs (p', m', v') x k
    return [(j, j) for j in range(k)] + [(k + j, 2 * k + j) for j in range(k)] + \
        [(2 * k + j, 3 * k + j) for j in range(k)]


IN_PLACE: dict[str, InPlace] = {
    "sgd_update": InPlace(sgd_update_, lambda n_in: [(0, 0)]),
    "sgd_momentum_update": InPlace(sgd_momentum_update_, lambda n_in: [(0, 0), (1, 2)]),
    "adam_update_multi": InPlace(adam_update_multi_, _adam_writes, workspace=True),
}
