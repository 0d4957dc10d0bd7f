"""Adam and AdamW (torch.optim.Adam/AdamW's rules, run per shard with torch's fused kernel, else foreach)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch

from ..errors import ArgumentError, SbpflowError
from ..graph.trace import StepScalar
from ..ops.optimizer import adam_fused_, adam_update_multi
from .optimizer import Optimizer, ShardBatch


class Adam(Optimizer):
    """Adam; ``weight_decay`` adds ``wd * p`` to the gradient (L2), AdamW decays the weights instead.

    >>> import sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.ones(2))
    >>> opt = sbpflow.optim.Adam([w], lr=0.1)
    >>> w.sum().backward()
    >>> opt.step()
    >>> [round(v, 4) for v in w.tolist()]
    [0.9, 0.9]
    """

    decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ArgumentError(f"{type(self).__name__} needs lr, eps and weight_decay >= 0, but got {lr}, {eps}, "
                             f"{weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ArgumentError(f"{type(self).__name__} needs betas in [0, 1), but got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": amsgrad, "maximize": maximize})

    def _state_names(self, group: dict[str, Any]) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])

    def _init_scalars(self, state: Any) -> None:
        state["step"] = 0.0

    def _update(self, group: dict[str, Any], batch: ShardBatch) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for t in batch.tensors:
            self.state[t]["step"] += 1
        steps = [self.state[batch.tensors[i]]["step"] for i in batch.owner]  # one per shard
        params, grads = batch.params, batch.grads
        if not params:  # this process holds no shard of them (another pipeline stage); foreach needs one tensor
            return
        exp_avgs, exp_avg_sqs = batch.state["exp_avg"], batch.state["exp_avg_sq"]
        maxs = batch.state["max_exp_avg_sq"] if group["amsgrad"] else []
        if adam_fused_(params, grads, exp_avgs, exp_avg_sqs, maxs, _step_tensors(steps, params[0].device), lr=lr,
                       beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, decoupled=self.decoupled,
                       maximize=group["maximize"]):
            return
        if group["maximize"]:
            grads = list(torch._foreach_neg(grads))
        if wd != 0:
            if self.decoupled:
                torch._foreach_mul_(params, 1 - lr * wd)
            else:
                grads = list(torch._foreach_add(grads, params, alpha=wd))
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = [-(lr / (1 - beta1**s)) for s in steps]
        bias_correction2_sqrt = [(1 - beta2**s) ** 0.5 for s in steps]
        if group["amsgrad"]:
            torch._foreach_maximum_(maxs, exp_avg_sqs)
            denom = torch._foreach_sqrt(maxs)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

    def step_feeds(self, prefix: str, group: dict[str, Any]) -> list[tuple[str, float]]:
        # one count per parameter: one frozen for some steps (requires_grad_(False)) is behind the others
        steps = [(f"{prefix}.step.{i}", float(self.state[p].get("step", 0.0)) + 1 if p in self.state else 1.0)
                 for i, p in enumerate(group["params"])]
        return super().step_feeds(prefix, group) + steps

    def after_compiled_step(self, updated: Collection[Any]) -> None:
        ids = {id(p) for p in updated}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in ids:
                    self.state[p]["step"] = self.state[p].get("step", 0.0) + 1

    def _trace_group(self, group: dict[str, Any], prefix: str, params: list[Any], grads: list[Any]) -> None:
        """One fused (foreach) update op per run of parameters sharing placement, SBP and dtype."""
        if group["amsgrad"]:
            raise SbpflowError(f"{type(self).__name__}(amsgrad=True) has no compiled update yet; use eager steps")
        beta1, beta2 = group["betas"]
        runs: dict[Any, list[int]] = {}
        views = [self._param_view(p) for p in params]  # ZeRO: the slice of the state layout
        for i, (p, view) in enumerate(zip(params, views, strict=True)):
            # a run shares one step count (fed each step as the count of its first parameter)
            runs.setdefault((view.placement, view.sbp, view.dtype, self.state[p].get("step", 0.0)), []).append(i)
        index = {id(p): i for i, p in enumerate(group["params"])}
        for members in runs.values():
            ps = [params[i] for i in members]
            states = [self.state[p] for p in ps]
            outs = adam_update_multi(
                *[views[i] for i in members], *[grads[i] for i in members], *[s["exp_avg"] for s in states],
                *[s["exp_avg_sq"] for s in states], StepScalar(group["lr"], f"{prefix}.lr"),
                StepScalar(1.0, f"{prefix}.step.{index[id(ps[0])]}"), beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], decoupled=self.decoupled, maximize=group["maximize"])
            k = len(ps)
            for j, (p, state) in enumerate(zip(ps, states, strict=True)):
                self._write_back(p, outs[j])
                state["exp_avg"]._assign(outs[k + j])
                state["exp_avg_sq"]._assign(outs[2 * k + j])


def _step_tensors(steps: list[float], device: torch.device) -> list[torch.Tensor]:
    """Each shard's step count as a 0-d float32 tensor on ``device``, one tensor per distinct count."""
    made = {s: torch.tensor(s, dtype=torch.float32, device=device) for s in set(steps)}
    return [made[s] for s in steps]


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the Adam step (default 0.01)."""

    decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize)
