"""Fused segments (``config.enable_fused_segments``, :mod:`sbpflow.graph.fuse`): runs of compute nodes become one
node of generated straight-line Python; training numbers stay those of the unfused plan, bit for bit (the same
kernels in the same order), and of eager mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn, sbp
from sbpflow.comm import SimulatedBackend
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.graph.fuse import FUSED, codegen, fuse_segments, members, sub_nodes, transient_bytes
from sbpflow.graph.verify import verify
from sbpflow.models.gpt import GPTConfig
from sbpflow.runtime import ActorRuntime, ExecutionError, run_plan
from sbpflow.runtime.builder import Const, PlanBuilder
from sbpflow.runtime.memory import dry_run
from sbpflow.runtime.trace import load

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P1 = sbpflow.placement("cpu", [0])
P2 = sbpflow.placement("cpu", [0, 1])
B = sbp.broadcast
CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
STEPS = 3


def _computes(plan: Any) -> int:
    return sum(1 for n in plan.nodes if n.kind == "compute")


# ----------------------------------------------------------------------------- GPT


def _gpt(spec: str | None, fused: bool | None, executor: str = "actors", m: int = 1) -> tuple[Any, ...]:
    """Three AdamW steps of the GPT: eager (``fused`` None) or compiled with or without fused segments."""
    trainer = build(CONFIG, spec, graph=fused is not None, executor=executor, micro_batches=m)
    if fused is not None:
        trainer.graph.config.enable_fused_segments(fused)
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, STEPS, 8, 8, seed=1)]
    return losses, parameter_values(trainer), trainer.graph


@pytest.mark.parametrize(("spec", "m", "executor"), [("dp=1", 1, "actors"), ("dp=1", 1, "inorder"),
                                                     ("dp=2", 1, "actors"), ("dp=2", 2, "actors"),
                                                     ("dp=2", 2, "inorder")])
def test_gpt_with_fused_segments_trains_as_the_unfused_graph_and_eager(spec: str, m: int, executor: str) -> None:
    losses, params, plain = _gpt(spec, False, executor, m)
    got_losses, got_params, graph = _gpt(spec, True, executor, m)
    assert got_losses == losses  # the same kernels in the same order: the same bits
    for name, value in params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
    if m == 1:  # eager on one device (local tensors) draws the same dropout masks as one micro-batch
        eager_losses, eager_params, _ = _gpt(None, None)
        np.testing.assert_allclose(got_losses, eager_losses, rtol=1e-5)
        for name, value in eager_params.items():  # AdamW scales rounding noise of about-zero gradients up to ~lr
            np.testing.assert_allclose(got_params[name], value, rtol=1e-5, atol=3e-5, err_msg=name)
    fused = [n for n in graph.plan.nodes if n.op == FUSED]
    assert fused and _computes(graph.plan) < _computes(plain.plan) // 4
    assert sum(len(sub_nodes(n)) for n in fused) + _computes(graph.plan) - len(fused) == _computes(plain.plan)
    assert [n.id for n in graph.plan.nodes] == list(range(len(graph.plan.nodes)))
    verify(graph.plan)
    if executor == "actors":  # the register protocol still predicts what the runtime measures
        stats = graph._compiled().executor.stats
        assert stats.peak_bytes == graph.plan.peak_bytes
        predicted = dry_run(graph.plan, SimulatedBackend())
        assert (stats.acts, stats.peak_slots) == (predicted.acts, predicted.peak_slots)


def _gpt_with(spec: str, fused: bool, zero: int = 0, amp: Any = None, checkpointed: bool = False,
              m: int = 1) -> tuple[Any, ...]:
    trainer = build(CONFIG, spec, graph=True, zero=zero, amp=amp, micro_batches=m)
    trainer.graph.config.enable_fused_segments(fused)
    for block in trainer.graph.model.h:
        block.config.activation_checkpointing = checkpointed
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, 2, 8, 8, seed=1)]
    return losses, parameter_values(trainer), trainer.graph


@pytest.mark.parametrize(("spec", "options"), [("dp=2", {"zero": 3}), ("dp=2", {"amp": torch.bfloat16}),
                                               ("dp=2", {"checkpointed": True}), ("dp=2,tp=2", {}),
                                               ("pp=2", {"m": 2})], ids=["zero3", "amp", "checkpointing", "tp2", "pp2"])
def test_fused_segments_keep_the_numbers_of_every_strategy(spec: str, options: dict[str, Any]) -> None:
    """ZeRO-3 (watched gathers, prefetch control edges), autocast casts, recomputation behind control edges and
    tensor-parallel collectives, pipeline stages: the same bits fused or not."""
    losses, params, plain = _gpt_with(spec, False, **options)
    got_losses, got_params, graph = _gpt_with(spec, True, **options)
    assert got_losses == losses
    for name, value in params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
    assert graph._compiled().executor.stats.peak_bytes == graph.plan.peak_bytes
    assert _computes(graph.plan) < _computes(plain.plan) * 3 // 5


@pytest.mark.parametrize(("spec", "schedule", "virtual"), [
    ("pp=2", "1f1b", 1), ("pp=2", "gpipe", 1), ("pp=2", "zero_bubble", 1), ("pp=4", "1f1b", 1),
    ("pp=2,dp=2", "1f1b", 1), ("pp=2", "interleaved_1f1b", 2)])
def test_pipelines_fuse_within_a_stage_and_part_and_keep_their_schedule(spec: str, schedule: str,
                                                                        virtual: int) -> None:
    """A run keeps to one stage and one part (F, B, W): the schedule's activation bounds and its numbers hold."""
    from sbpflow.graph.pipeline import activation_peaks

    config = dataclasses.replace(CONFIG, n_layer=4)
    results = []
    for fused in (False, True):
        trainer = build(config, spec, graph=True, micro_batches=4, schedule=schedule, virtual_stages=virtual)
        trainer.graph.config.enable_fused_segments(fused)
        losses = [trainer.step(ids, targets) for ids, targets in random_batches(config.vocab_size, 2, 8, 8, seed=1)]
        compiled = trainer.graph._compiled()
        pipe = compiled.plan.pipeline
        assert pipe is not None
        micro = [n for n in compiled.plan.nodes if n.op == FUSED and n.phase == "micro"]
        assert bool(micro) == fused  # each has the stage and part its members had
        assert all(n.id in pipe.stage_of and n.id in pipe.part_of for n in micro)
        results.append((losses, parameter_values(trainer), compiled,
                        activation_peaks(pipe, compiled.executor.stats.peak_slots)))
    (losses, params, plain, peaks), (got_losses, got_params, compiled, got_peaks) = results
    assert got_losses == losses
    for name, value in params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
    assert got_peaks == peaks
    assert _computes(compiled.plan) < _computes(plain.plan) // 2
    verify(compiled.plan)


def test_dropout_and_optimizer_nodes_stay_apart_and_collectives_split_segments() -> None:
    """Nodes with per-step scalars (dropout keys, the learning rate) and communication end a run; so does the
    maker of what a collective sends (it is issued at once), and a reader of a collective's output starts one (so
    what comes before it overlaps the transfer); the plan's collectives are those of the unfused plan, in the same
    order."""
    _, _, plain = _gpt("dp=2", False)
    _, _, graph = _gpt("dp=2", True)
    kept = [n for n in graph.plan.nodes if n.kind == "compute" and n.op != FUSED]
    assert {n.op for n in kept} >= {"dropout"}
    assert all(any(how in ("s", "k") for how, _ in n.args) or len(_run_of(graph.plan, n)) == 1 for n in kept)
    for rank in (0, 1):
        assert [n.name for n in graph.plan.collectives(rank)] == [n.name for n in plain.plan.collectives(rank)]
    assert "fused segments (graph.fuse): " in graph.explain() and "fused segments" not in plain.explain()
    communicated = {b for n in graph.plan.nodes if n.kind == "boxing" for b in n.outputs}
    sent = {b for n in graph.plan.nodes if n.kind == "boxing" for b in n.inputs}
    fused = [n for n in graph.plan.nodes if n.op == FUSED]
    for node in fused:  # only a run's first node waits for a transfer, only its last one makes what is sent
        assert all(communicated.isdisjoint(sub.inputs) for sub in sub_nodes(node)[1:]), node.label()
        assert all(sent.isdisjoint(sub.outputs) for sub in sub_nodes(node)[:-1]), node.label()
    assert any(not communicated.isdisjoint(sub_nodes(n)[0].inputs) for n in fused)
    assert any(not sent.isdisjoint(sub_nodes(n)[-1].outputs) for n in fused)


def _run_of(plan: Any, node: Any) -> list[Any]:
    """The consecutive compute nodes around ``node`` with its phase and ranks (itself included)."""
    i = plan.nodes.index(node)
    same = lambda n: n.kind == "compute" and (n.phase, n.ranks) == (node.phase, node.ranks)  # noqa: E731
    lo, hi = i, i
    while lo > 0 and same(plan.nodes[lo - 1]):
        lo -= 1
    while hi + 1 < len(plan.nodes) and same(plan.nodes[hi + 1]):
        hi += 1
    return plan.nodes[lo:hi + 1]


def test_on_by_default_and_off_gives_the_plan_of_its_members() -> None:
    """The default compiled plan fuses; turned off, the plan is the default's with each fused node replaced by the
    nodes it runs, in order (the same buffers in and out)."""
    trainer = build(CONFIG, "dp=1", graph=True)
    assert trainer.graph.config.fused_segments
    unfused = build(CONFIG, "dp=1", graph=True)
    unfused.graph.config.enable_fused_segments(False)
    for ids, targets in random_batches(CONFIG.vocab_size, 1, 8, 8, seed=1):
        trainer.step(ids, targets)
        unfused.step(ids, targets)
    default, off = trainer.graph.plan, unfused.graph.plan
    assert any(n.op == FUSED for n in default.nodes) and not any(n.op == FUSED for n in off.nodes)
    assert [(n.kind, n.name, n.inputs, n.outputs) for n in members(default.nodes)] == \
        [(n.kind, n.name, n.inputs, n.outputs) for n in off.nodes]


def test_config_refuses_bad_values() -> None:
    config = nn.Graph().config
    with pytest.raises(sbpflow.SbpflowError, match="enable_fused_segments takes booleans"):
        config.enable_fused_segments(1)  # type: ignore[arg-type]
    with pytest.raises(sbpflow.SbpflowError, match="needs enabled=True"):
        config.enable_fused_segments(False, torch_compile=True)


# ----------------------------------------------------------------------------- MLP


class Mlp(nn.Module):
    def __init__(self, placement: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16, placement=placement, sbp=B)
        self.fc2 = nn.Linear(16, 16, placement=placement, sbp=B)
        self.fc3 = nn.Linear(16, 3, placement=placement, sbp=B)

    def forward(self, x: Any) -> Any:
        return self.fc3(nn.functional.gelu(self.fc2(self.fc1(x).relu())))


class MlpStep(nn.Graph):
    def __init__(self, model: nn.Module, opt: Any, m: int, fused: bool, torch_compile: bool = False) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt, clip_grad_max_norm=1.0)
        self.config.set_gradient_accumulation_steps(m)
        self.config.enable_fused_segments(fused, torch_compile=torch_compile)

    def build(self, x: Any, y: Any) -> Any:
        loss = (self.model(x) - y).square().mean()
        loss.backward()
        return loss


def _mlp(placement: Any, fused: bool | None, m: int = 1, torch_compile: bool = False) -> tuple[Any, ...]:
    """Three AdamW steps of the MLP (data split on dim 0): eager (``fused`` None) or compiled."""
    sbpflow.manual_seed(0)
    model = Mlp(placement)
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)
    step = MlpStep(model, opt, m, fused, torch_compile) if fused is not None else None
    losses = []
    for i in range(STEPS):
        sbpflow.manual_seed(100 + i)
        x = sbpflow.randn(8, 6, placement=placement, sbp=sbp.split(0))
        y = sbpflow.randn(8, 3, placement=placement, sbp=sbp.split(0))
        if step is not None:
            losses.append(step(x, y).item())
            continue
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.numpy() for n, p in model.named_parameters()}, step


@pytest.mark.parametrize(("placement", "m"), [(P1, 1), (P2, 1), (P2, 2)], ids=["one-rank", "dp2", "dp2-m2"])
def test_mlp_with_fused_segments_trains_as_the_unfused_graph_and_eager(placement: Any, m: int) -> None:
    losses, params, plain = _mlp(placement, False, m)
    got_losses, got_params, step = _mlp(placement, True, m)
    assert got_losses == losses
    for name, value in params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
    eager_losses, eager_params, _ = _mlp(placement, None)
    np.testing.assert_allclose(got_losses, eager_losses, rtol=1e-6)
    for name, value in eager_params.items():
        np.testing.assert_allclose(got_params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert _computes(step.plan) < _computes(plain.plan)
    assert step._compiled().executor.stats.peak_bytes == step.plan.peak_bytes


@pytest.mark.slow
def test_torch_compile_segments_train_as_the_unfused_graph() -> None:
    """``torch_compile=True``: each segment's function runs under torch.compile (inductor may fuse kernels, so
    the numbers agree to rounding, not bit for bit)."""
    losses, params, _ = _mlp(P1, False)
    got_losses, got_params, step = _mlp(P1, True, torch_compile=True)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
    for name, value in params.items():
        np.testing.assert_allclose(got_params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(n.op == FUSED and dict(n.attrs)["torch_compile"] for n in step.plan.nodes)


# ----------------------------------------------------------------------------- the pass and its code


def _chain() -> Any:
    """x (fed, 4 x 3) -> relu -> matmul w (3 x 5) -> neg -> mul 2 -> out: four compute nodes on two ranks."""
    b = PlanBuilder()
    x = b.input("x", (4, 3), P2, (B,))
    w = b.variable("w", (3, 5), P2, (B,))
    h = b.compute("matmul", b.compute("relu", x), w)
    b.output("out", b.compute("mul", b.compute("neg", h), Const(2.0)))
    return b.build()


def test_a_chain_becomes_one_node_of_generated_code() -> None:
    plan = _chain()
    fused = fuse_segments(plan)
    verify(fused)
    (node,) = [n for n in fused.nodes if n.kind == "compute"]
    assert node.op == FUSED and [s.op for s in sub_nodes(node)] == ["relu", "matmul", "neg", "mul"]
    code = codegen(node)
    assert code.source.count("del ") == 3  # each intermediate dies after its last reader
    assert code.function.__code__.co_filename == f"<sbpflow {FUSED} #{node.id}>"  # its own code object
    assert set(fused.registers) == {b for n in fused.nodes for b in (*n.inputs, *n.outputs)}
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    feeds, variables = {"x": {r: x for r in (0, 1)}}, {"w": {r: w for r in (0, 1)}}
    expected = run_plan(plan, feeds, variables, SimulatedBackend())
    got = run_plan(fused, feeds, variables, SimulatedBackend())
    for r in (0, 1):
        assert torch.equal(got["out"][r], expected["out"][r])
    # relu's (48 B) and matmul's output (80 B) live at once inside the act, then neg's (80 B) with matmul's
    assert transient_bytes(fused, node, 0) == 48 + 80 + 80 - 48


@pytest.mark.parametrize("threads", [False, True], ids=["play", "worker-threads"])
def test_the_timeline_has_a_span_per_op_inside_a_fused_act(threads: bool, tmp_path: Any) -> None:
    """With a timeline, a fused act's span holds one span per sub-node per rank, in order and inside it; the
    numbers are those of the untimed code."""
    plan = _chain()
    fused = fuse_segments(plan)
    (node,) = [n for n in fused.nodes if n.op == FUSED]
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    feeds, variables = {"x": {r: x for r in (0, 1)}}, {"w": {r: w for r in (0, 1)}}
    path = str(tmp_path / "trace.json")
    runtime = ActorRuntime(fused, SimulatedBackend(), trace=path, threads=threads)
    got = runtime.run(feeds, variables)
    runtime.close()
    expected = run_plan(plan, feeds, variables, SimulatedBackend())
    assert all(torch.equal(got["out"][r], expected["out"][r]) for r in (0, 1))
    spans = [e for e in load(path) if e["ph"] == "X"]
    (act,) = [e for e in spans if e["name"] == node.label()]
    inner = [e for e in spans if e["name"].startswith(f"{node.label()}: ")]
    ops = ["relu", "matmul", "neg", "mul"]
    assert [e["name"] for e in inner] == [f"{node.label()}: {op} rank {r}" for r in (0, 1) for op in ops]
    assert [e["args"]["op"] for e in inner] == ops * 2
    assert all(e["tid"] == act["tid"] for e in inner)
    ends = [e["ts"] + e["dur"] for e in inner]
    assert act["ts"] <= inner[0]["ts"] and max(ends) <= act["ts"] + act["dur"] + 1  # (rounding to 1 us)
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(inner, inner[1:], strict=False))


def test_without_a_timeline_a_fused_act_reads_no_clock() -> None:
    """The timed code runs only while a timeline is written: a plain run leaves no marks behind."""
    from sbpflow.runtime.inorder import SEGMENT_MARKS

    fused = fuse_segments(_chain())
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    runtime = ActorRuntime(fused, SimulatedBackend())
    runtime.run({"x": {r: x for r in (0, 1)}}, {"w": {r: w for r in (0, 1)}})
    runtime.close()
    assert getattr(SEGMENT_MARKS, "spans", None) is None
    (node,) = [n for n in fused.nodes if n.op == FUSED]
    code = codegen(node)
    marks: list[float] = [0.0]
    assert torch.equal(code.timed(marks, x, w)[0], code.function(x, w)[0]) and len(marks) == 5
    # an error inside the timed twin is placed by its own lines (no second run of the plain code to find it)
    from sbpflow.runtime.inorder import _failing_line

    with pytest.raises(RuntimeError) as caught:
        code.timed([0.0], torch.randn(4, 4), w)
    failed = _failing_line(code, caught.value)
    assert failed is not None and failed.op == "matmul"


@pytest.mark.parametrize("threads", [False, True], ids=["play", "worker-threads"])
def test_a_fused_acts_intermediates_count_in_the_memory_plan_and_the_runtime(threads: bool) -> None:
    """The memory plan (the dry run) and the runtime count a fused act's intermediates while it runs, on top of
    its registers: the chain's act holds x (48 B), w (60 B, resident), its output (80 B) and 160 B inside."""
    fused = fuse_segments(_chain())
    (node,) = [n for n in fused.nodes if n.op == FUSED]
    predicted = dry_run(fused, SimulatedBackend())
    registers_only = 48 + 60 + 80
    assert predicted.peak_bytes == {0: registers_only + 160, 1: registers_only + 160}
    assert transient_bytes(fused, node, 1) == 160
    assert -1 - node.id not in predicted.peak_slots  # the intermediates are no register of the plan
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    runtime = ActorRuntime(fused, SimulatedBackend(), threads=threads)
    assert runtime.threaded == threads
    runtime.run({"x": {r: x for r in (0, 1)}}, {"w": {r: w for r in (0, 1)}})
    assert runtime.stats.peak_bytes == predicted.peak_bytes
    runtime.run({"x": {r: x for r in (0, 1)}}, {"w": {r: w for r in (0, 1)}})  # a second step counts the same
    assert runtime.stats.peak_bytes == predicted.peak_bytes
    runtime.close()


@pytest.mark.parametrize("executor", ["inorder", "actors", "actors-timeline"])
def test_an_error_inside_a_segment_names_the_original_node(executor: str, tmp_path: Any) -> None:
    fused = fuse_segments(_chain())
    feeds = {"x": {r: torch.randn(4, 4) for r in (0, 1)}}  # 4 columns, not 3: matmul fails
    variables = {"w": {r: torch.randn(3, 5) for r in (0, 1)}}
    match = r"compute fused_segment \(micro-batch 0\): its node #\d+ compute matmul \(op matmul\) failed: RuntimeError"
    with pytest.raises(ExecutionError, match=match):
        if executor == "inorder":
            run_plan(fused, feeds, variables, SimulatedBackend())
        else:  # with a timeline the timed twin of the code runs, and its lines name the sub-node too
            trace = str(tmp_path / "t.json") if executor == "actors-timeline" else None
            with ActorRuntime(fused, SimulatedBackend(), timeout=20.0, trace=trace) as rt:
                rt.run(feeds, variables)
