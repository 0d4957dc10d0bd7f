"""Gradient buckets (graph.bucket): all-reduces of whole tensors packed into DDP-sized buckets after lowering.

Plans are hand-built on 2 virtual ranks: partial sums (each rank's column sums of its rows, P(sum)) boxed to B,
as a data-parallel step's gradients are. The bucketed plan must pass the verifier, keep every reader, and give
bit-identical results on both executors.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import sbpflow
from sbpflow import boxing
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend
from sbpflow.comm.base import TARGET_COST_FACTORS
from sbpflow.graph.bucket import bucket_all_reduces
from sbpflow.graph.lower import donate_inputs
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.graph.verify import verify
from sbpflow.runtime import ActorRuntime, run_plan
from sbpflow.runtime.builder import PlanBuilder

P2 = sbpflow.placement("cpu", [0, 1])


def grads(sizes: list[int], rows: int = 4) -> PhysicalPlan:
    """One partial sum per size (a (size,) "gradient" from an (rows, size) input split over rows), each boxed
    to B where an output reads it, at the end of the plan (as lowering places the optimizer's reads)."""
    b = PlanBuilder()
    partials = [b.compute("sum", b.input(f"x{i}", (rows, n), P2, (S.split(0),)), dim=(0,), out_sbp=(S.partial_sum,))
                for i, n in enumerate(sizes)]
    for i, p in enumerate(partials):
        b.output(f"g{i}", b.boxing(p, (S.broadcast,)))
    return b.build()


def dependent_chain(n: int) -> PhysicalPlan:
    """n all-reduces, each one's input made from the previous one's result: no two may share a bucket."""
    b = PlanBuilder()
    x = b.input("x", (4, 8), P2, (S.split(0),))
    for i in range(n):
        total = b.boxing(b.compute("sum", x, dim=(0,), out_sbp=(S.partial_sum,)), (S.broadcast,))
        x = b.compute("mul", b.compute("unsqueeze", total, dim=0), b.input(f"w{i}", (4, 8), P2, (S.split(0),)))
    b.output("y", x)
    return b.build()


def bucketed(plan: PhysicalPlan, first: int, cap: int) -> PhysicalPlan:
    return bucket_all_reduces(plan, boxing.get_cost_model(), TARGET_COST_FACTORS, first=first, cap=cap)


def feeds_for(plan: PhysicalPlan) -> dict[str, dict[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {n.name: {r: torch.randn(plan.bufs[n.outputs[0]].local_shape(r), generator=g) for r in (0, 1)}
            for n in plan.nodes if n.kind == "input"}


def all_reduces(plan: PhysicalPlan) -> list[int]:
    """The element count of each all-reduce, in plan order."""
    return [plan.bufs[n.inputs[0]].shape[0] for n in plan.collectives(0) if n.boxing.steps[0].kind == "all_reduce"]


def assert_same_bits(plan: PhysicalPlan, out: PhysicalPlan) -> None:
    """``out`` (a rewrite of ``plan``) gives ``plan``'s outputs bit for bit, on both executors."""
    backend = SimulatedBackend()
    feeds = feeds_for(plan)
    want = run_plan(plan, feeds, {}, backend)
    with ActorRuntime(out, backend) as rt:
        for got in (run_plan(out, feeds, {}, backend), rt.run(feeds, {})):
            assert_equal_outputs(got, want)


def assert_equal_outputs(got: dict[str, dict[int, torch.Tensor]], want: dict[str, dict[int, torch.Tensor]]) -> None:
    for name, shards in want.items():
        for r, t in shards.items():
            assert torch.equal(got[name][r], t), name


def test_whole_gradients_go_out_in_buckets_of_the_first_size_then_the_cap() -> None:
    plan = grads([64] * 7)  # 256 B each
    out = bucketed(plan, first=512, cap=1024)
    verify(out)
    assert all_reduces(plan) == [64] * 7
    assert all_reduces(out) == [128, 256, 64]  # 512 B first, then 1 KiB; the last one left alone, where it was
    flat = [n for n in out.nodes if n.op == "bucket_flatten"]
    assert [len(n.inputs) for n in flat] == [2, 4]


def test_a_bucket_goes_out_right_after_its_last_gradient_is_made() -> None:
    out = bucketed(grads([64, 64, 64]), first=1 << 20, cap=1 << 20)
    names = [n.op or n.kind for n in out.nodes]
    last_sum = max(i for i, name in enumerate(names) if name == "sum")
    assert names[last_sum + 1:last_sum + 4] == ["bucket_flatten", "boxing", "bucket_split"]
    assert names[last_sum + 4:] == ["output"] * 3  # the readers are unchanged, after the bucket


def gradients_then_work() -> PhysicalPlan:
    """Three gradients, then three relus that do not read them (the rest of backward), then their readers."""
    b = PlanBuilder()
    partials = [b.compute("sum", b.input(f"x{i}", (4, 16), P2, (S.split(0),)), dim=(0,),
                          out_sbp=(S.partial_sum,)) for i in range(3)]
    reduced = [b.boxing(p, (S.broadcast,)) for p in partials]
    h = b.input("h", (4, 16), P2, (S.split(0),))
    for _ in range(3):
        h = b.compute("relu", h)
    b.output("h", h)
    for i, g in enumerate(reduced):
        b.output(f"g{i}", g)
    return b.build()


def test_a_bucket_is_split_right_before_the_first_reader_of_a_member() -> None:
    out = bucketed(gradients_then_work(), first=1 << 20, cap=1 << 20)
    verify(out)
    names = [n.op or n.kind for n in out.nodes]
    flatten, split = names.index("bucket_flatten"), names.index("bucket_split")
    assert names[flatten:split + 1] == ["bucket_flatten", "boxing", "input", "relu", "relu", "relu", "output",
                                        "bucket_split"]
    assert names[split + 1:] == ["output"] * 3


class _Log(TorchFunctionMode):
    """Logs the relus that run, and (through :class:`_Waits`) when an all-reduce is issued and waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") == "relu":
            self.events.append("relu")
        return func(*args, **(kwargs or {}))


class _Waits(SimulatedBackend):
    """Virtual ranks that issue collectives in flight, as torch.distributed does, and log when they are waited for."""

    in_flight = True

    def __init__(self, log: _Log) -> None:
        super().__init__()
        self.log = log

    def _all_reduce_async(self, group, inputs, op, donate=False):  # type: ignore[no-untyped-def]
        self.log.events.append("issue")
        done, events = super()._all_reduce_async(group, inputs, op, donate), self.log.events

        class Pending:
            def wait(self) -> dict[int, torch.Tensor]:
                events.append("wait")
                return done.wait()
        return Pending()


@pytest.mark.parametrize("executor", ["inorder", "actors"])
def test_a_bucket_is_issued_at_once_and_waited_for_by_its_split(executor: str) -> None:
    """The executors issue a cpu all-reduce without waiting: the relus run while it is in flight, and the
    bucket's split waits for it."""
    plan = bucketed(gradients_then_work(), first=1 << 20, cap=1 << 20)
    log = _Log()
    backend = _Waits(log)
    feeds = feeds_for(plan)
    want = run_plan(plan, feeds, {}, SimulatedBackend())
    with log:
        if executor == "inorder":
            got = run_plan(plan, feeds, {}, backend)
        else:
            with ActorRuntime(plan, backend) as rt:
                got = rt.run(feeds, {})
    assert log.events == ["issue", *["relu"] * 6, "wait"]  # 3 relus on each of the 2 ranks
    assert_equal_outputs(got, want)


def test_bucketed_results_are_bit_identical_on_both_executors() -> None:
    plan = grads([8, 24, 16, 40])
    out = bucketed(plan, first=1 << 20, cap=1 << 20)
    assert all_reduces(out) == [88]
    assert_same_bits(plan, out)


def test_an_all_reduce_reached_by_another_ones_result_stays_out_of_its_bucket() -> None:
    plan = dependent_chain(4)
    out = bucketed(plan, first=1 << 20, cap=1 << 20)
    assert out is plan  # nothing could share a bucket: the plan is returned as it was


@pytest.mark.parametrize("cap", [0, -1])
def test_a_cap_of_zero_turns_the_pass_off(cap: int) -> None:
    plan = grads([8, 8])
    assert bucketed(plan, first=1 << 20, cap=cap) is plan


def summed_partials(extra_reader: bool) -> PhysicalPlan:
    """An all-reduce of an ``add`` of two partial sums (a fresh buffer); ``extra_reader``: an output reads the
    partial sum too, so the all-reduce is not its only reader."""
    b = PlanBuilder()
    x, y = (b.input(name, (4, 16), P2, (S.split(0),)) for name in ("x", "y"))
    px, py = (b.compute("sum", t, dim=(0,), out_sbp=(S.partial_sum,)) for t in (x, y))
    total = b.compute("add", px, py)
    b.output("g", b.boxing(total, (S.broadcast,)))
    if extra_reader:
        b.output("partial", total)
    return b.build()


def donated(plan: PhysicalPlan) -> list[str]:
    """The producer op of each all-reduce that reduces in its input (``overwrites == 0``)."""
    producer = plan.producers()
    return [plan.node(producer[n.inputs[0]]).op for n in plan.nodes if n.kind == "boxing" and n.overwrites == 0]


def test_a_bucket_reduces_in_its_own_flat_buffer_and_gives_the_same_bits() -> None:
    plan = grads([8, 24, 16, 40])
    out = donate_inputs(bucketed(plan, first=1 << 20, cap=1 << 20))
    verify(out)
    assert donated(out) == ["bucket_flatten"]
    assert donated(donate_inputs(plan)) == []  # a sum's result may be a view: never reduced in place
    assert_same_bits(plan, out)


@pytest.mark.parametrize("extra_reader", [False, True])
def test_only_the_only_reader_of_a_fresh_buffer_reduces_in_it(extra_reader: bool) -> None:
    plan = donate_inputs(summed_partials(extra_reader))
    assert donated(plan) == ([] if extra_reader else ["add"])
