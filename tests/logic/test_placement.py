"""Placements: pure data, validated on construction, with mesh coordinates and axis groups."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import PlacementError


def test_one_d_placement_fields() -> None:
    p = sbpflow.placement("cpu", [0, 1, 2])
    assert p.type == "cpu"
    assert p.ranks == (0, 1, 2)
    assert p.hierarchy == (3,)
    assert (p.ndim, p.size, p.flat_ranks) == (1, 3, (0, 1, 2))


def test_keyword_construction_and_other_rank_containers() -> None:
    p = sbpflow.placement(type="cpu", ranks=[[0, 1], [2, 3]])
    assert p == sbpflow.placement("cpu", ((0, 1), (2, 3)))
    assert p == sbpflow.placement("cpu", np.array([[0, 1], [2, 3]]))
    assert p == sbpflow.placement("cpu", torch.tensor([[0, 1], [2, 3]]))
    assert sbpflow.placement("cpu", range(3)) == sbpflow.placement("cpu", [0, 1, 2])
    assert sbpflow.placement("cpu", 5).ranks == (5,)


@pytest.mark.parametrize(
    "ranks, hierarchy",
    [([4], (1,)), ([[0, 1], [2, 3]], (2, 2)), ([[0, 1, 2], [3, 4, 5]], (2, 3)), ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
                                                                              (2, 2, 2))],
)
def test_mesh_hierarchy(ranks: list, hierarchy: tuple[int, ...]) -> None:
    p = sbpflow.placement("cpu", ranks)
    assert p.hierarchy == hierarchy
    assert p.ndim == len(hierarchy)
    assert p.size == int(np.prod(hierarchy))


def test_frozen_hashable_and_equal_by_type_and_ranks() -> None:
    a = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    b = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != sbpflow.placement("cpu", [0, 1, 2, 3])  # same ranks, different mesh
    assert a != sbpflow.placement("cpu", [[0, 2], [1, 3]])  # same ranks, different order
    assert sbpflow.placement("cpu", [0, 1]) != sbpflow.placement("cpu", [1, 0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.type = "cuda"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.ranks = (0,)  # type: ignore[misc]


def test_repr_is_readable_and_evaluates_back() -> None:
    p = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    assert repr(p) == "placement(type='cpu', ranks=[[0, 1], [2, 3]])"
    assert str(p) == "cpu:[[0, 1], [2, 3]]"
    assert eval(repr(p), {"placement": sbpflow.placement}) == p


@pytest.mark.parametrize(
    "ranks, message",
    [
        ([0, 1, 1], "distinct, but rank 1 appears twice in [0, 1, 1]"),
        ([[0, 1], [1, 2]], "rank 1 appears twice"),
        ([0, -2], "non-negative, but [0, -2] contains -2"),
        ([[0, 1], [2]], "rectangular mesh, but [[0, 1], [2]] is ragged"),
        ([[0, 1], 2], "is ragged"),
        ([], "must not be empty, but got []"),
        ([[]], "must not be empty, but got [[]]"),
        ([0, 1.5], "non-negative ints, but [0, 1.5] contains 1.5"),
        ([0, "1"], "contains '1'"),
        ([True, False], "contains True"),
        ([[[[0]]]], "at most 3 axes, but [[[[0]]]] has 4"),
        ("0,1", "a list (or nested lists) of ints, but got '0,1'"),
        (None, "but got None"),
    ],
)
def test_bad_ranks_raise_naming_the_value(ranks: object, message: str) -> None:
    with pytest.raises(PlacementError) as info:
        sbpflow.placement("cpu", ranks)  # type: ignore[arg-type]
    assert message in str(info.value)


@pytest.mark.parametrize("device_type", ["gpu", "CPU", "tpu", ""])
def test_unknown_device_type_is_named(device_type: str) -> None:
    with pytest.raises(PlacementError, match=f"one of \\('cpu', 'cuda'\\), but got '{device_type}'"):
        sbpflow.placement(device_type, [0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this check is about machines without a GPU")
def test_cuda_placement_without_a_gpu_says_so() -> None:
    with pytest.raises(PlacementError, match=r"placement\('cuda', \[0, 1\]\) needs a CUDA GPU.*placement\('cpu'"):
        sbpflow.placement("cuda", [0, 1])


def test_placement_errors_are_sbpflow_and_value_errors() -> None:
    with pytest.raises(sbpflow.SbpflowError):
        sbpflow.placement("cpu", [])
    with pytest.raises(ValueError):
        sbpflow.placement("cpu", [])


def test_coords_and_rank_at_are_inverse() -> None:
    p = sbpflow.placement("cpu", [[[7, 6], [5, 4]], [[3, 2], [1, 0]]])
    for rank in p.flat_ranks:
        assert p.rank_at(p.coords(rank)) == rank
    assert p.coords(7) == (0, 0, 0) and p.coords(4) == (0, 1, 1) and p.coords(0) == (1, 1, 1)


def test_axis_groups_fix_every_other_coordinate() -> None:
    p = sbpflow.placement("cpu", [[0, 1, 2], [3, 4, 5]])
    assert p.axis_groups(0) == [(0, 3), (1, 4), (2, 5)]
    assert p.axis_groups(1) == [(0, 1, 2), (3, 4, 5)]
    assert p.axis_group_of(4, 0) == (1, 4)
    assert p.axis_group_of(4, 1) == (3, 4, 5)


# -- linear in ranks (issue 13, part 5): per-rank lookups must not scan the rank list ------------------------


class _NoScan(tuple):  # type: ignore[type-arg]
    """A rank tuple that fails if anything searches it: coords must use the placement's index."""

    def index(self, *args: object) -> int:  # type: ignore[override]
        raise AssertionError("flat_ranks.index scans every rank: O(ranks) per lookup")


def test_coords_use_a_dict_index_not_a_scan() -> None:
    p = sbpflow.placement("cpu", [[4, 5, 6], [7, 8, 9]])
    object.__setattr__(p, "flat_ranks", _NoScan(p.flat_ranks))
    assert [p.coords(r) for r in (4, 6, 8)] == [(0, 0), (0, 2), (1, 1)]
    assert p.axis_groups(0) == [(4, 7), (5, 8), (6, 9)] and p.axis_groups(1) == [(4, 5, 6), (7, 8, 9)]
    with pytest.raises(PlacementError, match="rank 3 is not in placement"):
        p.coords(3)


def test_hash_is_computed_once() -> None:
    p = sbpflow.placement("cpu", list(range(1000)))
    expected = hash(p)
    object.__setattr__(p, "ranks", None)  # hashing again must not read the ranks
    assert hash(p) == expected == hash(sbpflow.placement("cpu", list(range(1000))))


def test_pickle_rebuilds_the_cached_fields() -> None:
    import pickle

    p = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    q = pickle.loads(pickle.dumps(p))
    assert q == p and hash(q) == hash(p) and q.coords(3) == (1, 1) and {p: 1}[q] == 1
