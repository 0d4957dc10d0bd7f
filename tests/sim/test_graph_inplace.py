"""Compiled steps without copies: in-place optimizer updates, foreach clipping ops, buffers dropped after use.

An optimizer update whose outputs only go back to its own variables becomes one ``update`` node that writes the
variables' storage once the step has succeeded (graph.lower.in_place_updates); anything else keeps the
out-of-place op and its assigns. Both executors give the same numbers either way, and a failing step still
leaves the variables as they were.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend
from sbpflow.graph.fuse import members
from sbpflow.graph.lower import in_place_updates, overwrite_inputs, registers
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.ops.optimizer import grad_norm_multi, scale_multi
from sbpflow.runtime import ActorRuntime, ExecutionError, run_plan
from sbpflow.runtime.builder import Const, PlanBuilder
from sbpflow.runtime.inorder import program

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P2 = sbpflow.placement("cpu", [0, 1])
B = S.broadcast


class Step(nn.Graph):
    def __init__(self, model: nn.Module, opt: Any, executor: str, clip: float | None = None) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt, clip_grad_max_norm=clip)
        self.config.set_executor(executor)

    def build(self, x: Any, y: Any) -> Any:
        loss = (self.model(x) - y).square().mean()
        loss.backward()
        return loss


OPTIMIZERS = {
    "sgd": lambda ps: sbpflow.optim.SGD(ps, lr=0.1, weight_decay=0.01),
    "momentum": lambda ps: sbpflow.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adamw": lambda ps: sbpflow.optim.AdamW(ps, lr=0.01),
}


def _model() -> nn.Module:
    sbpflow.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to_global(P2, B)


def _batch(i: int) -> tuple[Any, Any]:
    sbpflow.manual_seed(10 + i)
    return (sbpflow.randn(8, 6, placement=P2, sbp=S.split(0)), sbpflow.randn(8, 3, placement=P2, sbp=S.split(0)))


@pytest.mark.parametrize("executor", ["inorder", "actors"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_updates_write_the_variables_in_place(name: str, executor: str) -> None:
    model, ref = _model(), _model()
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    step = Step(model, opt, executor, clip=0.5)
    storage = {n: {r: t.data_ptr() for r, t in p.local_tensors().items()} for n, p in model.named_parameters()}
    for i in range(3):
        x, y = _batch(i)
        step(x, y)
        ref_opt.zero_grad()
        (ref(x) - y).square().mean().backward()
        nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
        ref_opt.step()
    kinds = [n.kind for n in step.plan.nodes]
    assert "update" in kinds and "assign" not in kinds  # every parameter and state tensor is updated in place
    assert not any(n.op in ("sgd_update", "sgd_momentum_update", "adam_update_multi")
                   for n in step.plan.nodes if n.kind == "compute")
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert {r: t.data_ptr() for r, t in p.local_tensors().items()} == storage[n]
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-7, err_msg=n)


def test_clipping_is_one_norm_op_and_one_scale_op_per_layout() -> None:
    model = _model()
    step = Step(model, OPTIMIZERS["sgd"](model.parameters()), "inorder", clip=0.5)
    step(*_batch(0))
    ops = [n.op for n in members(step.plan.nodes) if n.kind == "compute"]
    assert ops.count("grad_norm_multi") == 1 and ops.count("scale_multi") == 1
    assert "square" not in ops


def test_foreach_clipping_ops_on_split_shards() -> None:
    a = sbpflow.tensor(torch.arange(8.0).reshape(4, 2), placement=P2, sbp=S.split(0))
    b = sbpflow.tensor(torch.tensor([3.0, -4.0]), placement=P2, sbp=S.split(0))
    total = grad_norm_multi(a, b, norm_type=2.0)
    assert total.sbp == (S.partial_sum,)
    assert total.item() == pytest.approx(float((torch.arange(8.0) ** 2).sum()) + 25.0)
    assert grad_norm_multi(a, b, norm_type=float("inf")).item() == 7.0
    scaled = scale_multi(a, b, sbpflow.tensor(torch.tensor(0.5), placement=P2, sbp=B))
    np.testing.assert_array_equal(scaled[0].numpy(), np.arange(8.0).reshape(4, 2) / 2)
    np.testing.assert_array_equal(scaled[1].numpy(), [1.5, -2.0])


# ----------------------------------------------------------------------------- the rewrite on hand-built plans


def _sgd_plan(also_output: bool, failing: bool = False) -> PhysicalPlan:
    """w <- sgd_update(w, g, 0.1) where g is fed; ``also_output`` returns the new w too (so it must stay a
    value of its own); ``failing`` adds a node after the update whose kernel raises."""
    b = PlanBuilder()
    w = b.variable("w", (3, 4), P2, (B,))
    g = b.input("g", (3, 4), P2, (B,))
    new = b.compute("sgd_update", w, b.compute("mul", g, Const(1.0)), Const(0.1))
    b.assign("w", new)
    if also_output:
        b.output("new_w", new)
    if failing:
        b.output("bad", b.compute("matmul", b.input("x", (4, 3), P2, (B,)), w))  # fed 5 columns: fails
    plan = b.build()
    rewritten = PhysicalPlan(in_place_updates(plan.nodes), plan.bufs, {}, plan.micro_batches, world=plan.world)
    rewritten.registers = registers(rewritten)
    return rewritten


def _run(plan: PhysicalPlan, executor: str, feeds: dict[str, Any], variables: dict[str, Any]) -> dict[str, Any]:
    backend = SimulatedBackend()
    if executor == "inorder":
        return run_plan(plan, feeds, variables, backend)
    with ActorRuntime(plan, backend, timeout=20.0) as rt:
        return rt.run(feeds, variables)


@pytest.mark.parametrize("executor", ["inorder", "actors"])
@pytest.mark.parametrize("also_output", [False, True])
def test_an_update_becomes_in_place_only_when_its_outputs_just_go_back(also_output: bool, executor: str) -> None:
    plan = _sgd_plan(also_output)
    kinds = [n.kind for n in plan.nodes]
    if also_output:  # the new value is read by an output: the op and its assign stay
        assert "update" not in kinds and "assign" in kinds
    else:
        assert "update" in kinds and "assign" not in kinds
        assert [n.id for n in plan.nodes] == list(range(len(plan.nodes)))
    w, g = torch.randn(3, 4), torch.randn(3, 4)
    variables = {"w": {r: w.clone() for r in (0, 1)}}
    ptr = variables["w"][0].data_ptr()
    out = _run(plan, executor, {"g": {r: g.clone() for r in (0, 1)}}, variables)
    for r in (0, 1):
        torch.testing.assert_close(variables["w"][r], w - 0.1 * g, rtol=0, atol=0)
    assert variables["w"][0].data_ptr() == ptr
    if also_output:
        torch.testing.assert_close(out["new_w"][1], w - 0.1 * g, rtol=0, atol=0)


@pytest.mark.parametrize("executor", ["inorder", "actors"])
def test_a_failing_step_leaves_variables_an_update_would_write_unchanged(executor: str) -> None:
    plan = _sgd_plan(also_output=False, failing=True)
    update = next(n for n in plan.nodes if n.kind == "update")
    matmul = next(n for n in plan.nodes if n.op == "matmul")
    assert update.id < matmul.id  # the update comes first in the plan, yet writes nothing before the step ends
    w = torch.randn(3, 4)
    variables = {"w": {r: w.clone() for r in (0, 1)}}
    feeds = {"g": {r: torch.ones(3, 4) for r in (0, 1)}, "x": {r: torch.ones(4, 5) for r in (0, 1)}}
    with pytest.raises(ExecutionError, match="matmul"):
        _run(plan, executor, feeds, variables)
    for r in (0, 1):
        assert torch.equal(variables["w"][r], w)


def test_the_in_order_executor_drops_each_buffer_after_its_last_reader() -> None:
    b = PlanBuilder(micro_batches=2)
    x_in = b.input("x", (8, 3), P2, (S.split(0),))
    x = b.unpack(x_in)
    w = b.repeat(b.variable("w", (3,), P2, (B,)))
    y = b.compute("mul", x, w)
    z = b.compute("relu", y)
    b.output("z", b.pack(b.compute("neg", z)))
    plan = b.build()
    prog = program(plan, SimulatedBackend())
    drops = {n.id: set(d) for _, steps in prog.phases for n, _, d in steps}
    by_out = {n.outputs[0]: n for n in plan.nodes if n.outputs}
    relu, neg = by_out[z], next(n for n in plan.nodes if n.op == "neg")
    assert y in drops[relu.id] and z in drops[neg.id]
    assert x_in in prog.after_micro  # a pre buffer read by every micro-batch lives until the last one
    neg_out = neg.outputs[0]
    assert neg_out in prog.gathered and all(neg_out not in d for d in drops.values())  # pack reads all m values
    x_full = torch.randn(8, 3)
    wv = torch.randn(3)
    out = run_plan(plan, {"x": {r: x_full[4 * r:4 * r + 4].clone() for r in (0, 1)}},
                   {"w": {r: wv.clone() for r in (0, 1)}}, SimulatedBackend())
    torch.testing.assert_close(out["z"][1], -torch.relu(x_full[4:] * wv))


@pytest.mark.parametrize("executor", ["inorder", "actors"])
def test_a_changed_plan_is_prepared_again(executor: str) -> None:
    b = PlanBuilder()
    b.output("y", b.compute("relu", b.input("x", (4,), P2, (S.split(0),))))
    plan = b.build()
    feeds = {"x": {0: torch.tensor([-1.0, 2.0]), 1: torch.tensor([3.0, -4.0])}}
    backend = SimulatedBackend()
    assert run_plan(plan, feeds, {}, backend)["y"][1].tolist() == [3.0, 0.0]
    relu = next(n for n in plan.nodes if n.op == "relu")
    plan.nodes[relu.id] = dataclasses.replace(relu, name="neg", op="neg")
    if executor == "inorder":
        out = run_plan(plan, feeds, {}, backend)
    else:
        with ActorRuntime(plan, backend, timeout=20.0) as rt:
            out = rt.run(feeds, {})
    assert out["y"][1].tolist() == [-3.0, 4.0]


@pytest.mark.parametrize("executor", ["inorder", "actors"])
def test_an_add_writes_into_a_fresh_input_it_alone_reads(executor: str) -> None:
    b = PlanBuilder()
    x, y, z = (b.input(name, (2, 3), P2, (B,)) for name in "xyz")
    row = b.input("row", (3,), P2, (B,))
    fresh = b.compute("add", x, y)  # read only by the next add: its memory takes the sum
    kept = b.compute("add", y, z)  # also an output: must keep its value
    wide = b.compute("add", x, z)  # read by an add with a broadcast row: same shape as the output, so it is taken
    b.output("s", b.compute("add", z, fresh))
    b.output("t", b.compute("add", kept, x))
    b.output("kept", kept)
    b.output("u", b.compute("add", row, wide))
    plan = b.build()
    nodes = overwrite_inputs(plan.nodes, plan.bufs)
    by_out = {n.outputs[0]: n for n in nodes if n.kind == "compute"}
    last = [n for n in nodes if n.kind == "compute"][-3:]
    assert [n.overwrites for n in last] == [1, None, 1]
    assert by_out[fresh].overwrites is None  # its inputs are fed, not fresh
    plan = PhysicalPlan(nodes, plan.bufs, {}, world=plan.world)
    plan.registers = registers(plan)
    vals = {k: torch.randn(2, 3) for k in "xyz"} | {"row": torch.randn(3)}
    feeds = {k: {r: v.clone() for r in (0, 1)} for k, v in vals.items()}
    out = _run(plan, executor, feeds, {})
    x_, y_, z_, row_ = vals["x"], vals["y"], vals["z"], vals["row"]
    assert torch.equal(out["s"][0], z_ + (x_ + y_)) and torch.equal(out["t"][1], (y_ + z_) + x_)
    assert torch.equal(out["kept"][0], y_ + z_) and torch.equal(out["u"][1], row_ + (x_ + z_))
    for k, v in vals.items():  # the feeds were never written
        assert torch.equal(feeds[k][0], v)
