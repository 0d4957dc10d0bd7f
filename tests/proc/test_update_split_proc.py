"""Updates per bucket (graph.update_split) on 2 gloo processes: dp2 with every gradient sent alone (so the update is
cut into a piece per all-reduce), with 1 and 4 micro-batches, trains bitwise as the whole update does on the same
processes, and as on virtual ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from sbpflow import boxing
from sbpflow.boxing import CostModel
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
FAST = CostModel().with_link("cpu", "intra", alpha=1e-9, beta=1 / 2e9)  # every gradient alone
RTOL, ATOL = 1e-5, 4e-5  # gloo sums in its own order (see tests/proc/test_graph_proc.py)


def train(m: int, split: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    trainer = build(CONFIG, "dp=2", graph=True, micro_batches=m, clip=None)
    trainer.graph.config.update_per_bucket = split
    with boxing.cost_model(FAST):
        losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, 3, 8,
                                                                               CONFIG.block_size, seed=4)]
    plan = trainer.graph._compiled().plan
    updates = sum(n.kind == "update" and n.op == "adam_update_multi" for n in plan.nodes)
    return {"losses": losses, "params": parameter_values(trainer), "updates": updates}


def job() -> dict[str, Any]:
    return {"rank": sbpflow.rank(), "runs": {(m, split): train(m, split) for m in (1, 4) for split in (False, True)}}


@pytest.mark.usefixtures("one_torch_thread")
def test_updates_per_bucket_on_two_processes_train_alike() -> None:
    per_rank = run_ranks(job, 2, timeout=300)
    for m in (1, 4):
        want = train(m, True)  # virtual ranks
        for out in per_rank:
            whole, split = out["runs"][(m, False)], out["runs"][(m, True)]
            where = f"rank {out['rank']}, m={m}"
            assert split["updates"] > whole["updates"] == 2, where  # decay and no-decay groups, then cut
            assert split["losses"] == whole["losses"], where  # the same kernels on the same sums: bitwise
            np.testing.assert_allclose(split["losses"], want["losses"], rtol=RTOL, err_msg=where)
            for name, value in split["params"].items():
                np.testing.assert_array_equal(value, whole["params"][name], err_msg=f"{name} {where}")
                np.testing.assert_allclose(value, want["params"][name], rtol=RTOL, atol=ATOL,
                                           err_msg=f"{name} {where}")
