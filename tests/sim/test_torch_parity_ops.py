"""The ops PyTorch users reach for (issue 13, section 3) against torch, on 1-D and 2-D meshes.

Each op runs on split and broadcast inputs through the harness (forward, gradients, leaf layouts), and on
partial inputs built from random per-rank pieces: each piece is wrong alone and only the reduction is right,
so a partial rule that lies gives wrong numbers here. Where an op declares that a partial passes through,
the test also asserts that no collective ran and that the output stays partial.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
import sbpflow.ops.functional as F
from harness import PLACEMENTS, PSUM, B, check, randn, random_sbp
from partials import check_pieces, pieces
from sbpflow import sbp as S
from sbpflow.comm import record

PNAMES = ["1", "2", "3", "2x2"]
PMAX, PMIN = S.Partial("max"), S.Partial("min")



def test_pieces_builder_hides_the_value_in_every_piece() -> None:
    value = randn(3, 4)
    for sbp in [(PSUM,), (PMAX,), (PMIN,)]:
        x = pieces(value, "2", sbp)
        np.testing.assert_allclose(x.numpy(), value.numpy(), rtol=1e-5, atol=1e-5)
        assert all(not torch.allclose(t.cpu(), value) for t in x.local_tensors().values())
    x = pieces(value, "2x2", (PSUM, S.split(1)))
    np.testing.assert_allclose(x.numpy(), value.numpy(), rtol=1e-5, atol=1e-5)


# -- elementwise: clone, sin, cos, erf, isnan, isfinite -------------------------------------------

UNARY = {
    "clone": (lambda x: x.clone(), torch.clone),
    "sin": (lambda x: x.sin(), torch.sin),
    "cos": (lambda x: x.cos(), torch.cos),
    "erf": (lambda x: x.erf(), torch.erf),
    "isnan": (lambda x: x.isnan(), torch.isnan),
    "isfinite": (lambda x: x.isfinite(), torch.isfinite),
}


def _with_specials(value: torch.Tensor) -> torch.Tensor:
    value[1, 2], value[2, 3], value[0, 1] = float("nan"), float("inf"), -float("inf")
    return value
# which partials each op passes through without communication (the others must reduce first)
PASSES = {"clone": {"sum", "max", "min"}, "erf": {"max", "min"}}


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("pname", PNAMES)
def test_unary_on_split_and_broadcast(name: str, pname: str) -> None:
    ours, theirs = UNARY[name]
    p = PLACEMENTS[pname]
    value = _with_specials(randn(5, 7))
    for seed in range(3):
        sbp = random_sbp(value.shape, p, random.Random(seed))
        r = check(ours, theirs, [value], p, [sbp])
        assert r.out.sbp == sbp


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("pname,kind", [("2", "sum"), ("3", "max"), ("2x2", "min"), ("2x2", "sum")])
def test_unary_on_partial_pieces(name: str, pname: str, kind: str) -> None:
    ours, theirs = UNARY[name]
    value = _with_specials(randn(4, 6)) if name.startswith("is") else randn(4, 6)  # nan/inf: no gradients
    sbp = (S.Partial(kind),) + ((S.split(1),) if pname == "2x2" else ())
    out, log = check_pieces(ours, theirs, [value], pname, [sbp], seed=sorted(UNARY).index(name))
    if kind in PASSES.get(name, ()):
        assert log.counts() == {} and out.sbp[0] == S.Partial(kind)
    else:
        assert not isinstance(out.sbp[0], S.Partial)


def test_erf_passes_max_through_and_its_gradient_matches() -> None:
    p = PLACEMENTS["2"]
    r = check(lambda x: x.erf().sin().cos(), lambda x: x.erf().sin().cos(), [randn(6, 3)], p, [S.split(0)])
    assert r.backward_log.counts() == {}


# -- masked_fill -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("value", [0.0, -1e4, float("-inf")])
def test_masked_fill_on_split_and_broadcast(pname: str, value: float) -> None:
    p = PLACEMENTS[pname]
    x, m = randn(5, 6), randn(1, 6, seed=1) > 0  # the mask broadcasts along dim 0
    for seed in range(3):
        rng = random.Random(seed)
        sbps = [random_sbp(x.shape, p, rng), random_sbp(m.shape, p, rng)]
        f = (lambda a, mask: a.masked_fill(mask, value).exp()) if value != 0.0 else (lambda a, mask: a.masked_fill(
            mask, value))
        check(f, f, [x, m], p, sbps)


@pytest.mark.parametrize("kind,value,passes", [("max", 3.0, True), ("min", -2.0, True), ("sum", 0.0, True),
                                               ("sum", 5.0, False)])
def test_masked_fill_of_partial_pieces(kind: str, value: float, passes: bool) -> None:
    x, m = randn(4, 6), randn(4, 6, seed=1) > 0
    out, log = check_pieces(lambda a, mask: a.masked_fill(mask, value), lambda a, mask: a.masked_fill(mask, value),
                            [x, m], "2x2", [(S.Partial(kind), S.split(0)), (B, B)], seed=3)
    assert (log.counts() == {} and out.sbp[0] == S.Partial(kind)) == passes


def test_masked_fill_with_a_0d_tensor_value_and_bad_masks() -> None:
    p = PLACEMENTS["2"]
    x, m = randn(4, 3), randn(4, 3, seed=1) > 0
    check(lambda a, v: F.masked_fill(a, a > 0, v), lambda a, v: a.masked_fill(a > 0, v), [x, torch.tensor(2.0)], p,
          [S.split(0), B])
    gx = sbpflow.tensor(x, placement=p, sbp=S.split(0))
    with pytest.raises(sbpflow.DTypeError, match="masked_fill needs a bool mask"):
        gx.masked_fill(sbpflow.tensor(m.float(), placement=p, sbp=B), 1.0)
    with pytest.raises(sbpflow.ShapeError, match=r"op 'masked_fill': shapes \[\[4, 3\], \[4, 4\]\] are not broadcast"):
        gx.masked_fill(sbpflow.tensor(torch.ones(4, 4, dtype=torch.bool), placement=p, sbp=B), 1.0)
    with pytest.raises(sbpflow.ShapeError, match=r"broadcasts to the input's shape \[4, 3\].*mask shape \[2, 4, 3\]"):
        gx.masked_fill(sbpflow.tensor(torch.ones(2, 4, 3, dtype=torch.bool), placement=p, sbp=B), 1.0)


def test_masked_fill_in_place_like_attention_code() -> None:
    p = PLACEMENTS["2x2"]
    scores = randn(4, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    x = sbpflow.tensor(scores, placement=p, sbp=(S.split(0), S.split(1)))
    with sbpflow.no_grad():
        assert x.masked_fill_(sbpflow.tensor(causal, placement=p, sbp=(B, B)), float("-inf")) is x
    assert x.sbp == (S.split(0), S.split(1))
    np.testing.assert_array_equal(x.numpy(), scores.masked_fill(causal, float("-inf")).numpy())


# -- argmax / argmin, all / any ----------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("dim,keepdim", [(None, False), (0, False), (1, True), (-1, False), (None, True)])
def test_argmax_argmin_match_torch(pname: str, name: str, dim: int | None, keepdim: bool) -> None:
    p = PLACEMENTS[pname]
    value = randn(5, 7)
    value[2, 3] = value[2, 5] = value.max() + 1  # a tie: torch takes the first
    value[4, 1] = value[4, 6] = value.min() - 1
    sbp = random_sbp(value.shape, p, random.Random(f"{name}{dim}{keepdim}"))
    r = check(lambda x: getattr(x, name)(dim=dim, keepdim=keepdim),
              lambda x: getattr(torch, name)(x, dim=dim, keepdim=keepdim), [value], p, [sbp])
    assert r.out.dtype == torch.int64


def test_argmax_keeps_other_dims_split_without_communication() -> None:
    p = PLACEMENTS["2x2"]
    r = check(lambda x: x.argmax(1), lambda x: x.argmax(1), [randn(6, 5)], p, [(S.split(0), S.split(0))])
    assert r.forward_log.counts() == {} and r.out.sbp == (S.split(0), S.split(0))
    r = check(lambda x: x.argmin(0), lambda x: x.argmin(0), [randn(6, 5)], p, [(S.split(0), B)])
    assert r.forward_log.counts() != {}  # the reduced dim is never split: moved first


def test_argmax_of_partial_pieces_reduces_first() -> None:
    x = randn(4, 6)
    for kind in ("sum", "max"):
        out = pieces(x, "2", (S.Partial(kind),), seed=1).argmax(1)
        assert out.tolist() == x.argmax(1).tolist()


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("name", ["all", "any"])
@pytest.mark.parametrize("dim,keepdim", [(None, False), (0, False), (1, True), ((0, 1), False)])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_all_any_match_torch(pname: str, name: str, dim: Any, keepdim: bool, dtype: torch.dtype) -> None:
    p = PLACEMENTS[pname]
    value = randn(5, 7) > -1.0
    value[:, 0] = True
    value[3, :] = False
    sbp = random_sbp(value.shape, p, random.Random(f"{name}{dim}{keepdim}"))
    if dim is None:
        check(lambda x: getattr(x, name)(), getattr(torch, name), [value.to(dtype)], p, [sbp])
    else:
        check(lambda x: getattr(x, name)(dim, keepdim), lambda x: getattr(torch, name)(x, dim=dim, keepdim=keepdim),
              [value.to(dtype)], p, [sbp])


def test_all_any_of_a_split_dim_are_bool_partials() -> None:
    p = PLACEMENTS["3"]
    value = torch.tensor([[True, True, False, True, True]])  # the False sits on rank 1
    x = sbpflow.tensor(value, placement=p, sbp=S.split(1))
    with record() as log:
        a, b = x.all(1), x.any(1)
    assert log.counts() == {} and a.sbp == (PMIN,) and b.sbp == (PMAX,)
    assert a.tolist() == [False] and b.tolist() == [True]
    empty = sbpflow.tensor(torch.ones(2, 2, dtype=torch.bool), placement=p, sbp=S.split(1))  # rank 2 holds nothing
    assert empty.all().item() is True and empty.any(1).tolist() == [True, True]


def test_all_any_of_bool_partial_pieces_pass_through() -> None:
    value = randn(4, 5) > -0.5
    for kind, name in [("min", "all"), ("max", "any")]:
        with record() as log:
            out = getattr(pieces(value, "2", (S.Partial(kind),), seed=2), name)(1)
        assert log.counts() == {} and out.sbp == (S.Partial(kind),)
        assert out.tolist() == getattr(value, name)(1).tolist()
        # the other kind (or a float input) is reduced first
        other = "max" if kind == "min" else "min"
        assert getattr(pieces(value, "2", (S.Partial(other),), seed=2), name)(1).tolist() == \
            getattr(value, name)(1).tolist()
    floats = randn(4, 5)
    assert pieces(floats, "2", (PSUM,), seed=3).any(1).tolist() == floats.any(1).tolist()


# -- cumsum ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cumsum_matches_torch(pname: str, dim: int) -> None:
    p = PLACEMENTS[pname]
    sbp = random_sbp((5, 7), p, random.Random(dim))
    check(lambda x: x.cumsum(dim) * x, lambda x: x.cumsum(dim) * x, [randn(5, 7)], p, [sbp])
    ints = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    r = check(lambda x: F.cumsum(x, 1), lambda x: torch.cumsum(x, 1), [ints], p, [(S.split(0),) * p.ndim])
    assert r.out.dtype == torch.int64


def test_cumsum_passes_partial_sums_and_other_splits() -> None:
    x = randn(4, 6)
    a, log = check_pieces(lambda t: t.cumsum(1), lambda t: t.cumsum(1), [x], "2x2", [(PSUM, S.split(0))], seed=4)
    assert log.counts() == {} and a.sbp == (PSUM, S.split(0))
    out, _ = check_pieces(lambda t: t.cumsum(0), lambda t: t.cumsum(0), [x], "2", [(PMAX,)])  # max: reduced first
    assert not isinstance(out.sbp[0], S.Partial)
    r = check(lambda t: t.cumsum(1), lambda t: t.cumsum(1), [x], PLACEMENTS["2"], [S.split(1)])
    assert r.out.sbp != (S.split(1),)  # a split of the summed dim is moved first


# -- topk --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("k,dim,largest", [(3, -1, True), (2, 0, False), (7, 1, True)])
def test_topk_values_indices_and_gradient(pname: str, k: int, dim: int, largest: bool) -> None:
    p = PLACEMENTS[pname]
    sbp = random_sbp((5, 7), p, random.Random(k))
    r = check(lambda x: tuple(x.topk(k, dim=dim, largest=largest)),
              lambda x: tuple(torch.topk(x, k, dim=dim, largest=largest)), [randn(5, 7)], p, [sbp])
    assert r.out[1].dtype == torch.int64


def test_topk_keeps_other_dims_split() -> None:
    r = check(lambda x: x.topk(2).values, lambda x: x.topk(2).values, [randn(6, 5)], PLACEMENTS["2x2"],
              [(S.split(0), B)])
    assert r.forward_log.counts() == {} and r.backward_log.counts() == {}
    assert r.out.sbp == (S.split(0), B)
    check_pieces(lambda t: t.topk(2).values, lambda t: t.topk(2).values, [randn(6, 5)], "2", [(PSUM,)], seed=5)
    with pytest.raises(sbpflow.ShapeError, match="topk needs 0 <= k <= 5"):
        sbpflow.randn(6, 5).topk(6)
