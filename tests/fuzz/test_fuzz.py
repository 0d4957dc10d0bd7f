"""Random programs on virtual ranks: nn.Graph on a random layout equals one rank in eager mode (tests/fuzz/programs.py).

Hypothesis draws the seed of each program (derandomized: the CI set is fixed); ``SBPFLOW_FUZZ_N`` programs (300 by
default, ``make fuzz N=5000`` for a campaign, random seeds when ``SBPFLOW_FUZZ_RANDOM=1``).
"""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .programs import Program, check, draw

N = int(os.environ.get("SBPFLOW_FUZZ_N", "300"))
FIXED = os.environ.get("SBPFLOW_FUZZ_RANDOM", "0") != "1"


@settings(max_examples=N, derandomize=FIXED, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_random_program_graph_equals_eager(seed: int) -> None:
    check(draw(random.Random(seed)))


def test_an_empty_weight_gradient_shard_on_a_2x2_mesh() -> None:
    """Found by the generator (seed 33): under ZeRO-2 on dp2 x tp2 a rank's shard of a weight gradient has no
    rows, and linear_weight_grad's reshape(-1, 0) could not tell the batch size of an empty tensor."""
    check(Program(width=8, classes=3, batch=8, blocks=("twice", "linear_tanh"), embedding=False, loss="mse_mean",
                  layout="dp2xtp2", micro_batches=2, weight_sbps=(2, 2, 1), labels_on_last=True, schedule="1f1b",
                  zero=2, fused=True, executor="inorder", change="eval"))


def test_the_generator_covers_every_choice() -> None:
    """The fixed seeds reach every block, loss, layout and model change (a generator that lost one tests less)."""
    progs = [draw(random.Random(seed)) for seed in range(300)]
    assert {b for p in progs for b in p.blocks} == {"linear_relu", "linear_tanh", "residual", "norm", "branch",
                                                      "twice", "gelu"}
    assert {p.loss for p in progs} == {"ce_mean", "ce_sum", "mse_mean", "mse_sum"}
    assert {p.layout for p in progs} == {"one", "dp2", "dp4", "tp2", "dp2xtp2", "pp2", "pp2xdp2"}
    assert {p.change for p in progs} == {"none", "freeze", "eval"} and {p.zero for p in progs} == {0, 1, 2, 3}
    assert {p.micro_batches for p in progs} == {1, 2, 4} and {p.executor for p in progs} == {"actors", "inorder"}
