"""Random programs on virtual ranks: nn.Graph on a random layout equals one rank in eager mode (tests/fuzz/programs.py).

Hypothesis draws the seed of each program (derandomized: the CI set is fixed); ``SBPFLOW_FUZZ_N`` programs (300 by
default, ``make fuzz N=5000`` for a campaign, random seeds when ``SBPFLOW_FUZZ_RANDOM=1``).
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from .programs import BLOCKS, CHANGES, LAYOUTS, LOSSES, OPTIMIZERS, SCHEDULES, Program, check, draw, placements_of

N = int(os.environ.get("SBPFLOW_FUZZ_N", "300"))
FIXED = os.environ.get("SBPFLOW_FUZZ_RANDOM", "0") != "1"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@settings(max_examples=N, derandomize=FIXED, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_random_program_graph_equals_eager(seed: int) -> None:
    assume(seed not in OPEN)  # each open failure is a strict xfail below, until it is fixed
    check(draw(random.Random(seed)))


# Open failures of the fixed set, each a strict xfail (it turns red when fixed, and leaves OPEN then): none now.
# Seed 32410 (bf16 amp) was two bf16 trajectories parting at a ReLU, not a bug: test_regressions.py.
OPEN: dict[int, str] = {}


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=r)) for s, r in
                                  sorted(OPEN.items())])
def test_open_failures_of_the_fixed_set(seed: int) -> None:
    check(draw(random.Random(seed)))


def test_an_empty_weight_gradient_shard_on_a_2x2_mesh() -> None:
    """Found by the generator (seed 33): under ZeRO-2 on dp2 x tp2 a rank's shard of a weight gradient has no
    rows, and linear_weight_grad's reshape(-1, 0) could not tell the batch size of an empty tensor."""
    assert check(Program(width=8, classes=3, batch=8, blocks=("twice", "linear_tanh"), embedding=False,
                         loss="mse_mean", layout="dp2xtp2", micro_batches=2, weight_sbps=((0, 2), (0, 2), (0, 1)),
                         labels_on_last=True, schedule="1f1b", zero=2, fused=True, executor="inorder",
                         change="eval"))


def test_the_generator_covers_every_choice() -> None:
    """The fixed seeds reach every block, loss, layout, schedule, optimizer and model change (a generator that
    lost one tests less)."""
    progs = [draw(random.Random(seed)) for seed in range(300)]
    assert {b for p in progs for b in p.blocks} == set(BLOCKS)
    assert {p.loss for p in progs} == set(LOSSES) and {p.layout for p in progs} == set(LAYOUTS)
    assert {p.schedule for p in progs if len(LAYOUTS[p.layout]) > 1} == set(SCHEDULES)
    assert {p.optimizer for p in progs} == set(OPTIMIZERS) and {p.head for p in progs} == {"linear", "tied"}
    assert {p.change for p in progs} == set(CHANGES) and {p.zero for p in progs} == {0, 1, 2, 3}
    assert {p.micro_batches for p in progs} == {1, 2, 3, 4} and {p.executor for p in progs} == {"actors", "inorder"}
    assert any(p.amp for p in progs) and any(p.checkpoint for p in progs) and any(p.rows for p in progs)
    four = [draw(random.Random(seed), max_ranks=4) for seed in range(100)]  # the gloo tier's 4 processes
    assert all(max(placements_of(p)[-1].flat_ranks) < 4 for p in four) and len({p.layout for p in four}) >= 8
