"""A model's training step traced on metadata, for the planner: ``model(*inputs)``, a loss, backward, AdamW;
and :func:`auto_parallel`, which plans that step for eager training and lays the model out by the plan.

>>> import sbpflow
>>> with sbpflow.meta_init():
...     mlp = sbpflow.nn.Sequential(sbpflow.nn.Linear(8, 32), sbpflow.nn.ReLU(), sbpflow.nn.Linear(32, 8))
...     x = sbpflow.randn(4, 8)
>>> sorted({n.name for n in trace_training_step(mlp, (x,)).nodes if n.name == "linear"})
['linear']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..autoparallel.apply import lay_out, plan_model
from ..autoparallel.graph_plan import Plan
from ..autoparallel.graph_search import Knobs
from ..autoparallel.profiles import DeviceProfile
from ..errors import PlanError
from ..graph.ir import LogicalGraph
from ..ops import functional as F
from ..optim import AdamW
from ..tensor import Tensor
from .graph import Graph
from .module import Module
from .parallelize import Strategy


class TrainingStep(Graph):
    """One step: forward, the loss (:func:`step_loss`), backward, AdamW."""

    def __init__(self, model: Module) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(AdamW(model.parameters(), lr=1e-4))

    def build(self, *inputs: Any) -> Tensor:
        loss = step_loss(self.model(*inputs))
        loss.backward()
        return loss


def step_loss(out: Any) -> Tensor:
    """The loss of a model's output: a scalar, the last scalar of a tuple (a GPT's ``(logits, loss)``), a dict's
    "loss", or else ``mean(square(output))``, a stand-in whose backward reaches every parameter as a real
    loss's would (its own cost is one elementwise op)."""
    if isinstance(out, dict) and isinstance(out.get("loss"), Tensor):
        return out["loss"]
    if isinstance(out, (tuple, list)):
        scalars = [t for t in out if isinstance(t, Tensor) and t.ndim == 0]
        if scalars:
            return scalars[-1]
        out = next((t for t in out if isinstance(t, Tensor)), None)
    if not isinstance(out, Tensor):
        raise PlanError(f"planning traces a training step, so the model must return a tensor, a tuple holding "
                        f"one, or a dict with 'loss', but it returned {type(out).__name__}")
    return out if out.ndim == 0 else F.mean(F.square(out))


def trace_training_step(model: Module, inputs: Sequence[Any]) -> LogicalGraph:
    """The logical graph of one training step of ``model`` on ``inputs`` (metadata is enough)."""
    return TrainingStep(model).trace(*inputs)


@dataclass
class AutoPlan:
    """What :func:`auto_parallel` chose (a graph plan: ``explain()``, ``to_json()``) and the layout it applied."""

    plan: Plan
    strategy: Strategy

    @property
    def micro_batches(self) -> int:
        return self.plan.micro_batches

    def explain(self) -> str:
        return self.plan.explain()


def auto_parallel(model: Module, inputs: Sequence[Any], devices: int, profile: str | DeviceProfile = "cpu",
                  memory_per_device: float | None = None, micro_batches: int | None = 1,
                  device: str = "cpu") -> AutoPlan:
    """Plans ``model``'s training step on the example ``inputs`` (plain local tensors, or metadata built under
    ``meta_init()``; their batch is the step's) for ``devices`` ranks and lays the model out by the plan.

    The plan is one that eager training runs as predicted: every activation kept, whole optimizer state on each
    replica, and ``micro_batches`` per step (1: a step is one forward and backward; None lets the search choose,
    for ``nn.Graph`` with ``config.set_gradient_accumulation_steps(auto.micro_batches)``). The model is then
    called with plain local inputs, which it lays out itself, or with ``auto.strategy.shard_inputs(...)``.

    >>> import sbpflow
    >>> from sbpflow import nn
    >>> sbpflow.manual_seed(0)
    >>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    >>> auto = sbpflow.auto_parallel(mlp, (sbpflow.randn(8, 16),), devices=2)
    >>> auto.strategy.world_size, mlp.strategy is auto.strategy
    (2, True)
    """
    if not isinstance(model, Module):
        raise PlanError(f"auto_parallel plans the training step of an sbpflow.nn.Module, but got "
                        f"{type(model).__name__}")
    if micro_batches is not None and (not isinstance(micro_batches, int) or micro_batches < 1):
        raise PlanError(f"auto_parallel needs micro_batches to be an int >= 1 or None, but got {micro_batches!r}")
    step = TrainingStep(model)
    batch = next((int(a.shape[0]) for a in inputs if isinstance(a, Tensor) and a.ndim), 1)
    plan = plan_model(step, tuple(inputs), devices, profile, memory_per_device, only=_eager(batch, micro_batches))
    return AutoPlan(plan, lay_out(model, plan, device))


def _eager(batch: int, micro_batches: int | None) -> Callable[[Knobs], bool]:
    """The plans eager training runs as they are predicted: no ZeRO or recompute, plain 1F1B stages."""

    def runs(k: Knobs) -> bool:
        return (k.zero == 0 and k.recompute == "none" and k.schedule == "1f1b" and k.virtual == 1
                and (micro_batches is None or batch == k.dp * k.micro_batch * micro_batches))

    return runs
