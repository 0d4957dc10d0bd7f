"""The actor runtime on virtual ranks: the in-order executor's numbers, bounded registers, errors, stalls.

Plans are hand-built (runtime.builder) so that each test states the exact plan it needs. Every runtime
gets a short watchdog timeout and is closed, so no test can hang.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow.cli import main as cli_main
from sbpflow.comm import SimulatedBackend, record
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.runtime import ActorRuntime, DeadlockError, ExecutionError, run_plan
from sbpflow.runtime.builder import Const, PlanBuilder
from sbpflow.runtime.memory import dry_run
from sbpflow.runtime.trace import load

P2 = sbpflow.placement("cpu", [0, 1])
B, PSUM = S.broadcast, S.partial_sum
TIMEOUT = 20.0  # a test that waits this long has failed; the watchdog tests set their own, shorter one


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend()


def runtime(plan: PhysicalPlan, backend: SimulatedBackend, **kwargs: Any) -> ActorRuntime:
    return ActorRuntime(plan, backend, timeout=kwargs.pop("timeout", TIMEOUT), **kwargs)


# -- a small training step: micro-batches, repeat/unpack/accumulate/pack, collectives, an assign ---------


def train_plan(m: int, register_num: int | dict[int, int] = 1, placement: sbpflow.Placement = P2) -> PhysicalPlan:
    """y = relu(x @ w) on S(0) data (4 rows per rank), loss = sum(y) per micro-batch (mean over micro-batches),
    g = sum_k x_k^T y_k all-reduced, w -= 0.1 g; y gathered to B. Also run on real processes (tests/proc)."""
    b = PlanBuilder(micro_batches=m)
    xk = b.unpack(b.input("x", (4 * placement.size, 3), placement, (S.split(0),)))
    w = b.variable("w", (3, 4), placement, (B,))
    y = b.compute("relu", b.compute("matmul", xk, b.repeat(w)))
    loss = b.boxing(b.compute("sum", y, out_sbp=(PSUM,)), (B,))
    grad = b.compute("matmul", b.compute("permute", xk, dims=(1, 0), out_sbp=(S.split(1),)), y, out_sbp=(PSUM,))
    g = b.accumulate(b.boxing(grad, (B,)))
    b.assign("w", b.compute("sub", w, b.compute("mul", g, Const(0.1))))
    b.output("loss", b.pack(loss, "mean"))
    b.output("y", b.boxing(b.pack(y), (B,)))
    return b.build(register_num)


def train_inputs(ranks: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(4 * ranks, 3, generator=gen), torch.randn(3, 4, generator=gen)


def feeds_and_vars(x: torch.Tensor, w: torch.Tensor, ranks: tuple[int, ...] = (0, 1)) -> tuple[dict[str, Any],
                                                                                               dict[str, Any]]:
    """Each listed rank's shards: 4 rows of x each (S(0)), a copy of w (B)."""
    return {"x": {r: x[4 * r:4 * r + 4].clone() for r in ranks}}, {"w": {r: w.clone() for r in ranks}}


def torch_step(x: torch.Tensor, w: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same step in plain torch: micro-batch k holds rows k of each rank's half."""
    y = torch.relu(x @ w)
    halves, rows = x.view(2, 4, 3), 4 // m  # (rank, local row, 3); each rank's half is cut into m chunks
    micro = [halves[:, k * rows:(k + 1) * rows].reshape(-1, 3) for k in range(m)]
    loss = torch.stack([torch.relu(xk @ w).sum() for xk in micro]).mean()
    return loss, y, w - 0.1 * (x.T @ y)


@pytest.mark.parametrize("m", [1, 4])
def test_training_step_equals_in_order_executor_and_torch(backend: SimulatedBackend, m: int) -> None:
    plan = train_plan(m)
    x, w = train_inputs()
    feeds, ref_vars = feeds_and_vars(x, w)
    expected = run_plan(plan, feeds, ref_vars, backend)
    feeds, variables = feeds_and_vars(x, w)
    with runtime(plan, backend) as rt:
        got = rt.run(feeds, variables)
        # virtual ranks: one thread acts for every lane, earliest plan position first: the dry run's schedule
        assert rt.stats.peak_bytes == dry_run(plan, backend).peak_bytes
    for name in ("loss", "y"):
        for r in (0, 1):
            assert torch.equal(got[name][r], expected[name][r]), name
    for r in (0, 1):
        assert torch.equal(variables["w"][r], ref_vars["w"][r])
    loss, y, new_w = torch_step(x, w, m)
    torch.testing.assert_close(got["loss"][1], loss)
    torch.testing.assert_close(got["y"][0], y)
    torch.testing.assert_close(variables["w"][0], new_w)


def test_collectives_keep_the_in_order_executor_order(backend: SimulatedBackend) -> None:
    plan = train_plan(4)
    x, w = train_inputs()
    with record() as expected:
        run_plan(plan, *feeds_and_vars(x, w), backend)
    with runtime(plan, backend) as rt, record() as got:
        rt.run(*feeds_and_vars(x, w))
    assert [(e.kind, e.ranks) for e in got.events] == [(e.kind, e.ranks) for e in expected.events]
    assert len(got.events) == 4 * 2 + 1  # per micro-batch: loss and gradient all-reduce; the final all-gather


def test_threads_live_across_steps_and_steps_chain(backend: SimulatedBackend) -> None:
    plan = train_plan(4)
    x, w = train_inputs()
    feeds, variables = feeds_and_vars(x, w)
    ref_feeds, ref_vars = feeds_and_vars(x, w)
    with runtime(plan, backend) as rt:
        rt.run(feeds, variables)
        run_plan(plan, ref_feeds, ref_vars, backend)
        threads = threading.active_count()
        for _ in range(3):
            run_plan(plan, ref_feeds, ref_vars, backend)
            rt.run(feeds, variables)
            assert threading.active_count() == threads
            assert rt.stats.acts == sum(a.steps for a in rt.board.actors)
    assert torch.equal(variables["w"][0], ref_vars["w"][0])


def test_a_runtime_dropped_without_close_ends_its_threads(backend: SimulatedBackend,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from sbpflow.runtime import actors

    monkeypatch.setattr(actors, "IDLE_CHECK", 0.05)
    before = set(threading.enumerate())  # other tests' runtimes may still be winding theirs down: not counted
    rt = runtime(train_plan(2), backend, threads=True)
    rt.run(*feeds_and_vars(*train_inputs()))
    started = [t for t in threading.enumerate() if t not in before]
    assert len(started) == 1, started  # one comm stream (the caller acts for the compute lane)
    del rt
    gc.collect()
    deadline = time.monotonic() + 5
    while started[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not started[0].is_alive()


# -- back-pressure: register counts bound what is in flight ----------------------------------------------


def chain_plan(m: int, register_num: int, rows: int = 32) -> tuple[PhysicalPlan, list[int]]:
    """input -> unpack -> relu -> neg -> relu -> pack -> output; returns the plan and the micro buffers."""
    b = PlanBuilder(micro_batches=m)
    u = b.unpack(b.input("x", (rows, 4), P2, (S.split(0),)))
    r1 = b.compute("relu", u)
    r2 = b.compute("neg", r1)
    r3 = b.compute("relu", r2)
    b.output("y", b.pack(r3))
    return b.build(register_num), [u, r1, r2, r3]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_chain_holds_at_most_register_num_values_in_flight(backend: SimulatedBackend, k: int) -> None:
    m = 8
    plan, micro_bufs = chain_plan(m, k)
    x = torch.randn(32, 4)
    with runtime(plan, backend) as rt:
        out = rt.run({"x": {0: x[:16], 1: x[16:]}}, {})
        stats = rt.stats
        live_after = dict(rt.board.live_bytes)
    assert torch.equal(out["y"][0], torch.relu(-torch.relu(x[:16])))
    # producers run ahead until their registers are full: exactly k values of each micro buffer at once
    assert [stats.peak_slots[bid] for bid in micro_bufs] == [k] * 4
    assert live_after == {0: 0, 1: 0}  # every register freed at the end of the step
    # Bytes per rank. k = 1: the 4 chain registers hold micro-batches 0..3 when the pack takes its first,
    # so the input (read until the 8th unpack) and the pack's output are live together with 4 micro values.
    # k >= 2: the chain holds all 8 micro-batches before the pack acts; the input is freed by then.
    shard, micro = 16 * 4 * 4, 2 * 4 * 4
    expected = {1: 2 * shard + 4 * micro, 2: shard + 8 * micro, 3: shard + 8 * micro}[k]
    assert stats.peak_bytes == {0: expected, 1: expected}
    bound = sum(reg.register_num * reg.bytes_on(0) for reg in plan.registers.values())
    assert stats.peak_bytes[0] <= bound
    # one compute thread: the run is the dry run's schedule, so the memory plan predicts it exactly
    assert dry_run(plan, backend).peak_bytes == stats.peak_bytes


# -- failure: the step stops, the error names the actor, variables keep their values -----------------------


def test_a_raising_kernel_names_the_actor_and_leaves_variables_unchanged(backend: SimulatedBackend) -> None:
    plan = train_plan(4)
    x, w = train_inputs()
    feeds, variables = feeds_and_vars(x, w)
    bad = {"x": {0: torch.randn(4, 5), 1: torch.randn(4, 5)}}  # 5 columns cannot multiply w (3 x 4)
    matmul = next(n for n in plan.nodes if n.op == "matmul")
    with runtime(plan, backend) as rt:
        with pytest.raises(ExecutionError) as info:
            rt.run(bad, variables)
        message = str(info.value)
        assert f"actor #{matmul.id} compute matmul (op matmul) failed on micro-batch 0" in message, message
        assert "RuntimeError" in message
        for r in (0, 1):
            assert torch.equal(variables["w"][r], w)
        # the runtime stays usable: the next step runs from the unchanged variables
        got = rt.run(feeds, variables)
    torch.testing.assert_close(variables["w"][0], torch_step(x, w, 4)[2])
    torch.testing.assert_close(got["y"][1], torch.relu(x @ w))


def test_a_missing_feed_is_an_error_naming_the_input(backend: SimulatedBackend) -> None:
    plan, _ = chain_plan(2, 1, rows=8)
    with runtime(plan, backend) as rt, pytest.raises(ExecutionError, match="no value for input 'x'"):
        rt.run({}, {})


# -- the watchdog: a plan that misses a message is a report, never a hang -----------------------------------


def test_a_plan_missing_a_message_is_reported_by_the_watchdog(backend: SimulatedBackend) -> None:
    plan, bufs = chain_plan(2, 1, rows=16)
    u = bufs[0]
    # corrupt it: drop the unpack node, so nothing ever writes register %u
    plan.nodes = [n for n in plan.nodes if n.kind != "unpack"]
    relu = next(n for n in plan.nodes if u in n.inputs)
    with runtime(plan, backend, timeout=0.5, threads=True) as rt, pytest.raises(DeadlockError) as info:
        rt.run({"x": {0: torch.ones(8, 4), 1: torch.ones(8, 4)}}, {})
    message = str(info.value)
    assert "no actor acted for 0.5 s (SBPFLOW_TIMEOUT)" in message
    assert (f"actor #{relu.id} compute relu (op relu) on cpu:0,1/compute, micro-batch 0: waits for register %{u} "
            "(no node of the plan writes it) for micro-batch 0") in message, message
    assert "cpu:0,1/compute: #0 input x micro-batch 0, ended" in message, message


def test_a_control_cycle_is_reported_with_both_actors(backend: SimulatedBackend) -> None:
    b = PlanBuilder(micro_batches=2)
    x = b.unpack(b.input("x", (4, 2), P2, (S.split(0),)))
    r = b.compute("relu", x)
    b.output("y", b.pack(b.compute("neg", r)))
    plan = b.build()
    relu = next(n for n in plan.nodes if n.op == "relu")
    neg = next(n for n in plan.nodes if n.op == "neg")
    # corrupt it: relu must wait for neg, which reads relu's output
    plan.nodes[relu.id] = type(relu)(**{**relu.__dict__, "control": (neg.id,)})
    start = time.monotonic()
    with runtime(plan, backend) as rt, pytest.raises(DeadlockError) as info:  # one thread: reported at once
        rt.run({"x": {0: torch.ones(2, 2), 1: torch.ones(2, 2)}}, {})
    assert time.monotonic() - start < TIMEOUT / 2
    message = str(info.value)
    assert message.startswith("sbpflow actor runtime: no actor can act (one thread acts for every actor here")
    assert f"actor #{relu.id} compute relu (op relu) on cpu:0,1/compute, micro-batch 0: waits for a control token " \
           f"from actor #{neg.id} compute neg for micro-batch 0" in message, message
    assert f"actor #{neg.id} compute neg (op neg) on cpu:0,1/compute, micro-batch 0: waits for register " \
           f"%{relu.outputs[0]} from actor #{relu.id} compute relu for micro-batch 0" in message, message


# -- the seed's resource example: control edges keep a step within its memory budget ------------------------


def resource_plan(ordered: bool) -> PhysicalPlan:
    """Seed 000, 2.3: M1 and M2 move data for O1 and O2; after both moves memory fits only O2, whose act
    frees M2's buffer, and then O1. ``ordered`` adds the compiler's control edge O2 -> O1.

    M1 and M2 are local boxing moves (S(0) -> P(sum): each rank pads its rows to the full tensor) on the
    compute thread, so the naive order (plan order among ready actors: O1 first) is deterministic."""
    b = PlanBuilder()
    a1 = b.input("a1", (8, 8), P2, (S.split(0),))  # 128 B/rank
    a2 = b.input("a2", (8, 64), P2, (S.split(0),))  # 1 KiB/rank
    w = b.variable("w", (8, 64), P2, (B,))  # 2 KiB/rank
    m1 = b.boxing(a1, (PSUM,))  # 256 B/rank
    m2 = b.boxing(a2, (PSUM,))  # 2 KiB/rank
    o2_node = len(b.nodes) + 1  # O1 is appended first (the naive order picks it), O2 right after
    o1 = b.compute("matmul", m1, w, control=(o2_node,) if ordered else ())  # (8, 64) P(sum): 2 KiB/rank
    o2 = b.compute("sum", m2)  # 4 B/rank
    b.output("o1", o1)
    b.output("o2", o2)
    return b.build()


def test_the_seed_resource_example_fits_its_budget_only_with_control_edges(backend: SimulatedBackend) -> None:
    budget = 6000  # bytes per rank
    a1, a2, w = torch.randn(8, 8), torch.randn(8, 64), torch.randn(8, 64)
    feeds = {"a1": {0: a1[:4], 1: a1[4:]}, "a2": {0: a2[:4], 1: a2[4:]}}
    peaks = {}
    for ordered in (False, True):
        plan = resource_plan(ordered)
        assert [n.kind for n in plan.nodes].count("boxing") == 2 and all(
            n.stream == "compute" for n in plan.nodes)
        with runtime(plan, backend) as rt:
            out = rt.run(feeds, {"w": {0: w, 1: w}})
            peaks[ordered] = rt.stats.peak_bytes[0]
        assert dry_run(plan, backend).peak_bytes[0] == peaks[ordered]
        torch.testing.assert_close(out["o1"][0] + out["o1"][1], a1 @ w)
        torch.testing.assert_close(out["o2"][0] + out["o2"][1], a2.sum())
    # w is resident for the whole step. Naive: O1 acts while M1 and M2 are live; ordered: the peak is
    # M2's move (its input still live), then O2 frees M2 before O1 writes
    assert peaks[False] == 2048 + 256 + 2048 + 2048 > budget
    assert peaks[True] == 2048 + 1024 + 256 + 2048 <= budget


# -- the timeline -------------------------------------------------------------------------------------------


def test_trace_has_a_lane_per_thread_and_a_span_per_act(backend: SimulatedBackend, tmp_path: Path) -> None:
    plan = train_plan(2)
    path = tmp_path / "t.json"
    with runtime(plan, backend, trace=str(path)) as rt:
        rt.run(*feeds_and_vars(*train_inputs()))
        rt.run(*feeds_and_vars(*train_inputs()))
        acts = rt.stats.acts
    events = json.loads(path.read_text())  # closed: strict JSON
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {"cpu:0,1/compute", "cpu/comm:0,1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 2 * acts
    matmul = next(e for e in spans if e["cat"] == "matmul")
    assert set(matmul["args"]) == {"actor", "op", "micro_batch", "bytes"} and matmul["args"]["bytes"] == 2 * 2 * 4 * 4
    merged = tmp_path / "merged.json"
    assert cli_main(["trace", "merge", str(path), str(path), "-o", str(merged)]) == 0
    both = load(merged)
    assert {e["pid"] for e in both} == {0, 1} and sum(e["ph"] == "X" for e in both) == 4 * acts


# -- synthetic time: pipeline stages on their own virtual devices overlap ----------------------------------


def test_synthetic_time_overlaps_pipeline_stages_on_their_own_threads(backend: SimulatedBackend,
                                                                      tmp_path: Path) -> None:
    """Two stages (ranks 0 and 1), 4 micro-batches, every compute act 30 ms of sleep: stage 1 works on
    micro-batch k while stage 0 works on k + 1, as on two devices."""
    stage0, stage1 = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    b = PlanBuilder(micro_batches=4)
    h = b.compute("neg", b.compute("relu", b.unpack(b.input("x", (8, 4), stage0, (B,)))))
    h = b.compute("neg", b.compute("relu", b.boxing(h, (B,), placement=stage1)))
    b.output("y", b.pack(h))
    plan = b.build()
    path = tmp_path / "pipe.json"
    sleep = {"compute": 0.03}
    with runtime(plan, backend, trace=str(path), synthetic=lambda node: sleep.get(node.kind, 0.0)) as rt:
        out = rt.run({"x": {0: torch.ones(8, 4)}}, {})
    assert out == {}  # nothing ran: placeholders only
    events = load(path)
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = {lane: [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and lanes[e["tid"]] == lane
                    and e["cat"] in ("relu", "neg")] for lane in ("cpu:0/compute", "cpu:1/compute")}
    assert [len(v) for v in spans.values()] == [8, 8]
    overlapping = sum(1 for a, z in spans["cpu:0/compute"] for c, d in spans["cpu:1/compute"] if min(z, d) > max(a, c))
    assert overlapping >= 2  # stage 1 on micro-batches 0..2 while stage 0 is on 1..3


@pytest.fixture(autouse=True)
def _no_thread_leak() -> Iterator[None]:
    before = threading.active_count()
    yield
    assert threading.active_count() <= before, "an ActorRuntime test left worker threads running"
