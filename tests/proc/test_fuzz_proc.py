"""Random programs on 4 gloo processes (tests/fuzz/programs.py): every process's compiled step gives the outputs,
parameters and optimizer state of one rank in eager mode, for 20 fixed programs of layouts of at most 4 ranks."""

from __future__ import annotations

import random
import warnings
from typing import Any

import pytest
import torch
from procrun import run_ranks

import sbpflow
from fuzz.programs import allowed, compare, draw, run_graph, run_oracle

SEEDS = tuple(range(20))
TIMEOUT = 300.0


def _programs() -> list[Any]:
    return [draw(random.Random(seed), max_ranks=4) for seed in SEEDS]


def job() -> dict[str, Any]:
    torch.set_num_threads(1)
    runs: dict[int, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed, prog in zip(SEEDS, _programs(), strict=True):
            try:
                runs[seed] = run_graph(prog, 1)
            except sbpflow.SbpflowError as error:
                if not allowed(error):
                    raise
                runs[seed] = None  # refused by every process alike (the plan is the same)
    return {"rank": sbpflow.rank(), "runs": runs}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_ranks(job, 4, timeout=TIMEOUT)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_process_equals_one_rank_eager(per_rank: list[dict[str, Any]]) -> None:
    progs = _programs()
    assert len({p.layout for p in progs}) >= 5  # the seeds reach most layouts
    for seed, prog in zip(SEEDS, progs, strict=True):
        refused = {out["runs"][seed] is None for out in per_rank}
        assert len(refused) == 1, f"{prog}: refused on some processes only"
        if refused == {True}:
            continue
        want = run_oracle(prog, 1, per_rank[0]["runs"][seed])  # under amp it follows one process's steps
        for out in per_rank:
            compare(out["runs"][seed], want, prog, where=f" rank {out['rank']} ")
