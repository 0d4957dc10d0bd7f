"""Every op's kernel reads strided views as it reads row-major copies.

Boxing hands kernels views: a local ``B -> S(d)`` step slices each rank's shard in place (no copy), so a
kernel's input may have a storage offset and strides that are not row-major. A kernel that reads raw memory
(torch's CPU ``native_layer_norm_backward`` reads its saved mean and rstd so) computes wrong numbers then, and
only under the plans that slice those inputs: a compiled step whose selection splits the kernel's rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from opcases import CASES, OpCase
from partial_checks import case_values, run_local


def strided(value: Any) -> Any:
    """``value``'s numbers in a view with a storage offset and padded strides, as a local slice gives."""
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    padded = value.new_zeros(tuple(d + 2 for d in value.shape))
    view = padded[tuple(slice(1, 1 + d) for d in value.shape)]
    view.copy_(value)
    return view


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_reads_strided_views_as_copies(case: OpCase, one_torch_thread: None) -> None:
    args = case_values(case)
    views = [strided(a) for a in args]
    want = run_local(case, [a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    got = run_local(case, views)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, equal_nan=True,
                                   msg=lambda m, i=i: f"{case.op} output {i} on strided inputs: {m}")


def test_strided_views_are_not_row_major() -> None:
    stats = strided(torch.arange(3.0).reshape(3, 1))  # a (rows, 1) statistic, as layer_norm saves it
    assert not stats.is_contiguous() and stats.storage_offset() > 0
    assert torch.equal(stats, torch.arange(3.0).reshape(3, 1))
