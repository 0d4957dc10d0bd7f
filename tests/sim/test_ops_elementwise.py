"""Elementwise ops against torch: broadcasting, type promotion, scalars, operators, in-place forms.

Inputs get random valid SBPs (uneven splits included) on 1, 2, 3 ranks and a 2x2 mesh;
forward values, input gradients and leaf-gradient layouts are compared by the harness.
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
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def _positive(*shape: int, seed: int = 0) -> torch.Tensor:
    return randn(*shape, seed=seed).abs() + 0.5


UNARY = {
    "neg": (lambda x: -x, lambda x: -x, randn),
    "exp": (F.exp, torch.exp, randn),
    "log": (F.log, torch.log, _positive),
    "sqrt": (F.sqrt, torch.sqrt, _positive),
    "rsqrt": (F.rsqrt, torch.rsqrt, _positive),
    "abs": (lambda x: abs(x), torch.abs, randn),
    "tanh": (lambda x: x.tanh(), torch.tanh, randn),
    "sigmoid": (lambda x: x.sigmoid(), torch.sigmoid, randn),
    "relu": (lambda x: x.relu(), torch.relu, randn),
    "gelu": (F.gelu, torch.nn.functional.gelu, randn),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                  lambda x: torch.nn.functional.gelu(x, approximate="tanh"), randn),
    "silu": (F.silu, torch.nn.functional.silu, randn),
    "square": (lambda x: x.square(), torch.square, randn),
    "clamp": (lambda x: x.clamp(-0.5, 0.7), lambda x: x.clamp(-0.5, 0.7), randn),
    "clamp_min": (lambda x: F.clamp(x, min=0.1), lambda x: torch.clamp(x, min=0.1), randn),
    "pow_scalar": (lambda x: x**3, lambda x: x**3, randn),
    "rpow": (lambda x: 2.0**x, lambda x: 2.0**x, randn),
}

BINARY = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "sub": (lambda a, b: a - b, lambda a, b: a - b),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "div": (lambda a, b: a / b, lambda a, b: a / b),
    "maximum": (F.maximum, torch.maximum),
    "minimum": (F.minimum, torch.minimum),
    "add_alpha": (lambda a, b: F.add(a, b, alpha=2.0), lambda a, b: torch.add(a, b, alpha=2.0)),
    "where": (lambda a, b: F.where(a > b, a, b), lambda a, b: torch.where(a > b, a, b)),
}

SCALAR = {
    "radd": (lambda x: 1.5 + x, lambda x: 1.5 + x),
    "rsub": (lambda x: 1.5 - x, lambda x: 1.5 - x),
    "rmul": (lambda x: 3 * x, lambda x: 3 * x),
    "rdiv": (lambda x: 2.0 / x, lambda x: 2.0 / x),
    "sub_int": (lambda x: x - 2, lambda x: x - 2),
    "div_int": (lambda x: x / 4, lambda x: x / 4),
    "where_scalar": (lambda x: F.where(x > 0, x, 0.0), lambda x: torch.where(x > 0, x, 0.0)),
}

SHAPES = [(5,), (3, 7), (2, 5, 3), (7, 1, 4)]


@st.composite
def _unary_case(draw):  # type: ignore[no-untyped-def]
    name = draw(st.sampled_from(sorted(UNARY)))
    shape = draw(st.sampled_from(SHAPES))
    pname = draw(st.sampled_from(PNAMES))
    return name, shape, pname, draw(st.integers(0, 10_000))


@SETTINGS
@given(_unary_case())
def test_unary_ops_match_torch(case) -> None:  # type: ignore[no-untyped-def]
    name, shape, pname, seed = case
    ours, theirs, make = UNARY[name]
    p = PLACEMENTS[pname]
    sbp = random_sbp(shape, p, random.Random(seed))
    r = check(ours, theirs, [make(*shape, seed=seed)], p, [sbp])
    assert r.forward_log.counts() == {}, f"{name} on {sbp} communicated"
    assert r.out.sbp == sbp


@st.composite
def _binary_case(draw):  # type: ignore[no-untyped-def]
    name = draw(st.sampled_from(sorted(BINARY)))
    out_shape = draw(st.sampled_from([(5,), (3, 7), (2, 5, 3)]))
    # the second operand drops leading dims and/or has size-1 dims, so it broadcasts
    lead = draw(st.integers(0, len(out_shape) - 1))
    ones = draw(st.lists(st.booleans(), min_size=len(out_shape) - lead, max_size=len(out_shape) - lead))
    b_shape = tuple(1 if one else n for one, n in zip(ones, out_shape[lead:], strict=True))
    swap = draw(st.booleans())
    pname = draw(st.sampled_from(PNAMES))
    return name, (b_shape, out_shape) if swap else (out_shape, b_shape), pname, draw(st.integers(0, 10_000))


@SETTINGS
@given(_binary_case())
def test_binary_ops_broadcast_like_torch(case) -> None:  # type: ignore[no-untyped-def]
    name, (sa, sb), pname, seed = case
    ours, theirs = BINARY[name]
    p = PLACEMENTS[pname]
    rng = random.Random(seed)
    a, b = randn(*sa, seed=seed), randn(*sb, seed=seed + 1)
    if name == "div":
        b = b.abs() + 0.5
    check(ours, theirs, [a, b], p, [random_sbp(sa, p, rng), random_sbp(sb, p, rng)])


@pytest.mark.parametrize("name", sorted(SCALAR))
@pytest.mark.parametrize("pname", PNAMES)
def test_scalar_operands_on_either_side(name: str, pname: str) -> None:
    ours, theirs = SCALAR[name]
    p = PLACEMENTS[pname]
    x = _positive(5, 3, seed=3)
    r = check(ours, theirs, [x], p, [(S.split(0),) * p.ndim])
    assert r.out.sbp == (S.split(0),) * p.ndim and r.forward_log.counts() == {}


@pytest.mark.parametrize("pname", PNAMES)
def test_comparisons_and_logical_ops(pname: str) -> None:
    p = PLACEMENTS[pname]
    a, b = randn(7, 3), randn(7, 3, seed=1)
    b[0] = a[0]  # some ties, so == and <= differ from < on purpose
    sbp = (S.split(0),) * p.ndim
    x = sbpflow.tensor(a, placement=p, sbp=sbp)
    y = sbpflow.tensor(b, placement=p, sbp=(B,) * p.ndim)
    pairs = [(x < y, a < b), (x <= y, a <= b), (x > y, a > b), (x >= y, a >= b), (x == y, a == b),
             (x != y, a != b), (x > 0.1, a > 0.1), (0.1 < x, 0.1 < a), ((x > 0) & (y > 0), (a > 0) & (b > 0)),
             ((x > 0) | (y > 0), (a > 0) | (b > 0)), (~(x > 0), ~(a > 0))]
    for ours, theirs in pairs:
        assert ours.dtype == torch.bool
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


PROMOTIONS = [
    (torch.float32, torch.float64, None),
    (torch.int64, torch.float32, None),
    (torch.int32, torch.int64, None),
    (torch.int64, None, 2.5),  # int tensor and a float scalar: default float
    (torch.float16, None, 2),  # a scalar never widens a tensor's float dtype
    (torch.float32, torch.float64, "0d"),  # a 0-d tensor ranks below an n-d one of the same kind
]


@pytest.mark.parametrize("da,db,scalar", PROMOTIONS)
def test_type_promotion_matches_torch(da: torch.dtype, db: torch.dtype | None, scalar: object) -> None:
    p = PLACEMENTS["2"]
    a = (randn(4, 3) * 4).to(da)
    x = sbpflow.tensor(a, placement=p, sbp=S.split(0))
    if scalar == "0d":
        b = torch.tensor(2.0, dtype=db)
        y = sbpflow.tensor(b, placement=p, sbp=B)
        pairs = [(x + y, a + b), (x * y, a * b)]
    elif db is None:
        pairs = [(x + scalar, a + scalar), (x * scalar, a * scalar), (x / scalar, a / scalar)]
    else:
        b = (randn(4, 3, seed=1) * 4).to(db)
        y = sbpflow.tensor(b, placement=p, sbp=B)
        pairs = [(x + y, a + b), (x * y, a * b), (x - y, a - b), (x / y, a / b)]
    for ours, theirs in pairs:
        assert ours.dtype == theirs.dtype
        np.testing.assert_allclose(ours.numpy().astype(np.float64), theirs.double().numpy(), rtol=1e-3)


def test_integer_division_gives_float_and_int_relu_keeps_dtype() -> None:
    p = PLACEMENTS["3"]
    a = torch.arange(-3, 4)
    x = sbpflow.tensor(a, placement=p, sbp=S.split(0))
    assert (x / 2).dtype == torch.float32 and (x / 2).numpy().tolist() == (a / 2).tolist()
    assert x.relu().dtype == torch.int64 and x.relu().tolist() == a.relu().tolist()
    assert F.exp(x).dtype == torch.float32


# -- partial values through elementwise ops --------------------------------------------------------


def test_partial_sum_stays_partial_through_linear_ops() -> None:
    p = PLACEMENTS["2"]
    a, b = randn(4, 6), randn(6, 3, seed=1)
    x = sbpflow.tensor(a, placement=p, sbp=S.split(1))
    w = sbpflow.tensor(b, placement=p, sbp=S.split(0))
    with record() as log:
        y = x @ w  # P(sum)
        z = -(y * 2.0 + y) / 3.0
    assert y.sbp == (PSUM,) and z.sbp == (PSUM,)
    assert log.counts() == {}
    np.testing.assert_allclose(z.numpy(), (-(a @ b * 3.0) / 3.0).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("native_collectives")  # on gloo's target reduce-scatter and all-reduce + slice tie
def test_partial_sum_reduced_once_by_the_cheapest_boxing() -> None:
    p = PLACEMENTS["2"]
    a, b = randn(4, 6), randn(6, 3, seed=1)
    x = sbpflow.tensor(a, placement=p, sbp=S.split(1))
    w = sbpflow.tensor(b, placement=p, sbp=S.split(0))
    y = x @ w
    with record() as log:
        z = y.relu()  # relu is not linear: P(sum) is reduced, and reduce-scatter to S beats all-reduce to B
    assert log.counts() == {"reduce_scatter": 1}
    assert z.sbp[0] in (S.split(0), S.split(1))
    np.testing.assert_allclose(z.numpy(), (a @ b).relu().numpy(), rtol=1e-5, atol=1e-6)
    with record() as log:
        full = y.to_global(sbp=B)
    assert log.counts() == {"all_reduce": 1}
    np.testing.assert_allclose(full.numpy(), (a @ b).numpy(), rtol=1e-5, atol=1e-6)


def test_partial_sum_plus_broadcast_is_not_added_twice() -> None:
    # P(sum) + B has no partial rule: adding b on every rank would count it p times
    p = PLACEMENTS["3"]
    a, b, c = randn(4, 6), randn(6, 3, seed=1), randn(4, 3, seed=2)
    y = sbpflow.tensor(a, placement=p, sbp=S.split(1)) @ sbpflow.tensor(b, placement=p, sbp=S.split(0))
    z = y + sbpflow.tensor(c, placement=p, sbp=B)
    np.testing.assert_allclose(z.numpy(), (a @ b + c).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["max", "min"])
def test_partial_max_min_pass_monotone_ops_and_flip_under_neg(kind: str) -> None:
    p = PLACEMENTS["2"]
    a = randn(6, 4)
    x = sbpflow.tensor(a, placement=p, sbp=S.split(0))
    with record() as log:
        m = F.amax(x, dim=0) if kind == "max" else F.amin(x, dim=0)
        e = F.exp(m)
        n = -m
    assert log.counts() == {}
    assert e.sbp == (S.Partial(kind),)
    assert n.sbp == (S.Partial("min" if kind == "max" else "max"),)
    ref = a.amax(0) if kind == "max" else a.amin(0)
    np.testing.assert_allclose(e.numpy(), ref.exp().numpy(), rtol=1e-5)
    np.testing.assert_allclose(n.numpy(), (-ref).numpy(), rtol=1e-5)


# -- in place ------------------------------------------------------------------------------------


INPLACE = [
    ("add_", lambda t, o: t.add_(o)), ("sub_", lambda t, o: t.sub_(o)), ("mul_", lambda t, o: t.mul_(o)),
    ("div_", lambda t, o: t.div_(o)), ("pow_", lambda t, o: t.pow_(o)),
    ("maximum_", lambda t, o: t.maximum_(o) if isinstance(t, sbpflow.Tensor)  # torch has no maximum_
     else t.copy_(torch.maximum(t, torch.as_tensor(o)))),
]


@pytest.mark.parametrize("name,fn", INPLACE)
@pytest.mark.parametrize("other_sbp", ["same", "B", "scalar"])
@pytest.mark.parametrize("pname", ["1", "3", "2x2"])
def test_inplace_forms_under_no_grad(name: str, fn, other_sbp: str, pname: str) -> None:  # type: ignore[no-untyped-def]
    p = PLACEMENTS[pname]
    a, b = randn(5, 3).abs() + 0.1, randn(5, 3, seed=1).abs() + 0.5
    sbp = (S.split(0),) * p.ndim
    x = sbpflow.tensor(a, placement=p, sbp=sbp, requires_grad=True)
    other: object = 2.0 if other_sbp == "scalar" else sbpflow.tensor(
        b, placement=p, sbp=sbp if other_sbp == "same" else (B,) * p.ndim)
    ref = a.clone()
    with sbpflow.no_grad():
        out = fn(x, other)
    fn(ref, 2.0 if other_sbp == "scalar" else b)
    assert out is x and x.sbp == sbp and x.requires_grad
    np.testing.assert_allclose(x.numpy(), ref.numpy(), rtol=1e-6)


def test_inplace_on_local_tensor_and_partial_target() -> None:
    a = randn(3, 4)
    x = sbpflow.tensor(a)
    x.mul_(2.0).add_(1.0)
    np.testing.assert_allclose(x.numpy(), (a * 2 + 1).numpy(), rtol=1e-6)
    p = PLACEMENTS["2"]
    y = global_tensor(a, p, PSUM)
    y.add_(1.0)  # a partial target: adding 1 to each piece would add it twice
    assert y.sbp == (PSUM,)
    np.testing.assert_allclose(y.numpy(), (a + 1).numpy(), rtol=1e-6)


def test_inplace_while_recording_raises() -> None:
    x = sbpflow.tensor(randn(3), requires_grad=True)
    with pytest.raises(sbpflow.AutogradError, match="add_"):
        x.add_(1.0)


def test_inplace_mistakes_raise_sbpflow_errors() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(torch.arange(6).reshape(2, 3), placement=p, sbp=S.split(1))
    with pytest.raises(sbpflow.DTypeError, match=r"add_\(\).*float32.*int64"):
        x.add_(sbpflow.tensor(randn(2, 3), placement=p, sbp=B))
    with pytest.raises(sbpflow.DTypeError, match="mul_"):
        x.mul_(0.5)
    y = sbpflow.tensor(randn(3), placement=p, sbp=B)
    with pytest.raises(sbpflow.ShapeError, match=r"add_\(\).*shape \[2, 3\].*shape \[3\]"):
        y.add_(sbpflow.tensor(randn(2, 3), placement=p, sbp=B))
    z = sbpflow.tensor(randn(3))
    with pytest.raises(sbpflow.ShapeError, match="add_"):
        z.add_(sbpflow.tensor(randn(2, 3)))
