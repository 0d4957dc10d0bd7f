"""Shape ops against torch: reshape/view/flatten/unflatten, transpose/permute, expand, squeeze/unsqueeze.

A split dim maps through when it stays whole (or divides evenly, see ops/shape.py); otherwise the
input is boxed first. Values, gradients and the SBPs that map through are checked.
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

# (input shape, op on sbpflow tensors, op on torch tensors)
CASES = [
    ((2, 3, 5), lambda x: x.reshape(6, 5), lambda x: x.reshape(6, 5)),
    ((2, 3, 5), lambda x: x.reshape(2, -1), lambda x: x.reshape(2, -1)),
    ((6, 5), lambda x: x.view(2, 3, 5), lambda x: x.view(2, 3, 5)),
    ((7, 4), lambda x: x.reshape(7, 2, 2), lambda x: x.reshape(7, 2, 2)),
    ((4, 7), lambda x: x.reshape(28), lambda x: x.reshape(28)),
    ((2, 3, 5), lambda x: x.flatten(), lambda x: x.flatten()),
    ((2, 3, 5), lambda x: x.flatten(1), lambda x: x.flatten(1)),
    ((5, 6), lambda x: x.unflatten(1, (2, 3)), lambda x: x.unflatten(1, (2, 3))),
    ((5, 3), lambda x: x.transpose(0, 1), lambda x: x.transpose(0, 1)),
    ((2, 5, 3), lambda x: x.transpose(-1, -2), lambda x: x.transpose(-1, -2)),
    ((2, 5, 3), lambda x: x.permute(2, 0, 1), lambda x: x.permute(2, 0, 1)),
    ((5, 3), lambda x: x.t(), lambda x: x.t()),
    ((5, 3), lambda x: x.T, lambda x: x.T),
    ((5, 1, 3), lambda x: x.expand(5, 4, 3), lambda x: x.expand(5, 4, 3)),
    ((5, 3), lambda x: x.expand(2, 5, 3), lambda x: x.expand(2, 5, 3)),
    ((5, 1), lambda x: x.expand(-1, 4), lambda x: x.expand(-1, 4)),
    ((5, 1, 3), lambda x: x.squeeze(1), lambda x: x.squeeze(1)),
    ((1, 5, 1), lambda x: x.squeeze(), lambda x: x.squeeze()),
    ((5, 3), lambda x: x.squeeze(0), lambda x: x.squeeze(0)),  # not size 1: unchanged
    ((5, 3), lambda x: x.unsqueeze(0), lambda x: x.unsqueeze(0)),
    ((5, 3), lambda x: x.unsqueeze(-1), lambda x: x.unsqueeze(-1)),
    # the fused pairs of attention (split into heads, merge back), against torch's two ops
    ((2, 6, 8), lambda x: F.reshape_permute(x, (2, 6, 4, 2), (0, 2, 1, 3)),
     lambda x: x.reshape(2, 6, 4, 2).permute(0, 2, 1, 3)),
    ((2, 6, 8), lambda x: F.reshape_permute(x, (2, -1, 4, 2), (0, -2, 1, 3)),
     lambda x: x.reshape(2, 6, 4, 2).permute(0, 2, 1, 3)),
    ((2, 4, 6, 2), lambda x: F.permute_reshape(x, (0, 2, 1, 3), (2, 6, 8)),
     lambda x: x.permute(0, 2, 1, 3).reshape(2, 6, 8)),
    ((3, 5, 4), lambda x: F.permute_reshape(x, (2, 0, 1), (-1,)), lambda x: x.permute(2, 0, 1).reshape(-1)),
]


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.integers(0, len(CASES) - 1), st.sampled_from(PNAMES), st.integers(0, 10_000), st.booleans())
def test_shape_ops_match_torch_on_any_sbp(index: int, pname: str, seed: int, partial: bool) -> None:
    shape, ours, theirs = CASES[index]
    p = PLACEMENTS[pname]
    check(ours, theirs, [randn(*shape, seed=seed)], p, [random_sbp(shape, p, random.Random(seed), partial=partial)])


def _heads(x, shape):  # type: ignore[no-untyped-def]
    """The fused op on sbpflow tensors, torch's two ops on torch tensors (the reference)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(shape).permute(0, 2, 1, 3)
    return F.reshape_permute(x, shape, (0, 2, 1, 3))


def _merge_heads(x, shape):  # type: ignore[no-untyped-def]
    if isinstance(x, torch.Tensor):
        return x.permute(0, 2, 1, 3).reshape(shape)
    return F.permute_reshape(x, (0, 2, 1, 3), shape)


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("shape,fn,in_dim,out_dim", [
    ((5, 3, 4), lambda x: x.reshape(5, 12), 0, 0),  # the split dim stays whole
    ((3, 4, 5), lambda x: x.reshape(12, 5), 2, 1),
    ((5, 3, 4), lambda x: x.flatten(1), 0, 0),
    ((5, 12), lambda x: x.unflatten(1, (3, 4)), 0, 0),
    ((5, 3), lambda x: x.transpose(0, 1), 0, 1),
    ((2, 5, 3), lambda x: x.permute(2, 0, 1), 1, 2),
    ((5, 3), lambda x: x.unsqueeze(0), 0, 1),
    ((5, 1, 3), lambda x: x.squeeze(1), 2, 1),
    ((5, 1, 3), lambda x: x.expand(5, 4, 3), 0, 0),
    # heads: the batch split stays, a split of C by whole heads becomes a split of H, T's split moves to dim 2
    # (12 heads: whole heads on each of 2, 3 or 4 ranks)
    ((4, 6, 24), lambda x: _heads(x, (4, 6, 12, 2)), 0, 0),
    ((4, 6, 24), lambda x: _heads(x, (4, 6, 12, 2)), 2, 1),
    ((4, 5, 24), lambda x: _heads(x, (4, 5, 12, 2)), 1, 2),
    ((2, 12, 6, 2), lambda x: _merge_heads(x, (2, 6, 24)), 1, 2),
    ((2, 12, 5, 2), lambda x: _merge_heads(x, (2, 5, 24)), 2, 1),
])
def test_a_whole_split_dim_maps_through_without_comm(pname: str, shape: tuple, fn, in_dim: int,  # type: ignore
                                                    out_dim: int) -> None:
    p = PLACEMENTS[pname]
    r = check(fn, fn, [randn(*shape)], p, [(S.split(in_dim),) * p.ndim])
    assert r.forward_log.counts() == {} and r.backward_log.counts() == {}
    assert r.out.sbp == (S.split(out_dim),) * p.ndim


@pytest.mark.parametrize("pname", ["2", "2x2"])
def test_merging_an_evenly_split_outer_dim_keeps_the_split(pname: str) -> None:
    p = PLACEMENTS[pname]
    sbp = (S.split(0),) * p.ndim
    r = check(lambda x: x.reshape(32, 3), lambda x: x.reshape(32, 3), [randn(8, 4, 3)], p, [sbp])
    assert r.forward_log.counts() == {} and r.out.sbp == sbp
    r = check(lambda x: x.reshape(4, 8, 3), lambda x: x.reshape(4, 8, 3), [randn(32, 3)], p, [sbp])
    assert r.forward_log.counts() == {} and r.out.sbp == sbp


def test_merging_an_unevenly_split_dim_boxes_first() -> None:
    p = PLACEMENTS["3"]
    a = randn(5, 4)
    x = sbpflow.tensor(a, placement=p, sbp=S.split(0))
    with record() as log:
        y = x.reshape(20)
    assert log.counts() != {}  # rows 2,2,1 do not make contiguous shards of 8,8,4... of a (20,) S(0)
    np.testing.assert_allclose(y.numpy(), a.reshape(20).numpy())


@pytest.mark.parametrize("fn", [lambda x: x.reshape(3, 4), lambda x: x.permute(1, 0), lambda x: x.unsqueeze(1),
                                lambda x: x.expand(2, 4, 3), lambda x: x.flatten()])
def test_partial_sum_passes_through_shape_ops(fn) -> None:  # type: ignore[no-untyped-def]
    p = PLACEMENTS["2"]
    a = randn(4, 3)
    x = global_tensor(a, p, PSUM)
    with record() as log:
        y = fn(x)
    assert log.counts() == {} and y.sbp == (PSUM,)
    np.testing.assert_allclose(y.numpy(), fn(a).numpy(), rtol=1e-6)


def test_expand_of_partial_sum_gradient_reduces_correctly() -> None:
    # y = expand(P(sum) x): its gradient is a sum over the expanded dim
    p = PLACEMENTS["2"]
    check(lambda x: x.expand(3, 4, 2), lambda x: x.expand(3, 4, 2), [randn(4, 2)], p, [PSUM])


def test_shape_mistakes_raise_shape_errors() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(randn(4, 3), placement=p, sbp=S.split(0))
    with pytest.raises(sbpflow.ShapeError, match=r"reshape.*12 elements.*\[5, 2\]"):
        x.reshape(5, 2)
    with pytest.raises(sbpflow.ShapeError, match="at most one -1"):
        x.reshape(-1, -1)
    with pytest.raises(sbpflow.ShapeError, match=r"permute.*permutation"):
        x.permute(0, 0)
    with pytest.raises(sbpflow.ShapeError, match=r"expand.*\[4, 3\].*\[4, 5\]"):
        x.expand(4, 5)
    with pytest.raises(sbpflow.ShapeError, match="out of range"):
        x.transpose(0, 2)
    with pytest.raises(sbpflow.ShapeError, match="out of range"):
        x.unsqueeze(4)
    with pytest.raises(sbpflow.ShapeError, match=r"reshape_permute.*12 elements.*\[5, 2\]"):
        F.reshape_permute(x, (5, 2), (1, 0))
    with pytest.raises(sbpflow.ShapeError, match=r"reshape_permute.*permutation"):
        F.reshape_permute(x, (2, 6), (0, 0))
    with pytest.raises(sbpflow.ShapeError, match=r"permute_reshape.*12 elements.*\[5\]"):
        F.permute_reshape(x, (1, 0), (5,))


def test_local_shape_ops_and_view_shares_no_state() -> None:
    for shape, ours, theirs in CASES:
        check(ours, theirs, [randn(*shape)], None)
    a = randn(2, 3)
    assert tuple(sbpflow.tensor(a).reshape(torch.Size([3, 2])).shape) == (3, 2)
    assert F.flatten(sbpflow.tensor(torch.tensor(3.0))).shape == torch.Size([1])
    x = sbpflow.tensor(a, placement=PLACEMENTS["2"], sbp=B)
    assert x.reshape(2, 3) is x  # a no-op reshape returns its input
