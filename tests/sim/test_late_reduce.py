"""Reduce after accumulating (graph.late_reduce): a data-parallel gradient is all-reduced once a step, not once
per micro-batch, with the same training results."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend, record
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.graph.late_reduce import reduce_after_accumulating
from sbpflow.graph.verify import verify
from sbpflow.models.gpt import GPTConfig
from sbpflow.runtime import run_plan
from sbpflow.runtime.builder import Const, PlanBuilder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
P2 = sbpflow.placement("cpu", [0, 1])
B, PSUM, PMAX = S.broadcast, S.partial_sum, S.partial_max


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    return list(random_batches(CONFIG.vocab_size, 3, 8, CONFIG.block_size, seed=2))


def _train(spec: str, m: int, late: bool, zero: int = 0) -> tuple[list[float], dict[str, np.ndarray], Any, Any]:
    trainer = build(CONFIG, spec, graph=True, micro_batches=m, zero=zero)
    trainer.graph.config.reduce_after_accumulating = late
    batches = _batches()
    losses = [trainer.step(ids, targets) for ids, targets in batches[:2]]
    with record() as log:
        losses.append(trainer.step(*batches[2]))
    return losses, parameter_values(trainer), trainer.graph._compiled().plan, log


def _one_device() -> tuple[list[float], dict[str, np.ndarray]]:
    """Eager training on one device, full batches: the reference."""
    trainer = build(CONFIG, None)
    losses = [trainer.step(ids, targets) for ids, targets in _batches()]
    return losses, parameter_values(trainer)


def _gradient_reduces(plan: Any, phase: str) -> list[Any]:
    """The all-reduces of gradients (a bucket's or one gradient's) that meet an accumulate: reading a sum (post)
    or feeding one (micro), directly or through a bucket's flatten/split."""
    producer = {b: n for n in plan.nodes for b in n.outputs}
    readers: dict[int, list[Any]] = {}
    for n in plan.nodes:
        for b in n.inputs:
            readers.setdefault(b, []).append(n)

    def near_sum(n: Any) -> bool:
        if phase == "post":
            src = producer[n.inputs[0]]
            return src.kind == "accumulate" or (src.op == "bucket_flatten" and all(
                producer[b].kind == "accumulate" for b in src.inputs))
        after = readers.get(n.outputs[0], [])
        return any(r.kind == "accumulate" or (r.op == "bucket_split" and any(
            x.kind == "accumulate" for b in r.outputs for x in readers.get(b, []))) for r in after)

    return [n for n in plan.nodes if n.kind == "boxing" and n.phase == phase and n.boxing is not None
            and n.boxing.steps[0].kind == "all_reduce" and near_sum(n)]


@pytest.mark.parametrize("spec", ["dp=2", "dp=2,pp=2"])
def test_gradients_are_reduced_once_a_step_with_the_same_results(spec: str) -> None:
    m = 4
    late_losses, late_params, late_plan, late_log = _train(spec, m, late=True)
    early_losses, early_params, early_plan, early_log = _train(spec, m, late=False)
    single_losses, single_params = _one_device()
    # the gradient all-reduces now run once a step, after the micro-batches (post phase), in fewer collectives
    late_reduces = _gradient_reduces(late_plan, "post")
    assert late_reduces and not _gradient_reduces(late_plan, "micro")
    assert len(_gradient_reduces(early_plan, "micro")) == len(late_reduces)
    assert not _gradient_reduces(early_plan, "post")
    # recorded per group: a node's all-reduce runs in each group of its mesh axis (2 under dp2 x tp2)
    per_step = sum(len(n.boxing.src.placement.axis_groups(n.boxing.steps[0].axis)) for n in late_reduces)
    late_count, early_count = late_log.counts()["all_reduce"], early_log.counts()["all_reduce"]
    assert early_count - late_count == (m - 1) * per_step, (early_count, late_count, per_step)
    # the sums are associated differently: equal up to rounding, and both equal one device's full batch
    np.testing.assert_allclose(late_losses, early_losses, rtol=1e-6)
    np.testing.assert_allclose(late_losses, single_losses, rtol=1e-5)
    # atol 1e-5 (1% of lr): the key bias's gradient is zero but for rounding (softmax ignores a shift of the keys),
    # and AdamW's m / sqrt(v) scales that noise up to about lr; it moved by 1.8e-6 against one device here
    for name, value in late_params.items():
        np.testing.assert_allclose(value, early_params[name], rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(value, single_params[name], rtol=1e-5, atol=1e-5, err_msg=name)
    # the running sums replace the reduced per-micro-batch gradients: no more memory
    assert max(late_plan.peak_bytes.values()) <= max(early_plan.peak_bytes.values())


def test_gradients_riding_the_activations_buckets_stay_per_micro_batch() -> None:
    """dp2 x tp2: the only per-micro-batch gradient all-reduces are the LayerNorm gradients' over the tensor axis
    (32 floats), each in a bucket with a backward activation all-reduce of the same group. Moved after the
    micro-batches they went out in a bucket of their own: one more collective a step (56 all-reduces against
    54) to save 3 sends of 512 bytes, far below a latency. They stay: both plans send the same collectives."""
    m = 4
    late_losses, late_params, late_plan, late_log = _train("dp=2,tp=2", m, late=True)
    early_losses, early_params, early_plan, early_log = _train("dp=2,tp=2", m, late=False)
    single_losses, single_params = _one_device()
    assert not _gradient_reduces(late_plan, "post")
    assert late_log.counts()["all_reduce"] == early_log.counts()["all_reduce"]
    np.testing.assert_allclose(late_losses, single_losses, rtol=1e-5)
    for name, value in late_params.items():
        np.testing.assert_allclose(value, single_params[name], rtol=1e-5, atol=1e-5, err_msg=name)


def _grad_plan(m: int, partial: Any = PSUM, second_reader: bool = False, target: Any = B,
               carrier: bool = False) -> Any:
    """w's gradient made per micro-batch as ``partial`` on 2 ranks, converted to ``target``, accumulated;
    w -= 0.1 g. ``carrier``: a per-micro-batch all-reduce of another P(sum) value too, output per micro-batch."""
    b = PlanBuilder(micro_batches=m)
    xk = b.unpack(b.input("x", (8, 3), P2, (S.split(0),)))
    w = b.variable("w", (3, 4), P2, (B,))
    y = b.compute("matmul", xk, b.repeat(w))
    grad = b.compute("matmul", b.compute("permute", xk, dims=(1, 0), out_sbp=(S.split(1),)), y, out_sbp=(PSUM,))
    if partial is PMAX:
        grad = b.compute("amax", y, dim=(0,), out_sbp=(PMAX,))
    reduced = b.boxing(grad, (target,))
    if second_reader:
        b.output("reduced", b.pack(reduced))
    if carrier:
        b.output("carried", b.pack(b.boxing(b.compute("mul", grad, Const(2.0)), (B,))))
    g = b.accumulate(reduced)
    if target != B:
        g = b.boxing(g, (B,))
    b.assign("w", b.compute("sub", w, b.compute("mul", g, Const(0.1))))
    return b.build()


def _run(plan: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 3, generator=gen), torch.randn(3, 4, generator=gen)
    feeds = {"x": {0: x[:4], 1: x[4:]}}
    variables = {"w": {0: w.clone(), 1: w.clone()}}
    run_plan(plan, feeds, variables, SimulatedBackend())
    return variables


def test_a_hand_built_plan_moves_its_all_reduce_after_the_accumulate_and_runs_alike() -> None:
    plan = _grad_plan(4)
    moved = reduce_after_accumulating(plan)
    verify(moved)
    kinds = [(n.kind, n.phase) for n in moved.nodes if n.kind in ("boxing", "accumulate")]
    assert kinds == [("accumulate", "post"), ("boxing", "post")]
    accumulate = next(n for n in moved.nodes if n.kind == "accumulate")
    assert moved.bufs[accumulate.outputs[0]].layout.sbp == (PSUM,)  # the running sum stays partial
    before, after = _run(plan), _run(moved)
    for r in (0, 1):
        torch.testing.assert_close(after["w"][r], before["w"][r], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("partial", "second_reader", "target"),
                         [(PMAX, False, B), (PSUM, True, B), (PSUM, False, S.split(0))],
                         ids=["partial-max", "reduced-value-read-per-micro-batch", "reduce-scatter (ZeRO)"])
def test_what_does_not_commute_with_the_sum_or_would_hold_more_stays(partial: Any, second_reader: bool,
                                                                      target: Any) -> None:
    """A P(max) conversion does not commute with a sum; a reduced value read per micro-batch must exist per
    micro-batch; accumulating before a reduce-scatter would hold the whole gradient where ZeRO holds a shard."""
    plan = _grad_plan(4, partial, second_reader, target)
    if target != B:
        assert [n.boxing.steps[0].kind for n in plan.nodes if n.kind == "boxing"][0] == "reduce_scatter"
    assert reduce_after_accumulating(plan) is plan


def test_one_micro_batch_leaves_the_plan_alone() -> None:
    plan = _grad_plan(1)
    assert reduce_after_accumulating(plan) is plan


@pytest.mark.parametrize(("alpha", "moves"), [(100e-6, False), (0.0, True)], ids=["latency", "no-latency"])
def test_a_gradient_sharing_a_bucket_moves_only_when_its_bytes_outweigh_a_latency(alpha: float,
                                                                                  moves: bool) -> None:
    """With another micro-batch all-reduce of its group and layouts, the gradient would ride that one's bucket
    per micro-batch: moving it saves 3 sends of its 48 bytes and adds the post phase's own collective."""
    plan = _grad_plan(4, carrier=True)
    model = sbpflow.boxing.CostModel().with_link("cpu", "intra", alpha, 1 / 2e9)
    moved = reduce_after_accumulating(plan, model)
    assert (moved is not plan) == moves
    alone = _grad_plan(4)
    assert reduce_after_accumulating(alone, model) is not alone  # with no other all-reduce it always moves
    verify(moved)
