"""Context parallelism on 4 gloo processes: GPT (eager) and Llama (nn.Graph) under dp2 x cp2 train as on one
device, the sequence split plainly (S(1)) or zigzag (Z(1)), the ring's K/V blocks moving between processes by
send/recv posted before each step's math."""

from __future__ import annotations

from typing import Any

import numpy as np
from procrun import run_ranks

from cp_train import train
from sbpflow.sbp import split, zigzag

TIMEOUT = 240.0
MESH = [[0, 1], [2, 3]]  # (data, cp)


def dp2_cp2_job() -> dict[str, Any]:
    """Runs on each process: three AdamW steps of each model; the losses and parameters, and the step's comms."""
    out = {}
    for kind, graph in (("gpt", False), ("llama", True)):
        for sequence in (split(1), zigzag(1)):  # eager's SBPs: the ring
            losses, params, log = train(kind, MESH, graph=graph, selection="greedy", sequence=sequence)
            out[kind, str(sequence)] = (losses, params, log.counts())
    return out


def test_dp2_cp2_on_four_processes_matches_one_device() -> None:
    results = run_ranks(dp2_cp2_job, 4, timeout=TIMEOUT)
    for kind in ("gpt", "llama"):
        ref_losses, ref_params, _ = train(kind, None)
        for got, sequence in ((got, sequence) for got in results for sequence in ("S(1)", "Z(1)")):
            losses, params, counts = got[kind, sequence]
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
            for name, value in ref_params.items():
                np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1.5e-3, err_msg=name)
            assert counts["send_recv"] == 8  # two layers: one ring message forward, three backward
