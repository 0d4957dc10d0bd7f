"""Fused segments on real processes (gloo): a data-parallel GPT step whose segments read gradient all-reduces
issued in flight (their readers wait inside the fused node's act), and a 1F1B pipeline whose segments read
activations received in flight, train as on virtual ranks, and as the unfused plan on the same processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.graph.fuse import FUSED
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
STEPS = 3
RTOL, ATOL = 1e-5, 4e-5  # gloo sums in its own order (see tests/proc/test_graph_proc.py)


def train(fused: bool, spec: str = "dp=2") -> tuple[list[float], dict[str, np.ndarray], int]:
    torch.set_num_threads(1)
    trainer = build(CONFIG, spec, graph=True, micro_batches=2)
    trainer.graph.config.enable_fused_segments(fused)
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, STEPS, 8, 16, seed=1)]
    return losses, parameter_values(trainer), sum(n.op == FUSED for n in trainer.graph.plan.nodes)


def job(spec: str) -> dict[str, Any]:
    return {"rank": sbpflow.rank(), "fused": train(True, spec), "plain": train(False, spec)}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("spec", ["dp=2", "pp=2"])
def test_fused_segments_on_two_processes_train_as_on_virtual_ranks(spec: str) -> None:
    per_rank = run_ranks(job, 2, args=(spec,), timeout=180)
    losses, params, segments = train(True, spec)
    assert segments > 0
    for out in per_rank:
        got_losses, got_params, got_segments = out["fused"]
        assert got_segments == segments
        assert got_losses == out["plain"][0]  # fused or not, the same kernels on the same process
        np.testing.assert_allclose(got_losses, losses, rtol=RTOL, err_msg=f"rank {out['rank']}")
        for name, value in params.items():
            np.testing.assert_array_equal(got_params[name], out["plain"][1][name], err_msg=name)
            np.testing.assert_allclose(got_params[name], value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} rank {out['rank']}")
