"""Collectives on the step's data alone go out first (graph.hoist): the loss's count of kept labels under data
parallelism is gathered at the start of the step, not where the loss reads it, and so is a batch gathered for a
weight gradient; the numbers stay as they were, and the other collectives keep their order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow
from harness import MeanSquareStep
from sbpflow import nn, optim
from sbpflow import sbp as S
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.graph import compile as compile_module
from sbpflow.graph.hoist import _early, issue_data_collectives
from sbpflow.graph.verify import verify
from sbpflow.models.gpt import GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P2 = sbpflow.placement("cpu", [0, 1])
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


@pytest.mark.parametrize(("spec", "m"), [("dp=2", 1), ("dp=2,tp=2", 1)])
def test_the_label_count_is_gathered_before_the_model_runs(spec: str, m: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    losses, params, plan = _train(spec, True, monkeypatch, m)
    plain_losses, plain_params, plain = _train(spec, False, monkeypatch, m)
    assert losses == plain_losses
    for name, value in plain_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    verify(plan)
    early = {n.name for n in plain.nodes if n.id in _early(plain.nodes) and n.kind == "boxing"}
    assert early  # the label count's collective (one per micro-batch layout)
    for rank in (0, 1):  # the same collectives; those on data alone first, the others in their order
        names, plain_names = [n.name for n in plan.collectives(rank)], [n.name for n in plain.collectives(rank)]
        assert sorted(names) == sorted(plain_names) and len(names) > len(early)
        assert [n in early for n in names] == sorted((n in early for n in names), reverse=True)
        assert [n for n in names if n not in early] == [n for n in plain_names if n not in early]
    before_the_model = []
    for p in (plan, plain):
        micro = [n for n in p.nodes if n.phase == "micro"]
        first_matmul = next(i for i, n in enumerate(micro) if n.op in ("linear", "matmul"))
        before_the_model.append([i < first_matmul for i, n in enumerate(micro)
                                 if n.kind == "boxing" and n.name in early])
    assert all(before_the_model[0]) and not all(before_the_model[1])


def test_with_micro_batches_the_label_count_is_the_whole_steps_before_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2 micro-batches the loss's count of kept labels is the whole step's (graph.micro traces it again on the
    whole batch): its collective runs once a step, in the pre phase, before any micro-batch, and no micro-batch
    collective is left on data alone; the numbers are those of the plan without the hoist pass."""
    losses, params, plan = _train("dp=2", True, monkeypatch, 2)
    plain_losses, plain_params, _ = _train("dp=2", False, monkeypatch, 2)
    assert losses == plain_losses
    for name, value in plain_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    verify(plan)
    assert [n.phase for n in plan.collectives(0) if n.phase != "micro" and n.phase != "post"] == ["pre"]
    assert not {n.id for n in plan.nodes if n.kind == "boxing"} & _early(plan.nodes)


def test_a_batch_gathered_for_a_weight_gradient_goes_out_before_the_model_runs() -> None:
    """The dp2 MLP's selection computes the first layer's weight gradient whole from two all-gathers (the batch
    and the gradient reaching that layer: tests/sim/test_graph_select.py). The batch's gather reads data alone:
    it goes out first, ahead of the gradient all-reduces, and only the other gather is left for the end of
    backward."""
    sbpflow.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(3):
        mods += [nn.Linear(1024, 1024), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(1024, 1024)).to_global(P2, S.broadcast)
    step = MeanSquareStep(model, optim.AdamW(model.parameters(), lr=1e-3))
    x = sbpflow.zeros(64, 1024, placement=P2, sbp=S.split(0))
    step.compile_only(x, x)
    plan = step.plan
    kinds = [n.boxing.steps[0].kind for n in plan.collectives(0)]
    assert kinds[0] == "all_gather" and kinds[1:].count("all_gather") == 1 and kinds.count("all_reduce") == 4
    first = plan.collectives(0)[0]
    producer = plan.node(plan.producers()[first.inputs[0]])
    assert producer.kind == "input"  # the batch itself
    assert plan.nodes.index(first) < min(i for i, n in enumerate(plan.nodes) if n.kind == "compute")


def test_a_plan_without_such_collectives_is_returned_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, plan = _train("dp=1", False, monkeypatch)
    assert issue_data_collectives(plan) is plan
