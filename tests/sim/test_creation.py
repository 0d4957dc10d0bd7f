"""Creating tensors: from data, constants, ranges and random streams, local or global, and the errors on bad input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import assert_own_memory
from sbpflow import PlacementError, SbpError, ShapeError
from sbpflow import random as sbp_random
from sbpflow import sbp as S

B = S.broadcast
P1 = sbpflow.placement("cpu", [0])
P2 = sbpflow.placement("cpu", [0, 1])
P3 = sbpflow.placement("cpu", [0, 1, 2])
MESH = sbpflow.placement("cpu", [[0, 1], [2, 3]])
MESH23 = sbpflow.placement("cpu", [[0, 1, 2], [3, 4, 5]])


def shards(x: sbpflow.Tensor) -> list[torch.Tensor]:
    return [t for _, t in sorted(x.local_tensors().items())]


# -- from data ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_tensor_from_data_is_split_as_tensor_split(kind: str) -> None:
    rows = [[float(3 * i + j) for j in range(3)] for i in range(7)]
    data: Any = {"list": rows, "numpy": np.array(rows, dtype=np.float32), "torch": torch.tensor(rows)}[kind]
    x = sbpflow.tensor(data, placement=P3, sbp=S.split(0))
    assert x.is_global and tuple(x.shape) == (7, 3) and x.dtype == torch.float32 and x.sbp == (S.split(0),)
    expected = torch.tensor_split(torch.tensor(rows), 3, dim=0)  # 3, 2, 2 rows
    assert [tuple(t.shape) for t in shards(x)] == [(3, 3), (2, 3), (2, 3)]
    for got, want in zip(shards(x), expected, strict=True):
        assert torch.equal(got, want)
    np.testing.assert_array_equal(x.numpy(), np.array(rows, dtype=np.float32))
    assert_own_memory(x)


def test_tensor_dtype_requires_grad_and_local_default() -> None:
    x = sbpflow.tensor([1, 2, 3], dtype=torch.float64, requires_grad=True)
    assert not x.is_global and x.dtype == torch.float64 and x.requires_grad
    y = sbpflow.tensor(np.arange(4), placement=P2, sbp=S.split(0))
    assert y.dtype == torch.int64 and y.numpy().tolist() == [0, 1, 2, 3]
    z = sbpflow.tensor([1.5, 2.5], placement=P2, sbp=B, dtype=torch.bfloat16)
    assert z.dtype == torch.bfloat16 and z.numpy().tolist() == [1.5, 2.5]


def test_tensor_copies_its_source() -> None:
    source = torch.ones(4)
    array = np.ones(4, dtype=np.float32)
    local, global_ = sbpflow.tensor(source), sbpflow.tensor(source, placement=P2, sbp=B)
    from_numpy = sbpflow.tensor(array, placement=P2, sbp=S.split(0))
    source.add_(1)
    array += 1
    assert local.numpy().tolist() == [1.0] * 4 and global_.numpy().tolist() == [1.0] * 4
    assert from_numpy.numpy().tolist() == [1.0] * 4


def test_uneven_split_gives_empty_shards() -> None:
    x = sbpflow.tensor([[1.0, 2.0]], placement=P3, sbp=S.split(0))
    assert [t.shape[0] for t in shards(x)] == [1, 0, 0]
    assert x.numpy().tolist() == [[1.0, 2.0]]
    y = sbpflow.tensor([[1.0, 2.0]], placement=MESH23, sbp=(S.split(1), S.split(1)))
    assert [tuple(t.shape) for t in shards(y)] == [(1, 1), (1, 0), (1, 0), (1, 1), (1, 0), (1, 0)]
    assert y.numpy().tolist() == [[1.0, 2.0]]


def test_partial_sbp_from_data_keeps_the_logical_value() -> None:
    value = [[1.0, -2.0], [3.0, 4.0]]
    for sbp in [S.partial_sum, S.partial_max, S.partial_min]:
        x = sbpflow.tensor(value, placement=P3, sbp=sbp)
        assert x.numpy().tolist() == value
        assert_own_memory(x)


# -- constants and ranges -----------------------------------------------------------------------------


def test_constants_without_placement_are_local() -> None:
    for x in [sbpflow.zeros(2, 3), sbpflow.ones((2, 3)), sbpflow.full((2, 3), 7.0), sbpflow.randn(2, 3),
              sbpflow.rand(2, 3), sbpflow.arange(6)]:
        assert not x.is_global
    assert sbpflow.full((2, 3), 7.0).numpy().tolist() == [[7.0] * 3] * 2
    assert sbpflow.full((2,), 7).dtype == torch.int64
    assert sbpflow.zeros(2, dtype=torch.int64).dtype == torch.int64


@pytest.mark.parametrize("placement, sbp", [(P3, S.split(1)), (MESH, (S.split(0), S.split(1))), (P2, S.partial_sum),
                                            (MESH, (S.partial_max, B)), (MESH23, (S.split(1), S.split(1)))], ids=str)
def test_constants_on_placements(placement: sbpflow.Placement, sbp: Any) -> None:
    for make, fill in [(sbpflow.zeros, 0.0), (sbpflow.ones, 1.0)]:
        x = make(3, 5, placement=placement, sbp=sbp)
        assert x.placement == placement and tuple(x.shape) == (3, 5)
        np.testing.assert_array_equal(x.numpy(), np.full((3, 5), fill, dtype=np.float32))
        assert_own_memory(x)
    y = sbpflow.full((3, 5), -2, placement=placement, sbp=sbp)
    assert y.dtype == torch.int64 and (y.numpy() == -2).all()
    assert_own_memory(y)


@pytest.mark.parametrize("placement, sbp", [(P3, S.split(0)), (MESH, (S.split(0), S.split(0))), (P2, S.partial_sum),
                                            (MESH, (S.partial_min, S.split(0))), (P3, B)], ids=str)
def test_arange_on_placements(placement: sbpflow.Placement, sbp: Any) -> None:
    x = sbpflow.arange(7, placement=placement, sbp=sbp)
    assert x.numpy().tolist() == list(range(7)) and x.dtype == torch.int64
    y = sbpflow.arange(1.0, 3.0, 0.25, placement=placement, sbp=sbp)
    np.testing.assert_allclose(y.numpy(), np.arange(1.0, 3.0, 0.25, dtype=np.float32))
    assert_own_memory(x)


def test_arange_local_shards() -> None:
    x = sbpflow.arange(7, placement=P3, sbp=S.split(0))
    assert [t.tolist() for t in shards(x)] == [[0, 1, 2], [3, 4], [5, 6]]


# -- random: the logical value ignores placement and SBP ----------------------------------------------

LAYOUTS = [
    (None, None), (P1, B), (P2, S.split(0)), (P3, S.split(1)), (P3, B), (P3, S.partial_sum), (P2, S.partial_max),
    (MESH, (S.split(0), S.split(1))), (MESH, (S.split(0), S.split(0))), (MESH, (S.partial_sum, S.split(1))),
    (MESH, (B, S.partial_min)), (MESH23, (S.split(1), S.split(0))), (sbpflow.placement("cpu", [5, 2]), S.split(1)),
]


def _draw(kind: str, shape: tuple[int, ...], layout: tuple[Any, Any], dtype: torch.dtype, seed: int = 3) -> np.ndarray:
    sbpflow.manual_seed(seed)
    placement, sbp = layout
    if sbp is not None:  # a 1-D tensor has only dim 0 to split
        nd = sbp if isinstance(sbp, tuple) else (sbp,)
        sbp = tuple(S.split(s.dim % len(shape)) if isinstance(s, S.Split) else s for s in nd)
    make = sbpflow.randn if kind == "randn" else sbpflow.rand
    sbpflow.randn(2)  # call order counts: the value below is the second draw
    return make(*shape, placement=placement, sbp=sbp, dtype=dtype).numpy()


@pytest.mark.parametrize("kind", ["randn", "rand"])
@pytest.mark.parametrize("shape", [(5, 7), (3, 300, 5), (70_000,)], ids=str)
def test_random_values_do_not_depend_on_placement_or_sbp(kind: str, shape: tuple[int, ...]) -> None:
    reference = _draw(kind, shape, LAYOUTS[0], torch.float32)
    assert reference.std() > 0.2
    for layout in LAYOUTS[1:]:
        np.testing.assert_array_equal(_draw(kind, shape, layout, torch.float32), reference, err_msg=str(layout))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_random_values_match_across_layouts_in_other_dtypes(dtype: torch.dtype) -> None:
    reference = _draw("randn", (6, 5), LAYOUTS[0], dtype)
    for layout in LAYOUTS[1:]:
        np.testing.assert_array_equal(_draw("randn", (6, 5), layout, dtype), reference, err_msg=str(layout))


def test_random_values_depend_on_seed_and_call_order() -> None:
    sbpflow.manual_seed(1)
    a, b = sbpflow.randn(4, 4).numpy(), sbpflow.randn(4, 4).numpy()
    sbpflow.manual_seed(1)
    again = sbpflow.randn(4, 4, placement=P2, sbp=S.split(1)).numpy()
    sbpflow.manual_seed(2)
    other = sbpflow.randn(4, 4).numpy()
    assert not np.array_equal(a, b) and not np.array_equal(a, other)
    np.testing.assert_array_equal(a, again)
    sbpflow.manual_seed(1)
    u = sbpflow.rand(1000, placement=P3, sbp=S.split(0)).numpy()
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.05


def test_a_rank_draws_only_its_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[int] = []
    original = sbp_random._tile

    def counting(key: int, index: int, shape: tuple[int, ...], kind: str, dtype: torch.dtype) -> torch.Tensor:
        drawn.append(int(np.prod(shape)))
        return original(key, index, shape, kind, dtype)

    monkeypatch.setattr(sbp_random, "_tile", counting)
    # (1024, 256) is 4 tiles of 256 x 256; on 4 ranks split by rows each rank draws exactly one.
    sbpflow.randn(1024, 256, placement=sbpflow.placement("cpu", [0, 1, 2, 3]), sbp=S.split(0))
    assert drawn == [256 * 256] * 4
    drawn.clear()
    # A partial sum keeps the value on one rank; the others hold zeros and draw nothing.
    x = sbpflow.randn(1024, 256, placement=P3, sbp=S.partial_sum)
    assert sum(drawn) == 1024 * 256
    assert [float(t.abs().sum()) == 0.0 for t in shards(x)] == [False, True, True]


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=str)
def test_random_shards_own_their_memory(layout: tuple[Any, Any]) -> None:
    placement, sbp = layout
    assert_own_memory(sbpflow.randn(5, 4, placement=placement, sbp=sbp))


def test_randint_and_uniform_are_placement_independent() -> None:
    sbpflow.manual_seed(5)
    a = sbpflow.randint(0, 10, (6, 6)).numpy()
    sbpflow.manual_seed(5)
    b = sbpflow.randint(0, 10, (6, 6), placement=MESH, sbp=(S.split(1), S.split(0))).numpy()
    np.testing.assert_array_equal(a, b)
    assert a.min() >= 0 and a.max() < 10
    sbpflow.manual_seed(5)
    u = sbpflow.uniform(50, low=-2.0, high=-1.0, placement=P3, sbp=S.split(0)).numpy()
    assert u.min() >= -2.0 and u.max() < -1.0


# -- errors on bad input ---------------------------------------------------------------------------


def test_split_dim_out_of_range() -> None:
    with pytest.raises(SbpError, match=r"splits dim 2, but the tensor has only 2 dim\(s\); expected split\(d\)"):
        sbpflow.randn(4, 5, placement=P2, sbp=S.split(2))
    with pytest.raises(SbpError, match=r"sbpflow.tensor of shape \[3\] splits dim 1"):
        sbpflow.tensor([1, 2, 3], placement=P2, sbp=S.split(1))


def test_more_sbps_than_mesh_axes() -> None:
    with pytest.raises(SbpError, match=r"one entry per mesh axis: placement cpu:\[0, 1\] has 1 axis\(es\), but got 2"):
        sbpflow.zeros(4, placement=P2, sbp=(S.split(0), B))
    with pytest.raises(SbpError, match=r"has 2 axis\(es\), but got 3 SBP\(s\) \(B, B, B\)"):
        sbpflow.ones(4, placement=MESH, sbp=(B, B, B))


@pytest.mark.parametrize("bad", [0, "split", torch.float32, [S.split(0), 1]], ids=repr)
def test_an_sbp_that_is_not_an_sbp(bad: Any) -> None:
    with pytest.raises(SbpError) as info:
        sbpflow.zeros(4, placement=P2 if not isinstance(bad, list) else MESH, sbp=bad)
    text = str(info.value)
    assert "sbp.split(d)" in text or "sbp.split(0)" in text or "cannot parse" in text
    assert repr(bad if not isinstance(bad, list) else bad[1]) in text


def test_ragged_data() -> None:
    with pytest.raises(ShapeError, match=r"rectangular numeric data, but \[\[1, 2\], \[3\]\] is not"):
        sbpflow.tensor([[1, 2], [3]])
    with pytest.raises(ShapeError, match="rectangular numeric data"):
        sbpflow.tensor([[1, 2], [3]], placement=P2, sbp=B)
    with pytest.raises(ShapeError, match="'a'"):
        sbpflow.tensor(["a", "b"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_placement_without_a_gpu() -> None:
    with pytest.raises(PlacementError, match=r"placement\('cuda', \[0\]\) needs a CUDA GPU"):
        sbpflow.randn(2, placement=sbpflow.placement("cuda", [0]), sbp=B)


def test_other_bad_arguments() -> None:
    with pytest.raises(SbpError, match="sbp= needs placement= as well"):
        sbpflow.zeros(3, sbp=B)
    with pytest.raises(SbpError, match=r"placement= needs an sbpflow.placement, but got \[0, 1\]"):
        sbpflow.zeros(3, placement=[0, 1], sbp=B)  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match=r"non-negative ints, but got \[2, -1\]"):
        sbpflow.zeros(2, -1)
    with pytest.raises(sbpflow.DTypeError, match="randn needs a floating-point dtype, but got torch.int64"):
        sbpflow.randn(3, dtype=torch.int64)
    with pytest.raises(sbpflow.AutogradError, match="only floating-point tensors can require gradients"):
        sbpflow.tensor([1, 2], placement=P2, sbp=B, requires_grad=True)


def test_a_tile_met_by_many_small_shards_is_drawn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """256 ranks holding one row each of a (256, 4) tensor share one 256 x 4 tile: one draw, not 256 (part 5)."""
    calls: list[int] = []
    draw = sbp_random._tile
    monkeypatch.setattr(sbp_random, "_tile", lambda key, index, *a: calls.append(index) or draw(key, index, *a))
    p = sbpflow.placement("cpu", list(range(256)))
    sbpflow.manual_seed(3)
    x = sbpflow.randn(256, 4, placement=p, sbp=S.split(0))
    assert calls == [0]
    sbpflow.manual_seed(3)
    assert (x.numpy() == sbpflow.randn(256, 4).numpy()).all()  # the same values as one device


@pytest.mark.parametrize("args", [(5,), (0, 7, 2), (7, 0, -3), (3, 3), (0, 10, 3), (-5, 5, 4), (2.5,), (0, 1, 0.25)])
def test_arange_counts_like_torch(args: tuple) -> None:  # type: ignore[type-arg]
    """Integer bounds are counted without torch's meta device (issue 14): same values and dtype as torch."""
    ours, theirs = sbpflow.arange(*args), torch.arange(*args)
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_arange_with_an_inconsistent_step_raises_like_torch() -> None:
    with pytest.raises(RuntimeError):
        torch.arange(5, 0, 1)
    with pytest.raises(RuntimeError):
        sbpflow.arange(5, 0, 1)
