"""The actor runtime on CUDA placements: each worker thread on its own stream, registers carry events.

The CUDA runs need a GPU (skipped on CPU-only machines); their numbers must equal the CPU run's.
"""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.runtime import ActorRuntime
from sbpflow.runtime.builder import PlanBuilder

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def plan_on(device: str) -> PhysicalPlan:
    """Per micro-batch: a matmul chain, an all-reduce (comm stream) of a partial sum, a gather to B."""
    p = sbpflow.placement(device, [0, 1])
    b = PlanBuilder(micro_batches=4)
    x = b.unpack(b.input("x", (64, 32), p, (S.split(0),)))
    w = b.repeat(b.variable("w", (32, 32), p, (S.broadcast,)))
    h = x
    for _ in range(4):
        h = b.compute("relu", b.compute("matmul", h, w))
    total = b.boxing(b.compute("sum", h, dim=(0,), out_sbp=(S.partial_sum,)), (S.broadcast,))
    b.output("total", b.pack(total, "cat"))
    b.output("h", b.boxing(b.pack(h), (S.broadcast,)))
    return b.build(register_num=2)


def test_only_acts_read_from_another_lane_record_events() -> None:
    """An event per act would cost a record and a wait each; only writers with a reader on another lane
    (another stream) signal. Lane wiring is the same on CPU, so this runs without a GPU."""
    with ActorRuntime(plan_on("cpu"), SimulatedBackend(), timeout=30, threads=True) as rt:
        actors = rt.board.actors
        for actor in actors:
            other = {e.consumer.lane for reg in actor.outputs for e in reg.readers} - {actor.lane}
            assert actor.signals == bool(other), actor.label()
        assert 0 < sum(a.signals for a in actors) < len(actors) / 2


@needs_cuda
@pytest.mark.parametrize("threads", [False, True], ids=["caller stream", "thread streams"])
def test_cuda_streams_give_the_cpu_numbers(threads: bool) -> None:
    """Without threads every act runs on the caller's stream; with threads each lane has a stream of its own,
    and registers read across streams carry events."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=gen), torch.randn(32, 32, generator=gen) / 6
    results = {}
    for device in ("cpu", "cuda"):
        backend = SimulatedBackend()
        dev = {r: backend.device_for(device, r) for r in (0, 1)}
        feeds = {"x": {r: x[32 * r:32 * r + 32].to(dev[r]) for r in (0, 1)}}
        variables = {"w": {r: w.to(dev[r]) for r in (0, 1)}}
        with ActorRuntime(plan_on(device), backend, timeout=30, threads=threads) as rt:
            for _ in range(2):  # a second run reuses the streams and the allocator's blocks
                out = rt.run(feeds, variables)
            if device == "cuda":
                assert all((worker.cuda is not None) == threads for worker in rt._workers.values())
        results[device] = {name: {r: t.cpu() for r, t in shards.items()} for name, shards in out.items()}
    for name in ("total", "h"):
        for r in (0, 1):
            torch.testing.assert_close(results["cuda"][name][r], results["cpu"][name][r], rtol=1e-4, atol=1e-4)
