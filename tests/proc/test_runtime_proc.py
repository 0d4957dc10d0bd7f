"""The actor runtime on real processes (gloo): the same numbers as on virtual ranks; a failing actor ends the job.

Each process owns one rank, so it runs only its own actors and feeds only its own shards; the plans are
the simulated tests' (tests/sim/test_runtime.py), built identically on every process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from procrun import run_ranks, spawn

import sbpflow
from sbpflow import sbp as S
from sbpflow.cli import main as cli_main
from sbpflow.comm import SimulatedBackend, get_backend
from sbpflow.graph.lower import donate_inputs
from sbpflow.runtime import ActorRuntime
from sbpflow.runtime.builder import PlanBuilder
from sbpflow.runtime.trace import load, trace_path
from sim.test_graph_bucket import bucketed, feeds_for, grads
from sim.test_runtime import feeds_and_vars, train_inputs, train_plan
from sim.test_runtime_route import moe_data, moe_plan, moe_shards, torch_moe

STEPS = 2


def train_steps(m: int, ranks: int, bad_rank: int | None = None) -> dict[str, Any]:
    """``STEPS`` steps of the simulated tests' training plan on this process's rank; ``bad_rank`` gets a
    batch of the wrong width, so its matmul actor raises on the first micro-batch."""
    rank = sbpflow.rank()
    placement = sbpflow.placement("cpu", list(range(ranks)))
    x, w = train_inputs(ranks)
    if rank == bad_rank:
        x = torch.randn(x.shape[0], 5)
    feeds, variables = feeds_and_vars(x, w, (rank,))
    losses = []
    with ActorRuntime(train_plan(m, placement=placement), timeout=20) as rt:
        for _ in range(STEPS):
            out = rt.run(feeds, variables)
            losses.append(out["loss"][rank].item())
        acts = rt.stats.acts
    return {"losses": losses, "y": out["y"][rank], "w": variables["w"][rank], "acts": acts}


def simulated(m: int, ranks: int) -> dict[str, Any]:
    placement = sbpflow.placement("cpu", list(range(ranks)))
    x, w = train_inputs(ranks)
    feeds, variables = feeds_and_vars(x, w, tuple(range(ranks)))
    losses = []
    with ActorRuntime(train_plan(m, placement=placement), SimulatedBackend(), timeout=20) as rt:
        for _ in range(STEPS):
            out = rt.run(feeds, variables)
            losses.append(out["loss"][0].item())
    return {"losses": losses, "y": out["y"][0], "w": variables["w"][0]}


def test_two_processes_compute_what_virtual_ranks_compute(tmp_path: Path) -> None:
    expected = simulated(4, 2)
    trace = tmp_path / "step.json"
    per_rank = run_ranks(train_steps, 2, args=(4, 2), env={"SBPFLOW_TRACE": str(trace)}, timeout=120)
    for got in per_rank:
        assert got["losses"] == expected["losses"]
        torch.testing.assert_close(got["y"], expected["y"], rtol=0, atol=0)
        torch.testing.assert_close(got["w"], expected["w"], rtol=0, atol=0)
    # SBPFLOW_TRACE: a timeline per rank, joined by `sbpflow trace merge`
    files = [tmp_path / f"step.rank{r}.json" for r in (0, 1)]
    merged = tmp_path / "merged.json"
    assert cli_main(["trace", "merge", *map(str, files), "-o", str(merged)]) == 0
    events = load(merged)
    lanes = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert lanes == {(r, lane) for r in (0, 1) for lane in (f"cpu:{r}/compute", "cpu/comm:0,1")}
    per_rank_spans = [sum(1 for e in events if e["ph"] == "X" and e["pid"] == r) for r in (0, 1)]
    assert per_rank_spans[0] == per_rank_spans[1] == STEPS * sum(got["acts"] for got in per_rank[:1])


def test_an_actor_raising_on_rank_1_ends_a_3_process_job_naming_it() -> None:
    job = spawn(train_steps, 3, args=(4, 3, 1), timeout=90)
    assert not job.timed_out, job.report()
    assert job.elapsed < 30, job.report()
    assert all(o.returncode not in (0, None) for o in job.ranks), job.report()
    error = job.ranks[1].error or ""
    assert error.startswith("ExecutionError: actor #") and "compute matmul (op matmul) failed on micro-batch 0" \
        in error, job.report()
    for survivor in (0, 2):
        assert (job.ranks[survivor].error or "").startswith("CommError: "), job.report()
        assert "while running actor #" in (job.ranks[survivor].error or ""), job.report()


def stall(_: int) -> None:
    """Every process runs the same plan missing its unpack node: no matmul ever gets micro-batch 0 of x.
    (A plan corrupted on one rank only is refused before it runs: see the different-plans test.)"""
    rank = sbpflow.rank()
    x, w = train_inputs(2)
    plan = train_plan(2, placement=sbpflow.placement("cpu", [0, 1]))
    plan.nodes = [n for n in plan.nodes if n.kind != "unpack"]
    with ActorRuntime(plan) as rt:  # the watchdog's timeout: SBPFLOW_TIMEOUT
        rt.run(*feeds_and_vars(x, w, (rank,)))


def test_a_plan_missing_a_message_is_a_watchdog_report_on_every_rank_not_a_hang() -> None:
    job = spawn(stall, 2, args=(0,), env={"SBPFLOW_TIMEOUT": "3"}, timeout=60)
    assert not job.timed_out and job.elapsed < 30, job.report()
    for outcome in job.ranks:
        assert outcome.returncode == 1, job.report()
        assert (outcome.error or "").startswith("DeadlockError: sbpflow actor runtime: no actor acted for 3 s"), \
            job.report()
        report = outcome.stderr  # printed by every rank before it raises
        assert f"compute matmul (op matmul) on cpu:{outcome.rank}/compute, micro-batch 0: waits for register %" \
            in report, job.report()
        assert "(no node of the plan writes it) for micro-batch 0" in report, job.report()


def moe_on_ranks() -> dict[str, Any]:
    """The simulated tests' top-1 MoE plan; this process holds one expert and its share of the tokens."""
    rank = sbpflow.rank()
    feeds, variables = moe_shards(moe_data(), (rank,))
    with ActorRuntime(moe_plan(), timeout=20) as rt:
        out = rt.run(feeds, variables)
    return {**{name: shards[rank] for name, shards in out.items()}, "threaded": rt.threaded}


def test_moe_routing_by_data_dependent_all_to_all_on_two_processes_matches_one_device() -> None:
    expected = torch_moe(moe_data())
    per_rank = run_ranks(moe_on_ranks, 2, timeout=120)
    for name in ("y", "dx", "dw"):
        torch.testing.assert_close(torch.cat([got[name] for got in per_rank]), expected[name])
    for got in per_rank:
        torch.testing.assert_close(got["dwg"], expected["dwg"])
        assert got["threaded"]  # its all-to-alls block until the peer comes: they get a thread


def overlap_on_ranks(trace: str) -> float:
    """A gradient-sized all-reduce next to an independent chain of matmuls; returns the milliseconds of this
    rank's timeline during which the all-reduce (comm thread) and a matmul (compute thread) both ran."""
    rank = sbpflow.rank()
    p = sbpflow.placement("cpu", [0, 1])
    b = PlanBuilder()
    grad = b.boxing(b.input("grad", (1024, 1024), p, (S.partial_sum,)), (S.broadcast,))  # 4 MiB all-reduce
    h = b.input("h", (256, 256), p, (S.broadcast,))
    for _ in range(30):
        h = b.compute("matmul", h, h)
    b.output("grad", grad)
    b.output("h", h)
    feeds = {"grad": {rank: torch.ones(1024, 1024)}, "h": {rank: torch.eye(256)}}
    with ActorRuntime(b.build(), trace=trace, timeout=20) as rt:
        for _ in range(2):
            out = rt.run(feeds, {})
    assert torch.equal(out["grad"][rank], torch.full((1024, 1024), 2.0))
    events = load(trace_path(trace, rank, 2))
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [(lanes[e["tid"]], e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X"]
    comm = [(a, z) for lane, a, z in spans if "/comm:" in lane]
    compute = [(a, z) for lane, a, z in spans if lane.endswith("/compute")]
    return sum(max(0.0, min(z, d) - max(a, c)) for a, z in comm for c, d in compute) / 1e3


def test_the_timeline_shows_communication_overlapping_compute(tmp_path: Path) -> None:
    per_rank = run_ranks(overlap_on_ranks, 2, args=(str(tmp_path / "overlap.json"),), timeout=120)
    assert all(ms > 0 for ms in per_rank), per_rank


def build_different_plans() -> None:
    """Rank 1 gathers a tensor of 5 columns where rank 0 gathers 4: their first collective differs."""
    p = sbpflow.placement("cpu", [0, 1])
    b = PlanBuilder()
    b.output("y", b.boxing(b.input("x", (8, 4 + sbpflow.rank()), p, (S.split(0),)), (S.broadcast,)))
    ActorRuntime(b.build(), timeout=20).close()


def test_processes_with_different_plans_get_an_error_naming_the_node_not_a_gloo_abort() -> None:
    job = spawn(build_different_plans, 2, timeout=60)
    assert not job.timed_out and all(o.returncode == 1 for o in job.ranks), job.report()
    for outcome in job.ranks:
        error = outcome.error or ""
        assert error.startswith("ExecutionError: the processes compiled different physical plans"), job.report()
        assert "first differ at entry 1 of 2 (micro-batches, then communication nodes):\n  rank 0: #1 boxing " \
               "all_gather" in error, error
        assert "[%0: [8, 4] float32 cpu:[0, 1] (S(0)), %1: [8, 4] float32 cpu:[0, 1] (B)]\n  rank 1: #1 boxing" in error
        assert error.endswith("[%0: [8, 5] float32 cpu:[0, 1] (S(0)), %1: [8, 5] float32 cpu:[0, 1] (B)]"), error


def bucket_plan() -> Any:
    return donate_inputs(bucketed(grads([8, 24, 16, 40]), first=1 << 20, cap=1 << 20))


def donated_bucket_on_ranks() -> dict[str, Any]:
    """The bucketed, donated gradient plan on this process's rank, then one all-reduce with and one without
    donation straight on the backend: the donated one must reduce in its input's storage, the other not."""
    rank = sbpflow.rank()
    plan = bucket_plan()
    feeds = {name: {rank: shards[rank]} for name, shards in feeds_for(plan).items()}
    with ActorRuntime(plan, timeout=20) as rt:
        out = rt.run(feeds, {})
        threaded = rt.threaded
    backend = get_backend()
    given, kept = torch.arange(6.0) + 10 * rank, torch.arange(6.0) + 10 * rank
    reduced = backend.all_reduce((0, 1), {rank: given}, "sum", donate=True)[rank]
    copied = backend.all_reduce((0, 1), {rank: kept}, "sum")[rank]
    return {"outputs": {name: shards[rank] for name, shards in out.items()},
            "in place": reduced.data_ptr() == given.data_ptr(), "reduced": reduced,
            "copied": copied.data_ptr() != kept.data_ptr(), "kept": kept, "threaded": threaded}


def test_a_donated_bucket_reduces_in_place_on_gloo_with_the_simulated_bits() -> None:
    plan = bucket_plan()
    assert sum(n.overwrites == 0 for n in plan.nodes if n.kind == "boxing") == 1
    with ActorRuntime(plan, SimulatedBackend()) as rt:
        want = rt.run(feeds_for(plan), {})
    for rank, got in enumerate(run_ranks(donated_bucket_on_ranks, 2, timeout=60)):
        for name, t in got["outputs"].items():
            assert torch.equal(t, want[name][rank]), name
        assert got["in place"] and got["copied"]
        assert not got["threaded"]  # its one collective is in flight: the caller's thread acts alone
        assert got["reduced"].tolist() == [10.0 + 2 * i for i in range(6)]
        assert got["kept"].tolist() == [10.0 * rank + i for i in range(6)]  # not donated: left as it was


def sends_in_flight_on_ranks() -> list[list[float]]:
    """Rank 0 posts four sends to rank 1 in flight (one transfer each: the same gloo tag) and never waits for them;
    rank 1 posts its receives only later (so gloo holds the sends until then) and waits for them last first."""
    from sbpflow.comm.base import Transfer

    rank, backend = sbpflow.rank(), get_backend()
    transfer = [Transfer(0, 1, (3,), torch.float32)]
    if rank == 0:
        for k in range(4):
            backend.send_recv_async(transfer, {0: torch.full((3,), float(k))})
        backend.settle_sends()  # returns once rank 1 has them all
        return []
    time.sleep(0.3)
    posted = [backend.send_recv_async(transfer, {}) for _ in range(4)]
    return [p.wait()[0].tolist() for p in reversed(posted)][::-1]


def test_sends_in_flight_arrive_in_the_order_posted_though_nobody_waits_for_them() -> None:
    _, received = run_ranks(sends_in_flight_on_ranks, 2, timeout=60)
    assert received == [[float(k)] * 3 for k in range(4)]


def exchange_waited_on_ranks() -> int:
    """Both ranks swap a tensor by one posted send/recv and wait for it (as ring attention does each step): the
    waited exchange is no longer held for settle_sends, so its buffers go with the caller's references."""
    from sbpflow.comm.base import Transfer

    rank, backend = sbpflow.rank(), get_backend()
    swap = [Transfer(0, 1, (3,), torch.float32), Transfer(1, 0, (3,), torch.float32)]
    posted = backend.send_recv_async(swap, {rank: torch.full((3,), float(rank))})
    assert posted.wait()[1 - rank].tolist() == [float(1 - rank)] * 3
    held = len(backend._sending)  # type: ignore[attr-defined]
    backend.settle_sends()
    return held


def test_a_waited_exchange_is_not_held_until_the_step_ends() -> None:
    assert run_ranks(exchange_waited_on_ranks, 2, timeout=60) == [0, 0]


def two_stage_plan() -> Any:
    """Stage 0 (rank 0) -> stage 1 (rank 1) -> back to stage 0, 4 micro-batches: p2p both ways, as a pipeline's
    activations and gradients."""
    stage0, stage1 = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    b = PlanBuilder(micro_batches=4)
    x = b.unpack(b.input("x", (8, 3), stage0, (S.broadcast,)))
    there = b.boxing(b.compute("relu", x), (S.broadcast,), placement=stage1)
    back = b.boxing(b.compute("neg", there), (S.broadcast,), placement=stage0)
    b.output("y", b.pack(b.compute("add", back, x)))
    return b.build(register_num=2)


def two_stages_on_ranks(threads: bool | None) -> dict[str, Any]:
    rank = sbpflow.rank()
    x = torch.arange(24.0).reshape(8, 3) - 12
    with ActorRuntime(two_stage_plan(), timeout=20, threads=threads) as rt:
        outs = [rt.run({"x": {0: x}} if rank == 0 else {}, {}) for _ in range(2)]
    return {"y": [o["y"][0] for o in outs] if rank == 0 else [], "threaded": rt.threaded}


def test_a_two_stage_pipeline_runs_on_one_thread_per_process_or_on_threads_with_blocking_p2p() -> None:
    x = torch.arange(24.0).reshape(8, 3) - 12
    want = x - torch.relu(x)
    for threads in (None, True):
        per_rank = run_ranks(two_stages_on_ranks, 2, args=(threads,), timeout=60)
        for y in per_rank[0]["y"]:
            assert torch.equal(y, want)
        assert [got["threaded"] for got in per_rank] == [bool(threads)] * 2
