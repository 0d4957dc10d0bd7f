"""The actor runtime's dependency state (runtime.board, runtime.workers), driven by hand: no threads, no kernels.

Each test plays the messages one at a time and checks who may act: the register rules of issue 9
(ready inputs and a free output slot), MPMD ownership, and the fixed order of a communication stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import pytest

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend
from sbpflow.comm.base import Backend
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.runtime import ExecutionError
from sbpflow.runtime.board import Actor, Board, lane_for
from sbpflow.runtime.builder import PlanBuilder
from sbpflow.runtime.memory import dry_run
from sbpflow.runtime.play import play
from sbpflow.runtime.workers import CommWorker

P2 = sbpflow.placement("cpu", [0, 1])


class OwnsOnly(SimulatedBackend):
    """A process that owns some ranks only (as one process per rank under torch.distributed)."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = set(ranks)

    def owns(self, rank: int) -> bool:
        return rank in self.ranks


def board(plan: PhysicalPlan, backend: Backend | None = None) -> Board:
    b = Board(plan, backend or SimulatedBackend())
    b.reset()
    return b


def by_kind(b: Board, kind: str, op: str | None = None) -> Actor:
    return next(a for a in b.actors if a.node.kind == kind and (op is None or a.node.op == op))


def act(b: Board, actor: Actor) -> None:
    """One step of ``actor`` with a stand-in value per output (no kernel runs)."""
    assert b.ready(actor), f"{actor.label()} is not ready"
    b.take(actor)
    written = [{0: ("value of", actor.node.id)}] * len(actor.outputs) if actor.emits(actor.step) else []
    b.finish(actor, written, None)


def chain(m: int, register_num: int) -> PhysicalPlan:
    b = PlanBuilder(micro_batches=m)
    u = b.unpack(b.input("x", (8, 2), P2, (S.split(0),)))
    b.output("y", b.pack(b.compute("neg", b.compute("relu", u))))
    return b.build(register_num)


def test_a_full_register_stops_its_producer_until_every_reader_frees_a_slot() -> None:
    b = board(chain(4, 1))
    source, unpack, relu = by_kind(b, "input"), by_kind(b, "unpack"), by_kind(b, "compute", "relu")
    act(b, source)
    act(b, unpack)  # micro-batch 0 fills unpack's only slot
    assert not b.ready(unpack)
    assert b.waits(unpack) == [f"a free slot of its register %{unpack.outputs[0].buf} (1 of 1 held; not yet "
                               f"freed by {relu.node.label()})"]
    act(b, relu)  # reads and frees it
    assert b.ready(unpack) and unpack.step == 1


def test_k_slots_let_the_producer_run_k_micro_batches_ahead() -> None:
    b = board(chain(4, 3))
    source, unpack = by_kind(b, "input"), by_kind(b, "unpack")
    act(b, source)
    for _ in range(3):
        act(b, unpack)
    assert not b.ready(unpack) and b.stats.peak_slots[unpack.outputs[0].buf] == 3
    # the input's single slot is read on every micro-batch: it stays live until the 4th read
    assert source.outputs[0].live == 1


def test_pack_frees_each_input_at_once_and_writes_on_the_last_micro_batch() -> None:
    b = board(chain(2, 1))
    source, unpack, relu, neg, pack = (by_kind(b, "input"), by_kind(b, "unpack"), by_kind(b, "compute", "relu"),
                                       by_kind(b, "compute", "neg"), by_kind(b, "pack"))
    output = by_kind(b, "output")
    act(b, source)
    for _ in range(2):
        act(b, unpack)
        act(b, relu)
        act(b, neg)
        assert not b.ready(output)
        act(b, pack)
    assert b.ready(output)
    act(b, output)
    assert b.all_done and set(b.live_bytes.values()) == {0}


def test_a_post_actor_reading_every_micro_batch_is_refused_naming_both() -> None:
    b = PlanBuilder(micro_batches=2)
    u = b.unpack(b.input("x", (4, 2), P2, (S.split(0),)))
    r = b.compute("relu", u)
    b.compute("neg", r, phase="post")
    with pytest.raises(ExecutionError, match=r"actor #3 compute neg \(op neg\) \(post phase\) reads a value that "
                                             r"#2 compute relu \(op relu\) writes on each of the 2 micro-batches"):
        board(b.build())


def test_a_process_runs_only_the_actors_of_its_ranks() -> None:
    """MPMD: two pipeline stages on ranks 0 and 1; rank 1's process holds stage 1 and the send/recv node,
    whose input (written on rank 0) reads as no shards."""
    stage0, stage1 = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    b = PlanBuilder()
    h = b.compute("relu", b.input("x", (4, 2), stage0, (S.broadcast,)))
    moved = b.boxing(h, (S.broadcast,), placement=stage1)
    b.output("y", b.compute("neg", moved))
    plan = b.build()
    mine = board(plan, OwnsOnly({1}))
    assert [(a.node.kind, a.lane) for a in mine.actors] == [
        ("boxing", "cpu/comm:0,1"), ("compute", "cpu:1/compute"), ("output", "cpu:1/compute")]
    send_recv = mine.actors[0]
    assert send_recv.lane == "cpu/comm:0,1" and send_recv.inputs[0].producer is None
    assert mine.ready(send_recv) and mine.take(send_recv) == [{}]
    assert mine.owned_ranks == [1]
    theirs = board(plan, OwnsOnly({0}))
    assert [a.node.kind for a in theirs.actors] == ["input", "compute", "boxing"]
    # one process owning both ranks (virtual ranks): each stage gets a compute thread of its own
    both = board(plan)
    assert sorted({a.lane for a in both.actors}) == ["cpu/comm:0,1", "cpu:0/compute", "cpu:1/compute"]


def test_a_comm_stream_acts_in_plan_order_pre_micro_then_post() -> None:
    b = PlanBuilder(micro_batches=3)
    w = b.boxing(b.variable("w", (4,), P2, (S.split(0),)), (S.broadcast,), phase="pre")  # all-gather, once
    x = b.unpack(b.input("x", (12, 4), P2, (S.split(0),)))
    y = b.boxing(b.compute("mul", x, b.repeat(w)), (S.broadcast,))  # all-gather per micro-batch
    g = b.accumulate(b.compute("sum", x, dim=(0,), out_sbp=(S.partial_sum,)))
    b.output("g", b.boxing(g, (S.broadcast,)))  # all-reduce, after the micro-batches
    b.output("y", b.pack(y))
    plan = b.build()
    bd = board(plan)
    comm = [a for a in bd.actors if a.lane == "cpu/comm:0,1"]
    worker = CommWorker("cpu/comm:0,1", threading.Lock(), comm, 3)
    order = [(a.node.phase, k) for a, k in worker.sequence]
    assert order == [("pre", 0), ("micro", 0), ("micro", 1), ("micro", 2), ("post", 0)]


def test_a_collective_planned_on_the_compute_stream_runs_on_a_comm_thread() -> None:
    b = PlanBuilder()
    b.output("y", b.boxing(b.input("x", (4,), P2, (S.split(0),)), (S.broadcast,), stream="compute"))
    plan = b.build()
    boxing = next(n for n in plan.nodes if n.kind == "boxing")
    assert boxing.stream == "compute" and lane_for(boxing, plan, [0, 1]) == "cpu/comm:0,1"
    local = PlanBuilder()
    local.output("y", local.boxing(local.input("x", (4,), P2, (S.broadcast,)), (S.split(0),)))
    slice_plan = local.build()
    assert lane_for(next(n for n in slice_plan.nodes if n.kind == "boxing"), slice_plan, [0, 1]) == "cpu:0,1/compute"


def test_the_dry_run_counts_a_step_and_refuses_a_plan_that_cannot_finish() -> None:
    plan = chain(4, 1)
    stats = dry_run(plan, SimulatedBackend())
    assert stats.acts == 1 + 4 * 4 + 1 and set(stats.peak_slots.values()) == {1}
    relu = next(n for n in plan.nodes if n.op == "relu")
    neg = next(n for n in plan.nodes if n.op == "neg")
    plan.nodes[relu.id] = type(relu)(**{**relu.__dict__, "control": (neg.id,)})  # relu waits for its own reader
    with pytest.raises(ExecutionError, match="cannot finish a step; waiting actors:") as info:
        dry_run(plan, SimulatedBackend())
    assert f"\n  #{relu.id} compute relu (op relu): a control token from actor #{neg.id} compute neg for " \
           "micro-batch 0\n" in str(info.value)


def _with_lead(plan: PhysicalPlan, lead: int) -> PhysicalPlan:
    """neg (the reader) waits, on each micro-batch k, for relu's micro-batch k + lead (a control edge)."""
    relu = next(n for n in plan.nodes if n.op == "relu")
    neg = next(n for n in plan.nodes if n.op == "neg")
    plan.nodes[neg.id] = type(neg)(**{**neg.__dict__, "control": (relu.id,), "control_lead": (lead,)})
    return plan


def test_a_control_lead_holds_the_reader_until_the_producer_is_lead_micro_batches_ahead() -> None:
    """GPipe's control edge: with lead 3 of 4 micro-batches, neg's first step waits for relu's fourth."""
    b = board(_with_lead(chain(4, 4), 3))
    source, unpack = by_kind(b, "input"), by_kind(b, "unpack")
    relu, neg = by_kind(b, "compute", "relu"), by_kind(b, "compute", "neg")
    act(b, source)
    for k in range(4):
        act(b, unpack)
        act(b, relu)
        assert b.ready(neg) == (k == 3)
    for _ in range(4):  # the last micro-batches need no more tokens than the producer has left
        act(b, neg)
    assert b.stats.peak_slots[relu.outputs[0].buf] == 4


def test_a_lead_needs_that_many_slots_or_the_step_cannot_finish() -> None:
    dry_run(_with_lead(chain(4, 3), 2), SimulatedBackend())
    with pytest.raises(ExecutionError, match="cannot finish a step"):
        dry_run(_with_lead(chain(4, 3), 3), SimulatedBackend())


def test_a_waiting_lead_edge_says_which_micro_batch_it_waits_for() -> None:
    b = board(_with_lead(chain(4, 4), 3))
    relu, neg = by_kind(b, "compute", "relu"), by_kind(b, "compute", "neg")
    for actor in (by_kind(b, "input"), by_kind(b, "unpack"), relu):
        act(b, actor)
    assert b.waits(neg) == [f"a control token (lead 3: the source's micro-batch 3) from actor {relu.node.label()} "
                            "for micro-batch 0"]


def _one_by_one(plan: PhysicalPlan) -> tuple[list[tuple[int, int]], Board]:
    """The play's pick rule (earliest priority among ready actors, a comm stream's head only), message by message
    through ``take`` and ``finish``: the reference that `play`'s one-loop version must equal."""
    b = board(plan)
    order = []
    while True:
        heads = {lane: seq[b.heads[lane]][0] for lane, seq in b.streams.items() if b.heads[lane] < len(seq)}
        ready = [a for a in b.actors if b.ready(a) and (not a.comm or heads.get(a.lane) is a)]
        if not ready:
            return order, b
        actor = min(ready, key=lambda a: a.priority(a.step))
        order.append((actor.node.id, actor.step))
        act(b, actor)
        if actor.comm:
            b.heads[actor.lane] += 1


def _comm_chain(m: int, register_num: int) -> PhysicalPlan:
    """unpack -> relu -> all-reduce of a partial sum -> accumulate, and a pack of the relu: a comm stream in it."""
    b = PlanBuilder(micro_batches=m)
    u = b.unpack(b.input("x", (8, 2), P2, (S.split(0),)))
    h = b.compute("relu", u)
    total = b.boxing(b.compute("sum", h, dim=(0,), out_sbp=(S.partial_sum,)), (S.broadcast,))
    b.output("g", b.accumulate(total))
    b.output("y", b.pack(h))
    return b.build(register_num)


def _variables(m: int, register_num: int) -> PhysicalPlan:
    """Three variables in a row (one pick of play.play), read through repeat, directly by a micro actor (m reads
    of one slot) and by a pre output; a value with two readers; an op with an output nobody reads."""
    b = PlanBuilder(micro_batches=m)
    x = b.unpack(b.input("x", (8, 2), P2, (S.split(0),)))
    w1, w2, w3 = (b.variable(f"w{i}", (2,), P2, (S.broadcast,)) for i in (1, 2, 3))
    h = b.compute("add", x, b.repeat(w1))
    h2 = b.compute("add", b.compute("mul", h, b.repeat(w2)), h)
    top, _ = b.compute_n("max_dim", b.compute("sub", h2, w3), dim=1)
    b.output("y", b.pack(top))
    b.output("w3", w3)
    return b.build(register_num)


def _fanout(m: int, register_num: int) -> PhysicalPlan:
    """A value with three readers, an op with two outputs both read (one of them twice), accumulate and pack: with
    one slot every act takes play.play's short path; with two, the shared values go through Slots."""
    b = PlanBuilder(micro_batches=m)
    h = b.compute("relu", b.unpack(b.input("x", (8, 2), P2, (S.split(0),))))
    top, where = b.compute_n("max_dim", b.compute("add", h, h), dim=1)
    b.output("y", b.pack(b.compute("mul", top, b.compute("sum", h, dim=(1,)))))
    b.output("i", b.pack(where))
    b.output("g", b.accumulate(b.compute("neg", top)))
    return b.build(register_num)


@pytest.mark.parametrize("plan", [chain(4, 1), chain(4, 3), _comm_chain(4, 1), _comm_chain(4, 2), _comm_chain(1, 1),
                                  _with_lead(chain(4, 4), 3), _variables(4, 1), _variables(4, 2), _variables(1, 1),
                                  _fanout(4, 1), _fanout(4, 2), _fanout(1, 1)],
                         ids=["chain k=1", "chain k=3", "comm k=1", "comm k=2", "comm m=1", "lead 3", "variables k=1",
                              "variables k=2", "variables m=1", "fanout k=1", "fanout k=2", "fanout m=1"])
def test_play_sends_the_same_messages_as_take_and_finish_one_by_one(plan: PhysicalPlan) -> None:
    expected, reference = _one_by_one(plan)
    b = board(plan)
    order: list[tuple[int, int]] = []

    def perform(actor: Actor, step: int, inputs: list[object]) -> list[object]:
        order.append((actor.node.id, step))
        return [{0: ("value of", actor.node.id)}] * len(actor.outputs) if actor.emits(step) else []

    play(b, perform)
    assert b.all_done and reference.all_done
    assert order == expected
    assert b.stats.acts == reference.stats.acts == len(order)
    assert b.stats.peak_bytes == reference.stats.peak_bytes and b.stats.peak_slots == reference.stats.peak_slots
    assert b.live_bytes == reference.live_bytes == b.resident


def test_play_takes_its_short_path_only_where_values_pass_without_slots() -> None:
    """The plans above cover both of play.play's paths: with one slot per register every actor of ``_fanout``
    takes the short one (a two-output op and a value with three readers included); with two, an actor that reads
    or writes a shared value through a Slot takes the general one, and the comm stream's actors always do."""
    one = board(_fanout(4, 1))
    assert all(a.fast for a in one.actors)
    assert any(len(a.outputs) == 2 for a in one.actors) and any(len(r.readers) == 3 for r in one.registers.values())
    two = board(_fanout(4, 2))
    relu = by_kind(two, "compute", "relu")
    assert not relu.fast and not relu.outputs[0].direct
    assert all(not edge.consumer.fast for edge in relu.outputs[0].readers)
    assert by_kind(two, "unpack").fast  # its one reader gets the value itself, whatever the slots
    assert all(not a.fast for a in board(_comm_chain(4, 1)).actors if a.comm)


def test_play_keeps_a_comm_stream_in_turn_where_a_receiver_has_no_input_to_wait_for() -> None:
    """A receiving process (its send/recv nodes read nothing here) with two activations on one stream: each act
    passes the stream's turn on before its actor is offered again, so micro-batch 1 of the first waits for
    micro-batch 0 of the second (as the sender issues them), even with a free slot (register_num 2)."""
    stage0, stage1 = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    b = PlanBuilder(micro_batches=2)
    x = b.unpack(b.input("x", (4, 2), stage0, (S.broadcast,)))
    first = b.boxing(b.compute("relu", x), (S.broadcast,), placement=stage1)
    second = b.boxing(b.compute("neg", x), (S.broadcast,), placement=stage1)
    b.output("y", b.pack(b.compute("add", first, second)))
    mine = board(b.build(register_num=2), OwnsOnly({1}))
    sends = [a for a in mine.actors if a.comm]
    assert len(sends) == 2 and all(not a.fed for a in sends)
    acted: list[tuple[int, int]] = []

    def perform(actor: Actor, step: int, inputs: list[object]) -> list[object]:
        if actor.comm:
            acted.append((actor.node.id, step))
        return [{1: None}] * len(actor.outputs) if actor.emits(step) else []

    play(mine, perform)
    assert mine.all_done
    (lane, order), = mine.streams.items()
    assert acted == [(a.node.id, k) for a, k in order] == [(sends[0].node.id, 0), (sends[1].node.id, 0),
                                                          (sends[0].node.id, 1), (sends[1].node.id, 1)]
