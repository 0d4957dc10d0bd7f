"""A first tier-2 case: matmul signatures and their collectives (more in the op suites)."""

from __future__ import annotations

import pytest

from harness import PLACEMENTS, PSUM, B, check, randn
from sbpflow import sbp as S


@pytest.mark.parametrize("pname", ["1", "2", "3", "2x2"])
def test_matmul_row_split_needs_no_comm(pname: str) -> None:
    p = PLACEMENTS[pname]
    sbps = [(S.split(0),) * p.ndim, (B,) * p.ndim]
    r = check(lambda a, b: a @ b, lambda a, b: a @ b, [randn(7, 5), randn(5, 3, seed=1)], p, sbps)
    assert r.forward_log.counts() == {}
    assert r.out.sbp == (S.split(0),) * p.ndim


def test_matmul_contraction_split_gives_partial_sum() -> None:
    p = PLACEMENTS["2"]
    r = check(lambda a, b: a @ b, lambda a, b: a @ b, [randn(4, 6), randn(6, 3, seed=1)], p, [S.split(1), S.split(0)])
    assert r.out.sbp == (PSUM,)
    assert r.forward_log.counts() == {}
