"""The planner reaches a model only through ``autoparallel.apply.Plannable``: any object with the protocol's
sizes and ``lay_out`` is planned, and gets exactly the search's plan; anything else is refused by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import sbpflow
from sbpflow.autoparallel import get_profile
from sbpflow.autoparallel.apply import Plannable
from sbpflow.autoparallel.predict import Cluster
from sbpflow.autoparallel.search import Fixed, search
from sbpflow.autoparallel.transformer import TransformerSpec
from sbpflow.errors import PlanError

SIZES = {"layers": 4, "hidden": 64, "heads": 4, "seq": 16, "vocab": 64}


class ForeignModel:
    """A model sbpflow did not write: it records how the planner asked it to lay itself out."""

    def __init__(self) -> None:
        self.strategy: Any = None
        self.calls: list[tuple[int, int, tuple[int, ...], str]] = []

    def planner_sizes(self) -> dict[str, int]:
        return dict(SIZES)

    def lay_out(self, data: int, tensor: int, pipeline: Sequence[int], device: str) -> Any:
        self.calls.append((data, tensor, tuple(pipeline), device))
        self.strategy = ("laid out", data, tensor, tuple(pipeline))
        return self.strategy


def test_a_foreign_model_gets_the_searchs_plan() -> None:
    model = ForeignModel()
    assert isinstance(model, Plannable)
    auto = sbpflow.auto_parallel(model, devices=4, batch=8)
    want = search(TransformerSpec(**SIZES), Cluster(4, get_profile("cpu"), 4), 8,
                  Fixed(zero=0, recompute="none", micro_batches=1, layout="megatron")).best
    assert model.calls == [(want.plan.dp, want.plan.tp, tuple(want.stage_layers), "cpu")]
    assert auto.strategy is model.strategy
    assert auto.prediction.plan == want.plan


def test_an_object_without_the_protocol_is_refused() -> None:
    with pytest.raises(PlanError, match="Plannable"):
        sbpflow.auto_parallel(object(), devices=2, batch=4)
