"""SBPs inside a block by ILP (HiGHS) against enumerating every assignment; Megatron's pattern rediscovered."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sbpflow.autoparallel import PROFILES, Cluster, ParallelPlan, TransformerSpec, plan_costs, predict, search
from sbpflow.autoparallel.block_sbp import (
    MEGATRON_CHOICES,
    BlockBudget,
    cached_solve,
    enumerate_block,
    megatron,
    solve_block,
)
from sbpflow.errors import PlanError

A100 = PROFILES["a100-80gb"]
SMALL = TransformerSpec(layers=2, hidden=256, heads=4, seq=64, vocab=512)
GPT3 = TransformerSpec(96, 12288, 96, 2048, 51200)


STAGE = BlockBudget(state_bytes=6.0, blocks=3, copies=4.0, gathered_bytes=4.0, param_seconds=2e-12)


@pytest.mark.parametrize(("limit", "recompute", "budget"), [(None, "none", BlockBudget()), (5e6, "none", BlockBudget()),
                                                          (None, "full", STAGE), (2.5e7, "selective", STAGE)])
def test_ilp_equals_enumeration_of_every_assignment(limit, recompute, budget):
    ilp = solve_block(SMALL, 2, 4, A100, limit, recompute, budget)
    every = enumerate_block(SMALL, 2, 4, A100, limit, recompute, budget)
    assert ilp.seconds == pytest.approx(every.seconds, rel=1e-6)
    if limit is not None:
        assert ilp.memory <= limit and every.memory <= limit


def test_memory_limit_forces_sharded_weights():
    roomy = solve_block(SMALL, 2, 4, A100)
    tight = solve_block(SMALL, 2, 4, A100, memory_limit=4e6)
    assert roomy.comm_seconds == 0 and not megatron(roomy)  # small layers: replicate, no communication
    assert megatron(tight) and tight.memory <= 4e6 and tight.seconds > roomy.seconds
    with pytest.raises(PlanError, match="fits"):
        solve_block(SMALL, 2, 4, A100, memory_limit=1e5)


@pytest.mark.parametrize(("tp", "solve"), [(1, solve_block), (4, solve_block), (4, enumerate_block)])
def test_no_fit_says_in_words_what_was_asked_and_what_it_needs(tp, solve):
    """No internal reprs (TransformerSpec(...), raw floats): the block's sizes, the limit and the least need."""
    with pytest.raises(PlanError) as caught:
        solve(SMALL, 2, tp, A100, 1e5, "selective")
    message = str(caught.value)
    assert message.startswith(f"no SBP assignment of a block of 2 layers, hidden 256, 4 heads, MLP 1024 gelu, "
                              f"seq 64, vocab 512 (micro-batch 2, recompute selective) on {tp} rank")
    assert "fits in 0.10 MiB per rank: the smallest needs at least " in message
    least = float(message.split("at least ")[1].split(" MiB")[0])
    assert least > 0.1  # more than the limit, or an assignment would have fitted
    assert "TransformerSpec(" not in message and "BlockBudget(" not in message


def test_gpt3_block_on_eight_gpus_is_megatron():
    """One block stands for all 96: the choice is Megatron-LM's column/row pairing (with LayerNorm and the
    residual stream split over tokens, i.e. sequence parallelism), found in well under a second."""
    plan = solve_block(GPT3, 1, 8, A100)
    assert megatron(plan) and plan.comm_seconds > 0
    assert plan.solve_s < 5


# ----------------------------------------------------------------------------- the choice the predictions use

SLOW_TP = replace(A100, intra_bandwidth=2e9, intra_alpha=1e-4)  # a tensor-parallel link 100x slower than NVLink
GPT_8 = TransformerSpec(layers=8, hidden=1024, heads=16, seq=512, vocab=8192)


def _predict(memory_gb, layout):
    profile = replace(SLOW_TP, memory_bytes=memory_gb * 1e9, reserved_bytes=0.0)
    return predict(GPT_8, Cluster(4, profile, 4), ParallelPlan(4, 1, 1, 8, 0, "none", layout), 8)


def test_plentiful_memory_and_a_slow_link_change_the_choice_and_the_prediction():
    """With room for whole weights, the ILP replicates the layers rather than pay the slow link: the prediction
    prices that choice (no tensor-parallel traffic, whole-width compute, whole weights), and beats the same plan
    under Megatron's layout."""
    ilp, hand = _predict(80.0, "ilp"), _predict(80.0, "megatron")
    assert not megatron(ilp.block) and megatron(hand.block) and hand.block.choices == MEGATRON_CHOICES
    assert ilp.breakdown["tp_comm"] == 0 < hand.breakdown["tp_comm"]
    assert ilp.breakdown["compute"] > hand.breakdown["compute"]
    assert ilp.block.params == GPT_8.layer_params  # every weight whole on every rank
    assert ilp.memory["weights"] - hand.memory["weights"] == pytest.approx(2 * 8 * (ilp.block.params
                                                                                   - hand.block.params))
    assert ilp.step_time < hand.step_time / 5


def test_short_memory_gives_megatrons_layers():
    """Under 1.2 GB only split weights fit: the ILP finds Megatron's column/row layers (with the residual stream
    split over tokens, which is what lets this plan fit where Megatron's whole stream does not)."""
    ilp, hand = _predict(1.2, "ilp"), _predict(1.2, "megatron")
    assert megatron(ilp.block) and ilp.fits and not hand.fits
    assert dict(ilp.block.choices)["x"] == "S(0)"
    assert ilp.breakdown["tp_comm"] == pytest.approx(hand.breakdown["tp_comm"])
    nothing = _predict(1.0, "ilp")  # nothing fits: Megatron's layout, reported as not fitting
    assert nothing.block.choices == MEGATRON_CHOICES and not nothing.fits


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_prediction_prices_the_choice_as_the_ilp_does(recompute):
    """The plan's per-block seconds are the ILP's objective for its choice: compute (and what recompute reruns)
    from the same kernels, tensor-parallel time from the collectives the choice issues."""
    cluster = Cluster(1024, A100, 8)
    costs = plan_costs(GPT3, cluster, ParallelPlan(8, 16, 8, 1, 0, recompute), 1536)
    block = costs.block
    assert block.method == "ilp" and megatron(block)
    assert costs.layer_tp == pytest.approx(block.comm_seconds, rel=1e-9)
    assert costs.layer_compute + costs.layer_recompute + costs.layer_tp == pytest.approx(block.seconds, rel=1e-9)


def test_solves_are_cached_across_candidates():
    cached_solve.cache_clear()
    cluster = Cluster(16, A100, 8)
    result = search(GPT_8, cluster, 64)
    info = cached_solve.cache_info()
    assert info.hits > 0 and info.misses < result.candidates
    plan = result.best.plan
    predict(GPT_8, cluster, plan, 64)
    assert cached_solve.cache_info().misses == info.misses  # the same plan again: no new solve


def test_megatron_layout_fixes_every_plans_block_sbps():
    """``layout="megatron"`` prices every plan with Megatron-LM's block SBPs (what sbpflow.parallelize lays out
    from column/row pairs), even where the ILP would choose otherwise."""
    from sbpflow.autoparallel.search import Fixed

    tiny = TransformerSpec(layers=2, hidden=16, heads=2, seq=8, vocab=32)
    result = search(tiny, Cluster(2, SLOW_TP, 2), 4, Fixed(zero=0, recompute="none", layout="megatron", virtual=1))
    for p in [result.best, *result.runners_up]:
        assert p.plan.layout == "megatron" and p.block.choices == MEGATRON_CHOICES
