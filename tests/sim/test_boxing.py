"""Boxing on virtual ranks: every conversion keeps the logical value, runs the planned collectives, aliases nothing.

Partial inputs are built from a logical value and pieces that reduce to it
(random pieces for P(sum), non-identical pieces for P(max)/P(min)), and results
are checked by reassembling their shards directly, independently of boxing.
Values are small integers, so sums are exact in every dtype, bfloat16 included.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import sbpflow
from sbpflow import boxing
from sbpflow import sbp as S
from sbpflow._layout import box_shape, shard_box, split_range
from sbpflow.comm import record
from sbpflow.sbp import Broadcast, NdSbp, Split
from sbpflow.tensor import Tensor

B = S.broadcast
PARTIALS = [S.partial_sum, S.partial_max, S.partial_min]
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]


def pl(ranks: Any) -> sbpflow.Placement:
    return sbpflow.placement("cpu", ranks)


CUBE = pl([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
SAME = [pl([0]), pl([0, 1]), pl([0, 1, 2]), pl([0, 1, 2, 3]), pl([[0, 1], [2, 3]]), pl([[0, 1, 2], [3, 4, 5]]), CUBE]
CROSS = [
    (pl([0, 1]), pl([2, 3, 4])),
    (pl([0, 1, 2, 3]), pl([[0, 1], [2, 3]])),
    (pl([[0, 1], [2, 3]]), pl([0, 1, 2, 3])),
    (pl([0]), pl([0, 1, 2])),
    (pl([0, 1, 2]), pl([0])),
    (pl([0, 1, 2]), pl([1, 2, 3])),  # overlapping rank sets
    (pl([[0, 1], [2, 3]]), pl([[3, 2], [1, 0]])),  # same ranks, permuted mesh
    (pl([[0, 1], [2, 3]]), pl([4, 5])),
    (pl([4]), pl([[0, 1, 2], [3, 4, 5]])),
    (pl([[0, 1, 2], [3, 4, 5]]), pl([2, 7])),
    (CUBE, pl([[1, 3], [5, 7]])),
]


# -- building inputs and reading results without boxing ----------------------------------------


def pieces(value: torch.Tensor, placement: sbpflow.Placement, nd: NdSbp, rng: random.Random) -> dict[int, torch.Tensor]:
    """Shards whose logical value under (placement, nd) is ``value``, one mesh axis at a time (outermost first)."""
    groups: dict[tuple[int, ...], torch.Tensor] = {(): value}
    for axis, s in enumerate(nd):
        n = placement.hierarchy[axis]
        groups = {coords + (i,): piece for coords, v in groups.items() for i, piece in enumerate(_cut(v, s, n, rng))}
    return {placement.rank_at(c): t.clone() for c, t in groups.items()}


def _cut(v: torch.Tensor, s: Any, n: int, rng: random.Random) -> list[torch.Tensor]:
    if isinstance(s, Split) and s.zigzag:  # chunks i and 2n-1-i of 2n, as torch.tensor_split cuts them
        chunks = torch.tensor_split(v, 2 * n, dim=s.dim)
        return [torch.cat([chunks[i], chunks[2 * n - 1 - i]], dim=s.dim) for i in range(n)]
    if isinstance(s, Split):
        return [v.narrow(s.dim, *_start_len(v.shape[s.dim], n, i)) for i in range(n)]
    if isinstance(s, Broadcast):
        return [v] * n
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    noise = [torch.randint(0, 4, v.shape, generator=gen).to(v.dtype) for _ in range(n)]
    if s.op == "sum":
        return [v - sum(noise[1:], torch.zeros_like(v))] + noise[1:]
    holder = torch.randint(0, n, v.shape, generator=gen)  # which rank holds the extreme, per element
    step = -1 if s.op == "max" else 1
    return [torch.where(holder == i, v, v + step * (noise[i] + 1)) for i in range(n)]


def _start_len(length: int, parts: int, index: int) -> tuple[int, int]:
    a, b = split_range(length, parts, index)
    return a, b - a


def assemble(shards: dict[int, torch.Tensor], placement: sbpflow.Placement, nd: NdSbp) -> torch.Tensor:
    """The logical value of shards, innermost mesh axis first; broadcast replicas must agree."""
    groups = {placement.coords(r): t for r, t in shards.items()}
    for axis in reversed(range(placement.ndim)):
        merged = {}
        for prefix in sorted({c[:axis] for c in groups}):
            merged[prefix] = _merge([groups[prefix + (i,)] for i in range(placement.hierarchy[axis])], nd[axis])
        groups = merged
    return groups[()]


def _merge(parts: list[torch.Tensor], s: Any) -> torch.Tensor:
    if isinstance(s, Split) and s.zigzag:
        n = len(parts)
        sizes = [len(c) for c in torch.tensor_split(torch.arange(sum(p.shape[s.dim] for p in parts)), 2 * n)]
        chunks: list[torch.Tensor] = [torch.empty(0)] * (2 * n)
        for i, p in enumerate(parts):
            chunks[i], chunks[2 * n - 1 - i] = torch.split(p, [sizes[i], sizes[2 * n - 1 - i]], dim=s.dim)
        return torch.cat(chunks, dim=s.dim)
    if isinstance(s, Split):
        return torch.cat(parts, dim=s.dim)
    if isinstance(s, Broadcast):
        for p in parts[1:]:
            assert torch.equal(p, parts[0]), "broadcast replicas differ"
        return parts[0]
    out = parts[0].clone()
    for p in parts[1:]:
        out = out + p if s.op == "sum" else torch.maximum(out, p) if s.op == "max" else torch.minimum(out, p)
    return out


def make_global(value: torch.Tensor, placement: sbpflow.Placement, nd: NdSbp, seed: int = 0) -> Tensor:
    shards = pieces(value, placement, nd, random.Random(seed))
    x = Tensor._from_shards(tuple(value.shape), value.dtype, placement, nd, shards)
    assert torch.equal(assemble(x.local_tensors(), placement, nd), value)  # the builder itself is right
    return x


def logical(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-20, 20, shape, generator=gen).to(dtype)


# -- the checks every conversion must pass ---------------------------------------------------


def assert_no_aliasing(shards: dict[int, torch.Tensor]) -> None:
    """No two ranks share memory: an in-place update on one rank's shard leaves every other shard alone."""
    storages = {}
    for r, t in shards.items():
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            assert ptr not in storages, f"ranks {storages.get(ptr)} and {r} share memory"
            storages[ptr] = r
    for r, t in shards.items():
        if not t.numel():
            continue
        before = {q: u.clone() for q, u in shards.items() if q != r}
        t.add_(1)
        for q, u in before.items():
            assert torch.equal(shards[q], u), f"an in-place update on rank {r} changed rank {q}"
        t.sub_(1)


def convert_and_check(x: Tensor, value: torch.Tensor, placement: sbpflow.Placement, nd: NdSbp) -> Tensor:
    src = boxing.Layout(x.placement, x.sbp)
    plan = boxing.plan(tuple(x.shape), x.dtype, src, boxing.Layout(placement, nd))
    with record() as log:
        y = x.to_global(placement=placement, sbp=nd)
    assert (y.placement, y.sbp, tuple(y.shape), y.dtype) == (placement, nd, tuple(value.shape), value.dtype)
    shards = y.local_tensors()
    assert sorted(shards) == sorted(placement.flat_ranks)
    for r, t in shards.items():
        assert tuple(t.shape) == box_shape(shard_box(tuple(value.shape), placement, nd, r)), f"rank {r} shape"
        assert t.dtype == value.dtype
    assert torch.equal(assemble(shards, placement, nd), value), f"{plan}"
    assert log.kinds() == expected_events(plan), f"{log.kinds()}\n{plan}"
    assert log.total_bytes() == plan.bytes, f"recorded {log.total_bytes()} B, planned {plan.bytes} B\n{plan}"
    if plan.steps:
        assert_no_aliasing(shards)
    return y


def expected_events(plan: boxing.Plan) -> list[str]:
    """The collective calls a plan makes: one per group along the step's mesh axis (a 2x3 mesh has 3 groups
    on axis 0, 2 on axis 1); a send_recv that moves no bytes (every piece stays on its rank) makes none."""
    events = []
    for step in plan.steps:
        if step.kind in ("local", "relabel") or (step.kind == "send_recv" and step.bytes == 0):
            continue
        groups = 1 if step.axis is None else len(step.src.placement.axis_groups(step.axis))
        events += [step.kind] * groups
    return events


# -- exhaustive on one axis ----------------------------------------------------------------------


def one_d_sbps(ndim: int) -> list[Any]:
    return [B, *(S.split(d) for d in range(ndim)), *(S.zigzag(d) for d in range(ndim)), *PARTIALS]


def zigzag_ok(nd: NdSbp) -> bool:
    """A zigzag split is the only split of its dim and the only zigzag entry (sbp.normalize's rule)."""
    zigzags = [s for s in nd if isinstance(s, Split) and s.zigzag]
    dims = [s.dim for s in nd if isinstance(s, Split)]
    return not zigzags or (len(zigzags) == 1 and dims.count(zigzags[0].dim) == 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 2), (2, 7), (1,)], ids=str)
def test_every_one_d_pair_on_three_ranks(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    placement = pl([0, 1, 2])
    value = logical(shape, dtype, seed=len(shape))
    for a in one_d_sbps(len(shape)):
        for b in one_d_sbps(len(shape)):
            x = make_global(value, placement, (a,))
            convert_and_check(x, value, placement, (b,))


# -- property tests: any pair, any mesh, across placements ---------------------------------------


def nd_sbp(draw: Any, ndim: int, placement: sbpflow.Placement) -> NdSbp:
    nd = tuple(draw(st.sampled_from(one_d_sbps(ndim))) for _ in range(placement.ndim))
    assume(zigzag_ok(nd))
    return nd


@st.composite
def cases(draw: Any, pairs: list[tuple[sbpflow.Placement, sbpflow.Placement]]) -> tuple[Any, ...]:
    src_pl, dst_pl = draw(st.sampled_from(pairs))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    return src_pl, dst_pl, shape, dtype, nd_sbp(draw, len(shape), src_pl), nd_sbp(draw, len(shape), dst_pl), \
        draw(st.integers(0, 1000))


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(cases([(p, p) for p in SAME]))
def test_any_pair_on_one_placement_keeps_the_value(case: tuple[Any, ...]) -> None:
    src_pl, dst_pl, shape, dtype, a, b, seed = case
    value = logical(shape, dtype, seed)
    convert_and_check(make_global(value, src_pl, a, seed), value, dst_pl, b)


@PROPERTY
@given(cases(CROSS))
def test_any_pair_across_placements_keeps_the_value(case: tuple[Any, ...]) -> None:
    src_pl, dst_pl, shape, dtype, a, b, seed = case
    value = logical(shape, dtype, seed)
    convert_and_check(make_global(value, src_pl, a, seed), value, dst_pl, b)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_chains_of_conversions_keep_the_value(shape: list[int], data: Any) -> None:
    """Several hops in a row (as a program does): the value survives every one."""
    value = logical(tuple(shape), torch.float32, seed=sum(shape))
    x = make_global(value, SAME[4], (B, B))
    for _ in range(4):
        placement = data.draw(st.sampled_from(SAME[1:]))
        nd = tuple(data.draw(st.sampled_from(one_d_sbps(len(shape)))) for _ in range(placement.ndim))
        assume(zigzag_ok(nd))
        x = convert_and_check(x, value, placement, nd)


# -- named cases from the issue -------------------------------------------------------------------


@pytest.mark.parametrize(
    "src_pl, a, dst_pl, b",
    [
        (pl([0, 1]), (S.split(0),), pl([2, 3, 4]), (S.split(0),)),
        (pl([0, 1]), (S.partial_sum,), pl([2, 3, 4]), (S.split(1),)),
        (pl([0, 1, 2, 3]), (S.split(1),), pl([[0, 1], [2, 3]]), (S.split(1), S.split(0))),
        (pl([0, 1, 2, 3]), (S.partial_max,), pl([[0, 1], [2, 3]]), (B, S.split(0))),
        (pl([0]), (B,), pl([0, 1, 2]), (S.split(0),)),
        (pl([0, 1, 2]), (S.split(0),), pl([0]), (B,)),
        (pl([0, 1, 2]), (S.partial_min,), pl([0]), (B,)),
    ],
    ids=["2->3 S", "2->3 P->S", "4->2x2", "4->2x2 Pmax", "1->3", "3->1", "3->1 Pmin"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moves_between_placements(src_pl: Any, a: NdSbp, dst_pl: Any, b: NdSbp, dtype: torch.dtype) -> None:
    value = logical((5, 3), dtype, seed=3)
    convert_and_check(make_global(value, src_pl, a), value, dst_pl, b)


def test_one_rank_to_three_and_back() -> None:
    value = logical((4, 5), torch.float32, seed=4)
    x = make_global(value, pl([0]), (B,))
    with record() as log:
        y = convert_and_check(x, value, pl([0, 1, 2]), (B,))
    assert log.counts() == {"broadcast": 1}
    with record() as log:
        convert_and_check(y, value, pl([0]), (B,))
    assert log.counts() == {}  # rank 0 already holds the value


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("op", ["max", "min"])
def test_partial_max_min_reduce_with_their_own_op(op: str, dtype: torch.dtype) -> None:
    # Pieces are well away from the value (±1..4) on all ranks but one, so a sum or the wrong extreme shows.
    value = logical((3, 5), dtype, seed=5)
    x = make_global(value, pl([0, 1, 2]), (S.Partial(op),))
    for b in [(B,), (S.split(0),), (S.split(1),), (S.partial_sum,)]:
        convert_and_check(x, value, pl([0, 1, 2]), b)


def test_empty_shards_and_dims_smaller_than_the_mesh() -> None:
    value = logical((2, 1), torch.float32, seed=6)
    mesh = pl([[0, 1, 2], [3, 4, 5]])
    for a in [(S.split(0), S.split(0)), (S.split(1), S.split(0)), (S.partial_sum, S.split(1))]:
        x = make_global(value, mesh, a)
        assert any(t.numel() == 0 for t in x.local_tensors().values())
        for b in [(B, B), (S.split(1), S.split(1)), (S.split(0), S.partial_max), (B, S.split(0))]:
            convert_and_check(x, value, mesh, b)


def test_zero_size_tensors_convert() -> None:
    value = torch.zeros(0, 3)
    x = make_global(value, pl([0, 1]), (S.split(1),))
    for b in [(B,), (S.split(0),), (S.partial_sum,)]:
        convert_and_check(x, value, pl([0, 1]), b)
    convert_and_check(x, value, pl([2, 3, 4]), (S.split(0),))


def test_nested_split_of_one_dim_on_a_mesh() -> None:
    # (S(0), S(0)) on 2x3 cuts 7 rows into 4 | 3, then each into 2,1,1 | 1,1,1: rank order is row order.
    value = torch.arange(7 * 2, dtype=torch.float32).reshape(7, 2)
    mesh = pl([[0, 1, 2], [3, 4, 5]])
    x = sbpflow.tensor(value, placement=mesh, sbp=(S.split(0), S.split(0)))
    rows = [t.shape[0] for _, t in sorted(x.local_tensors().items())]
    assert rows == [2, 1, 1, 1, 1, 1]
    with record() as log:
        convert_and_check(x, value, mesh, (B, B))
    assert log.counts() == {"all_gather": 2 + 3}  # axis 1 in 2 groups, then axis 0 in 3 groups


# -- recorded collectives match the plan ----------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, counts",
    [
        (S.split(0), B, {"all_gather": 1}),
        (S.split(0), S.split(1), {"all_to_all": 1}),
        (S.partial_sum, B, {"all_reduce": 1}),
        (S.partial_sum, S.split(0), {"reduce_scatter": 1}),
        (B, S.split(1), {}),
        (B, S.partial_sum, {}),
        (S.split(1), S.split(1), {}),
    ],
    ids=str,
)
def test_canonical_pairs_record_exactly_the_planned_collective(a: Any, b: Any, counts: dict[str, int]) -> None:
    p4 = pl([0, 1, 2, 3])
    value = logical((8, 8), torch.float32, seed=7)
    x = make_global(value, p4, (a,))
    plan = boxing.plan((8, 8), torch.float32, boxing.Layout(p4, (a,)), boxing.Layout(p4, (b,)))
    with record() as log:
        convert_and_check(x, value, p4, (b,))
    assert log.counts() == counts == dict(Counter(plan.collectives()))
    assert [e.ranks for e in log.events] == [(0, 1, 2, 3)] * len(log.events)
    assert log.total_bytes() == plan.bytes


def test_explain_returns_the_plan_that_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """A REPL shows the returned text once (its repr is the text); explain prints nothing itself (issue 32)."""
    x = sbpflow.zeros(4, 6, placement=pl([0, 1]), sbp=S.split(0))
    text = sbpflow.explain(x, sbp=S.split(1))
    assert capsys.readouterr().out == "" and repr(text) == str(text)
    assert "all_to_all axis 0" in text and "(S(0)) -> (S(1))" in text
    text = sbpflow.explain(x, pl([2, 3, 4]), S.split(0))
    assert "send_recv(general)" in text and "cpu:[2, 3, 4]" in text
    assert "identity" in sbpflow.explain(x)


def test_boxing_keeps_the_source_tensor_intact() -> None:
    value = logical((6, 4), torch.float32, seed=8)
    x = make_global(value, pl([0, 1, 2]), (S.partial_sum,))
    before = {r: t.clone() for r, t in x.local_tensors().items()}
    for b in [B, S.split(0), S.split(1), S.partial_max]:
        y = x.to_global(sbp=b)
        for t in y.local_tensors().values():
            t.add_(100)
    for r, t in x.local_tensors().items():
        assert torch.equal(t, before[r])
