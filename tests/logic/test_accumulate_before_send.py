"""graph.accumulate: a gradient summed across stages is accumulated on each stage and crosses once per step."""

from __future__ import annotations

import torch

import sbpflow
from sbpflow.graph.accumulate import accumulate_before_send
from sbpflow.graph.ir import LNode, LogicalGraph, Value
from sbpflow.sbp import broadcast

SHAPE = (4, 3)


class _Builder:
    """A logical graph written node by node (ids are positions, as tracing makes them)."""

    def __init__(self, m: int) -> None:
        self.g = LogicalGraph(micro_batches=m)

    def value(self, ranks: list[int]) -> int:
        v = Value(len(self.g.values), SHAPE, torch.float32, sbpflow.placement("cpu", ranks), (broadcast,))
        self.g.values[v.id] = v
        return v.id

    def node(self, kind: str, name: str, inputs: tuple[int, ...], ranks: list[int] | None, phase: str = "micro",
             **extra: object) -> int:
        outs = (self.value(ranks),) if ranks is not None else ()
        n = LNode(len(self.g.nodes), kind, name, inputs, outs, phase=phase, **extra)  # type: ignore[arg-type]
        for i, vid in enumerate(outs):
            self.g.values[vid].producer, self.g.values[vid].index = n.id, i
        self.g.nodes.append(n)
        return outs[0] if outs else -1

    def stage_gradient(self, rank: int) -> int:
        """A micro-batch value on ``rank``'s stage (neg of an input: something computed per micro-batch)."""
        x = self.node("input", f"x{rank}", (), [rank], phase="pre")
        return self.node("op", "neg", (x,), [rank], args=(("t", 0),))

    def add(self, a: int, b: int, ranks: list[int]) -> int:
        return self.node("op", "add", (a, b), ranks, args=(("t", 0), ("t", 1)))


def _tied_over_three_stages(m: int = 4) -> LogicalGraph:
    """A parameter on stage 0 read on stages 1 and 2 too: add(add(a, to_global(b)), to_global(c)), accumulated."""
    b = _Builder(m)
    a, far1, far2 = (b.stage_gradient(r) for r in (0, 1, 2))
    s = b.add(a, b.node("to_global", "to_global", (far1,), [0], fixed=True), [0])
    s = b.add(s, b.node("to_global", "to_global", (far2,), [0], fixed=True), [0])
    total = b.node("accumulate", "sum", (s,), [0], phase="post", fixed=True)
    b.node("output", "grad", (total,), None, phase="post")
    return b.g


def _kinds(g: LogicalGraph, phase: str) -> list[str]:
    return [n.kind if n.kind != "op" else n.name for n in g.nodes if n.phase == phase]


def test_a_parameter_read_on_three_stages_sends_each_far_part_once_after_the_micro_batches() -> None:
    g = _tied_over_three_stages()
    assert accumulate_before_send(g) == 2
    assert _kinds(g, "micro") == ["neg", "neg", "neg"]  # no conversion, no add per micro-batch
    post = _kinds(g, "post")
    assert post.count("accumulate") == 3 and post.count("to_global") == 2 and post.count("add") == 2
    sends = [n for n in g.nodes if n.kind == "to_global"]
    for n in sends:  # each crosses from its stage's accumulated sum to stage 0
        src = g.nodes[g.values[n.inputs[0]].producer]
        assert src.kind == "accumulate" and g.values[n.outputs[0]].placement.flat_ranks == (0,)
    out = next(n for n in g.nodes if n.kind == "output")
    assert g.nodes[g.values[out.inputs[0]].producer].name == "add"  # the graph's result is the last sum
    for n in g.nodes:  # ids are positions, producers point back, values are defined before they are read
        assert all(g.values[v].producer == n.id for v in n.outputs)
        assert all(g.values[v].producer < n.id for v in n.inputs)


def test_one_micro_batch_and_sums_on_one_stage_are_left_alone() -> None:
    assert accumulate_before_send(_tied_over_three_stages(m=1)) == 0
    b = _Builder(4)
    a, other = b.stage_gradient(0), b.stage_gradient(0)
    s = b.add(a, b.node("to_global", "to_global", (other,), [0], fixed=True), [0])  # same placement: no send
    b.node("accumulate", "sum", (s,), [0], phase="post", fixed=True)
    before = [(n.kind, n.phase) for n in b.g.nodes]
    assert accumulate_before_send(b.g) == 0
    assert [(n.kind, n.phase) for n in b.g.nodes] == before


def test_a_sum_read_elsewhere_in_the_micro_batch_keeps_its_per_micro_batch_send() -> None:
    """The micro-batch sum is also read by another op: it must exist per micro-batch, so nothing moves."""
    b = _Builder(4)
    a, far = b.stage_gradient(0), b.stage_gradient(1)
    s = b.add(a, b.node("to_global", "to_global", (far,), [0], fixed=True), [0])
    b.node("accumulate", "sum", (s,), [0], phase="post", fixed=True)
    b.node("op", "neg", (s,), [0], args=(("t", 0),))
    assert accumulate_before_send(b.g) == 0


def _post_add(g: LogicalGraph) -> LNode:
    return next(n for n in g.nodes if n.kind == "op" and n.name == "add" and n.phase == "post")


def _producer_kind(g: LogicalGraph, vid: int) -> str:
    return g.nodes[g.values[vid].producer].kind


def test_the_post_add_keeps_the_micro_adds_argument_order() -> None:
    """add(a, to_global(b)) becomes add(A, to_global(B)), and add(to_global(b), a) becomes add(to_global(B), A):
    the near sum and the sent sum each land in the position their micro-batch values had."""
    for far in (0, 1):
        b = _Builder(4)
        a, remote = b.stage_gradient(0), b.stage_gradient(1)
        sent = b.node("to_global", "to_global", (remote,), [0], fixed=True)
        s = b.add(*((sent, a) if far == 0 else (a, sent)), [0])
        b.node("accumulate", "sum", (s,), [0], phase="post", fixed=True)
        assert accumulate_before_send(b.g) == 1
        add = _post_add(b.g)
        kinds = [_producer_kind(b.g, v) for v in add.inputs]
        assert kinds == (["to_global", "accumulate"] if far == 0 else ["accumulate", "to_global"])
        near = b.g.nodes[b.g.values[add.inputs[1 - far]].producer]
        assert b.g.nodes[b.g.values[near.inputs[0]].producer].name == "neg"  # A sums stage 0's own part


def test_the_conversion_to_the_parameters_layout_moves_after_the_accumulation() -> None:
    """accumulate(to_global(add(a, to_global(b)))), the outer to_global on the add's own placement (a layout change):
    post holds A, B, to_global(B), the add into a new value, and the layout conversion into the accumulated value."""
    b = _Builder(4)
    a, remote = b.stage_gradient(0), b.stage_gradient(1)
    s = b.add(a, b.node("to_global", "to_global", (remote,), [0], fixed=True), [0])
    layout = b.node("to_global", "to_global", (s,), [0], fixed=True)
    total = b.node("accumulate", "sum", (layout,), [0], phase="post", fixed=True)
    b.node("output", "grad", (total,), None, phase="post")
    assert accumulate_before_send(b.g) == 1
    assert _kinds(b.g, "micro") == ["neg", "neg"]
    assert _kinds(b.g, "post") == ["accumulate", "accumulate", "to_global", "add", "to_global", "output"]
    add, convert = [n for n in b.g.nodes if n.phase == "post"][3:5]
    assert convert.inputs == add.outputs and convert.outputs == (total,)
    assert b.g.values[total].producer == convert.id


def test_sends_that_are_not_per_micro_batch_gradients_stay() -> None:
    """A to_global of a value computed once (pre phase), or one held back by a control edge (recomputation), is
    not a micro-batch gradient part: accumulating it over the micro-batches would change its meaning or order."""
    for case in ("pre", "control"):
        b = _Builder(4)
        a = b.stage_gradient(0)
        if case == "pre":
            remote = b.node("input", "w1", (), [1], phase="pre")
            sent = b.node("to_global", "to_global", (remote,), [0], fixed=True)
        else:
            remote = b.stage_gradient(1)
            sent = b.node("to_global", "to_global", (remote,), [0], fixed=True, control=(a,))
        s = b.add(a, sent, [0])
        b.node("accumulate", "sum", (s,), [0], phase="post", fixed=True)
        assert accumulate_before_send(b.g) == 0, case
