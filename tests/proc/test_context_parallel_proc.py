"""Context parallelism on 4 gloo processes: GPT (eager) and Llama (nn.Graph) under dp2 x cp2 train as on one
device, the ring's K/V blocks moving between processes by send/recv."""

from __future__ import annotations

from typing import Any

import numpy as np
from procrun import run_ranks

from cp_train import train

TIMEOUT = 240.0
MESH = [[0, 1], [2, 3]]  # (data, cp)


def dp2_cp2_job() -> dict[str, Any]:
    """Runs on each process: three AdamW steps of each model; the losses and parameters, and the step's comms."""
    out = {}
    for kind, graph in (("gpt", False), ("llama", True)):
        losses, params, log = train(kind, MESH, graph=graph, selection="greedy")  # eager's SBPs: the ring
        out[kind] = (losses, params, log.counts())
    return out


def test_dp2_cp2_on_four_processes_matches_one_device() -> None:
    results = run_ranks(dp2_cp2_job, 4, timeout=TIMEOUT)
    for kind in ("gpt", "llama"):
        ref_losses, ref_params, _ = train(kind, None)
        for got in results:
            losses, params, counts = got[kind]
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
            for name, value in ref_params.items():
                np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1.5e-3, err_msg=name)
            assert counts["send_recv"] == 6  # two layers: one ring pass forward, two backward
