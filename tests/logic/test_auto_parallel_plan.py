"""``sbpflow.auto_parallel`` reads the traced training step, not a model class: a model sbpflow did not write,
built under ``meta_init()``, gets exactly the graph search's plan among the plans eager training runs, laid out
by ``sbpflow.parallelize``; anything but a module is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

import sbpflow
from sbpflow import nn
from sbpflow.autoparallel.graph_plan import plan_graph
from sbpflow.errors import PlanError
from sbpflow.nn.trace_step import trace_training_step


class ForeignModel(nn.Module):
    """A model sbpflow did not write: a stem, blocks of two Linears with a residual, a head."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                   nn.Linear(4 * width, width)) for _ in range(depth)])
        self.head = nn.Linear(width, 16)

    def forward(self, x: Any) -> Any:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _meta() -> tuple[ForeignModel, tuple[Any, ...]]:
    with sbpflow.meta_init():
        return ForeignModel(), (sbpflow.randn(32, 16),)


def test_a_foreign_model_gets_the_searchs_plan() -> None:
    model, inputs = _meta()
    auto = sbpflow.auto_parallel(model, inputs, devices=4)
    fresh, again = _meta()
    want = plan_graph(trace_training_step(fresh, again), 4,
                      only=lambda k: (k.zero, k.recompute, k.schedule, k.virtual) == (0, "none", "1f1b", 1)
                      and k.dp * k.micro_batch == 32)
    assert auto.plan.knobs == want.knobs and auto.plan.stages == want.stages
    k = auto.plan.knobs
    assert (model.strategy.data, model.strategy.tensor, model.strategy.pipeline) == (k.dp, k.tp, k.pp)
    assert all(p.is_meta and p.is_global for p in model.parameters())


def test_a_memory_cap_shards_the_weights() -> None:
    free, inputs = _meta()
    roomy = sbpflow.auto_parallel(free, inputs, devices=4).plan
    model, inputs = _meta()
    capped = sbpflow.auto_parallel(model, inputs, devices=4, memory_per_device=roomy.memory_per_device * 0.6).plan
    assert capped.memory_per_device <= roomy.memory_per_device * 0.6
    assert capped.knobs.tp * capped.knobs.pp > 1  # eager runs no ZeRO: the weights split by tp or pp


def test_anything_but_a_module_is_refused() -> None:
    with pytest.raises(PlanError, match="sbpflow.nn.Module, but got object"):
        sbpflow.auto_parallel(object(), (sbpflow.randn(4, 4),), devices=2)  # type: ignore[arg-type]


def test_an_impossible_cap_names_the_smallest_memory_and_leaves_the_model_as_it_was() -> None:
    model, inputs = _meta()
    with pytest.raises(PlanError, match="would fit it"):
        sbpflow.auto_parallel(model, inputs, devices=4, memory_per_device=1000.0)
    assert not any(p.is_global for p in model.parameters()) and getattr(model, "strategy", None) is None
