"""Random programs on 4 gloo processes (tests/fuzz/programs.py): every process's compiled step gives the outputs
and parameters of one rank in eager mode, for 20 fixed programs of every layout."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from fuzz.programs import draw, run_eager, run_graph

SEEDS = tuple(range(20))
TIMEOUT = 300.0


def job() -> dict[str, Any]:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return {"rank": sbpflow.rank(), "runs": {seed: run_graph(draw(random.Random(seed)), 1) for seed in SEEDS}}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_ranks(job, 4, timeout=TIMEOUT)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_process_equals_one_rank_eager(per_rank: list[dict[str, Any]]) -> None:
    assert len({draw(random.Random(s)).layout for s in SEEDS}) >= 5  # the seeds reach most layouts
    for seed in SEEDS:
        prog = draw(random.Random(seed))
        want = run_eager(prog, 1)
        for out in per_rank:
            got = out["runs"][seed]
            for step, (outs, wants) in enumerate(zip(got[0], want[0], strict=True)):
                for k, (o, w) in enumerate(zip(outs, wants, strict=True)):
                    np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-5,
                                               err_msg=f"{prog} rank {out['rank']} step {step} output {k}")
            for name in want[1]:
                np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-4, atol=1e-5,
                                           err_msg=f"{prog} rank {out['rank']} {name}")
