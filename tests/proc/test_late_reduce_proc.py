"""Reduce after accumulating (graph.late_reduce) on 2 gloo processes: dp2 with 4 micro-batches sends each gradient
bucket once a step instead of once per micro-batch, and trains as the per-micro-batch plan does on the same
processes and as on virtual ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from sbpflow.comm import record
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
M = 4
RTOL, ATOL = 1e-5, 4e-5  # gloo sums in its own order (see tests/proc/test_graph_proc.py)
SPEC = "dp=2"


def train(spec: str, late: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    trainer = build(CONFIG, spec, graph=True, micro_batches=M)
    trainer.graph.config.reduce_after_accumulating = late
    batches = list(random_batches(CONFIG.vocab_size, 3, 8, CONFIG.block_size, seed=2))
    losses = [trainer.step(ids, targets) for ids, targets in batches[:2]]
    with record() as log:
        losses.append(trainer.step(*batches[2]))
    return {"losses": losses, "params": parameter_values(trainer),
            "all_reduce": log.counts().get("all_reduce", 0)}


def job() -> dict[str, Any]:
    return {"rank": sbpflow.rank(), "runs": {late: train(SPEC, late) for late in (False, True)}}


@pytest.mark.usefixtures("one_torch_thread")
def test_late_reduces_on_two_processes_send_less_and_train_alike() -> None:
    per_rank = run_ranks(job, 2, timeout=300)
    want = train(SPEC, True)  # virtual ranks
    for out in per_rank:
        early, late = out["runs"][False], out["runs"][True]
        where = f"rank {out['rank']}"
        # one bucket of gradients and the loss: the bucket went out M times a step before, once now
        assert early["all_reduce"] - late["all_reduce"] == M - 1, where
        np.testing.assert_allclose(late["losses"], early["losses"], rtol=RTOL, err_msg=where)
        np.testing.assert_allclose(late["losses"], want["losses"], rtol=RTOL, err_msg=where)
        for name, value in late["params"].items():
            np.testing.assert_allclose(value, early["params"][name], rtol=RTOL, atol=ATOL, err_msg=f"{name} {where}")
            np.testing.assert_allclose(value, want["params"][name], rtol=RTOL, atol=ATOL, err_msg=f"{name} {where}")
