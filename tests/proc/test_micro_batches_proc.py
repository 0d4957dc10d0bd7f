"""Micro-batches on 4 gloo processes: the residual MLP of tests/micro_programs.py, which moves its input, ids and
labels to the second stage with ``to_global``, equals plain torch's full-batch step on every process (outputs and
parameters after 2 SGD steps), for mean and sum losses (a mean over unevenly padded targets too), on pp2
(processes 2 and 3 idle) and pp2 x dp2, and with OneFlow's averaged accumulation."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from procrun import run_ranks

import sbpflow
from micro_programs import assert_matches, train_graph, train_torch
from sbpflow import sbp as S

# (layout, micro-batches, loss, average, labels B): the bug's two cases first (pp2 m4 at pick, pp2 x dp2 m2 at
# send/recv); the last gives the labels B beside S(0) data
CASES = [("pp2", 4, "mean", False, False), ("pp2xdp2", 2, "mean", False, False), ("pp2xdp2", 4, "sum", False, False),
         ("pp2xdp2", 4, "padded", False, False), ("pp2xdp2", 2, "mse_sum", False, False),
         ("pp2xdp2", 4, "sum", True, False), ("pp2xdp2", 2, "padded", False, True)]
RTOL, ATOL = 1e-4, 1e-5
TIMEOUT = 240.0


def job() -> dict[str, Any]:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return {"rank": sbpflow.rank(),
                "runs": {case: train_graph(*case[:3], average=case[3], label_sbp=S.broadcast if case[4] else None)
                         for case in CASES}}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_ranks(job, 4, timeout=TIMEOUT)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_process_has_the_full_batch_step(per_rank: list[dict[str, Any]]) -> None:
    for case in CASES:
        layout, m, loss, average, _ = case
        want = train_torch(loss, 1.0 / m if average and loss == "sum" else 1.0)
        for out in per_rank:
            assert_matches(out["runs"][case], want, RTOL, ATOL, what=f"{case} rank {out['rank']}")
