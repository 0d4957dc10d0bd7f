"""A model's training step traced on metadata, for the planner: ``model(*inputs)``, a loss, backward, AdamW.

>>> import sbpflow
>>> with sbpflow.meta_init():
...     mlp = sbpflow.nn.Sequential(sbpflow.nn.Linear(8, 32), sbpflow.nn.ReLU(), sbpflow.nn.Linear(32, 8))
...     x = sbpflow.randn(4, 8)
>>> sorted({n.name for n in trace_training_step(mlp, (x,)).nodes if n.name == "linear"})
['linear']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import PlanError
from ..graph.ir import LogicalGraph
from ..ops import functional as F
from ..optim import AdamW
from ..tensor import Tensor
from .graph import Graph
from .module import Module


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
