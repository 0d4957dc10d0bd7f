"""The global Tensor: logical metadata, shards, to_global / to_local / local_tensors, printing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from harness import assert_own_memory
from sbpflow import SbpError, SbpflowError
from sbpflow import sbp as S
from sbpflow.comm import record

B = S.broadcast
P1 = sbpflow.placement("cpu", [0])
P2 = sbpflow.placement("cpu", [0, 1])
P3 = sbpflow.placement("cpu", [0, 1, 2])
MESH = sbpflow.placement("cpu", [[0, 1], [2, 3]])


def test_metadata_is_logical() -> None:
    x = sbpflow.zeros(5, 3, placement=MESH, sbp=(S.split(0), S.split(1)), dtype=torch.float64)
    assert x.is_global
    assert x.shape == torch.Size([5, 3]) and x.ndim == 2 and x.numel() == 15
    assert x.dtype == torch.float64 and x.placement == MESH
    assert x.sbp == (S.split(0), S.split(1))
    assert x.device == torch.device("cpu")


def test_sbp_is_always_a_tuple() -> None:
    assert sbpflow.zeros(4, placement=P2, sbp=S.split(0)).sbp == (S.split(0),)
    assert sbpflow.zeros(4, placement=P2, sbp="P(max)").sbp == (S.partial_max,)
    assert sbpflow.zeros(4, placement=P2).sbp == (B,)  # default: broadcast on every axis
    assert sbpflow.zeros(4, placement=MESH).sbp == (B, B)


def test_local_tensors_have_no_placement() -> None:
    x = sbpflow.zeros(3)
    assert not x.is_global
    with pytest.raises(SbpflowError, match=r"a local tensor has no placement; convert it with .to_global"):
        _ = x.placement
    with pytest.raises(SbpflowError, match="a local tensor has no sbp"):
        _ = x.sbp


@pytest.mark.parametrize("n", [7, 5, 2, 1, 0])
def test_one_shard_per_rank_sized_as_tensor_split(n: int) -> None:
    x = sbpflow.arange(n * 2, placement=P3, sbp=S.split(0))
    pieces = torch.tensor_split(torch.arange(n * 2), 3)
    assert sorted(x.local_tensors()) == [0, 1, 2]
    for r, want in enumerate(pieces):
        assert torch.equal(x.local_tensors()[r], want)


def test_mesh_shards_cut_outer_axis_first() -> None:
    value = torch.arange(5 * 3).reshape(5, 3)
    x = sbpflow.tensor(value, placement=MESH, sbp=(S.split(0), S.split(1)))
    got = {r: tuple(t.shape) for r, t in x.local_tensors().items()}
    assert got == {0: (3, 2), 1: (3, 1), 2: (2, 2), 3: (2, 1)}
    assert torch.equal(x.local_tensors()[3], value[3:, 2:])


# -- to_global ----------------------------------------------------------------------------------


def test_to_global_keeps_omitted_arguments() -> None:
    x = sbpflow.tensor(np.arange(12.0).reshape(3, 4), placement=P2, sbp=S.split(0))
    y = x.to_global(sbp=S.split(1))
    assert (y.placement, y.sbp) == (P2, (S.split(1),))
    z = x.to_global(placement=sbpflow.placement("cpu", [2, 3]))
    assert (z.placement, z.sbp) == (sbpflow.placement("cpu", [2, 3]), (S.split(0),))
    assert x.to_global() is x  # nothing to do
    for t in (y, z):
        np.testing.assert_array_equal(t.numpy(), np.arange(12.0).reshape(3, 4))


def test_to_global_onto_a_mesh_of_other_rank_needs_an_sbp() -> None:
    x = sbpflow.zeros(4, placement=P2, sbp=S.split(0))
    with pytest.raises(SbpError, match=r"onto cpu:\[\[0, 1\], \[2, 3\]\] \(2 mesh axes\) needs sbp=.*\(S\(0\)\) has 1"):
        x.to_global(placement=MESH)
    with pytest.raises(SbpError, match=r"needs an sbpflow.placement, but got 'cpu'"):
        x.to_global(placement="cpu")  # type: ignore[arg-type]
    with pytest.raises(SbpError, match=r"splits dim 1, but the tensor has only 1 dim"):
        x.to_global(sbp=S.split(1))


def test_to_global_of_a_local_tensor_takes_it_as_every_ranks_shard() -> None:
    local = sbpflow.tensor([[1.0, 2.0], [3.0, 4.0]])
    x = local.to_global(placement=P3, sbp=S.split(0))
    assert tuple(x.shape) == (6, 2)  # three virtual ranks, each contributing the same (2, 2) shard
    np.testing.assert_array_equal(x.numpy(), np.tile(local.numpy(), (3, 1)))
    assert_own_memory(x)
    for sbp, times in [(B, 1), (S.partial_sum, 3), (S.partial_max, 1)]:  # P(sum) adds the three contributions
        y = local.to_global(placement=P3, sbp=sbp)
        assert tuple(y.shape) == (2, 2)
        np.testing.assert_array_equal(y.numpy(), times * local.numpy())
        assert_own_memory(y)
    m = local.to_global(placement=MESH, sbp=(S.split(1), S.split(0)))
    assert tuple(m.shape) == (4, 4)
    np.testing.assert_array_equal(m.numpy(), np.tile(local.numpy(), (2, 2)))


def test_to_global_of_a_local_tensor_does_not_share_its_memory() -> None:
    local = sbpflow.tensor([1.0, 2.0])
    x = local.to_global(placement=P2, sbp=B)
    local.to_local().add_(10)
    assert x.numpy().tolist() == [1.0, 2.0]


def test_to_global_of_a_local_tensor_needs_placement_and_sbp() -> None:
    local = sbpflow.zeros(2)
    with pytest.raises(SbpError, match="needs both placement= and sbp="):
        local.to_global(placement=P2)
    with pytest.raises(SbpError, match="needs both placement= and sbp="):
        local.to_global(sbp=B)


def test_to_global_records_its_collectives() -> None:
    x = sbpflow.zeros(4, 6, placement=P2, sbp=S.split(0))
    with record() as log:
        x.to_global(sbp=B)
        x.to_global(sbp=S.split(1))
        x.to_global(sbp=S.partial_sum)
    assert log.counts() == {"all_gather": 1, "all_to_all": 1}
    assert [e.ranks for e in log.events] == [(0, 1), (0, 1)]
    assert log.events[0].bytes == 2 * 4 * 6 * 4 // 2  # each rank receives the other's half


def test_to_global_is_differentiable() -> None:
    x = sbpflow.tensor(np.arange(6.0).reshape(2, 3), placement=P2, sbp=S.split(1), requires_grad=True)
    y = x.to_global(placement=P3, sbp=B)
    (y * y).sum().backward()
    assert x.grad is not None and x.grad.placement == P2 and x.grad.sbp == (S.split(1),)
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.arange(6.0).reshape(2, 3))


# -- to_local and local_tensors ----------------------------------------------------------------------


def test_to_local_on_one_rank_returns_the_shard() -> None:
    x = sbpflow.tensor([1.0, 2.0], placement=P1, sbp=B)
    assert torch.equal(x.to_local(), torch.tensor([1.0, 2.0]))
    local = sbpflow.tensor([3.0])
    assert local.to_local() is local.to_local()


def test_to_local_with_several_virtual_ranks_is_the_lowest_ranks_shard() -> None:
    """What OneFlow's rank 0 prints (issue 32); local_tensors() gives every virtual rank's shard."""
    x = sbpflow.arange(4.0, placement=P3, sbp=S.split(0))
    assert x.to_local().tolist() == [0.0, 1.0] and x.to_local() is x.local_tensors()[0]


def test_local_tensors_is_a_fresh_dict_of_the_shards() -> None:
    x = sbpflow.zeros(4, placement=P2, sbp=S.split(0))
    shards = x.local_tensors()
    assert set(shards) == {0, 1} and all(isinstance(t, torch.Tensor) for t in shards.values())
    shards.pop(0)
    assert set(x.local_tensors()) == {0, 1}
    x.local_tensors()[1].fill_(5.0)  # the tensors themselves are the shards
    assert x.numpy().tolist() == [0.0, 0.0, 5.0, 5.0]


# -- values and printing ---------------------------------------------------------------------------


def test_numpy_is_the_logical_value_in_every_layout() -> None:
    value = np.arange(20, dtype=np.float32).reshape(4, 5)
    for placement, sbp in [(P2, S.split(1)), (P3, S.partial_sum), (MESH, (S.split(1), S.split(0))), (P1, B)]:
        x = sbpflow.tensor(value, placement=placement, sbp=sbp)
        np.testing.assert_array_equal(x.numpy(), value)
        assert x.tolist() == value.tolist()
    bf = sbpflow.tensor([1.5, -2.0], placement=P2, sbp=S.split(0), dtype=torch.bfloat16)
    assert bf.numpy().dtype == np.float32 and bf.numpy().tolist() == [1.5, -2.0]
    assert sbpflow.tensor([[7]], placement=P3, sbp=S.split(0)).item() == 7


def test_printing_shows_logical_shape_placement_sbp_and_values() -> None:
    x = sbpflow.tensor([[1.0, 2.0, 3.0]], placement=P2, sbp=S.split(1))
    text = repr(x)
    assert text == str(x)
    assert "[[1., 2., 3.]]" in text
    assert "placement=placement(type='cpu', ranks=[0, 1])" in text and "sbp=(S(1))" in text
    assert "shape=[1, 3]" in text
    mesh_text = repr(sbpflow.zeros(2, 2, placement=MESH, sbp=(S.partial_sum, S.split(0))))
    assert "sbp=(P(sum), S(0))" in mesh_text and "ranks=[[0, 1], [2, 3]]" in mesh_text
    assert "requires_grad=True" in repr(sbpflow.zeros(2, placement=P2, requires_grad=True))
