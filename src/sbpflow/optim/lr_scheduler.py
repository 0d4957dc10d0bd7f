"""Learning-rate schedules: linear warmup, cosine annealing, and warmup followed by cosine.

Each schedule is a closed-form function of the step count, applied to every
param group's initial lr; ``step()`` advances one step and ``get_last_lr()``
returns the lrs it set. The numbers equal torch's ``LinearLR`` and
``CosineAnnealingLR``.

>>> import sbpflow
>>> from sbpflow.optim.lr_scheduler import WarmupCosine
>>> opt = sbpflow.optim.SGD([sbpflow.nn.Parameter(sbpflow.zeros(1))], lr=1.0)
>>> sched = WarmupCosine(opt, warmup_steps=2, total_steps=4, min_lr=0.0)
>>> lrs = [sched.get_last_lr()[0]]
>>> for _ in range(4):
...     sched.step()
...     lrs.append(round(sched.get_last_lr()[0], 3))
>>> lrs
[0.0, 0.5, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import SbpflowError
from .optimizer import Optimizer


class LRScheduler:
    """Base class: subclasses define ``lr_at(step, base_lr)``; construction applies step 0."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__} needs an sbpflow optimizer, but got {type(optimizer).__name__}")
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._last_lr: list[float] = []
        self.step()

    def lr_at(self, step: int, base_lr: float) -> float:
        raise NotImplementedError

    def step(self) -> None:
        """Advances one step and sets every group's lr (all computed first: a failed step changes nothing)."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.base_lrs):
            raise SbpflowError(f"{type(self).__name__}.step: the schedule was made for {len(self.base_lrs)} param "
                               f"groups, but the optimizer now has {len(groups)}; make a new schedule")
        lrs = [self.lr_at(self.last_epoch + 1, base) for base in self.base_lrs]
        self.last_epoch += 1
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` of a schedule of this kind made for as many param groups."""
        own = self.state_dict()
        if not isinstance(state, dict) or set(state) != set(own):
            raise SbpflowError(f"{type(self).__name__}.load_state_dict needs the keys {sorted(own)} (a state_dict() of "
                               f"this schedule), but got {sorted(state) if isinstance(state, dict) else type(state)}")
        if not isinstance(state["last_epoch"], int) or len(state["base_lrs"]) != len(self.base_lrs):
            raise SbpflowError(f"{type(self).__name__}.load_state_dict: the saved schedule has last_epoch "
                               f"{state['last_epoch']!r} and {len(state['base_lrs'])} base lrs, but this one needs "
                               f"an int and {len(self.base_lrs)} (one per param group)")
        self.__dict__.update(state)


class LinearWarmup(LRScheduler):
    """``lr = base * (start + (1 - start) * min(step, warmup_steps) / warmup_steps)`` (torch's LinearLR to 1)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, start_factor: float = 0.0,
                 last_epoch: int = -1) -> None:
        if warmup_steps <= 0 or not 0.0 <= start_factor <= 1.0:
            raise ValueError(f"LinearWarmup needs warmup_steps > 0 and start_factor in [0, 1], but got "
                             f"{warmup_steps} and {start_factor}")
        self.warmup_steps, self.start_factor = warmup_steps, start_factor
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        return base_lr * _warmup_factor(step, self.warmup_steps, self.start_factor)


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (base - eta_min) * (1 + cos(pi * step / T_max)) / 2`` (torch's closed form)."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        if T_max <= 0:
            raise ValueError(f"CosineAnnealingLR needs T_max > 0, but got {T_max}")
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * step / self.T_max)) / 2


class WarmupCosine(LRScheduler):
    """Linear warmup over ``warmup_steps``, then cosine from the base lr down to ``min_lr`` at ``total_steps``.

    After ``total_steps`` the lr stays at ``min_lr``.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
                 start_factor: float = 0.0, last_epoch: int = -1) -> None:
        if not 0 <= warmup_steps < total_steps:
            raise ValueError(f"WarmupCosine needs 0 <= warmup_steps < total_steps, but got {warmup_steps} and "
                             f"{total_steps}")
        self.warmup_steps, self.total_steps, self.min_lr = warmup_steps, total_steps, min_lr
        self.start_factor = start_factor
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup_steps:
            return base_lr * _warmup_factor(step, self.warmup_steps, self.start_factor)
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr + (base_lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2


def _warmup_factor(step: int, warmup_steps: int, start_factor: float) -> float:
    return start_factor + (1.0 - start_factor) * min(step, warmup_steps) / warmup_steps


__all__ = ["CosineAnnealingLR", "LRScheduler", "LinearWarmup", "WarmupCosine"]
