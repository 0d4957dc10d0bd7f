"""SGD with momentum, dampening, Nesterov and weight decay (torch.optim.SGD's rule, per shard)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch

from ..errors import ArgumentError
from ..graph.trace import StepScalar
from ..ops.optimizer import sgd_momentum_update, sgd_update
from .optimizer import Optimizer, ShardBatch


class SGD(Optimizer):
    """``p -= lr * d`` where ``d`` is the (weight-decayed) gradient, or its momentum buffer.

    The first step's momentum buffer is the gradient itself, as in torch.

    >>> import sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.ones(2))
    >>> opt = sbpflow.optim.SGD([w], lr=0.1, momentum=0.9)
    >>> for _ in range(2):
    ...     opt.zero_grad()
    ...     w.sum().backward()
    ...     opt.step()
    >>> [round(v, 4) for v in w.tolist()]
    [0.71, 0.71]
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ArgumentError(
                f"SGD needs lr, momentum and weight_decay >= 0, but got {lr}, {momentum}, {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ArgumentError("SGD with nesterov=True needs momentum > 0 and dampening = 0")
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize})

    def _state_names(self, group: dict[str, Any]) -> list[str]:
        return ["momentum_buffer"] if group["momentum"] != 0 else []

    def _init_scalars(self, state: Any) -> None:
        state["momentum_started"] = False

    def _update(self, group: dict[str, Any], batch: ShardBatch) -> None:
        if not batch.params:  # this process holds no shard of them (another pipeline stage); foreach needs one
            return
        grads = batch.grads
        if group["maximize"]:
            grads = list(torch._foreach_neg(grads))
        if group["weight_decay"] != 0:
            grads = list(torch._foreach_add(grads, batch.params, alpha=group["weight_decay"]))
        if group["momentum"] != 0:
            grads = self._momentum(group, batch, grads)
        torch._foreach_add_(batch.params, grads, alpha=-group["lr"])

    def _momentum(self, group: dict[str, Any], batch: ShardBatch, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        momentum, dampening = group["momentum"], group["dampening"]
        bufs = batch.state["momentum_buffer"]
        # A loaded state dict holds a buffer but no flag: that buffer has started.
        started = [self.state[t].get("momentum_started", True) for t in batch.tensors]
        fresh = [i for i, owner in enumerate(batch.owner) if not started[owner]]
        old = [i for i, owner in enumerate(batch.owner) if started[owner]]
        for i in fresh:  # the first buffer is the gradient itself (no dampening), as torch
            bufs[i].copy_(grads[i])
        if old:
            torch._foreach_mul_([bufs[i] for i in old], momentum)
            torch._foreach_add_([bufs[i] for i in old], [grads[i] for i in old], alpha=1 - dampening)
        for t in batch.tensors:
            self.state[t]["momentum_started"] = True
        if group["nesterov"]:
            return list(torch._foreach_add(grads, bufs, alpha=momentum))
        return bufs

    # -- compiled steps -----------------------------------------------------------------------------

    def step_feeds(self, prefix: str, group: dict[str, Any]) -> list[tuple[str, float]]:
        feeds = super().step_feeds(prefix, group)
        if group["momentum"] != 0:  # per parameter: one put into the group later starts its buffer later
            for i, p in enumerate(group["params"]):
                started = p not in self.state or self.state[p].get("momentum_started", True)
                feeds.append((f"{prefix}.started.{i}", 1.0 if started else 0.0))
        return feeds

    def after_compiled_step(self, updated: Collection[Any]) -> None:
        ids = {id(p) for p in updated}
        for group in self.param_groups:
            if group["momentum"] != 0:
                for p in group["params"]:
                    if id(p) in ids:
                        self.state[p]["momentum_started"] = True

    def _trace_group(self, group: dict[str, Any], prefix: str, params: list[Any], grads: list[Any]) -> None:
        index = {id(p): i for i, p in enumerate(group["params"])}  # names each parameter's "started" feed
        for p, grad in zip(params, grads, strict=True):
            self._trace_update(group, prefix, p, grad, index[id(p)])

    def _trace_update(self, group: dict[str, Any], prefix: str, p: Any, grad: Any, index: int = 0) -> None:
        lr = StepScalar(group["lr"], f"{prefix}.lr")
        if group["momentum"] == 0:
            self._write_back(p, sgd_update(self._param_view(p), grad, lr, weight_decay=group["weight_decay"],
                                 maximize=group["maximize"]))
            return
        buf = self.state[p]["momentum_buffer"]
        started = StepScalar(0.0, f"{prefix}.started.{index}")
        new_p, new_buf = sgd_momentum_update(
            self._param_view(p), grad, buf, lr, started, momentum=group["momentum"],
            dampening=group["dampening"], weight_decay=group["weight_decay"], nesterov=group["nesterov"],
            maximize=group["maximize"])
        self._write_back(p, new_p)
        buf._assign(new_buf)
