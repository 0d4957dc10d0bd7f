"""ZeRO stages 1-3 on 2 real processes (gloo): the same training as on virtual ranks, and as plain data parallel.

One job trains the GPT of tests/sim/test_zero.py under plain dp=2 and each ZeRO stage, one process per rank;
stage 3's gathers, frees and re-gathers then run over gloo. Results must equal the virtual-rank run of the same
job (rtol 1e-5) and plain data parallel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from harness import MeanSquareStep
from sbpflow import optim
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
STEPS = 3
ATOL = 1e-5 * STEPS  # the key bias's zero true gradient: see tests/sim/test_zero.py
TIMEOUT = 150.0


def zero_job() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        sbpflow.manual_seed(0)
        trainer = build(CONFIG, "dp=2", seed=0)
        if stage:
            optim.zero(trainer.optimizer, stage, model=trainer.model)
        losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, STEPS, 8, 16,
                                                                                  seed=1)]
        out[stage] = (losses, parameter_values(trainer), optim.memory_per_rank(trainer.optimizer))
    return out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_zero_stages_on_two_processes_equal_virtual_ranks_and_plain_dp() -> None:
    per_rank = run_ranks(zero_job, 2, timeout=TIMEOUT)
    simulated = zero_job()
    for rank_result in per_rank:
        for stage in (0, 1, 2, 3):
            losses, params, memory = rank_result[stage]
            want_losses, want_params, want_memory = simulated[stage]
            np.testing.assert_allclose(losses, want_losses, rtol=1e-5, err_msg=f"stage {stage}")
            np.testing.assert_allclose(losses, simulated[0][0], rtol=1e-5, err_msg=f"stage {stage} vs plain")
            for name, value in want_params.items():
                np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=ATOL, err_msg=f"{stage} {name}")
            assert memory == want_memory  # each process holds exactly virtual rank 0's or 1's bytes (even here)
    assert sum(per_rank[0][3][2].values()) < sum(per_rank[0][0][2].values()) / 1.9


def graph_zero3_job(prefetch: int | None) -> dict[str, Any]:
    """Four equal Linear layers, dp=2, a compiled step: plain (prefetch None) or ZeRO-3 with that window."""
    from sbpflow.optim.zero import GATHERED

    torch.set_num_threads(1)
    p2 = sbpflow.placement("cpu", [0, 1])
    sbpflow.manual_seed(0)
    model = sbpflow.nn.Sequential(*[sbpflow.nn.Linear(16, 16) for _ in range(4)]).to_global(p2, sbpflow.sbp.broadcast)
    step = MeanSquareStep(model, optim.Adam(model.parameters(), lr=0.01))
    if prefetch is not None:
        step.config.enable_zero(3, prefetch=prefetch, min_shard_numel=1)
    sbpflow.manual_seed(1)
    losses = [float(step(sbpflow.randn(8, 16, placement=p2, sbp=sbpflow.sbp.split(0))).numpy()) for _ in range(3)]
    peak = step._compiled().executor.stats.watch_peak.get(GATHERED, {}) if prefetch is not None else {}
    return {"losses": losses, "params": [p.numpy() for p in model.parameters()], "peak": peak}


def test_graph_zero3_prefetch_window_on_two_processes() -> None:
    """The compiled ZeRO-3 step with prefetch=1 over gloo: plain-DP numbers, and each process's runtime count
    of gathered parameter bytes stays within two layers (its rank's whole weights and biases)."""
    plain = graph_zero3_job(None)
    per_rank = run_ranks(graph_zero3_job, 2, args=(1,), timeout=TIMEOUT)
    layer_bytes = 4 * (16 * 16 + 16)
    for rank, got in enumerate(per_rank):
        np.testing.assert_allclose(got["losses"], plain["losses"], rtol=1e-5)
        for p, q in zip(got["params"], plain["params"], strict=True):
            np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-7)
        assert list(got["peak"]) == [rank] and 0 < got["peak"][rank] <= 2 * layer_bytes


def graph_zero1_job(buckets: bool) -> dict[str, Any]:
    """The GPT's compiled dp=2 step with ZeRO-1, its updated slices gathered in buckets or one by one."""
    torch.set_num_threads(1)
    sbpflow.manual_seed(0)
    trainer = build(CONFIG, "dp=2", seed=0, graph=True)
    trainer.graph.config.enable_zero(1)
    trainer.graph.config.gather_buckets = buckets
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, STEPS, 8, 16, seed=1)]
    gathers = [n for n in trainer.graph.plan.collectives(sbpflow.distributed.rank())
               if n.boxing.steps[0].kind == "all_gather" and n.phase == "post"]
    return {"losses": losses, "params": parameter_values(trainer), "gathers": len(gathers)}


def test_graph_zero1_gather_buckets_on_two_processes() -> None:
    """Over gloo, the bucketed all-gather of ZeRO-1's updated slices (one collective) trains to the numbers of
    the one-by-one gathers."""
    bucketed = run_ranks(graph_zero1_job, 2, args=(True,), timeout=TIMEOUT)
    alone = run_ranks(graph_zero1_job, 2, args=(False,), timeout=TIMEOUT)
    for got, want in zip(bucketed, alone, strict=True):
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
        for name, value in want["params"].items():
            np.testing.assert_allclose(got["params"][name], value, rtol=1e-6, atol=1e-7, err_msg=name)
        assert got["gathers"] == 1 < want["gathers"]
