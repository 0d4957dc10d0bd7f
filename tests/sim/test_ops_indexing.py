"""Indexing and joining ops against torch: slicing, index_select, gather, cat/stack, split/chunk."""

from __future__ import annotations

import random

import pytest
import torch

import sbpflow
from harness import DEVICE, PLACEMENTS, PSUM, B, check, randn, random_sbp
from sbpflow import sbp as S
from sbpflow.ops import functional as F

PNAMES = ["1", "2", "3", "2x2"]


def _nd(p: sbpflow.Placement, s: object) -> tuple:
    return (s,) * p.ndim


def _index(n: int, high: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed))


# -- slicing ---------------------------------------------------------------------------------------

NARROWS = [(0, 1, 3), (1, -4, 4), (2, 0, 1), (1, 2, 0)]


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("args", NARROWS, ids=repr)
def test_narrow_random_sbps(pname: str, args: tuple[int, int, int]) -> None:
    p, rng = PLACEMENTS[pname], random.Random(repr(args))
    x = randn(5, 7, 2)
    for _ in range(3):
        sbp = random_sbp(x.shape, p, rng, partial=True)
        check(lambda t: t.narrow(*args), lambda t: t.narrow(*args), [x], p, [sbp])


KEYS = [
    (1,), (slice(1, 4),), (Ellipsis, slice(None, None, 2)), (None, slice(1, 6, 3), -1),
    (-1, None, slice(None, None, 3)), (slice(None), 0, slice(1, 2)), (slice(3, 1),), (Ellipsis, None),
]


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_getitem_random_sbps(pname: str, key: tuple) -> None:
    p, rng = PLACEMENTS[pname], random.Random(repr(key))
    x = randn(5, 7, 3)
    for _ in range(2):
        check(lambda t: t[key], lambda t: t[key], [x], p, [random_sbp(x.shape, p, rng, partial=True)])


@pytest.mark.parametrize("pname", ["2", "3", "2x2"])
def test_slice_along_other_dim_keeps_split_without_comm(pname: str) -> None:
    p = PLACEMENTS[pname]
    r = check(lambda t: t[1:5:2, None], lambda t: t[1:5:2, None], [randn(5, 7)], p, [_nd(p, S.split(1))])
    assert r.out.sbp == _nd(p, S.split(2))
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}  # B upstream -> S(1) is a local slice


@pytest.mark.parametrize("key", [slice(2, 6), slice(1, 7, 3), slice(5, 7)], ids=repr)
def test_slice_along_split_dim_gives_partial_sum_without_comm(key: slice) -> None:
    p = PLACEMENTS["3"]
    r = check(lambda t: t[key], lambda t: t[key], [randn(7, 3)], p, [S.split(0)])
    assert r.out.sbp == (PSUM,)  # each rank fills the rows it holds; the sum happens where a consumer needs it
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}


def test_slice_of_partial_stays_partial() -> None:
    p = PLACEMENTS["2"]
    r = check(lambda t: t[:, 1:3], lambda t: t[:, 1:3], [randn(3, 5)], p, [PSUM])
    assert r.out.sbp == (PSUM,)
    assert r.forward_log.counts() == {}


def test_iteration_and_int_index_on_local_tensor() -> None:
    x = sbpflow.tensor(torch.arange(6.0).reshape(3, 2))
    assert [row.tolist() for row in x] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert x[-1, 0].item() == 4.0


# -- index_select ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dim", [0, 1])
def test_index_select_random_sbps(pname: str, seed: int, dim: int) -> None:
    p, rng = PLACEMENTS[pname], random.Random(seed)
    x = randn(7, 5, seed=seed)
    idx = _index(5 if seed % 2 else 2, x.shape[dim], seed)
    sbps = [random_sbp(x.shape, p, rng, partial=True), random_sbp(idx.shape, p, rng)]
    check(lambda t, i: t.index_select(dim, i), lambda t, i: t.index_select(dim, i), [x, idx], p, sbps)


@pytest.mark.parametrize("pname", ["2", "3", "2x2"])
def test_index_select_vocab_parallel_gives_partial_sum_without_comm(pname: str) -> None:
    p = PLACEMENTS[pname]
    idx = torch.tensor([0, 6, 3, 3, 1])
    r = check(lambda w, i: F.index_select(w, 0, i), lambda w, i: torch.index_select(w, 0, i),
              [randn(7, 4), idx], p, [_nd(p, S.split(0)), _nd(p, B)])
    assert r.out.sbp == _nd(p, PSUM)
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}  # each rank adds the rows it owns


def test_index_select_rows_follow_a_split_index() -> None:
    p = PLACEMENTS["2"]
    r = check(lambda w, i: F.index_select(w, 0, i), lambda w, i: torch.index_select(w, 0, i),
              [randn(4, 3), torch.tensor([3, 0, 0, 2, 1])], p, [B, S.split(0)])
    assert r.out.sbp == (S.split(0),)
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {"all_reduce": 1}  # rows of a B weight's grad come from every rank


def test_tensor_key_uses_index_select() -> None:
    p = PLACEMENTS["3"]
    check(lambda x, i: x[:, i], lambda x, i: x[:, i], [randn(2, 5), torch.tensor([4, 0, 4])], p, [S.split(1), B])


# -- gather ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("dim", "index_shape"), [(1, (5, 4)), (0, (3, 6)), (1, (2, 9))])
def test_gather_random_sbps(pname: str, seed: int, dim: int, index_shape: tuple[int, int]) -> None:
    p, rng = PLACEMENTS[pname], random.Random(seed)
    x = randn(5, 6, seed=seed)
    idx = torch.randint(0, x.shape[dim], index_shape, generator=torch.Generator().manual_seed(seed))
    sbps = [random_sbp(x.shape, p, rng, partial=True), random_sbp(idx.shape, p, rng)]
    check(lambda t, i: t.gather(dim, i), lambda t, i: t.gather(dim, i), [x, idx], p, sbps)


def test_gather_row_split_needs_no_comm() -> None:
    p = PLACEMENTS["2x2"]
    idx = torch.randint(0, 6, (5, 3), generator=torch.Generator().manual_seed(1))
    r = check(lambda t, i: t.gather(1, i), lambda t, i: t.gather(1, i), [randn(5, 6), idx], p,
              [_nd(p, S.split(0)), _nd(p, S.split(0))])
    assert r.out.sbp == _nd(p, S.split(0))
    assert r.forward_log.counts() == {}


def test_gather_along_split_dim_gives_partial_sum() -> None:
    p = PLACEMENTS["3"]
    idx = torch.tensor([[0, 6, 2], [5, 5, 1]])
    r = check(lambda t, i: t.gather(1, i), lambda t, i: t.gather(1, i), [randn(2, 7), idx], p, [S.split(1), B])
    assert r.out.sbp == (PSUM,)
    assert r.forward_log.counts() == {}


# -- cat / stack / split / chunk -------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dim", [0, 1])
def test_cat_random_shared_sbp(pname: str, seed: int, dim: int) -> None:
    p, rng = PLACEMENTS[pname], random.Random(seed)
    shapes = [(2, 5), (3, 5), (1, 5)] if dim == 0 else [(3, 1), (3, 4), (3, 2)]
    xs = [randn(*s, seed=seed + i) for i, s in enumerate(shapes)]
    sbp = random_sbp(shapes[0], p, rng, partial=True)
    check(lambda *ts: F.cat(ts, dim=dim), lambda *ts: torch.cat(ts, dim=dim), xs, p, [sbp] * 3)


@pytest.mark.parametrize("pname", ["2", "3", "2x2"])
def test_cat_split_on_other_dim_passes_through(pname: str) -> None:
    p = PLACEMENTS[pname]
    xs = [randn(5, 2), randn(5, 3, seed=1)]
    r = check(lambda a, b: F.cat([a, b], dim=-1), lambda a, b: torch.cat([a, b], dim=-1), xs, p,
              [_nd(p, S.split(0))] * 2)
    assert r.out.sbp == _nd(p, S.split(0))
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}


def test_cat_promotes_dtypes_and_casts_grads_back() -> None:
    p = PLACEMENTS["2"]
    xs = [randn(2, 3), randn(1, 3, seed=1, dtype=torch.float64)]
    check(lambda a, b: F.cat([a, b]), lambda a, b: torch.cat([a, b]), xs, p, [S.split(1), S.split(1)])


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_stack_random_sbps(pname: str, dim: int) -> None:
    p, rng = PLACEMENTS[pname], random.Random(dim)
    xs = [randn(5, 3, seed=i) for i in range(3)]
    sbp = random_sbp(xs[0].shape, p, rng, partial=True)
    r = check(lambda *ts: F.stack(ts, dim), lambda *ts: torch.stack(ts, dim), xs, p, [sbp] * 3)
    assert r.forward_log.counts() == {}


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("how", [("split", 2), ("split", (1, 4, 2)), ("chunk", 3), ("chunk", 4)], ids=repr)
def test_split_and_chunk_random_sbps(pname: str, how: tuple) -> None:
    p, rng = PLACEMENTS[pname], random.Random(len(pname))
    name, arg = how
    x = randn(3, 7)
    for _ in range(2):
        sbp = random_sbp(x.shape, p, rng, partial=True)
        check(lambda t: getattr(t, name)(arg, 1), lambda t: getattr(t, name)(arg, 1), [x], p, [sbp])


def test_qkv_split_of_batch_split_needs_no_comm() -> None:
    p = PLACEMENTS["2x2"]
    r = check(lambda t: t.split(4, dim=2), lambda t: t.split(4, dim=2), [randn(5, 3, 12)], p,
              [(S.split(0), S.split(1))])
    assert all(o.sbp == (S.split(0), S.split(1)) for o in r.out)
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}


# -- errors ----------------------------------------------------------------------------------------


def _g(value: torch.Tensor, sbp: object = B, pname: str = "2") -> sbpflow.Tensor:
    return sbpflow.tensor(value, placement=PLACEMENTS[pname], sbp=sbp)


def test_index_select_out_of_range_names_op_shape_and_sbp() -> None:
    with pytest.raises(sbpflow.ShapeError, match=r"'index_select'.*index 7 .*size 7.*\[7, 2\].*S\(0\)"):
        F.index_select(_g(randn(7, 2), S.split(0)), 0, _g(torch.tensor([1, 7])))
    with pytest.raises(sbpflow.ShapeError, match=r"index -1 is out of range"):
        F.index_select(_g(randn(7, 2)), 0, _g(torch.tensor([-1])))


def test_gather_out_of_range_and_bad_index_shape() -> None:
    with pytest.raises(sbpflow.ShapeError, match=r"'gather'.*index 3 is out of range for dim 1 of size 3"):
        F.gather(_g(randn(2, 3)), 1, _g(torch.tensor([[0], [3]])))
    with pytest.raises(sbpflow.ShapeError, match=r"'gather'.*input \[2, 3\] and index \[3, 1\]"):
        F.gather(_g(randn(2, 3)), 1, _g(torch.tensor([[0], [1], [2]])))
    with pytest.raises(sbpflow.DTypeError, match=r"gather needs an int64 or int32 index"):
        F.gather(_g(randn(2, 3)), 1, _g(torch.ones(2, 1)))


def test_getitem_and_narrow_out_of_range() -> None:
    x = _g(randn(3, 4), S.split(1))
    with pytest.raises(sbpflow.ShapeError, match=r"index 4 is out of range for dim 1 of size 4.*S\(1\)"):
        x[:, 4]
    with pytest.raises(sbpflow.ShapeError, match=r"3 indices for a tensor of 2 dim"):
        x[0, 0, 0]
    with pytest.raises(sbpflow.ShapeError, match=r"narrow: start 2 and length 3 .*size 4"):
        x.narrow(1, 2, 3)
    with pytest.raises(sbpflow.ShapeError, match=r"step must be positive"):
        x[::-1]
    with pytest.raises(sbpflow.OpError, match=r"takes ints, slices"):
        x["a"]


def test_cat_mismatched_shapes_and_placements() -> None:
    with pytest.raises(sbpflow.ShapeError, match=r"'cat'.*tensor 1 has shape \[2, 4\].*sbp"):
        F.cat([_g(randn(2, 3)), _g(randn(2, 4))], dim=0)
    with pytest.raises(sbpflow.OpError, match=rf"'cat' needs all inputs on one placement.*{DEVICE}:\[0, 1\]"):
        F.cat([_g(randn(2, 3)), _g(randn(2, 3), pname="3")])
    with pytest.raises(sbpflow.ShapeError, match=r"stack needs tensors of one shape"):
        F.stack([_g(randn(2, 3)), _g(randn(3, 3))])
    with pytest.raises(sbpflow.ShapeError, match=r"split sections \[1, 1, 1\] must .*sum to dim 0's size 2"):
        F.split(_g(randn(2, 3)), [1, 1, 1], 0)
