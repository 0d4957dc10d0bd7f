"""Partial inputs held as random per-rank pieces, in every partial signature an op keeps or declares.

On 1-D and 2-D meshes the op must give the single-device value with no collective and a partial output:
a declaration that lies gives wrong numbers, one that is missing gives a collective.
"""

from __future__ import annotations

import pytest

from opcases import CASES, OpCase, marked_on_meshes
from partial_checks import check_partial_inputs


@pytest.mark.parametrize(("case", "placement"), marked_on_meshes(CASES, ["2", "3", "2x2"]))
def test_partial_inputs_give_the_single_device_value(case: OpCase, placement: str, one_torch_thread: None) -> None:
    check_partial_inputs(case, placement)
