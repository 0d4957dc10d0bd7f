"""nn.Graph's guards on 4 gloo processes: the run of tests/guards.py (a frozen weight, replaced parameters,
eval(), a new hyperparameter, loaded optimizer state, a replaced buffer, then train() and unfreezing) compiles
again on every process at each change and gives one device's eager numbers after every step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from procrun import run_ranks

import sbpflow
from guards import CHANGES, assert_same_run, changing_run

TIMEOUT = 240.0
RTOL, ATOL = 1e-5, 1e-6


def guards_job() -> dict[str, Any]:
    torch.set_num_threads(1)
    return changing_run(sbpflow.placement("cpu", [0, 1, 2, 3]), graph=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_changes_between_compiled_steps_on_four_processes() -> None:
    reference = changing_run(sbpflow.placement("cpu", [0]), graph=False)
    for rank, ours in enumerate(run_ranks(guards_job, 4, timeout=TIMEOUT)):
        assert_same_run(ours, reference, rtol=RTOL, atol=ATOL)
        recompiled = [name for (name, _), said in zip(CHANGES, ours["warnings"], strict=True) if said]
        assert recompiled == [name for name, _ in CHANGES[1:]], (rank, recompiled)  # each change, on every process
        assert ours["plans"][-1] == len(CHANGES), rank
