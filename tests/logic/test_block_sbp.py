"""SBPs inside a block by ILP (HiGHS) against enumerating every assignment; Megatron's pattern rediscovered."""

from __future__ import annotations

import pytest

from sbpflow.autoparallel import PROFILES, TransformerSpec
from sbpflow.autoparallel.block_sbp import enumerate_block, megatron, solve_block
from sbpflow.errors import PlanError

A100 = PROFILES["a100-80gb"]
SMALL = TransformerSpec(layers=2, hidden=256, heads=4, seq=64, vocab=512)


@pytest.mark.parametrize("limit", [None, 5e6])
def test_ilp_equals_enumeration_of_every_assignment(limit):
    ilp = solve_block(SMALL, 2, 4, A100, memory_limit=limit)
    every = enumerate_block(SMALL, 2, 4, A100, memory_limit=limit)
    assert ilp.seconds == pytest.approx(every.seconds, rel=1e-6)
    if limit is not None:
        assert ilp.memory <= limit and every.memory <= limit


def test_memory_limit_forces_sharded_weights():
    roomy = solve_block(SMALL, 2, 4, A100)
    tight = solve_block(SMALL, 2, 4, A100, memory_limit=4e6)
    assert roomy.comm_seconds == 0 and not megatron(roomy)  # small layers: replicate, no communication
    assert megatron(tight) and tight.memory <= 4e6 and tight.seconds > roomy.seconds
    with pytest.raises(PlanError, match="fits"):
        solve_block(SMALL, 2, 4, A100, memory_limit=1e5)


def test_gpt3_block_on_eight_gpus_is_megatron():
    """One block stands for all 96: the choice is Megatron-LM's column/row pairing (with LayerNorm and the
    residual stream split over tokens, i.e. sequence parallelism), found in well under a second."""
    plan = solve_block(TransformerSpec(96, 12288, 96, 2048, 51200), 1, 8, A100)
    assert megatron(plan) and plan.comm_seconds > 0
    assert plan.solve_s < 5
