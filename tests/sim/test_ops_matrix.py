"""matmul / bmm / linear against torch: every signature, batch dims, 1-D operands, and their collectives."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sbpflow
import sbpflow.ops.functional as F
from harness import PLACEMENTS, PSUM, B, all_reduce_payloads, check, global_tensor, randn, random_sbp
from sbpflow import sbp as S
from sbpflow.comm import record

PNAMES = ["1", "2", "3", "2x2"]


def _nd(p: sbpflow.Placement, s: object) -> tuple[object, ...]:
    return (s,) * p.ndim


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("sa,sb,expected", [
    (S.split(0), B, S.split(0)),  # rows of a
    (B, S.split(1), S.split(1)),  # columns of b
    (S.split(1), S.split(0), PSUM),  # the contraction dim
    (B, B, B),
])
def test_matmul_signatures_need_no_forward_comm(pname: str, sa: object, sb: object, expected: object) -> None:
    p = PLACEMENTS[pname]
    r = check(lambda a, b: a @ b, lambda a, b: a @ b, [randn(7, 5), randn(5, 3, seed=1)], p, [_nd(p, sa), _nd(p, sb)])
    assert r.forward_log.counts() == {}
    assert r.out.sbp == _nd(p, expected)


@pytest.mark.parametrize("pname", ["2", "3"])
@pytest.mark.parametrize("partial_side", [0, 1])
def test_matmul_partial_times_broadcast_stays_partial(pname: str, partial_side: int) -> None:
    p = PLACEMENTS[pname]
    a, b = randn(5, 4), randn(4, 3, seed=1)
    ps = global_tensor(a if partial_side == 0 else b, p, PSUM)
    bs = sbpflow.tensor(b if partial_side == 0 else a, placement=p, sbp=B)
    with record() as log:
        out = ps @ bs if partial_side == 0 else bs @ ps
    assert log.counts() == {} and out.sbp == (PSUM,)
    np.testing.assert_allclose(out.numpy(), (a @ b).numpy(), rtol=1e-5, atol=1e-6)


def test_contraction_split_backward_gives_split_grads_without_comm() -> None:
    # S(1) @ S(0) -> P(sum); upstream B; da = dy @ b^T keeps S(1), db = a^T @ dy keeps S(0)
    p = PLACEMENTS["3"]
    r = check(lambda a, b: a @ b, lambda a, b: a @ b, [randn(4, 7), randn(7, 3, seed=1)], p, [S.split(1), S.split(0)])
    assert r.out.sbp == (PSUM,)
    assert r.backward_log.counts() == {}


def test_ddp_matmul_weight_grad_is_one_all_reduce() -> None:
    p = PLACEMENTS["3"]
    r = check(lambda x, w: (x @ w).relu(), lambda x, w: (x @ w).relu(), [randn(7, 4), randn(4, 5, seed=1)], p,
              [S.split(0), B], grad=[False, True])
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {"all_reduce": 1}


@st.composite
def _batched_case(draw):  # type: ignore[no-untyped-def]
    batch = draw(st.sampled_from([(), (3,), (2, 5), (5, 1)]))
    b_batch = draw(st.sampled_from([batch, batch[1:], tuple(1 for _ in batch)]))
    m, k, n = draw(st.integers(1, 6)), draw(st.integers(1, 7)), draw(st.integers(1, 5))
    pname = draw(st.sampled_from(PNAMES))
    return batch + (m, k), b_batch + (k, n), pname, draw(st.integers(0, 10_000))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(_batched_case())
def test_batched_matmul_any_input_sbps(case) -> None:  # type: ignore[no-untyped-def]
    sa, sb, pname, seed = case
    p = PLACEMENTS[pname]
    rng = random.Random(seed)
    sbps = [random_sbp(sa, p, rng, partial=True), random_sbp(sb, p, rng)]
    check(lambda a, b: a @ b, torch.matmul, [randn(*sa, seed=seed), randn(*sb, seed=seed + 1)], p, sbps)


@pytest.mark.parametrize("pname", PNAMES)
def test_batch_split_is_local(pname: str) -> None:
    p = PLACEMENTS[pname]
    sbps = [_nd(p, S.split(0)), _nd(p, S.split(0))]
    r = check(F.bmm, torch.bmm, [randn(5, 3, 4), randn(5, 4, 2, seed=1)], p, sbps)
    assert r.forward_log.counts() == {} and r.backward_log.counts() == {}
    assert r.out.sbp == _nd(p, S.split(0))


def test_batch_split_of_one_side_broadcasts_the_other() -> None:
    p = PLACEMENTS["2"]
    r = check(lambda a, b: a @ b, torch.matmul, [randn(5, 3, 4), randn(4, 2, seed=1)], p, [S.split(0), B])
    assert r.forward_log.counts() == {} and r.out.sbp == (S.split(0),)


@pytest.mark.parametrize("sa,sb", [((S.split(0), S.split(2)), (B, S.split(0))),
                                   ((S.split(0), B), (B, S.split(1))),
                                   ((B, S.split(2)), (B, S.split(0)))])
def test_matmul_on_2x2_mesh_combines_signatures(sa: tuple, sb: tuple) -> None:  # type: ignore[type-arg]
    p = PLACEMENTS["2x2"]
    r = check(lambda a, b: a @ b, torch.matmul, [randn(3, 5, 6), randn(6, 4, seed=1)], p, [sa, sb])
    assert r.forward_log.counts() == {}


@pytest.mark.parametrize("shapes", [((5,), (5, 3)), ((4, 5), (5,)), ((5,), (5,)), ((2, 3, 5), (5,))])
@pytest.mark.parametrize("pname", ["1", "3"])
def test_matmul_with_1d_operands(shapes: tuple, pname: str) -> None:  # type: ignore[type-arg]
    p = PLACEMENTS[pname]
    sa, sb = shapes
    check(F.matmul, torch.matmul, [randn(*sa), randn(*sb, seed=1)], p, [B, S.split(0)])


# -- linear --------------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("layout,out_sbp", [
    ("data", S.split(0)),  # x S(0), w B, b B
    ("column", S.split(2)),  # x B, w S(0), b S(0)
    ("row", PSUM),  # x S(-1), w S(1), b P: the bias counted once
])
def test_linear_parallel_layouts(pname: str, layout: str, out_sbp: object) -> None:
    p = PLACEMENTS[pname]
    x, w, b = randn(5, 3, 6), randn(4, 6, seed=1), randn(4, seed=2)
    sbps = {"data": [S.split(0), B, B], "column": [B, S.split(0), S.split(0)],
            "row": [S.split(2), S.split(1), B]}[layout]
    r = check(F.linear, torch.nn.functional.linear, [x, w, b], p, [_nd(p, s) for s in sbps])
    if layout != "row":
        assert r.forward_log.counts() == {}
    assert r.out.sbp == _nd(p, out_sbp) or layout == "row"


def test_linear_data_parallel_weight_and_bias_grads_share_one_bucket() -> None:
    p = PLACEMENTS["3"]
    def loss(fn):  # type: ignore[no-untyped-def]
        return lambda x, w, b: fn(x, w, b).relu().sum()

    r = check(loss(F.linear), loss(torch.nn.functional.linear), [randn(7, 5), randn(6, 5, seed=1), randn(6, seed=2)],
              p, [S.split(0), B, B], grad=[False, True, True])
    assert r.out.sbp == (PSUM,)
    assert all_reduce_payloads(r.backward_log) == [4 * (6 * 5 + 6)]  # weight and bias: one flat bucket, as DDP
    assert r.backward_log.counts() == {"all_reduce": 1}


def test_linear_without_bias_and_row_parallel_output_partial() -> None:
    p = PLACEMENTS["2"]
    x, w = randn(3, 8), randn(5, 8, seed=1)
    r = check(F.linear, torch.nn.functional.linear, [x, w], p, [S.split(1), S.split(1)])
    assert r.out.sbp == (PSUM,) and r.forward_log.counts() == {}


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.sampled_from([(5,), (4, 3), (2, 3, 5)]), st.sampled_from(PNAMES), st.booleans(), st.integers(0, 10_000))
def test_linear_any_input_sbps(lead: tuple, pname: str, bias: bool, seed: int) -> None:  # type: ignore[type-arg]
    p = PLACEMENTS[pname]
    rng = random.Random(seed)
    shapes = [lead + (6,), (4, 6)] + ([(4,)] if bias else [])
    values = [randn(*s, seed=seed + i) for i, s in enumerate(shapes)]
    sbps = [random_sbp(s, p, rng) for s in shapes]
    check(F.linear, torch.nn.functional.linear, values, p, sbps)


def test_local_matmul_and_linear() -> None:
    a, b, w = randn(3, 4), randn(4, 2, seed=1), randn(5, 4, seed=2)
    check(lambda x, y: x @ y, torch.matmul, [a, b], None)
    check(F.linear, torch.nn.functional.linear, [a, w], None)
    check(lambda x, y: x.matmul(y), torch.matmul, [a, b], None)


@pytest.mark.parametrize("where", [None, "1", "2"])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, True), (True, False, False), (False, False, True),
                                   (True, True, False)])
def test_linear_gradients_for_any_inputs_needing_them(where: str | None, needs: tuple[bool, ...],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Local and one-rank backward runs linear_backward (one op) for the wanted gradients only; more ranks run the
    three ops. Either way the gradients are torch's, and None where not wanted."""
    from sbpflow.ops import schema

    dispatched: list[str] = []
    inner = schema.apply

    def counting(opdef, args, attrs):  # type: ignore[no-untyped-def]
        dispatched.append(opdef.name)
        return inner(opdef, args, attrs)

    monkeypatch.setattr(schema, "apply", counting)
    values = [randn(2, 3, 6), randn(4, 6, seed=1), randn(4, seed=2)]
    theirs = [v.clone().requires_grad_(n) for v, n in zip(values, needs, strict=True)]
    torch.nn.functional.linear(*theirs).square().sum().backward()
    p = PLACEMENTS[where] if where else None
    ours = [sbpflow.tensor(v, placement=p, sbp=S.broadcast, requires_grad=n) if p else
            sbpflow.tensor(v, requires_grad=n) for v, n in zip(values, needs, strict=True)]
    F.linear(*ours).square().sum().backward()
    for mine, ref in zip(ours, theirs, strict=True):
        if ref.grad is None:
            assert mine.grad is None
        else:
            np.testing.assert_allclose(mine.grad.numpy(), ref.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert ("linear_backward" in dispatched) == (where != "2")
    assert ("linear_weight_grad" in dispatched) == (where == "2" and needs[1])
