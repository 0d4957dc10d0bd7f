"""SBP selection's cost model picks plain data parallelism where it is cheaper (graph/select.py, graph/bucket.py).

The models are the dp2 benchmark's (benchmarks/graph_dist_compare.py): parameters B, the batch S(0) on 2 virtual
ranks, compiled without running. Data parallelism is the cheaper plan there: every rank does half of every
matmul either way, but a column-parallel linear gathers its input, while the gradients' all-reduces go out in
buckets during backward. Before the cost model counted the weight and input gradients' FLOPs (``flops``) and
priced gradient all-reduces by what backward does not cover, the ILP chose column-parallel linears for the MLP
(9 all-gathers and an all-to-all per step, replicated weight gradients).
"""

from __future__ import annotations

from typing import Any

import pytest

import sbpflow
from harness import MeanSquareStep
from sbpflow import nn, optim
from sbpflow import sbp as S
from sbpflow.demo.train_gpt import build, random_batches
from sbpflow.graph import milp, select
from sbpflow.graph.bucket import solo_bytes
from sbpflow.graph.explain import collective_counts
from sbpflow.graph.fuse import members
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.models.gpt import GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P2 = sbpflow.placement("cpu", [0, 1])
B, S0, PSUM = (S.broadcast,), (S.split(0),), (S.partial_sum,)


def _mlp_step(width: int = 1024, hidden: int = 3, batch: int = 64) -> MeanSquareStep:
    """The issue-4 MLP under dp2, compiled (not run)."""
    sbpflow.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(hidden):
        mods += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(width, width)).to_global(P2, S.broadcast)
    step = MeanSquareStep(model, optim.AdamW(model.parameters(), lr=1e-3))
    x = sbpflow.zeros(batch, width, placement=P2, sbp=S.split(0))  # logical (64, 1024), local (32, 1024)
    step.compile_only(x, x)
    return step


def _signatures(step: nn.Graph, op: str) -> set[tuple[Any, ...]]:
    g = step.logical
    return {(tuple(n.in_sbps), tuple(g.values[v].sbp for v in n.outputs)) for n in g.nodes if n.name == op}


def _gradient_reductions(plan: PhysicalPlan) -> list[tuple[int, int]]:
    """Per all-reduce of rank 0, in plan order: (tensors it reduces, plan position of the node that makes its
    input); a bucket's input is made by its flatten, right after the last member's producer (in a fused node,
    the sub-node that writes it)."""
    producer = plan.producers()
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    out = []
    for n in plan.collectives(0):
        if n.boxing.steps[0].kind == "all_reduce":
            source = plan.node(producer[n.inputs[0]])
            maker = next(m for m in members([source]) if n.inputs[0] in m.outputs)
            out.append((len(maker.inputs) if maker.op == "bucket_flatten" else 1, position[source.id]))
    return out


def _assert_issued_when_made(plan: PhysicalPlan) -> None:
    """Each all-reduce comes right after the node that makes its input (a bucket: after its flatten), so the
    communication lane, which keeps plan order, sends gradients in backward's order while backward goes on."""
    producer = plan.producers()
    for i, n in enumerate(plan.nodes):
        if n.kind == "boxing" and n.is_comm and n.boxing.steps[0].kind == "all_reduce":
            made = plan.nodes.index(plan.node(producer[n.inputs[0]]))
            assert made == i - 1, f"{n.label()} at {i}, its input made at {made}"


def test_dp2_mlp_is_data_parallel_with_the_last_weight_gradient_made_whole() -> None:
    """Data parallel, except one choice a fixed strategy cannot make: the first layer's weight gradient (4 MiB,
    made last in backward) is computed whole on each rank from its two gathered inputs (256 KiB each: the
    batch itself and the gradient reaching the first layer), which costs two small all-gathers and a second
    copy of one matmul instead of a 4 MiB all-reduce. The other layers' gradients are all-reduced: gathering
    their inputs would make every rank run the rest of backward whole."""
    step = _mlp_step()
    assert _signatures(step, "linear") == {((S0, B, B), (S0,))}
    assert _signatures(step, "matmul_nd") == {((S0, B), (S0,))}
    assert _signatures(step, "linear_weight_grad") == {((S0, S0), (PSUM,)), ((B, B), (B,))}
    g = step.logical
    whole = [n for n in g.nodes if n.name == "linear_weight_grad" and tuple(n.in_sbps) == (B, B)]
    last = [n for n in g.nodes if n.name == "linear_weight_grad"][-1]
    assert [n.id for n in whole] == [last.id]  # the last one backward makes: the first layer's
    plan = step.plan
    counts = collective_counts(plan, 0)
    assert dict(counts) == {"all_reduce": 4, "all_gather": 2}  # 3 weights alone, the 4 biases in 1 bucket
    gathers = [n for n in plan.collectives(0) if n.boxing.steps[0].kind == "all_gather"]
    assert all(plan.bufs[n.outputs[0]].nbytes(0) == 64 * 1024 * 4 for n in gathers)  # (64, 1024) float32 each
    reductions = _gradient_reductions(plan)
    assert sorted(k for k, _ in reductions) == [1, 1, 1, 4]
    assert sum(k for k, _ in reductions) == len(list(step.model.parameters())) - 1  # all but the whole one
    _assert_issued_when_made(plan)
    first_update = next(i for i, n in enumerate(plan.nodes) if n.kind == "update")
    backward_ops = [i for i, n in enumerate(plan.nodes)
                    if any(m.op in ("matmul_nd", "linear_weight_grad") for m in members([n]))]
    assert reductions[0][1] < backward_ops[-1] < first_update  # the first goes out while backward goes on


def test_dp2_gpt_is_plain_data_parallel() -> None:
    """The benchmark's GPT: no activation is gathered (one 512-byte gather of the loss's token mask), and every
    parameter's gradient is all-reduced once, the big ones alone, the others in buckets, each issued when made."""
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.0)
    trainer = build(config, "dp=2", clip=None, graph=True)
    ids, targets = next(random_batches(256, 1, 8, 128, seed=1))
    trainer.graph.compile_only(*trainer.inputs(ids, targets))
    assert _signatures(trainer.graph, "linear_weight_grad") == {(((S.split(0), S.broadcast),) * 2,
                                                                 ((S.partial_sum, S.broadcast),))}
    plan = trainer.graph.plan
    counts = collective_counts(plan, 0)
    params = list(trainer.model.parameters())
    solo = solo_bytes(sbpflow.boxing.get_cost_model(), _any_all_reduce(plan))
    assert solo > 1 << 20  # gloo's latency: even the MLP's 1 MiB weights are cheaper to copy into a bucket
    assert max(p.numel() * 4 for p in params) < solo
    reductions = _gradient_reductions(plan)
    assert sum(k for k, _ in reductions) == len(params)
    assert all(k > 1 for k, _ in reductions) and counts["all_reduce"] == len(reductions)
    gathers = [n for n in plan.collectives(0) if n.boxing.steps[0].kind == "all_gather"]
    assert set(counts) == {"all_reduce", "all_gather"} and len(gathers) == 1
    assert plan.bufs[gathers[0].outputs[0]].nbytes(0) <= 1024
    _assert_issued_when_made(plan)


def _any_all_reduce(plan: PhysicalPlan) -> Any:
    return next(n for n in plan.collectives(0) if n.boxing.steps[0].kind == "all_reduce")



def _selection(strategy: str, n_layer: int = 2) -> Any:
    config = GPTConfig(vocab_size=100, block_size=32, n_layer=n_layer, n_head=4, n_embd=64, dropout=0.0)
    trainer = build(config, strategy, graph=True, executor="inorder")
    ids, targets = next(random_batches(100, 1, 8, 32, seed=1))
    trainer.graph.compile_only(*trainer.inputs(ids, targets))
    return trainer.graph._compiled().report.selection


def _slow_links(factor: float) -> Any:
    """A CPU link of 20 us latency and ``factor`` times 0.2 ns per byte: the gradient all-reduces of the dp2 GPT
    then outlast backward's cover, and the overlap column binds."""
    model = sbpflow.boxing.get_cost_model()
    return sbpflow.boxing.cost_model(model.with_link("cpu", "intra", 20e-6, factor / 5e9))


@pytest.mark.parametrize("n_layer", [2, 12])
def test_neighbourhood_search_finds_the_whole_programs_plan(n_layer: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the overlap column makes the relaxation fractional, the integer program over the mixed choices and
    their twins (milp.neighbourhood) chooses a plan as cheap as the branch and bound over every choice (the
    12-layer one: within 0.01 %), and much cheaper than greedy's."""
    calls: list[int] = []
    search = milp.neighbourhood

    def counted(*args: Any) -> Any:
        calls.append(len(args[3]))
        return search(*args)

    monkeypatch.setattr(milp, "neighbourhood", counted)
    with _slow_links(30):
        fast = _selection("dp=2", n_layer)
        assert calls, "the relaxation came out whole: this case no longer exercises the neighbourhood search"
        monkeypatch.setattr(milp, "neighbourhood", lambda *args: None)  # the branch and bound over everything
        whole = _selection("dp=2", n_layer)
    assert fast.greedy_cost == whole.greedy_cost
    assert fast.chosen_cost <= whole.chosen_cost * (1 + 1e-4)
    assert fast.chosen_cost < fast.greedy_cost * 0.97


def test_small_gradients_share_a_bucket_latency() -> None:
    """The selection prices gradient all-reduces as graph.bucket sends them: the GPT of benchmarks/sbp_selection.py
    on dp=4 has dozens of small gradients (biases, norms) in one bucket. Priced one latency each, they made the
    ILP compute every weight gradient whole on every rank, moving more bytes in 11 collectives instead of 3, and
    its steps measured 25 % slower than greedy's."""
    config = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)
    trainer = build(config, "dp=4", graph=True, executor="inorder")
    ids, targets = next(random_batches(96, 1, 8, 32, seed=0))
    trainer.graph.compile_only(*trainer.inputs(ids, targets))
    d4 = ((S.split(0), S.broadcast),) * 2
    assert _signatures(trainer.graph, "linear_weight_grad") == {(d4, ((S.partial_sum, S.broadcast),))}
    plan = trainer.graph.plan
    reductions = _gradient_reductions(plan)
    assert sum(k for k, _ in reductions) == len(list(trainer.model.parameters()))
    assert len(reductions) <= 2 and set(collective_counts(plan, 0)) <= {"all_reduce", "all_gather"}
    node = _any_all_reduce(plan)
    assert select.solo_bytes(sbpflow.boxing.get_cost_model(), node.boxing.src.placement) == \
        solo_bytes(sbpflow.boxing.get_cost_model(), node)
