"""The harness's partial inputs: random pieces, each wrong alone, whose reduction is the value."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from harness import PLACEMENTS, global_tensor, partial_shards, randn
from sbpflow import sbp as S
from sbpflow.comm import record

PARTIALS = [S.partial_sum, S.partial_max, S.partial_min]
LAYOUTS = [("2", (p,)) for p in PARTIALS] + [("3", (p,)) for p in PARTIALS] + [
    ("2x2", nd) for nd in itertools.product(PARTIALS + [S.broadcast, S.split(0)], repeat=2)
    if any(isinstance(s, S.Partial) for s in nd)
]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32]


def _value(dtype: torch.dtype, shape: tuple[int, ...] = (5, 3)) -> torch.Tensor:
    x = randn(*shape, seed=3) * 10
    return x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "nd"), LAYOUTS, ids=str)
def test_pieces_reduce_to_the_value(name: str, nd: tuple, dtype: torch.dtype) -> None:
    value = _value(dtype)
    if dtype == torch.float16 and any(s == S.partial_sum for s in nd):
        pytest.skip("a half-precision sum of pieces rounds: covered by the float32/float64 cases")
    t = global_tensor(value, PLACEMENTS[name], nd, seed=1)
    with record() as log:
        got = t.numpy()
    if dtype.is_floating_point:
        np.testing.assert_allclose(got, value.numpy(), rtol=1e-6 if dtype != torch.float16 else 1e-3, atol=1e-5)
    else:
        np.testing.assert_array_equal(got, value.numpy())
    assert log.counts(), "reading a partial value must reduce it"


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool], ids=str)
def test_every_piece_is_wrong_alone(op: str, dtype: torch.dtype) -> None:
    if op == "sum" and dtype == torch.bool:
        pytest.skip("no P(sum) of bool")
    value = _value(dtype, (40,)) if dtype != torch.bool else _value(torch.float32, (40,)) > 0
    shards = partial_shards(value, PLACEMENTS["3"], (S.Partial(op),), seed=2)
    for r, piece in shards.items():
        assert not torch.equal(piece.cpu(), value), f"rank {r} holds the whole value"
    if op != "sum" and dtype.is_floating_point:
        assert any(bool(p.isneginf().any() if op == "max" else p.isposinf().any()) for p in shards.values()), (
            "some losing pieces must be the identity, as from an empty shard")


def test_pieces_are_seeded() -> None:
    value = _value(torch.float32)
    a = partial_shards(value, PLACEMENTS["2x2"], (S.partial_sum, S.partial_max), seed=5)
    b = partial_shards(value, PLACEMENTS["2x2"], (S.partial_sum, S.partial_max), seed=5)
    c = partial_shards(value, PLACEMENTS["2x2"], (S.partial_sum, S.partial_max), seed=6)
    assert all(torch.equal(a[r], b[r]) for r in a)
    assert not all(torch.equal(a[r], c[r]) for r in a)


def test_empty_shards() -> None:
    """A split dim shorter than the mesh leaves a rank with an empty shard; the partial axis still reduces."""
    value = _value(torch.float32, (1, 3))
    t = global_tensor(value, PLACEMENTS["2x2"], (S.split(0), S.partial_max), seed=1)
    assert min(s.numel() for s in t.local_tensors().values()) == 0
    np.testing.assert_array_equal(t.numpy(), value.numpy())


@pytest.mark.parametrize("op", ["max", "min"])
def test_finite_pieces_on_request(op: str) -> None:
    """``empty_share=0``: losing pieces are finite, so a rule failing only on finite losers shows too."""
    value = _value(torch.float32, (40,))
    shards = partial_shards(value, PLACEMENTS["3"], (S.Partial(op),), seed=2, empty_share=0.0)
    assert all(bool(p.isfinite().all()) for p in shards.values())
    stacked = torch.stack(list(shards.values())).cpu()
    assert torch.equal(stacked.amax(0) if op == "max" else stacked.amin(0), value)
