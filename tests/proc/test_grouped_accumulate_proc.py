"""Grouped accumulation (graph.group) on 2 gloo processes: pipelines (1F1B, zero bubble, with fused segments) and a
data-parallel step train bitwise as with one accumulate node per gradient on the same processes, with the same peak
bytes, each process acting fewer accumulate steps; and as on virtual ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=32, dropout=0.0)
STEPS = 2
RTOL, ATOL = 1e-5, 4e-5  # gloo sums in its own order (see tests/proc/test_graph_proc.py)
CASES = [("pp=2", 4, "1f1b", False), ("pp=2", 8, "zero_bubble", False), ("pp=2", 4, "1f1b", True),
         ("dp=2", 4, "1f1b", False)]


def train(case: tuple[str, int, str, bool], group: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    spec, m, schedule, fused = case
    trainer = build(CONFIG, spec, graph=True, micro_batches=m, schedule=schedule)
    trainer.graph.config.group_accumulates = group
    trainer.graph.config.enable_fused_segments(fused)
    losses = [trainer.step(ids, targets)
              for ids, targets in random_batches(CONFIG.vocab_size, STEPS, 16, CONFIG.block_size, seed=1)]
    executor = trainer.graph._compiled().executor
    acc_steps = sum(a.steps for a in executor.board.actors if a.node.kind == "accumulate")
    return {"losses": losses, "params": parameter_values(trainer), "peak": dict(executor.stats.peak_bytes),
            "acc_steps": acc_steps}


def job() -> dict[str, Any]:
    return {"rank": sbpflow.rank(),
            "runs": {case: {group: train(case, group) for group in (False, True)} for case in CASES}}


@pytest.mark.usefixtures("one_torch_thread")
def test_groups_on_two_processes_train_bitwise_as_single_accumulates() -> None:
    per_rank = run_ranks(job, 2, timeout=300)
    for case in CASES:
        want = train(case, True)  # virtual ranks
        for out in per_rank:
            single, grouped = out["runs"][case][False], out["runs"][case][True]
            where = f"{case} rank {out['rank']}"
            assert grouped["losses"] == single["losses"], where
            for name, value in single["params"].items():
                np.testing.assert_array_equal(grouped["params"][name], value, err_msg=f"{name} {where}")
                np.testing.assert_allclose(value, want["params"][name], rtol=RTOL, atol=ATOL, err_msg=where)
            np.testing.assert_allclose(grouped["losses"], want["losses"], rtol=RTOL, err_msg=where)
            assert grouped["peak"] == single["peak"], where
            assert grouped["acc_steps"] < single["acc_steps"], where
