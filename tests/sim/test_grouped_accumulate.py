"""Grouped accumulation (graph.group): one accumulate node per act's gradients, with the numbers, the memory plan
and the activation bounds of one node per gradient.

The GPT cases train the same model twice, with ``config.group_accumulates`` off and on: losses and parameters must
be bitwise equal (a group adds the same values in the same order, ``_foreach_add_`` being ``add_`` per pair), the
memory plan and the runtime's peak bytes equal, and the accumulate acts per step fall to groups x m.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.graph.explain import accumulate_text
from sbpflow.graph.group import group_accumulates, members
from sbpflow.graph.pipeline import activation_peaks
from sbpflow.graph.verify import verify
from sbpflow.models.gpt import GPTConfig
from sbpflow.runtime import ActorRuntime, run_plan
from sbpflow.runtime.builder import PlanBuilder
from sbpflow.runtime.inorder import add_into
from sbpflow.runtime.memory import dry_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=32, dropout=0.0)
INTERLEAVED = GPTConfig(vocab_size=64, block_size=8, n_layer=8, n_head=2, n_embd=32, dropout=0.0)
P2 = sbpflow.placement("cpu", [0, 1])


def _train(spec: str, m: int, schedule: str, group: bool, fused: bool = False) -> tuple[list[float], Any, Any]:
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    config = INTERLEAVED if virtual == 2 else CONFIG
    trainer = build(config, spec, graph=True, micro_batches=m, schedule=schedule, virtual_stages=virtual)
    trainer.graph.config.group_accumulates = group
    trainer.graph.config.enable_fused_segments(fused)
    losses = [trainer.step(ids, targets)
              for ids, targets in random_batches(config.vocab_size, 2, 16, config.block_size, seed=1)]
    return losses, parameter_values(trainer), trainer.graph._compiled()


def _accumulates(plan: Any) -> list[Any]:
    return [n for n in plan.nodes if n.kind == "accumulate"]


CASES = [("1f1b", "pp=2", 8, False), ("1f1b", "pp=4", 4, False), ("gpipe", "pp=2", 4, False),
         ("zero_bubble", "pp=4", 8, False), ("interleaved_1f1b", "pp=2", 4, False), ("1f1b", "dp=2,pp=2", 4, False),
         ("1f1b", "dp=2", 4, False), ("1f1b", "tp=2", 4, False), ("1f1b", "pp=2", 4, True),
         ("zero_bubble", "pp=2", 4, True)]


@pytest.mark.parametrize(("schedule", "spec", "m", "fused"), CASES,
                         ids=[f"{s}-{p}-m{m}{'-fused' if f else ''}" for s, p, m, f in CASES])
def test_groups_give_the_same_bits_memory_and_bounds_with_fewer_acts(schedule: str, spec: str, m: int,
                                                                     fused: bool) -> None:
    single_losses, single_params, single = _train(spec, m, schedule, False, fused)
    losses, params, grouped = _train(spec, m, schedule, True, fused)
    assert losses == single_losses
    for name, value in single_params.items():
        assert np.array_equal(params[name], value), name
    assert grouped.plan.peak_bytes == single.plan.peak_bytes
    assert grouped.executor.stats.peak_bytes == single.executor.stats.peak_bytes
    assert grouped.executor.stats.peak_bytes == grouped.plan.peak_bytes  # the memory plan predicts the run
    if grouped.plan.pipeline is not None:
        for compiled in (single, grouped):
            assert activation_peaks(compiled.plan.pipeline, compiled.executor.stats.peak_slots) == \
                activation_peaks(single.plan.pipeline, single.executor.stats.peak_slots)
    before, after = _accumulates(single.plan), _accumulates(grouped.plan)
    assert sum(len(n.inputs) for n in after) == len(before)  # every gradient is still summed, once
    assert len(after) < len(before) or schedule == "gpipe"  # GPipe keeps them single (see the test below)
    assert single.executor.stats.acts - grouped.executor.stats.acts == (len(before) - len(after)) * m


def test_a_pp2_gpt_step_acts_one_accumulate_per_stage_act_and_micro_batch() -> None:
    """1F1B, pp=2, m=8: 69 gradients were 69 accumulates of 8 acts (552 per step); now each stage's backward
    gradients are one group, and the tied embedding's head part (sent once, alone: graph.accumulate) stays single:
    3 nodes, 24 acts. Each group's gradients come from one stage's B."""
    _, _, compiled = _train("pp=2", 8, "1f1b", True)
    plan, pipe = compiled.plan, compiled.plan.pipeline
    accs = _accumulates(plan)
    assert sum(len(n.inputs) for n in accs) == 69
    assert sorted(len(n.inputs) for n in accs) == [1, 34, 34]
    producer = plan.producers()
    for n in accs:
        acts = {(pipe.stage_of[producer[b]], pipe.part_of[producer[b]]) for b in n.inputs}
        assert len(acts) == 1 and acts.pop()[1] == "B", n.label()
        assert n.inputs == tuple(member.inputs[0] for member in members(n))
    gathering = [a for a in compiled.executor.board.actors if a.node.kind == "accumulate"]
    assert sum(a.steps for a in gathering) == 3 * 8
    text = "\n".join(accumulate_text(plan, 0))
    assert "sums 34 gradients with 1 accumulate nodes, 8 acts per step (one per gradient: 272)" in text
    assert "sum of 34 gradients (B of stage 0):" in text


def test_gpipe_keeps_single_accumulates_where_a_group_would_raise_the_peak() -> None:
    """Under GPipe a stage holds all m activations after its first backward, and a group would take its sums'
    registers while the act's gradients are all live: each gradient keeps its own accumulate."""
    _, _, compiled = _train("pp=2", 4, "gpipe", True)
    assert all(len(n.inputs) == 1 for n in _accumulates(compiled.plan))


# -- small plans: which accumulates group, on both executors ----------------------------------------------------


def _sums_plan(m: int = 4) -> tuple[Any, list[int]]:
    """Five partial gradients split from one node (as a data-parallel step's bucket): sums 0 and 1 feed one
    all-reduce (through an add, as a bucket's flatten), sum 2 is reduced alone, sums 3 and 4 are read by outputs
    only; a sixth gradient, made by another node, stays single."""
    b = PlanBuilder(micro_batches=m)
    x = b.unpack(b.input("x", (10 * m,), P2, (S.partial_sum,)))
    grads = list(b.compute_n("bucket_split", b.compute("relu", x), shapes=((2,),) * 5))
    grads.append(b.compute("neg", x))
    sums = [b.accumulate(g) for g in grads]
    b.output("both", b.boxing(b.compute("add", sums[0], sums[1], phase="post"), (S.broadcast,), phase="post"))
    b.output("alone", b.boxing(sums[2], (S.broadcast,), phase="post"))
    for i in (3, 4, 5):
        b.output(f"sum{i}", sums[i])
    return b.build(), sums


def test_sums_feeding_different_collectives_are_not_grouped() -> None:
    plan, sums = _sums_plan()
    grouped = group_accumulates(plan)
    verify(grouped)
    outputs = sorted(n.outputs for n in _accumulates(grouped))
    assert outputs == sorted([(sums[0], sums[1]), (sums[2],), (sums[3], sums[4]), (sums[5],)])


def test_a_group_sums_bitwise_as_single_accumulates_on_both_executors() -> None:
    plan, _ = _sums_plan()
    grouped = group_accumulates(plan)
    torch.manual_seed(0)
    feeds = {"x": {0: torch.randn(40), 1: torch.randn(40)}}
    want = run_plan(plan, feeds, {}, SimulatedBackend())
    for got in (run_plan(grouped, feeds, {}, SimulatedBackend()),
                ActorRuntime(grouped, SimulatedBackend()).run(feeds, {})):
        assert got.keys() == want.keys()
        for name, shards in want.items():
            for r, t in shards.items():
                assert torch.equal(got[name][r], t), (name, r)
    assert dry_run(grouped, SimulatedBackend()).peak_bytes == dry_run(plan, SimulatedBackend()).peak_bytes
    assert dry_run(plan, SimulatedBackend()).acts - dry_run(grouped, SimulatedBackend()).acts == 2 * 4


def test_add_into_copies_the_first_values_then_adds_in_place() -> None:
    """The first micro-batch is copied into the running sums (its register's tensors are never written); later ones
    are added into the sums in one call, bitwise as ``+=`` per shard."""
    first = [{0: torch.ones(3), 1: torch.full((2,), 2.0)}, {0: torch.arange(4.0)}]
    totals = add_into(None, first)
    assert all(totals[i][r] is not first[i][r] for i in range(2) for r in first[i])
    later = [{0: torch.full((3,), 0.1), 1: torch.full((2,), 0.2)}, {0: torch.full((4,), 0.3)}]
    add_into(totals, later)
    assert torch.equal(first[0][0], torch.ones(3)) and torch.equal(first[1][0], torch.arange(4.0))
    for i, value in enumerate(later):
        for r, t in value.items():
            want = first[i][r].clone()
            want += t
            assert torch.equal(totals[i][r], want)
