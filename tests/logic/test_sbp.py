"""SBP values: frozen and hashable, printed as S(0) / B / P(sum), parsed back, normalised per mesh axis."""

from __future__ import annotations

import dataclasses

import pytest

import sbpflow
from sbpflow import SbpError
from sbpflow import sbp as S

P1 = sbpflow.placement("cpu", [0, 1])
MESH = sbpflow.placement("cpu", [[0, 1], [2, 3]])
ALL = [S.split(0), S.split(1), S.split(12), S.zigzag(2), S.broadcast, S.partial_sum, S.partial_max, S.partial_min]


def test_values_print_short_and_repr_exact() -> None:
    assert [str(s) for s in ALL] == ["S(0)", "S(1)", "S(12)", "Z(2)", "B", "P(sum)", "P(max)", "P(min)"]
    assert repr(S.split(1)) == "Split(dim=1)"
    assert repr(S.zigzag(2)) == "Split(dim=2, zigzag=True)"
    assert repr(S.broadcast) == "Broadcast()"
    assert repr(S.partial_max) == "Partial(op='max')"


@pytest.mark.parametrize("value", ALL, ids=str)
def test_parse_inverts_str(value: S.SbpParallel) -> None:
    assert S.parse(str(value)) == value
    assert S.parse(f"  {value} ") == value


def test_split_keyword_and_equality() -> None:
    assert S.split(dim=1) == S.split(1) == S.Split(1)
    assert S.split(0) != S.split(1)
    assert S.partial_sum == S.Partial("sum") and S.partial_sum != S.partial_max
    assert S.zigzag(1) == S.Split(1, zigzag=True) != S.split(1)
    assert S.broadcast == S.Broadcast()
    assert S.split(0) != S.broadcast


def test_frozen_and_hashable() -> None:
    assert len({S.split(0), S.split(dim=0), S.broadcast, S.Broadcast(), S.partial_sum, S.Partial()}) == 3
    nd = (S.split(0), S.broadcast)
    assert {nd: 1}[(S.split(0), S.broadcast)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        S.split(0).dim = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        S.partial_sum.op = "max"  # type: ignore[misc]


@pytest.mark.parametrize("dim", [-1, 1.0, "0", True, None])
def test_split_dim_must_be_a_non_negative_int(dim: object) -> None:
    with pytest.raises(SbpError, match=f"non-negative int dim, but got {dim!r}"):
        S.split(dim)  # type: ignore[arg-type]


def test_partial_op_must_be_known() -> None:
    with pytest.raises(SbpError, match="one of \\('sum', 'max', 'min'\\), but got 'mean'"):
        S.Partial("mean")


@pytest.mark.parametrize("text", ["S(-1)", "S()", "P(avg)", "b", "Split(0)", "", 3])
def test_parse_rejects_naming_the_text(text: object) -> None:
    with pytest.raises(SbpError) as info:
        S.parse(text)  # type: ignore[arg-type]
    assert repr(text) in str(info.value)
    assert "expected 'S(<dim>)', 'Z(<dim>)', 'B' or 'P(sum|max|min)'" in str(info.value)


def test_normalize_gives_one_entry_per_mesh_axis() -> None:
    assert S.normalize(S.split(0), P1) == (S.split(0),)
    assert S.normalize("P(max)", P1) == (S.partial_max,)
    assert S.normalize([S.broadcast], P1) == (S.broadcast,)
    assert S.normalize((S.split(1), "S(0)"), MESH, ndim=2) == (S.split(1), S.split(0))
    assert S.format_nd((S.split(1), S.partial_sum)) == "(S(1), P(sum))"


def test_normalize_rejects_more_sbps_than_mesh_axes() -> None:
    with pytest.raises(SbpError, match=r"one entry per mesh axis: placement cpu:\[0, 1\] has 1 axis\(es\), "
                                       r"but got 2 SBP\(s\) \(S\(0\), B\)"):
        S.normalize((S.split(0), S.broadcast), P1)
    with pytest.raises(SbpError, match=r"has 2 axis\(es\), but got 1 SBP\(s\) \(B\)"):
        S.normalize(S.broadcast, MESH)


@pytest.mark.parametrize("bad", [0, None, {"S": 0}, 1.5])
def test_normalize_rejects_what_is_not_an_sbp(bad: object) -> None:
    with pytest.raises(SbpError, match=f"must be an SBP such as sbp.split\\(0\\).*but got {bad!r} of type"):
        S.normalize(bad, P1)


def test_normalize_rejects_a_non_sbp_inside_a_tuple() -> None:
    with pytest.raises(SbpError, match="must contain SBP values.*but got 0 of type int"):
        S.normalize((S.broadcast, 0), MESH)


def test_normalize_checks_split_dims_against_the_tensor() -> None:
    with pytest.raises(SbpError, match=r"splits dim 2, but the tensor has only 2 dim\(s\); expected split\(d\) "
                                       r"with 0 <= d < 2"):
        S.normalize(S.split(2), P1, ndim=2)


@pytest.mark.parametrize("bad", [(S.zigzag(0), S.split(0)), (S.split(0), S.zigzag(0)), (S.zigzag(0), S.zigzag(1))],
                         ids=S.format_nd)
def test_a_zigzag_split_is_the_only_split_of_its_dim(bad: S.NdSbp) -> None:
    """Its chunks are cut from the whole dim, and one dim out of logical order is all boxing converts."""
    with pytest.raises(SbpError, match=r"a zigzag split Z\(d\) must be the only entry splitting dim d"):
        S.normalize(bad, MESH, ndim=2)
    assert S.normalize((S.split(0), S.zigzag(1)), MESH, ndim=2) == (S.split(0), S.zigzag(1))
