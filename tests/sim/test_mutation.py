"""The mutation check in the test run: flipping any partial rule of an op must fail one of its numeric checks.

A representative subset of ops runs by default (seconds each); the whole sweep is ``-m slow``.
``PYTHONPATH=src python -m tests.mutation_report`` reruns it and rewrites ``docs/testing.md``.
"""

from __future__ import annotations

import pytest

from mutation import TRUE_PROPERTIES, Flip, by_op, flipped, flips, judge, outcomes, sweep
from opcases import BY_ID, CASES, sig_text
from partial_checks import declared
from sbpflow.ops import dispatch

SUBSET = ["neg", "abs", "relu", "mul", "sum", "amax", "matmul", "slice"]
GROUPS = by_op(CASES)


@pytest.mark.parametrize("op", SUBSET)
def test_every_flip_is_caught(op: str, one_torch_thread: None) -> None:
    cases = GROUPS[op]
    baselines = {c.id: outcomes(c) for c in cases}
    assert not any(any(b.values()) for b in baselines.values()), f"{op} must pass unflipped: {baselines}"
    missed = [str(v.flip) for v in (judge(f, cases, baselines) for f in flips(op, cases)) if not v.caught]
    assert not missed, f"{op}: flips no numeric check catches: {missed}"


def test_a_flip_is_undone() -> None:
    case = BY_ID["relu"]
    before, cache = declared(case), dispatch._global_cache
    drop = Flip("relu", before[0], adds=False)
    with flipped(drop):
        assert drop.sig not in declared(case)
        assert dispatch._global_cache is not cache
    assert declared(case) == before and dispatch._global_cache is cache


@pytest.mark.slow
def test_the_whole_sweep_catches_every_lie(one_torch_thread: None) -> None:
    """Every flip is caught, but those adding a reviewed true property or masked by a known-wrong rule."""
    missed = [f"{v.flip.op}: {v.flip}" for v in sweep(CASES)
              if not v.caught and not v.known_wrong and (v.flip.op, sig_text(v.flip.sig)) not in TRUE_PROPERTIES]
    assert not missed, f"flips no numeric check catches: {missed}"
