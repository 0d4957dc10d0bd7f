"""The checkpoint index as pure logic: who writes which box, and the index's JSON round trip and checks."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sbpflow
from sbpflow import sbp as S
from sbpflow._layout import box_shape, numel
from sbpflow.checkpoint._index import Index, ScalarEntry, tensor_entry, writer_boxes, written_sbp
from sbpflow.errors import CheckpointError

P22 = sbpflow.placement("cpu", [[0, 1], [2, 3]])
P4 = sbpflow.placement("cpu", [0, 1, 2, 3])


def test_replicas_share_the_writing() -> None:
    loads: dict[int, int] = {}
    # four replicated tensors of 10 floats on 4 ranks: one each, not all on rank 0
    writers = [writer_boxes((10,), P4, (S.broadcast,), 4, loads)[0][1] for _ in range(4)]
    assert writers == [0, 1, 2, 3] and loads == {0: 40, 1: 40, 2: 40, 3: 40}
    # a data x tensor mesh: the tensor-parallel halves go to the least loaded holder of each
    assert writer_boxes((4, 6), P22, (S.broadcast, S.split(1)), 4, loads) == [(((0, 4), (0, 3)), 0),
                                                                               (((0, 4), (3, 6)), 1)]
    assert writer_boxes((4, 6), P22, (S.broadcast, S.split(1)), 4, loads) == [(((0, 4), (0, 3)), 2),
                                                                               (((0, 4), (3, 6)), 3)]


def test_partial_axes_are_written_as_broadcast_and_empty_boxes_skipped() -> None:
    assert written_sbp((S.partial_sum, S.split(0))) == (S.broadcast, S.split(0))
    boxes = writer_boxes((2, 3), P4, (S.split(0),), 4, {})  # 2 rows on 4 ranks: ranks 2 and 3 hold nothing
    assert boxes == [(((0, 1), (0, 3)), 0), (((1, 2), (0, 3)), 1)]


SBPS = [S.broadcast, S.split(0), S.split(1)]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 7), cols=st.integers(1, 7), a=st.sampled_from(SBPS), b=st.sampled_from(SBPS))
def test_boxes_cover_every_element_once(rows: int, cols: int, a: object, b: object) -> None:
    boxes = writer_boxes((rows, cols), P22, (a, b), 4, {})  # type: ignore[arg-type]
    assert sum(numel(box_shape(box)) for box, _ in boxes) == rows * cols
    cells = [cell for box, _ in boxes for cell in itertools.product(*(range(lo, hi) for lo, hi in box))]
    assert len(set(cells)) == len(cells)


def test_index_round_trips_through_json() -> None:
    written = writer_boxes((4, 6), P22, (S.broadcast, S.split(1)), 4, {})
    index = Index({"m/w": tensor_entry(("m", "w"), (4, 6), torch.bfloat16, P22, (S.partial_sum, S.split(1)), written),
                   "m/b": tensor_entry(("m", "b"), (), torch.int64, None, None, [((), 0)]),
                   "opt/0/step": ScalarEntry(("opt", 0, "step"), 3.0)}, {})
    again = Index.from_json(index.to_json(), "test")
    assert again.entries == index.entries
    assert again.entries["opt/0/step"].path == ("opt", 0, "step")  # int keys stay ints


def test_damaged_or_foreign_indexes_are_refused() -> None:
    with pytest.raises(CheckpointError, match="damaged or not an sbpflow index: ValueError: its format is not"):
        Index.from_json('{"format": "other"}', "x/index.json")
    with pytest.raises(CheckpointError, match="has version 9; this sbpflow reads version 1"):
        Index.from_json('{"format": "sbpflow-checkpoint", "version": 9}', "x/index.json")
    with pytest.raises(CheckpointError, match="damaged or not an sbpflow index: KeyError"):
        Index.from_json('{"format": "sbpflow-checkpoint", "version": 1, "files": {}}', "x/index.json")
