"""The pipeline pass's plan on a small chain over four stages: which stage sends, how many micro-batches each
register holds, the runtime's priorities and GPipe's control edge (graph/pipeline.py).

The chain: one Linear per placement (ranks 0, 1, 2, 3), the labels given on the first placement and moved to the
last for the loss, and a parameter of the first placement read on the last (its gradient goes back per
micro-batch). Compiled only; the numbers of these layouts are checked against eager by tests/fuzz and
tests/sim/test_pipeline.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sbpflow
import sbpflow.nn.functional as F
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.graph.fuse import _fused, sub_nodes
from sbpflow.graph.group import group_accumulates, members
from sbpflow.graph.physical import PNode
from sbpflow.graph.pipeline import LAST

PLACES = [sbpflow.placement("cpu", [r]) for r in range(4)]
ALTERNATING = [PLACES[0], PLACES[1], PLACES[0], PLACES[1]]  # interleaved 1F1B: two virtual stages per placement
M = 4  # micro-batches


class Chain(nn.Module):
    def __init__(self, places: list[Any]) -> None:
        super().__init__()
        self.places = places
        self.layers = nn.ModuleList([nn.Linear(4, 4, placement=p, sbp=S.broadcast) for p in places])
        self.shift = nn.Parameter(sbpflow.zeros(4, placement=places[0], sbp=S.broadcast))

    def forward(self, x: Any) -> Any:
        for p, layer in zip(self.places, self.layers, strict=True):
            x = layer(x.to_global(p, S.split(0))).tanh()
        return x + self.shift.to_global(self.places[-1], S.broadcast)


_PLANS: dict[tuple[str, bool], Any] = {}


def _plan(schedule: str, passes: bool = True) -> Any:
    """The compiled plan; with ``passes`` off, as the pipeline pass left it (no grouped accumulates, no fusion)."""
    if (schedule, passes) not in _PLANS:
        sbpflow.manual_seed(0)
        places = ALTERNATING if schedule == "interleaved_1f1b" else PLACES
        model = Chain(places)
        opt = sbpflow.optim.SGD(model.parameters(), lr=0.1)

        class Step(nn.Graph):
            def __init__(self) -> None:
                super().__init__()
                self.model = model
                self.add_optimizer(opt)
                self.config.set_gradient_accumulation_steps(M)
                self.config.set_pipeline_schedule(schedule)
                self.config.group_accumulates = passes
                self.config.enable_fused_segments(passes)

            def build(self, x: Any, y: Any) -> Any:
                loss = F.cross_entropy(self.model(x), y.to_global(places[-1], S.split(0)))
                loss.backward()
                return loss

        step = Step()
        x = sbpflow.zeros(8, 4, placement=PLACES[0], sbp=S.split(0))
        y = sbpflow.zeros(8, dtype=torch.int64, placement=PLACES[0], sbp=S.split(0))
        step.compile_only(x, y)
        _PLANS[(schedule, passes)] = step.plan
    return _PLANS[(schedule, passes)]


def _rank(plan: Any, buf: int) -> int:
    return plan.bufs[buf].layout.placement.flat_ranks[0]


def _sends(plan: Any, phase: str) -> list[Any]:
    """Boxing nodes of ``phase`` that move a value to another stage."""
    return [n for n in plan.nodes if n.kind == "boxing" and n.phase == phase
            and _rank(plan, n.inputs[0]) != _rank(plan, n.outputs[0])]


def test_a_send_belongs_to_the_stage_it_leaves() -> None:
    """A cross-stage boxing node runs on its source's rank in that stage's order: its stage is the source's."""
    plan = _plan("1f1b")
    sends = _sends(plan, "micro")
    assert len(sends) == 8  # 3 activations forward, the labels, the shift's gradient, 3 gradients back
    for n in sends:
        assert plan.pipeline.stage_of[n.id] == _rank(plan, n.inputs[0])


def test_registers_hold_what_1f1b_has_in_flight() -> None:
    """Under 1F1B stage s runs up to p - s forwards ahead of its backward. An activation sent to stage s is held
    there until its backward: p - s slots. A message that crosses d stages is in flight d micro-batches (the
    labels 0 -> 3, the shift's gradient 3 -> 0). A gradient sent one stage back, and what is sent once before
    the micro-batches (weights), needs one."""
    plan = _plan("1f1b")
    counts = {(_rank(plan, n.inputs[0]), _rank(plan, n.outputs[0]), plan.bufs[n.inputs[0]].shape):
              plan.registers[n.outputs[0]].register_num for n in _sends(plan, "micro")}
    assert counts == {
        (0, 1, (2, 4)): 3, (1, 2, (2, 4)): 2, (2, 3, (2, 4)): 1,  # activations: held p - s
        (0, 3, (2,)): 3,  # the labels: in flight three stages
        (3, 0, (4,)): 3,  # the shift's gradient
        (3, 2, (2, 4)): 1, (2, 1, (2, 4)): 1, (1, 0, (2, 4)): 1,  # input gradients
    }
    pre = _sends(plan, "pre")
    assert pre and all(plan.registers[b].register_num == 1 for n in pre for b in n.outputs)


def test_priorities_follow_each_stages_schedule() -> None:
    """A micro node's priority at micro-batch k is its action's index in its stage's 1F1B order; what runs before
    the micro-batches comes first, what runs after them last; accumulations take their feeder's priority."""
    plan = _plan("1f1b")
    pipe = plan.pipeline
    for n in plan.nodes:
        if n.phase == "pre":
            assert pipe.key(n, 0) < 0  # below every action's index
        elif n.id in pipe.part_of:
            stage = pipe.stage_of[n.id]
            order = pipe.schedule.compute_order(stage)
            assert [pipe.key(n, k) for k in range(M)] == [order[(pipe.part_of[n.id], stage, k)] for k in range(M)]
        elif n.phase == "post":
            assert pipe.key(n, 0) == LAST
    backward = next(n for n in plan.nodes if pipe.part_of.get(n.id) == "B" and pipe.stage_of[n.id] == 0)
    post = next(n for n in plan.nodes if n.phase == "post")
    assert pipe.key(post, 1, feeder=backward.id) == pipe.key(backward, 1)
    assert pipe.key(backward, 0) == M  # stage 0 (4 slots) runs its 4 forwards first


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_only_gpipe_holds_the_last_stages_backward_behind_every_forward(schedule: str) -> None:
    """GPipe: the last stage's first backward nodes wait for its last forward node with a lead of m - 1
    micro-batches (B 0 after F m-1). 1F1B starts each backward as soon as its forward is done: no such edge."""
    plan = _plan(schedule)
    pipe = plan.pipeline
    led = [n for n in plan.nodes if n.control_lead]
    if schedule == "1f1b":
        assert led == []
        return
    last = len(pipe.stages) - 1
    on_last = [n for n in plan.nodes if pipe.stage_of.get(n.id) == last and n.phase == "micro"]
    first_b = next(i for i, n in enumerate(on_last) if pipe.part_of[n.id] == "B")
    tail = [n for n in on_last[:first_b] if pipe.part_of[n.id] == "F" and n.kind == "compute"][-1]
    assert led == [on_last[first_b]]  # the loss's backward: the one backward node that reads no gradient
    assert (led[0].control, led[0].control_lead) == ((tail.id,), (M - 1,))


def test_activations_are_the_held_buffers_computed_from_the_micro_batch() -> None:
    """Held buffers (written by a stage's forward, read by its backward) count as activations when they depend on
    the micro-batch's data: here those with its 2 rows. The loss's scalar held on the last stage is computed
    from no data: it needs slots like the others but is no activation."""
    plan = _plan("1f1b")
    pipe = plan.pipeline
    assert sorted(pipe.held) == [0, 1, 2, 3]
    for s, bufs in pipe.held.items():
        rows = tuple(b for b in bufs if plan.bufs[b].shape[:1] == (2,))
        assert rows and pipe.activations[s] == rows
    assert any(plan.bufs[b].shape == () for b in pipe.held[3])


def test_a_stage_acts_weight_gradients_sums_as_one_group_in_its_slot() -> None:
    """graph.group on the pipeline's plan: where 1F1B holds no more activations after an act's second micro-batch
    than after its first (stages 1 to 3 here; stage 0 forwards all 4 micro-batches before its first backward),
    the act's weight and bias gradient sums become one node. It keeps the act's stage (the runtime's priorities
    follow it), and sits after its last gradient's producer, where its first member sat if that is later."""
    before = _plan("1f1b", passes=False)
    after = group_accumulates(before)
    pipe = after.pipeline
    grouped = [n for n in after.nodes if len(members(n)) > 1]
    producer = {b: n for n in before.nodes for b in n.outputs}
    acts = set()
    for g in grouped:
        feeders = [producer[b] for b in g.inputs]
        act = {(before.pipeline.stage_of[f.id], before.pipeline.part_of[f.id]) for f in feeders}
        assert len(act) == 1 and pipe.stage_of[g.id] == next(iter(act))[0]
        stage, part = next(iter(act))
        assert g.name == f"sum of {len(feeders)} gradients ({part} of stage {stage})"  # as explain() lists it
        acts |= act
        inside = {m.id for h in grouped for m in members(h)}
        kept_before = [n.id for n in before.nodes if n.id not in inside]
        position = {nid: i for i, nid in enumerate(kept_before)}
        first = next(i for i, n in enumerate(before.nodes) if n.id == members(g)[0].id)
        slot = max(len([n for n in before.nodes[:first] if n.id not in inside]),
                   max(position[f.id] for f in feeders) + 1)
        assert len([n for n in after.nodes[:after.nodes.index(g)] if len(members(n)) <= 1]) == slot
    assert acts == {(1, "B"), (2, "B"), (3, "B")}


def test_each_stages_linear_and_tanh_are_one_fused_segment() -> None:
    """graph.fuse: consecutive compute nodes of one stage and part run as one node (two are enough), never one
    alone; each stage's forward Linear and tanh is such a pair."""
    plan = _plan("1f1b")
    fused = [n for n in plan.nodes if sub_nodes(n)]
    assert fused and all(len(sub_nodes(n)) >= 2 for n in fused)
    pairs = [plan.pipeline.stage_of[n.id] for n in fused if [m.op for m in sub_nodes(n)] == ["linear", "tanh"]]
    assert pairs == [0, 1, 2, 3]


def test_a_fused_node_keeps_each_control_edges_lead() -> None:
    """Members' control edges from outside the run become the fused node's, each with its own lead: GPipe's lead of
    m - 1 on one member, lead 0 (none given) on another's edge, the larger lead where two members share one."""
    def node(i: int, control: tuple[int, ...] = (), lead: tuple[int, ...] = ()) -> PNode:
        return PNode(i, "compute", "neg", (i,), (i + 1,), (0,), op="neg", args=(("t", 0),), control=control,
                     control_lead=lead)

    led, plain = node(10, (1,), (3,)), node(11, (2,))
    fused = _fused([led, plain], {12: [99]}, set(), False)
    assert (fused.control, fused.control_lead) == ((1, 2), (3, 0))
    both = _fused([node(10, (1,), (3,)), node(11, (1,), (0,))], {12: [99]}, set(), False)
    assert (both.control, both.control_lead) == ((1,), (3,))
    unled = _fused([node(10, (1,)), node(11, (2,))], {12: [99]}, set(), False)
    assert (unled.control, unled.control_lead) == ((1, 2), ())


def test_interleaved_virtual_stages_follow_the_forward() -> None:
    """Interleaved 1F1B on placements 0, 1, 0, 1: the forward starts a new virtual stage each time it moves, so
    layer k runs on stage k and its backward too. The loss reads the logits (stage 3) and the labels, which
    arrive on placement 1 at its first stage (1): a forward node takes the latest of its inputs' stages, 3."""
    plan = _plan("interleaved_1f1b")
    pipe = plan.pipeline
    assert pipe.virtual == 2
    layers = [n for n in plan.nodes if [m.op for m in sub_nodes(n)] == ["linear", "tanh"]]
    assert [pipe.stage_of[n.id] for n in layers] == [0, 1, 2, 3]
    loss = [n for n in plan.nodes if n.op == "log_softmax" or "pick" in [m.op for m in sub_nodes(n)]]
    assert len(loss) == 2 and all((pipe.part_of[n.id], pipe.stage_of[n.id]) == ("F", 3) for n in loss)
    weight_grads = [n for n in plan.nodes if "linear_weight_grad" in [m.op or n.op for m in sub_nodes(n) or [n]]]
    assert sorted(pipe.stage_of[n.id] for n in weight_grads) == [0, 1, 2, 3]
    assert all(pipe.part_of[n.id] == "B" for n in weight_grads)
