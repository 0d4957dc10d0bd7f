"""The host model (eager steps of processes sharing cores) against hand-computed cases: a block's FLOPs and
bytes, the collectives a block's SBP choices issue, buckets, a profile's lookups, and whole steps."""

from __future__ import annotations

import pytest

from sbpflow.autoparallel import ParallelPlan, TransformerSpec
from sbpflow.autoparallel.block_sbp import MEGATRON_CHOICES, block_collectives
from sbpflow.autoparallel.calibrate_host import fit_line
from sbpflow.autoparallel.host import (
    DISPATCH_FIXED,
    DISPATCH_PER_BLOCK,
    BlockShape,
    HeadShape,
    HostProfile,
    host_plans,
    host_search,
    predict_host,
    stage_work,
)
from sbpflow.errors import PlanError, SbpflowError

TINY = TransformerSpec(layers=2, hidden=8, heads=2, seq=4, vocab=16)


def toy(processes: int = 2, **kw: object) -> HostProfile:
    """Round numbers: 10 us per op (2 us outside), 1 GFLOP/s, 1 GB/s, sharing 1.5x with 2 busy processes,
    all-reduce 100 us + 1 ns/B wall and 10 us + 0.1 ns/B CPU, sends 50 us + 2 ns/B."""
    base = dict(processes=processes, cores_factor=((1, 1.0), (2, 1.5), (4, 3.0)), dispatch_s=1e-5,
                foreign_dispatch_s=2e-6, gemm_flops=1e9, elementwise_bw=1e9,
                collectives=((2, 1e-4, 1e-9), (4, 2e-4, 2e-9)), collective_cpu=((2, 1e-5, 1e-10), (4, 2e-5, 2e-10)),
                p2p=(5e-5, 2e-9), optimizer_s_per_param=1e-9)
    base.update(kw)
    return HostProfile(**base)  # type: ignore[arg-type]


def test_block_shape_flops_and_bytes_by_hand():
    # 8 tokens (2 sequences of 4), hidden 8, 1 local head of 4, MLP width 16
    shape = BlockShape(tokens=8, hidden=8, heads=1, head_dim=4, ffn=16, seq=4)
    # forward: q, k, v, projection: 4 GEMMs of 8x8x4 (2*8*8*4 each); MLP 2 of 8x8x16; scores + context 4*8*4*4
    forward = 4 * 2 * 8 * 8 * 4 + 2 * 2 * 8 * 8 * 16 + 4 * 8 * 4 * 4
    assert shape.flops == 3 * forward == 3 * 6656
    # fp32: LayerNorms 2*(read+write) 8x8, adds 2*3 8x8, GeLU 2 x 8x16, softmax 3 x (2 seqs x 1 head x 4x4)
    forward_bytes = 4 * (4 * 64 + 6 * 64 + 2 * 128 + 3 * 2 * 16)
    assert shape.nbytes == 3 * forward_bytes
    head = HeadShape(tokens=8, hidden=8, vocab=16)
    assert head.flops == 3 * 2 * 8 * 8 * 16 and head.nbytes == 9 * 4 * 8 * 16


def test_megatron_block_issues_two_all_reduces_each_way():
    assert block_collectives(None, 1) == []
    kinds = block_collectives(MEGATRON_CHOICES, 4)
    assert kinds == [("all_reduce", 1)] * 4  # proj -> add1 and fc2 -> add2, forward and backward


def test_block_collectives_follow_the_chosen_layouts():
    # a replicated fc2 reads GeLU's S(1) output whole: an all-gather forward, its reduce-scatter backward
    choices = dict(MEGATRON_CHOICES)
    choices["fc2"] = "replicate"
    got = block_collectives(tuple(choices.items()), 2)
    assert sorted(got) == sorted([("all_reduce", 1), ("all_reduce", 1), ("all_gather", 4), ("reduce_scatter", 4)])
    everything_whole = tuple((op, "replicate" if op in ("qkv", "proj", "fc1", "fc2") else "B")
                             for op, _ in MEGATRON_CHOICES)
    assert block_collectives(everything_whole, 2) == []
    with pytest.raises(PlanError, match="'diagonal'"):
        block_collectives((("x", "B"), ("ln1", "diagonal")) + MEGATRON_CHOICES[2:], 2)


def test_profile_lookups():
    host = toy()
    assert host.collective("all_reduce", 2, 1000) == pytest.approx(1e-4 + 1e-6)
    assert host.collective("all_reduce", 2, 1000, cpu=True) == pytest.approx(1e-5 + 1e-7)
    assert host.collective("send_recv", 2, 1000) == pytest.approx(5e-5 + 2e-6)
    assert host.collective("all_reduce", 1, 1000) == 0.0
    assert host.factor(1) == 1.0 and host.factor(2) == 1.5 and host.factor(3) == 3.0  # the next measured count
    # a shape not in the table: FLOPs at the GEMM rate plus bytes at the elementwise rate
    assert host.kernel_seconds((0, 1), 2e9, 1e9) == pytest.approx(3.0)
    assert toy(kernels=(((0, 1), 0.25),)).kernel_seconds((0, 1), 2e9, 1e9) == 0.25
    with pytest.raises(SbpflowError, match="groups of \\[2, 4\\], not 3"):
        host.collective("all_reduce", 3, 10)
    with pytest.raises(SbpflowError, match="cores_factor"):
        toy(processes=8)
    with pytest.raises(SbpflowError, match="dispatch_s"):
        toy(dispatch_s=0.0)


def test_fit_line_recovers_a_and_b():
    times = {n: 3e-4 + n * 2e-9 for n in (4, 1 << 16, 1 << 20)}
    a, b = fit_line(times)
    assert a == pytest.approx(3e-4, rel=1e-6) and b == pytest.approx(2e-9, rel=1e-6)


def test_data_parallel_step_by_hand():
    # 2 processes, dp2: both run at once (sharing 1.5x); the loss's token count and one gradient bucket
    block, head = BlockShape(8, 8, 2, 4, 32, 4), HeadShape(8, 8, 16)
    host = toy(kernels=((block.key, 1e-3), (head.key, 5e-4)))
    got = predict_host(TINY, ParallelPlan(1, 1, 2, 2, 0, "none"), (2,), 4, host)
    params = 2 * (12 * 64 + 13 * 8) + 16 * 8 + 4 * 8 + 2 * 8  # blocks, token and position embeddings, ln_f
    dispatch = (2 * DISPATCH_PER_BLOCK + DISPATCH_FIXED) * 1e-5
    cpu = dispatch + 2 * 1e-3 + 5e-4 + params * 1e-9
    # the loss's token count (8 B) and value (4 B); one bucket of fp32 gradients
    comm = (1e-4 + 8 * 1e-9) + (1e-4 + 4 * 1e-9) + (1e-4 + 4 * params * 1e-9)
    assert got.step_time == pytest.approx(1.5 * cpu + comm)
    assert got.breakdown["sharing"] == pytest.approx(0.5 * cpu)
    # each blocking collective (the loss's two) also waits sync_s
    waiting = toy(kernels=host.kernels, sync_s=1e-3)
    assert predict_host(TINY, ParallelPlan(1, 1, 2, 2, 0, "none"), (2,), 4, waiting).step_time == pytest.approx(
        1.5 * cpu + comm + 2 * 1e-3)
    assert got.breakdown["dispatch"] == pytest.approx(dispatch)
    assert got.collectives == 3
    assert got.cpu_per_rank[0] == pytest.approx(cpu + 3e-5 + 1e-10 * (8 + 4 + 4 * params))


def test_pipeline_step_by_hand():
    # 2 processes, pp2: the stages run one after another, each alone (sharing 1.0); sends counted once
    block, head = BlockShape(16, 8, 2, 4, 32, 4), HeadShape(16, 8, 16)
    host = toy(kernels=((block.key, 1e-3), (head.key, 5e-4)))
    got = predict_host(TINY, ParallelPlan(1, 2, 1, 4, 0, "none"), (1, 1), 4, host)
    params0 = 12 * 64 + 13 * 8 + 16 * 8 + 4 * 8
    params1 = 12 * 64 + 13 * 8 + 2 * 8 + 16 * 8
    own0, own1 = DISPATCH_PER_BLOCK + 8, DISPATCH_PER_BLOCK + DISPATCH_FIXED - 8
    stage0 = own0 * 1e-5 + 1e-3 + params0 * 1e-9
    stage1 = own1 * 1e-5 + 1e-3 + 5e-4 + params1 * 1e-9
    # the activation and its gradient, the tied embedding and its gradient, the loss's value to every process
    sends = 2 * (5e-5 + 2e-9 * 4 * 16 * 8) + 2 * (5e-5 + 2e-9 * 4 * 16 * 8) + (5e-5 + 2e-9 * 4)
    assert got.step_time == pytest.approx(stage0 + stage1 + sends)
    assert got.breakdown["pp_comm"] == pytest.approx(sends)
    # each of the 5 transfers (activation, tied embedding, their gradients, the loss) is received after compute
    waiting = toy(kernels=host.kernels, sync_s=1e-3)
    assert predict_host(TINY, ParallelPlan(1, 2, 1, 4, 0, "none"), (1, 1), 4, waiting).step_time == pytest.approx(
        stage0 + stage1 + sends + 5e-3)
    # the ops of the other stage are dispatched too, at the outsider's floor
    assert stage_work(TINY, ParallelPlan(1, 2, 1, 4, 0, "none"), (1, 1), 0, 4).dispatch_foreign == own1


def test_tensor_parallel_collectives_counted():
    # tp2 on 2 processes: per block Megatron's 4 all-reduces, the embedding's and the head's, 3 for the loss
    # (max, sum, gradient) and 1 to read its value
    work = stage_work(TINY, ParallelPlan(2, 1, 1, 4, 0, "none"), (2,), 0, 4)
    assert sum(c.count for c in work.comms) == 2 * 4 + 2 + 3 + 1
    tokens = 4 * 4
    assert {c.nbytes for c in work.comms if c.part == "tp_comm"} == {4 * tokens * 8}


def test_host_search_covers_every_plan_and_cut():
    plans = host_plans(TINY, 4, 8)
    # tp 1 or 2 (heads 2); pp 1 or 2 (2 layers, one cut each); dp the rest
    assert sorted((p.tp, p.pp, p.dp, c) for p, c in plans) == [
        (1, 1, 4, (2,)), (1, 2, 2, (1, 1)), (2, 1, 2, (2,)), (2, 2, 1, (1, 1))]
    host = toy(processes=4)
    ranked = host_search(TINY, host, 8)
    assert [p.step_time for p in ranked] == sorted(p.step_time for p in ranked) and len(ranked) == 4
    with pytest.raises(PlanError, match="processes"):
        predict_host(TINY, ParallelPlan(1, 1, 2, 4, 0, "none"), (2,), 8, host)
    # three calibrations: each plan ranks by its median prediction, so one odd snapshot does not decide
    slow = toy(processes=4, cores_factor=((1, 1.0), (2, 1.5), (4, 30.0)))
    median = host_search(TINY, [host, slow, host], 8)
    assert [(p.plan, p.step_time) for p in median] == [(p.plan, p.step_time) for p in ranked]
    assert host_search(TINY, [slow], 8)[0].plan.pp == 2  # alone, the odd one would pick pipeline stages
    with pytest.raises(PlanError, match="one process count"):
        host_search(TINY, [host, toy()], 8)
