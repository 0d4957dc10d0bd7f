"""The zigzag split's layout: rank r of p holds chunks r and 2p-1-r of 2p (torch.tensor_split sizes), stored end
to end; boxes are in storage order, logical_pieces give the logical ranges."""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow import SbpError
from sbpflow import sbp as S
from sbpflow._layout import logical_pieces, shard_box, storage_index, zigzag_range


@pytest.mark.parametrize(("n", "p"), [(8, 2), (7, 2), (11, 3), (3, 2), (16, 4)])
def test_storage_order_is_each_rank_s_two_chunks_end_to_end(n: int, p: int) -> None:
    chunks = torch.tensor_split(torch.arange(n), 2 * p)
    expected = torch.cat([torch.cat([chunks[r], chunks[2 * p - 1 - r]]) for r in range(p)]).tolist()
    assert list(storage_index(n, p)) == expected
    starts = [zigzag_range(n, p, r) for r in range(p)]
    assert starts[0][0] == 0 and starts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(starts, starts[1:], strict=False))  # the shards tile the dim


def test_uneven_zigzag_shards_need_not_match_a_plain_split() -> None:
    """7 over 2: chunks 2, 2, 2, 1, so rank 0 holds 2 + 1 and rank 1 2 + 2 (a plain split gives 4 and 3)."""
    p = sbpflow.placement("cpu", [0, 1])
    assert [shard_box((7,), p, (S.zigzag(0),), r) for r in (0, 1)] == [((0, 3),), ((3, 7),)]
    assert logical_pieces((7,), p, (S.zigzag(0),), 0) == (((0, 2),), ((6, 7),))
    assert logical_pieces((5, 7), p, (S.zigzag(1),), 1) == (((0, 5), (2, 4)), ((0, 5), (4, 6)))


def test_a_second_split_of_a_zigzag_dim_is_refused_where_boxes_are_cut() -> None:
    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(SbpError, match=r"Z\(d\) must be the only entry splitting dim d.*\(S\(0\), Z\(0\)\)"):
        shard_box((8,), mesh, (S.split(0), S.zigzag(0)), 0)
