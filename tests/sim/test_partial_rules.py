"""Ops on partial values whose rules used to lie (issue 13, part 1): casts and log/sqrt of partial pieces.

Every input here is built from chosen per-rank pieces, each wrong on its own, so that an op applied piece by
piece (where it does not commute with the reduction) gives a visibly wrong number. Each case is compared with
torch on the logical value.
"""

from __future__ import annotations

import pytest
import torch

import sbpflow
import sbpflow.ops.functional as F
from sbpflow import sbp as S
from sbpflow.comm import record
from sbpflow.errors import IndexOutOfRangeError, ShapeError
from sbpflow.ops import _rules as R
from sbpflow.tensor import Tensor

P2 = sbpflow.placement("cpu", [0, 1])
PSUM, PMAX, PMIN = S.partial_sum, S.partial_max, S.partial_min


def pieces(values: list[list[float]], sbp: S.Partial, dtype: torch.dtype = torch.float32) -> Tensor:
    """A P(op) tensor on P2 whose rank r holds ``values[r]``."""
    shards = {r: torch.tensor(v, dtype=dtype) for r, v in enumerate(values)}
    return Tensor._from_shards(tuple(shards[0].shape), dtype, P2, (sbp,), shards)


def logical(values: list[list[float]], op: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    stacked = torch.tensor(values, dtype=dtype)
    return {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]


def test_long_of_a_partial_sum_rounds_the_whole_value() -> None:
    x = sbpflow.tensor([[0.6, 0.6], [0.7, -0.2]], placement=P2, sbp=S.split(1))
    y = x.sum(1)
    assert y.sbp == (PSUM,)  # the reduction of a split dim stays partial
    assert y.long().tolist() == torch.tensor([[0.6, 0.6], [0.7, -0.2]]).sum(1).long().tolist() == [1, 0]


@pytest.mark.parametrize("cast", [torch.float16, torch.bfloat16, torch.int32, torch.bool])
def test_narrowing_casts_of_partial_sums(cast: torch.dtype) -> None:
    values = [[1000.3, 0.5], [-1000.0, -0.5]]
    out = F.cast(pieces(values, PSUM), cast)
    expected = logical(values, "sum").to(cast)
    assert out.dtype == cast
    assert F.cast(out, torch.float64).tolist() == expected.double().tolist()


def test_half_of_partial_sum_is_0_3_not_0_5() -> None:
    out = pieces([[1000.3], [-1000.0]], PSUM).half()
    assert abs(out.item() - 0.3) < 1e-3


def test_widening_float_cast_stays_partial_with_no_collective() -> None:
    values = [[1.5, -2.0], [0.25, 4.0]]
    with record() as log:
        out = pieces(values, PSUM, torch.float16).float()
    assert out.sbp == (PSUM,) and log.counts() == {}
    torch.testing.assert_close(torch.as_tensor(out.numpy()), logical(values, "sum", torch.float16).float())


@pytest.mark.parametrize("op, sbp", [("max", PMAX), ("min", PMIN)])
def test_bool_of_partial_max_min(op: str, sbp: S.Partial) -> None:
    values = [[-1.0, 0.0, 2.0], [0.0, -3.0, 0.0]]
    out = pieces(values, sbp).bool()
    assert out.tolist() == logical(values, op).bool().tolist()


def test_amax_bool_of_split_pieces() -> None:
    x = sbpflow.tensor([[-1.0, 0.0], [0.0, 0.0]], placement=P2, sbp=S.split(1))
    assert x.amax(1).sbp == (PMAX,)
    assert x.amax(1).bool().tolist() == [False, False]


def test_int_of_partial_min_with_an_empty_shard() -> None:
    x = sbpflow.tensor([[0.5], [2.5]], placement=P2, sbp=S.split(1))  # rank 1 holds no column: its piece is +inf
    assert x.amin(1).long().tolist() == [0, 2]


def test_order_preserving_casts_keep_partial_max() -> None:
    values = [[-1.0, 3.0], [2.0, -7.0]]
    with record() as log:
        out = pieces(values, PMAX).double()
    assert out.sbp == (PMAX,) and log.counts() == {}
    assert out.tolist() == logical(values, "max").double().tolist()


@pytest.mark.parametrize("fn, name", [(F.log, "log"), (F.sqrt, "sqrt")])
def test_log_sqrt_of_partial_max(fn: object, name: str) -> None:
    values = [[-1.0, 4.0, float("-inf")], [2.0, -3.0, 9.0]]  # each losing piece is outside the domain
    out = fn(pieces(values, PMAX))  # type: ignore[operator]
    expected = getattr(torch, name)(logical(values, "max"))
    torch.testing.assert_close(torch.as_tensor(out.numpy()), expected)


@pytest.mark.parametrize("fn, name", [(F.log, "log"), (F.sqrt, "sqrt")])
def test_log_sqrt_of_partial_min_stay_partial(fn: object, name: str) -> None:
    values = [[1.0, 4.0, 0.0], [2.0, 3.0, 9.0]]
    with record() as log:
        out = fn(pieces(values, PMIN))  # type: ignore[operator]
    assert out.sbp == (PMIN,) and log.counts() == {}
    torch.testing.assert_close(torch.as_tensor(out.numpy()), getattr(torch, name)(logical(values, "min")))


def test_log_of_split_max_with_an_empty_shard() -> None:
    x = sbpflow.tensor([[4.0], [0.5]], placement=P2, sbp=S.split(1))
    torch.testing.assert_close(torch.as_tensor(x.amax(1).log().numpy()), torch.tensor([4.0, 0.5]).log())


def test_sum_with_a_narrower_dtype_of_partial_sum() -> None:
    values = [[1000.3, 2.0], [-1000.0, 1.0]]
    out = F.sum(pieces(values, PSUM), dim=0, dtype=torch.float16)
    assert abs(out.item() - torch.tensor(values).sum().half().item()) < 1e-2
    assert abs(out.item() - 3.3) < 1e-2


@pytest.mark.parametrize("src, dst, linear, ordered", [
    (torch.float16, torch.float32, True, True), (torch.bfloat16, torch.float32, True, True),
    (torch.float32, torch.float64, True, True), (torch.float32, torch.float16, False, True),
    (torch.float16, torch.bfloat16, False, True), (torch.float32, torch.int64, False, False),
    (torch.float32, torch.bool, False, False), (torch.bool, torch.float32, False, True),
    (torch.int32, torch.int64, False, True), (torch.int64, torch.int32, False, False),
    (torch.uint8, torch.int8, False, False), (torch.int8, torch.float16, False, True),
])
def test_cast_properties(src: torch.dtype, dst: torch.dtype, linear: bool, ordered: bool) -> None:
    assert R.cast_is_linear(src, dst) is linear
    assert R.cast_keeps_order(src, dst) is ordered


def test_max_of_nothing_raises_like_torch() -> None:
    for x in (sbpflow.zeros(0), sbpflow.zeros(0, placement=P2, sbp=S.split(0))):
        with pytest.raises(ShapeError, match="max/min of a tensor with no elements"):
            x.max()
        with pytest.raises(ShapeError):
            F.amin(x)
    with pytest.raises(IndexError):
        F.amax(sbpflow.zeros(0, 3, placement=P2, sbp=S.split(1)), dim=0)
    with pytest.raises(IndexOutOfRangeError):
        sbpflow.zeros(0, 3).max(dim=0)
    with pytest.raises(RuntimeError):
        torch.zeros(0).max()
    assert F.amax(sbpflow.zeros(0, 3, placement=P2, sbp=S.split(0)), dim=1).shape == torch.Size([0])


@pytest.mark.parametrize("dtype, big", [(torch.bfloat16, 256.0), (torch.float16, 2048.0)])
def test_16_bit_partial_sums_are_reduced_in_fp32(dtype: torch.dtype, big: float) -> None:
    """Summed in 16 bits, big + 1 + 1 + 1 stays big at every step; in fp32 it is big + 3, rounded once."""
    p4 = sbpflow.placement("cpu", [0, 1, 2, 3])
    shards = {r: torch.full((2,), big if r == 0 else 1.0, dtype=dtype) for r in range(4)}
    x = Tensor._from_shards((2,), dtype, p4, (PSUM,), shards)
    want = torch.tensor([big + 3.0] * 2).to(dtype)
    assert F.to_global(x, p4, (S.broadcast,)).tolist() == want.tolist() != [big] * 2
    assert F.to_global(x, p4, (S.split(0),)).tolist() == want.tolist()  # reduce-scatter


@pytest.mark.parametrize("other", [float("inf"), "tensor"])
def test_partial_max_plus_infinity(other: object) -> None:
    """A losing piece of -inf (an empty shard) plus +inf is NaN; the logical max plus inf is inf."""
    x = sbpflow.tensor([[1.0], [2.0]], placement=P2, sbp=S.split(1))  # rank 1 holds no column: its piece is -inf
    m = x.amax(1)
    b = float("inf") if other != "tensor" else sbpflow.tensor([float("inf")] * 2, placement=P2, sbp=S.broadcast)
    assert (m + b).tolist() == [float("inf")] * 2
    assert (m - (-1 * b if other == "tensor" else -b)).tolist() == [float("inf")] * 2  # type: ignore[operator]
