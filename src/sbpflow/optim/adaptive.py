"""RMSprop and Adagrad (torch.optim's rules, per shard: every update is elementwise, so each rank's shard of a
parameter updates from its shard of the gradient and state alone)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import ArgumentError
from .optimizer import Optimizer, ShardBatch


class RMSprop(Optimizer):
    """``p -= lr * g / (sqrt(v) + eps)`` with ``v`` the running mean of ``g²`` (centred, with momentum, as torch).

    >>> import sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.ones(2))
    >>> opt = sbpflow.optim.RMSprop([w], lr=0.1)
    >>> w.sum().backward(); opt.step()
    >>> [round(v, 4) for v in w.tolist()]
    [0.0, 0.0]
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False,
                 maximize: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or momentum < 0 or alpha < 0:
            raise ArgumentError(f"RMSprop needs lr, alpha, eps, weight_decay and momentum >= 0, but got {lr}, {alpha}, "
                                f"{eps}, {weight_decay}, {momentum}")
        super().__init__(params, {"lr": lr, "alpha": alpha, "eps": eps, "weight_decay": weight_decay,
                                  "momentum": momentum, "centered": centered, "maximize": maximize})

    def _state_names(self, group: dict[str, Any]) -> list[str]:
        return ["square_avg"] + (["momentum_buffer"] if group["momentum"] > 0 else []) + (
            ["grad_avg"] if group["centered"] else [])

    def _update(self, group: dict[str, Any], batch: ShardBatch) -> None:
        alpha, eps, lr = group["alpha"], group["eps"], group["lr"]
        for i, (p, g) in enumerate(zip(batch.params, batch.grads, strict=True)):
            g = -g if group["maximize"] else g
            if group["weight_decay"] != 0:
                g = g.add(p, alpha=group["weight_decay"])
            square_avg = batch.state["square_avg"][i]
            square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
            if group["centered"]:
                grad_avg = batch.state["grad_avg"][i]
                grad_avg.lerp_(g, 1 - alpha)
                avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_().add_(eps)
            else:
                avg = square_avg.sqrt().add_(eps)
            if group["momentum"] > 0:
                buf = batch.state["momentum_buffer"][i]
                buf.mul_(group["momentum"]).addcdiv_(g, avg)
                p.add_(buf, alpha=-lr)
            else:
                p.addcdiv_(g, avg, value=-lr)


class Adagrad(Optimizer):
    """``p -= clr * g / (sqrt(sum of g²) + eps)`` with ``clr = lr / (1 + (step - 1) * lr_decay)`` (torch's rule).

    >>> import sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.ones(2))
    >>> opt = sbpflow.optim.Adagrad([w], lr=0.5)
    >>> w.sum().backward(); opt.step()
    >>> [round(v, 4) for v in w.tolist()]
    [0.5, 0.5]
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, maximize: bool = False) -> None:
        if lr < 0 or lr_decay < 0 or weight_decay < 0 or initial_accumulator_value < 0 or eps < 0:
            raise ArgumentError(f"Adagrad needs lr, lr_decay, weight_decay, initial_accumulator_value and eps >= 0, "
                                f"but got {lr}, {lr_decay}, {weight_decay}, {initial_accumulator_value}, {eps}")
        super().__init__(params, {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay, "eps": eps,
                                  "initial_accumulator_value": initial_accumulator_value, "maximize": maximize})

    def _state_names(self, group: dict[str, Any]) -> list[str]:
        return ["sum"]

    def _init_scalars(self, state: Any) -> None:
        state["step"] = 0.0

    def _update(self, group: dict[str, Any], batch: ShardBatch) -> None:
        for t in batch.tensors:
            self.state[t]["step"] += 1
        for i, (p, g) in enumerate(zip(batch.params, batch.grads, strict=True)):
            step = self.state[batch.tensors[batch.owner[i]]]["step"]
            g = -g if group["maximize"] else g
            if group["weight_decay"] != 0:
                g = g.add(p, alpha=group["weight_decay"])
            total = batch.state["sum"][i]
            if step == 1 and group["initial_accumulator_value"] != 0:  # the state starts as zeros
                total.add_(group["initial_accumulator_value"])
            clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
            total.addcmul_(g, g, value=1)
            p.addcdiv_(g, total.sqrt().add_(group["eps"]), value=-clr)
