"""The plan search: stage cuts against every cut, branch and bound against costing every plan, known optima on
small models, and the GPT-3 175B anchor (Megatron-LM 2021: 140 TFLOP/s per A100 on 1024 GPUs)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from sbpflow.autoparallel import (
    PROFILES,
    Cluster,
    Fixed,
    ParallelPlan,
    TransformerSpec,
    candidate_plans,
    cut_stages,
    plan_costs,
    predict,
    predict_with_cuts,
    search,
)
from sbpflow.autoparallel.predict import TIME_KEYS, lower_bound
from sbpflow.autoparallel.stages import all_cuts
from sbpflow.errors import PlanError

A100 = PROFILES["a100-80gb"]
GPT3 = TransformerSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
SMALL = TransformerSpec(layers=8, hidden=1024, heads=16, seq=512, vocab=8192)


def _best_by_enumeration(costs):
    """The slowest-stage-minimising cut among all cuts whose every stage fits (or None)."""
    usable = costs.cluster.profile.usable_memory
    best = None
    for cuts in all_cuts(costs.spec.layers, costs.plan.pp):
        if any(sum(costs.stage_memory(i, k).values()) > usable for i, k in enumerate(cuts)):
            continue
        slowest = max(costs.stage_cost(i, k).total for i, k in enumerate(cuts))
        if best is None or slowest < best[0] - 1e-12:
            best = (slowest, cuts)
    return best


@pytest.mark.parametrize("memory_gb", [80.0, 2.35, 2.3, 1.0])
def test_stage_cuts_match_enumeration_of_every_cut(memory_gb):
    """With room to spare the cuts are balanced; under a tight memory limit the early stages (more micro-batches
    in flight under 1F1B) must take fewer blocks; with too little memory there is no cut at all."""
    profile = replace(A100, memory_bytes=memory_gb * 1e9, reserved_bytes=0.0)
    spec = TransformerSpec(layers=9, hidden=1024, heads=16, seq=1024, vocab=8192)
    costs = plan_costs(spec, Cluster(4, profile, 4), ParallelPlan(1, 4, 1, 2, 0, "none"), batch=16)
    expected = _best_by_enumeration(costs)
    cuts = cut_stages(costs)
    if expected is None:
        assert cuts is None
        return
    assert cuts is not None and sum(cuts) == 9
    assert max(costs.stage_cost(i, k).total for i, k in enumerate(cuts)) == pytest.approx(expected[0])
    assert all(sum(costs.stage_memory(i, k).values()) <= profile.usable_memory for i, k in enumerate(cuts))


def test_tight_memory_gives_uneven_cuts():
    profile = replace(A100, memory_bytes=2.3e9, reserved_bytes=0.0)
    spec = TransformerSpec(layers=9, hidden=1024, heads=16, seq=1024, vocab=8192)
    cuts = cut_stages(plan_costs(spec, Cluster(4, profile, 4), ParallelPlan(1, 4, 1, 2, 0, "none"), batch=16))
    assert cuts is not None and cuts[0] < cuts[-1]


def test_branch_and_bound_equals_exhaustive_search():
    cluster = Cluster(16, A100, 8)
    fast = search(SMALL, cluster, batch=64, keep=4)
    full = search(SMALL, cluster, batch=64, keep=4, exhaustive=True)
    assert full.costed == full.candidates > fast.costed
    assert fast.best.step_time == pytest.approx(full.best.step_time)
    assert [p.step_time for p in fast.runners_up] == pytest.approx([p.step_time for p in full.runners_up])


def test_lower_bound_never_exceeds_the_prediction():
    cluster = Cluster(16, A100, 8)
    for plan in candidate_plans(SMALL, cluster, 64):
        costs = plan_costs(SMALL, cluster, plan, 64)
        cuts = cut_stages(costs)
        if cuts is not None:
            assert lower_bound(costs) <= predict_with_cuts(costs, cuts, 64).step_time * (1 + 1e-9), plan


def test_small_model_plenty_of_memory_is_pure_data_parallel():
    """Known optimum: when the model fits one device, tensor and pipeline parallelism only add communication
    and bubbles, and recomputation only adds work."""
    best = search(SMALL, Cluster(8, A100, 8), batch=64).best
    assert (best.plan.tp, best.plan.pp, best.plan.dp, best.plan.recompute) == (1, 1, 8, "none")


def test_model_too_big_for_one_device_is_split():
    """Known optimum: a 20B model's weights alone exceed an 80 GB device under data parallelism, so the plan
    must shard it; with one node, tensor parallelism over NVLink beats pipeline bubbles for a small batch."""
    spec = TransformerSpec(layers=44, hidden=6144, heads=64, seq=2048, vocab=51200)
    best = search(spec, Cluster(8, A100, 8), batch=8).best
    assert best.fits
    assert best.plan.tp > 1 and best.plan.pp == 1


def test_search_is_exact_on_a_tiny_grid():
    """Every candidate costed by hand: the search's best is the minimum over all that fit."""
    spec = TransformerSpec(layers=4, hidden=512, heads=8, seq=256, vocab=4096)
    cluster = Cluster(4, replace(A100, memory_bytes=3e9, reserved_bytes=0.0), 2)
    fitting = [p for p in (predict(spec, cluster, plan, 32) for plan in candidate_plans(spec, cluster, 32)) if p.fits]
    best = search(spec, cluster, 32).best
    assert best.step_time == pytest.approx(min(p.step_time for p in fitting))


def test_fixed_flags_restrict_the_search():
    cluster = Cluster(16, A100, 8)
    result = search(SMALL, cluster, 64, Fixed(tp=2, recompute="selective"))
    for p in [result.best, *result.runners_up]:
        assert p.plan.tp == 2 and p.plan.recompute == "selective"
    with pytest.raises(PlanError, match=r"no plan of .* for a batch of 64 with tp=3 fixed: a plan needs tp dividing"):
        search(SMALL, cluster, 64, Fixed(tp=3))
    one = search(SMALL, cluster, 64, Fixed(micro_batches=1))
    for p in [one.best, *one.runners_up]:
        assert p.plan.dp * p.plan.micro_batch == 64


def test_invalid_plans_are_refused():
    cluster = Cluster(16, A100, 8)
    with pytest.raises(PlanError, match="tp · pp · dp"):
        predict(SMALL, cluster, ParallelPlan(2, 2, 2, 1), 64)
    with pytest.raises(PlanError, match="whole|divide heads"):
        predict(replace(SMALL, heads=8), cluster, ParallelPlan(16, 1, 1, 1), 64)
    with pytest.raises(PlanError, match="needs a block"):
        predict(SMALL, cluster, ParallelPlan(1, 16, 1, 1), 64)
    with pytest.raises(PlanError, match="micro-batches"):
        predict(SMALL, cluster, ParallelPlan(1, 1, 16, 3), 64)


def test_breakdown_sums_to_the_step_time():
    p = predict(GPT3, Cluster(1024, A100, 8), ParallelPlan(8, 16, 8, 1, 0, "full"), 1536)
    assert set(p.breakdown) == set(TIME_KEYS)
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time)
    # equal stages: the bubble is (p - 1) / m of the pipelined work, m = 1536 / 8 = 192
    pipelined = sum(p.breakdown[k] for k in ("compute", "recompute", "tp_comm", "pp_comm"))
    assert p.breakdown["bubble"] / pipelined == pytest.approx(15 / 192, rel=0.05)


@pytest.mark.parametrize("layout", ["ilp", "megatron"])
def test_gpt3_anchor_within_15_percent_of_megatron(layout):
    """Narayanan et al. 2021: GPT-3 175B, 1024 A100-80GB, TP 8, PP 16, DP 8, batch 1536: 140 TFLOP/s per GPU;
    with the block ILP's choice (Megatron's layers, the stream split over tokens) or Megatron-LM's exact layout."""
    p = predict(GPT3, Cluster(1024, A100, 8), ParallelPlan(8, 16, 8, 1, 0, "full", layout), 1536)
    assert p.fits
    assert p.tflops_per_device == pytest.approx(140, rel=0.15)


def test_gpt3_search_beats_megatron_hand_plan_in_under_a_minute():
    cluster = Cluster(1024, A100, 8)
    megatron = predict(GPT3, cluster, ParallelPlan(8, 16, 8, 1, 0, "full"), 1536)
    start = time.perf_counter()
    result = search(GPT3, cluster, 1536)
    assert time.perf_counter() - start < 60
    assert result.best.fits and result.best.step_time <= megatron.step_time
    assert all(p.step_time >= result.best.step_time for p in result.runners_up)
    assert all(not p.fits and p.step_time < result.best.step_time for p in result.too_big)


def test_interleaving_divides_the_bubble_and_multiplies_the_sends():
    cluster = Cluster(16, A100, 8)
    spec = replace(SMALL, layers=16)
    plain = predict(spec, cluster, ParallelPlan(2, 4, 2, 1), 64)
    costs = plan_costs(spec, cluster, ParallelPlan(2, 4, 2, 1, virtual=4), 64)
    interleaved = predict_with_cuts(costs, plain.stage_layers, 64)
    assert plain.stage_layers == interleaved.stage_layers == (4, 4, 4, 4)
    middle = plan_costs(spec, cluster, ParallelPlan(2, 4, 2, 1), 64)
    assert costs.stage_cost(1, 4).pp_comm == 4 * middle.stage_cost(1, 4).pp_comm  # 2v sends instead of 2
    assert costs.stage_cost(0, 4).pp_comm == 7 * costs.p2p  # the model's input is not received
    extra_sends = (interleaved.breakdown["pp_comm"] - plain.breakdown["pp_comm"])
    assert interleaved.breakdown["bubble"] == pytest.approx((plain.breakdown["bubble"] + extra_sends * 3 / 16) / 4,
                                                            rel=0.05)
    assert interleaved.memory["activations"] > plain.memory["activations"]  # the first chunks run ahead


def test_interleaving_needs_a_block_per_chunk_and_whole_groups_of_micro_batches():
    cluster = Cluster(16, A100, 8)
    with pytest.raises(PlanError, match=r"pp · virtual <= 8 \(the layers\)"):
        predict(SMALL, cluster, ParallelPlan(2, 4, 2, 1, virtual=3), 64)
    with pytest.raises(PlanError, match="groups of pp=4, but the plan has 2"):
        predict(SMALL, cluster, ParallelPlan(2, 4, 2, 16, virtual=2), 64)
    assert {p.virtual for p in candidate_plans(SMALL, cluster, 64, Fixed(tp=2, pp=4))} == {1, 2}
    assert search(SMALL, cluster, 64, Fixed(virtual=2)).best.plan.virtual == 2
