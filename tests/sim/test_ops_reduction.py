"""Reductions against torch: sum, mean, amax, amin, max/min (values and indices), var, std.

Reducing a split dim gives the matching partial (sum/mean -> P(sum), amax -> P(max), amin -> P(min))
without communication; mean, var and std stay exact on uneven shards.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sbpflow
import sbpflow.ops.functional as F
from harness import PLACEMENTS, PSUM, B, check, global_tensor, randn, random_sbp
from sbpflow import sbp as S
from sbpflow.comm import record

PNAMES = ["1", "2", "3", "2x2"]

REDUCTIONS = {
    "sum": (lambda x, **kw: x.sum(**kw), lambda x, **kw: x.sum(**kw)),
    "mean": (lambda x, **kw: x.mean(**kw), lambda x, **kw: x.mean(**kw)),
    "amax": (lambda x, **kw: x.amax(**kw), lambda x, **kw: x.amax(**kw)),
    "amin": (lambda x, **kw: x.amin(**kw), lambda x, **kw: x.amin(**kw)),
    "var": (lambda x, **kw: x.var(**kw), lambda x, **kw: x.var(**kw)),
    "std": (lambda x, **kw: x.std(**kw), lambda x, **kw: x.std(**kw)),
    "var_biased": (lambda x, **kw: F.var(x, correction=0, **kw), lambda x, **kw: torch.var(x, correction=0, **kw)),
}
PARTIAL_OF = {"sum": PSUM, "mean": PSUM, "amax": S.partial_max, "amin": S.partial_min}


@st.composite
def _case(draw):  # type: ignore[no-untyped-def]
    name = draw(st.sampled_from(sorted(REDUCTIONS)))
    shape = draw(st.sampled_from([(7,), (5, 3), (3, 7), (2, 5, 3)]))
    ndim = len(shape)
    dim = draw(st.one_of(st.none(), st.integers(-ndim, ndim - 1),
                         st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True).map(tuple)))
    keepdim = draw(st.booleans())
    return name, shape, dim, keepdim, draw(st.sampled_from(PNAMES)), draw(st.integers(0, 10_000))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(_case())
def test_reductions_match_torch_on_any_sbp(case) -> None:  # type: ignore[no-untyped-def]
    name, shape, dim, keepdim, pname, seed = case
    ours, theirs = REDUCTIONS[name]
    kw = {"keepdim": keepdim} if dim is None and name in ("amax", "amin") else {"dim": dim, "keepdim": keepdim}
    if dim is None and name not in ("amax", "amin"):
        kw = {} if not keepdim else {"dim": tuple(range(len(shape))), "keepdim": True}
    p = PLACEMENTS[pname]
    x = randn(*shape, seed=seed)
    if name in ("amax", "amin"):
        x = x.round(decimals=1)  # ties: the gradient is shared between equal values, as in torch
    check(lambda t: ours(t, **kw), lambda t: theirs(t, **kw), [x], p, [random_sbp(shape, p, random.Random(seed))])


@pytest.mark.parametrize("name", sorted(PARTIAL_OF))
@pytest.mark.parametrize("pname", ["2", "3"])
def test_reducing_a_split_dim_gives_the_matching_partial(name: str, pname: str) -> None:
    p = PLACEMENTS[pname]
    ours, theirs = REDUCTIONS[name]
    r = check(lambda t: ours(t, dim=1), lambda t: theirs(t, dim=1), [randn(4, 7)], p, [S.split(1)])
    assert r.out.sbp == (PARTIAL_OF[name],)
    assert r.forward_log.counts() == {}
    r = check(lambda t: ours(t, dim=1), lambda t: theirs(t, dim=1), [randn(4, 7)], p, [S.split(0)])
    assert r.out.sbp == (S.split(0),) and r.forward_log.counts() == {}


def test_keepdim_maps_split_dims_of_the_output() -> None:
    p = PLACEMENTS["2x2"]
    x = sbpflow.tensor(randn(3, 5, 4), placement=p, sbp=(S.split(2), S.split(0)))
    with record() as log:
        kept = x.sum(dim=1, keepdim=True)
        dropped = x.sum(dim=1)
    assert kept.sbp == (S.split(2), S.split(0)) and dropped.sbp == (S.split(1), S.split(0))
    assert log.counts() == {}


def test_partial_sum_input_sums_without_comm_and_partial_max_amax() -> None:
    p = PLACEMENTS["3"]
    a = randn(4, 5)
    x = global_tensor(a, p, PSUM)
    m = F.amax(sbpflow.tensor(a, placement=p, sbp=S.split(1)), dim=1)  # P(max)
    with record() as log:
        s = x.sum(dim=0)
        mm = m.amax()
    assert s.sbp == (PSUM,) and mm.sbp == (S.partial_max,) and log.counts() == {}
    np.testing.assert_allclose(s.numpy(), a.sum(0).numpy(), rtol=1e-5)
    np.testing.assert_allclose(mm.numpy(), a.max().numpy(), rtol=1e-6)


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("n", [5, 7])
def test_mean_var_std_exact_on_uneven_shards(pname: str, n: int) -> None:
    p = PLACEMENTS[pname]
    sbp = (S.split(0),) * p.ndim
    for fn in (lambda t: t.mean(), lambda t: t.var(dim=0), lambda t: t.std(dim=0, keepdim=True),
               lambda t: t.var(unbiased=False)):
        check(fn, fn, [randn(n, 3) * 3 + 1], p, [sbp])


def test_sum_dtype_and_integer_sum() -> None:
    p = PLACEMENTS["3"]
    a = torch.arange(10).reshape(5, 2)
    x = sbpflow.tensor(a, placement=p, sbp=S.split(0))
    assert x.sum().dtype == torch.int64 and x.sum().item() == 45
    y = sbpflow.tensor(a.float(), placement=p, sbp=S.split(0))
    assert F.sum(y, dtype=torch.float64).dtype == torch.float64


def test_amax_of_an_empty_shard_uses_the_identity() -> None:
    p = PLACEMENTS["3"]
    a = -torch.rand(2, 3) - 1  # all negative: an empty shard holding 0 would win the max
    x = sbpflow.tensor(a, placement=p, sbp=S.split(0))  # rank 2 holds no rows
    np.testing.assert_allclose(x.amax(dim=0).numpy(), a.amax(0).numpy())
    np.testing.assert_allclose(x.amin(dim=0).numpy(), a.amin(0).numpy())


# -- max / min with torch semantics --------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("which", ["max", "min"])
@pytest.mark.parametrize("dim,keepdim", [(0, False), (1, True), (-1, False)])
def test_max_min_over_a_dim_return_values_and_indices(pname: str, which: str, dim: int, keepdim: bool) -> None:
    p = PLACEMENTS[pname]
    rng = random.Random(dim * 7 + keepdim)
    shape = (5, 7)
    r = check(lambda t: getattr(t, which)(dim=dim, keepdim=keepdim),
              lambda t: getattr(torch, which)(t, dim=dim, keepdim=keepdim),
              [randn(*shape, seed=3)], p, [random_sbp(shape, p, rng)])
    values, indices = r.out
    assert r.out.values is values and r.out.indices is indices
    assert indices.dtype == torch.int64


@pytest.mark.parametrize("which", ["max", "min"])
def test_max_over_a_split_dim_gathers_it_and_keeps_other_splits(which: str) -> None:
    p = PLACEMENTS["2x2"]
    a = randn(6, 5, seed=4)
    x = sbpflow.tensor(a, placement=p, sbp=(S.split(0), S.split(1)))
    with record() as log:
        values, indices = getattr(F, which)(x, dim=1)
    # only mesh axis 1 splits the reduced dim: it is gathered (or moved onto dim 0 by an all-to-all)
    assert set(log.counts()) <= {"all_gather", "all_to_all"} and "all_reduce" not in log.counts()
    assert values.sbp[0] == S.split(0) and values.sbp == indices.sbp
    ref = getattr(torch, which)(a, dim=1)
    np.testing.assert_array_equal(indices.numpy(), ref.indices.numpy())
    np.testing.assert_allclose(values.numpy(), ref.values.numpy())


def test_max_min_without_dim_and_with_a_tensor() -> None:
    p = PLACEMENTS["3"]
    a, b = randn(4, 5), randn(4, 5, seed=1)
    check(lambda t: t.max(), lambda t: t.max(), [a], p, [S.split(1)])
    check(lambda t: F.min(t), lambda t: torch.min(t), [a], p, [S.split(0)])
    check(lambda t, u: F.max(t, u), torch.max, [a, b], p, [S.split(0), B])
    check(lambda t: t.max(dim=0).values, lambda t: t.max(dim=0).values, [a], None)


def test_max_over_an_empty_dim_raises() -> None:
    x = sbpflow.tensor(torch.zeros(3, 0))
    with pytest.raises(sbpflow.ShapeError, match=r"max_dim.*non-empty"):
        x.max(dim=1)
