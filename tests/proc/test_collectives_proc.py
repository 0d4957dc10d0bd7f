"""Boxing, ops and comm primitives on real processes (gloo), against the simulated backend and torch.

One job per world size runs every case (see cases.full_job); the tests below
read its per-rank results. The reference is the same code run here, in one
process, on virtual ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from cases import BOXING, base_value, boxing_job, full_job, mlp_reference, ops_job
from procrun import run_ranks

from sbpflow import boxing, placement
from sbpflow import sbp as S
from sbpflow.boxing.plan import _plan_cached, get_cost_model

RTOL = 1e-5

AG, AR, RS, A2A, SR, RED = "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv", "reduce"

# Collectives each process takes part in, per case: one dict for every rank, or a list by rank.
EXPECTED_COUNTS: dict[int, dict[str, Any]] = {
    2: {
        "S0->B": {AG: 1},
        "S0->S1": {A2A: 1},
        "P->B": {AR: 1},
        "P->S0": {RS: 1},
        "Pmax->B": {AR: 1},
        "B->S1": {},
        "S0 [0,1] -> B [1]": {AG: 1},  # rank 1 already holds the whole value after the all-gather
        "B [0] -> S1 [0,1]": {SR: 1},
        "P [0,1] -> B [0]": {RED: 1},
        "S0 [0,1] -> S0 [1,0]": {AG: 1},
        "B [1] -> B [0]": {SR: 1},
    },
    4: {
        "S0->B": {AG: 1},
        "P->S1": {RS: 1},
        "S0->S1": {A2A: 1},
        "mesh (S0,S1)->(B,B)": {AG: 2},  # one per mesh axis: each process is in one group of each axis
        "mesh (P,S0)->(B,S0)": {AR: 1},
        "mesh (B,P)->(S1,B)": {AR: 1},
        # gather on the source ranks, then they send the whole value to ranks 0 and 3
        "S0 [1,2] -> B all": [{SR: 1}, {AG: 1, SR: 1}, {AG: 1, SR: 1}, {SR: 1}],
        # gloo's reduce-scatter costs an all-reduce (cost factor 2), so the planner all-reduces on [0, 1, 2]
        # and rank 0 alone sends to rank 3
        "P [0,1,2] -> B [3]": [{AR: 1, SR: 1}, {AR: 1}, {AR: 1}, {SR: 1}],
        "B [0] -> B all": {"broadcast": 1},  # one rank to many
        "S0 all -> mesh (S1,S0)": {SR: 1},
        "S0 [0,1] -> S1 [2,3]": {SR: 1},
    },
}


@pytest.fixture(scope="module", params=[2, 4], ids=["2 processes", "4 processes"])
def run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    world = request.param
    per_rank = run_ranks(full_job, world, args=(world,), timeout=120)
    reference = {"boxing": boxing_job(world), "ops": ops_job(world)}  # virtual ranks, in this process
    return world, per_rank, reference


def _expected(world: int, name: str, rank: int) -> dict[str, int]:
    counts = EXPECTED_COUNTS[world][name]
    return counts[rank] if isinstance(counts, list) else counts


def test_every_boxing_case_is_checked() -> None:
    for world in (2, 4):
        assert set(EXPECTED_COUNTS[world]) == set(BOXING[world])


def test_boxing_values_and_shards_match_simulated(run: Any) -> None:
    world, per_rank, ref = run
    for rank, result in enumerate(per_rank):
        for name, case in BOXING[world].items():
            got, want = result["boxing"][name], ref["boxing"][name]
            np.testing.assert_allclose(got["input"], want["input"], rtol=RTOL, err_msg=f"{name} input, rank {rank}")
            np.testing.assert_allclose(got["value"], want["value"], rtol=RTOL, err_msg=f"{name}, rank {rank}")
            dst = placement("cpu", case[3])
            assert sorted(got["shards"]) == ([rank] if rank in dst.flat_ranks else []), name
            for r, shard in got["shards"].items():
                np.testing.assert_allclose(shard, want["shards"][r], rtol=RTOL, err_msg=f"{name} shard of rank {r}")


def test_boxing_of_non_partial_inputs_keeps_the_logical_value(run: Any) -> None:
    world, per_rank, _ = run
    for name, (shape, _, src_sbp, _, _) in BOXING[world].items():
        if any(isinstance(s, S.Partial) for s in src_sbp):
            continue
        for result in per_rank:
            np.testing.assert_allclose(result["boxing"][name]["value"], base_value(shape).numpy(), rtol=RTOL)


def test_boxing_collectives_per_process(run: Any) -> None:
    world, per_rank, _ = run
    for rank, result in enumerate(per_rank):
        for name in BOXING[world]:
            assert result["boxing"][name]["counts"] == _expected(world, name, rank), (name, rank)


def test_ops_match_simulated(run: Any) -> None:
    world, per_rank, ref = run
    for result in per_rank:
        for name in ("matmul S1 x S0", "elementwise S0", "sum over split dim", "sum then B", "mask rows", "topk S0"):
            np.testing.assert_allclose(result["ops"][name]["value"], ref["ops"][name]["value"], rtol=RTOL,
                                       err_msg=name)
    a, b = base_value((5, 7)), base_value((7, 3)) * 2
    np.testing.assert_allclose(per_rank[0]["ops"]["matmul S1 x S0"]["value"], (a @ b).numpy(), rtol=RTOL, atol=1e-6)


def test_in_place_writes_match_torch_on_processes(run: Any) -> None:
    _, per_rank, ref = run
    for got in [ref["ops"]["in-place writes"]] + [r["ops"]["in-place writes"] for r in per_rank]:
        np.testing.assert_allclose(got["x"], got["torch x"], rtol=RTOL)
        np.testing.assert_allclose(got["y"], got["torch y"], rtol=RTOL)


def test_16_bit_sums_are_accumulated_in_fp32(run: Any) -> None:
    world, per_rank, _ = run
    ones = [1.0] * (world - 1)
    bf16 = float(torch.tensor([256.0, *ones]).sum().bfloat16())  # 4 ranks: 259 -> 260 (256 summed in bf16)
    fp16 = float(torch.tensor([2048.0, *ones]).sum().half())  # 4 ranks: 2051 -> 2052 (2048 summed in fp16)
    for result in per_rank:
        assert result["primitives"]["all_reduce bfloat16 sum in fp32"][0].tolist() == [bf16] * 3
        assert result["primitives"]["reduce_scatter float16 sum in fp32"][0].tolist() == [fp16] * 3


def test_local_tensor_onto_partial_sum_is_the_same_in_both_modes(run: Any) -> None:
    """Each rank contributes its local [1, 1], so the value is world x [1, 1] in both modes. A local gradient
    belongs to its process: each process's own tensor gets 1 per element, and the one local tensor that all
    virtual ranks share gets the sum of those, world."""
    world, per_rank, ref = run
    virtual = ref["ops"]["local to P(sum)"]
    assert virtual["value"].tolist() == virtual["grad"].tolist() == [float(world)] * 2
    for result in per_rank:
        assert result["ops"]["local to P(sum)"]["value"].tolist() == [float(world)] * 2
        assert result["ops"]["local to P(sum)"]["grad"].tolist() == [1.0, 1.0]
    assert sum(r["ops"]["local to P(sum)"]["grad"] for r in per_rank).tolist() == virtual["grad"].tolist()


def test_ops_collectives_and_sbp(run: Any) -> None:
    _, per_rank, _ = run
    for result in per_rank:
        ops = result["ops"]
        assert ops["matmul S1 x S0"]["counts"] == {} and ops["matmul S1 x S0"]["sbp"] == "(Partial(op='sum'),)"
        assert ops["elementwise S0"]["counts"] == {}
        assert ops["sum over split dim"]["counts"] == {} and "Partial" in ops["sum over split dim"]["sbp"]
        assert ops["sum then B"]["counts"] == {AR: 1}
        assert ops["mask rows"]["counts"] == {} and ops["topk S0"]["counts"] == {}


def test_mlp_backward_reduces_both_weights_in_one_bucket(run: Any) -> None:
    _, per_rank, _ = run
    want = mlp_reference()
    for result in per_rank:
        mlp = result["ops"]["mlp backward"]
        assert mlp["forward counts"] == {}
        assert mlp["backward counts"] == {AR: 1}
        assert mlp["grad sbp"] == ["(Broadcast(),)", "(Broadcast(),)"]
        for key in ("loss", "grad w1", "grad w2"):
            np.testing.assert_allclose(mlp[key], want[key], rtol=RTOL, atol=1e-5, err_msg=key)


def test_primitives_match_simulated_backend(run: Any) -> None:
    _, per_rank, _ = run
    for rank, result in enumerate(per_rank):
        for name, (got, want) in result["primitives"].items():
            if isinstance(want, dict):
                assert got.keys() == want.keys(), (name, rank)
                for i in want:
                    np.testing.assert_allclose(got[i], want[i], rtol=RTOL, err_msg=f"{name} piece {i}, rank {rank}")
            elif isinstance(want, list):
                assert len(got) == len(want)
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_allclose(g, w, rtol=RTOL, err_msg=f"{name}, rank {rank}")
            elif want is None:
                assert got is None, (name, rank)
            else:
                np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"{name}, rank {rank}")


def test_local_to_global_takes_the_logical_shape_from_every_rank(run: Any) -> None:
    world, per_rank, _ = run
    logical = base_value((2 * world + 1, 3)).numpy()
    for result in per_rank:
        multi = result["multi"]
        assert multi["local_to_global shape"] == (2 * world + 1, 3)
        np.testing.assert_array_equal(multi["local_to_global value"], logical)
        assert "tile a logical tensor the way torch.tensor_split cuts it" in multi["uneven mismatch error"]


def test_processes_outside_a_placement_read_values_and_hold_nothing(run: Any) -> None:
    world, per_rank, _ = run
    logical = base_value((2 * world + 1, 3)).numpy()
    for rank, result in enumerate(per_rank):
        multi = result["multi"]
        np.testing.assert_array_equal(multi["outside value"], logical)
        assert multi["outside shards"] == ([world - 1] if rank == world - 1 else [])
        assert multi["outside op counts"] == {}
        assert multi["outside op value"] == pytest.approx(float((2 * logical).sum()), rel=1e-5)


def test_rank_errors_and_print0(run: Any) -> None:
    world, per_rank, _ = run
    for rank, result in enumerate(per_rank):
        multi = result["multi"]
        assert (multi["rank"], multi["world"]) == (rank, world)
        assert f"below the number of processes, {world}" in multi["too many ranks error"]
        assert multi["print0"] == (f"hello from {rank}\n" if rank == 0 else "")


def test_planner_counts_gloo_reduce_scatter_as_an_all_reduce() -> None:
    """The cost factor changes the plan: on gloo, P -> B across placements all-reduces instead."""
    src = boxing.Layout(placement("cpu", [0, 1, 2]), (S.partial_sum,))
    dst = boxing.Layout(placement("cpu", [3]), (S.broadcast,))
    plain = _plan_cached((7, 5), torch.float32, src, dst, get_cost_model(), ())
    gloo = _plan_cached((7, 5), torch.float32, src, dst, get_cost_model(), ((("cpu", "reduce_scatter"), 2.0),))
    assert plain.collectives() == [RS, SR]
    assert gloo.collectives() == [AR, SR]
    rs = boxing.Layout(placement("cpu", [0, 1, 2]), (S.split(0),))
    doubled = _plan_cached((6, 4), torch.float32, src, rs, get_cost_model(), ((("cpu", "reduce_scatter"), 2.0),))
    single = _plan_cached((6, 4), torch.float32, src, rs, get_cost_model(), ())
    assert doubled.steps[0].kind == single.steps[0].kind == RS
    assert doubled.steps[0].bytes == 2 * single.steps[0].bytes
