"""Learning-rate schedules as closed-form functions of the step: linear warmup, cosine, warmup then cosine.

The numbers equal torch's ``LinearLR`` and ``CosineAnnealingLR``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
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

    def _group_lr(self, index: int, step: int, base_lr: float) -> float:
        """Group ``index``'s lr at ``step``: ``lr_at`` unless a schedule differs per group (LambdaLR)."""
        return self.lr_at(step, base_lr)

    def step(self) -> None:
        """Advances one step and sets every group's lr (all computed first: a failed step changes nothing)."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.base_lrs):
            raise SbpflowError(f"{type(self).__name__}.step: the schedule was made for {len(self.base_lrs)} param "
                               f"groups, but the optimizer now has {len(groups)}; make a new schedule")
        lrs = [self._group_lr(i, self.last_epoch + 1, base) for i, base in enumerate(self.base_lrs)]
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

    >>> import sbpflow
    >>> opt = sbpflow.optim.SGD([sbpflow.nn.Parameter(sbpflow.zeros(1))], lr=1.0)
    >>> sched = WarmupCosine(opt, warmup_steps=2, total_steps=4, min_lr=0.0)
    >>> lrs = [sched.get_last_lr()[0]]
    >>> for _ in range(4):
    ...     sched.step()
    ...     lrs.append(round(sched.get_last_lr()[0], 3))
    >>> lrs
    [0.0, 0.5, 1.0, 0.5, 0.0]
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


class StepLR(LRScheduler):
    """``lr = base * gamma ** (step // step_size)`` (torch's StepLR)."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        if step_size <= 0:
            raise ValueError(f"StepLR needs step_size > 0, but got {step_size}")
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        return base_lr * self.gamma ** (step // self.step_size)


class MultiStepLR(LRScheduler):
    """``lr = base * gamma ** (number of milestones passed)`` (torch's MultiStepLR)."""

    def __init__(self, optimizer: Optimizer, milestones: Sequence[int], gamma: float = 0.1,
                 last_epoch: int = -1) -> None:
        self.milestones, self.gamma = sorted(milestones), gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        return base_lr * self.gamma ** bisect.bisect_right(self.milestones, step)


class ExponentialLR(LRScheduler):
    """``lr = base * gamma ** step`` (torch's ExponentialLR)."""

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        return base_lr * self.gamma**step


class LambdaLR(LRScheduler):
    """``lr = base * lr_lambda(step)``, one function for every group or one per group (torch's LambdaLR)."""

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
                 last_epoch: int = -1) -> None:
        groups = len(optimizer.param_groups)
        self.lr_lambdas: list[Callable[[int], float]] = (
            list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * groups)  # type: ignore[list-item]
        if len(self.lr_lambdas) != groups:
            raise ValueError(f"LambdaLR needs one lr_lambda or one per param group ({groups}), but got "
                             f"{len(self.lr_lambdas)}")
        super().__init__(optimizer, last_epoch)

    def _group_lr(self, index: int, step: int, base_lr: float) -> float:
        return base_lr * self.lr_lambdas[index](step)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}


class OneCycleLR(LRScheduler):
    """torch's OneCycleLR: the lr rises from ``max_lr / div_factor`` to ``max_lr`` over ``pct_start`` of the steps,
    then anneals to ``initial / final_div_factor`` (cos or linear; ``three_phase`` as torch); momentum (or Adam's
    beta1) cycles the other way between ``max_momentum`` and ``base_momentum``."""

    def __init__(self, optimizer: Optimizer, max_lr: float | Sequence[float], total_steps: int | None = None,
                 epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True, base_momentum: float = 0.85,
                 max_momentum: float = 0.95, div_factor: float = 25.0, final_div_factor: float = 1e4,
                 three_phase: bool = False, last_epoch: int = -1) -> None:
        if total_steps is None:
            if epochs is None or steps_per_epoch is None:
                raise ValueError("OneCycleLR needs total_steps, or epochs and steps_per_epoch")
            total_steps = epochs * steps_per_epoch
        if total_steps <= 0 or not 0 <= pct_start <= 1 or anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"OneCycleLR needs total_steps > 0, pct_start in [0, 1] and anneal_strategy 'cos' or "
                             f"'linear', but got {total_steps}, {pct_start}, {anneal_strategy!r}")
        groups = optimizer.param_groups
        max_lrs: list[float] = list(max_lr) if isinstance(max_lr, (list, tuple)) else [max_lr] * len(groups)  # type: ignore[list-item]
        self.anneal = _cos if anneal_strategy == "cos" else _linear
        self.cycle_momentum = cycle_momentum
        # (end step, lr from, lr to, momentum from, momentum to), as multiples of the group's values
        up = float(pct_start * total_steps) - 1
        if three_phase:
            self.phases = [(up, "initial", "max", "max_m", "base_m"),
                           (float(2 * pct_start * total_steps) - 2, "max", "initial", "base_m", "max_m"),
                           (total_steps - 1, "initial", "min", "max_m", "max_m")]
        else:
            self.phases = [(up, "initial", "max", "max_m", "base_m"),
                           (total_steps - 1, "max", "min", "base_m", "max_m")]
        self.points: list[dict[str, float]] = []
        for group, top in zip(groups, max_lrs, strict=True):
            initial = top / div_factor
            group["initial_lr"] = initial
            self.points.append({"initial": initial, "max": top, "min": initial / final_div_factor,
                                "base_m": base_momentum, "max_m": max_momentum})
        if cycle_momentum and not all("momentum" in g or "betas" in g for g in groups):
            raise ValueError("OneCycleLR with cycle_momentum=True needs an optimizer with momentum or betas")
        super().__init__(optimizer, last_epoch)

    def _group_lr(self, index: int, step: int, base_lr: float) -> float:
        lr, momentum = self._at(self.points[index], step)
        if self.cycle_momentum:
            group = self.optimizer.param_groups[index]
            if "betas" in group:
                group["betas"] = (momentum, *group["betas"][1:])
            else:
                group["momentum"] = momentum
        return lr

    def _at(self, point: dict[str, float], step: int) -> tuple[float, float]:
        start = 0.0
        for i, (end, lr_from, lr_to, m_from, m_to) in enumerate(self.phases):
            if step <= end or i == len(self.phases) - 1:
                pct = (step - start) / (end - start)
                return (self.anneal(point[lr_from], point[lr_to], pct), self.anneal(point[m_from], point[m_to], pct))
            start = end
        raise AssertionError("unreachable: the last phase takes every later step")


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def _linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


def _warmup_factor(step: int, warmup_steps: int, start_factor: float) -> float:
    return start_factor + (1.0 - start_factor) * min(step, warmup_steps) / warmup_steps


__all__ = ["CosineAnnealingLR", "ExponentialLR", "LRScheduler", "LambdaLR", "LinearWarmup", "MultiStepLR", "OneCycleLR",
           "StepLR", "WarmupCosine"]
