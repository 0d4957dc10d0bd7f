"""Collectives on the step's data alone go out first (graph.hoist): the loss's count of kept labels under data
parallelism is gathered at the start of the step, not where the loss reads it; the numbers and the order of
the collectives stay as they were."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.graph import compile as compile_module
from sbpflow.graph.hoist import _early, issue_data_collectives
from sbpflow.graph.verify import verify
from sbpflow.models.gpt import GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)


def _train(spec: str, hoist: bool, monkeypatch: pytest.MonkeyPatch, m: int = 1) -> tuple[list[float], Any, Any]:
    if not hoist:
        monkeypatch.setattr(compile_module, "issue_data_collectives", lambda plan: plan)
    trainer = build(CONFIG, spec, graph=True, micro_batches=m)
    # the plan as this pass leaves it: fused segments (a later pass) would merge the label count's nodes with the
    # model's in the plan that is not hoisted
    trainer.graph.config.enable_fused_segments(False)
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, 2, 8, 8, seed=1)]
    monkeypatch.undo()
    return losses, parameter_values(trainer), trainer.graph.plan


@pytest.mark.parametrize(("spec", "m"), [("dp=2", 1), ("dp=2", 2), ("dp=2,tp=2", 1)])
def test_the_label_count_is_gathered_before_the_model_runs(spec: str, m: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    losses, params, plan = _train(spec, True, monkeypatch, m)
    plain_losses, plain_params, plain = _train(spec, False, monkeypatch, m)
    assert losses == plain_losses
    for name, value in plain_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    verify(plan)
    for rank in (0, 1):  # the same collectives in the same order
        assert [n.name for n in plan.collectives(rank)] == [n.name for n in plain.collectives(rank)]
    early = {n.name for n in plain.nodes if n.id in _early(plain.nodes) and n.kind == "boxing"}
    assert early  # the label count's collective (one per micro-batch layout)
    if "tp" in spec:  # the collectives keep their order: behind the tensor-parallel ones of the forward
        return
    before_the_model = []
    for p in (plan, plain):
        micro = [n for n in p.nodes if n.phase == "micro"]
        first_matmul = next(i for i, n in enumerate(micro) if n.op in ("linear", "matmul"))
        before_the_model.append([i < first_matmul for i, n in enumerate(micro)
                                 if n.kind == "boxing" and n.name in early])
    assert all(before_the_model[0]) and not all(before_the_model[1])

def test_a_plan_without_such_collectives_is_returned_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, plan = _train("dp=1", False, monkeypatch)
    assert issue_data_collectives(plan) is plan
