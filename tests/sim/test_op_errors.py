"""User mistakes raise sbpflow's own errors naming the op, each tensor's shape/placement/SBP and what was expected."""

from __future__ import annotations

import pytest
import torch

import sbpflow
import sbpflow.ops.functional as F
from harness import DEVICE, PLACEMENTS, B, randn
from sbpflow import sbp as S

P2, P3 = PLACEMENTS["2"], PLACEMENTS["3"]


def _g(*shape: int, p: sbpflow.Placement = P2, sbp: object = B, dtype: torch.dtype = torch.float32) -> sbpflow.Tensor:
    return sbpflow.tensor(randn(*shape).to(dtype), placement=p, sbp=sbp)


def test_matmul_shape_mismatch_names_op_shapes_and_layouts() -> None:
    with pytest.raises(sbpflow.ShapeError) as e:
        _g(4, 3, sbp=S.split(0)) @ _g(4, 5)
    text = str(e.value)
    for part in ("'matmul'", "last dim", "[4, 3]", "[4, 5]", f"{DEVICE}:[0, 1]", "S(0)", "(B)"):
        assert part in text, (part, text)


def test_matmul_dtype_mismatch() -> None:
    with pytest.raises(sbpflow.DTypeError, match=r"'matmul'.*one dtype.*float32.*float64"):
        _g(2, 3) @ _g(3, 2, dtype=torch.float64)
    with pytest.raises(sbpflow.DTypeError, match=r"'linear'.*float64"):
        F.linear(_g(2, 3), _g(4, 3, dtype=torch.float64))


def test_linear_and_bmm_shape_errors() -> None:
    with pytest.raises(sbpflow.ShapeError, match=r"'linear'.*in-features"):
        F.linear(_g(2, 3), _g(4, 5))
    with pytest.raises(sbpflow.ShapeError, match=r"bmm needs 3-D"):
        F.bmm(_g(2, 3), _g(3, 2))
    with pytest.raises(sbpflow.ShapeError, match="at least 1 dim"):
        F.matmul(sbpflow.tensor(torch.tensor(1.0), placement=P2, sbp=B), _g(3))


def test_non_broadcastable_elementwise() -> None:
    with pytest.raises(sbpflow.ShapeError) as e:
        _g(4, 3, sbp=S.split(1)) + _g(4, 2)
    text = str(e.value)
    assert "'add'" in text and "not broadcastable" in text and "[4, 3]" in text and "S(1)" in text
    with pytest.raises(sbpflow.ShapeError, match=r"'where'.*not broadcastable"):
        F.where(_g(3) > 0, _g(3), _g(2))


def test_backward_of_non_scalar_without_gradient() -> None:
    x = sbpflow.tensor(randn(3, 2), placement=P2, sbp=S.split(0), requires_grad=True)
    with pytest.raises(sbpflow.AutogradError, match=r"scalar output.*\[3, 2\].*S\(0\)"):
        (x * 2).backward()


def test_mixed_placements_name_both() -> None:
    with pytest.raises(sbpflow.OpError) as e:
        _g(3, p=P2) + _g(3, p=P3)
    text = str(e.value)
    assert "'add'" in text and f"{DEVICE}:[0, 1]" in text and f"{DEVICE}:[0, 1, 2]" in text and "to_global" in text


def test_local_and_global_mix() -> None:
    with pytest.raises(sbpflow.OpError, match=rf"'mul'.*local and global.*local shape \[3\].*{DEVICE}:\[0, 1\]"):
        sbpflow.tensor(randn(3)) * _g(3)


def test_reduction_and_shape_attribute_errors() -> None:
    x = _g(4, 3, sbp=S.split(0))
    with pytest.raises(sbpflow.ShapeError, match=r"'sum'.*dim 2 is out of range.*\[4, 3\]"):
        x.sum(dim=2)
    with pytest.raises(sbpflow.DTypeError, match=r"'mean'.*floating-point.*int64"):
        sbpflow.tensor(torch.arange(4), placement=P2, sbp=B).mean()
    with pytest.raises(sbpflow.ShapeError, match=r"'reshape'.*\[5\]"):
        x.reshape(5)
    with pytest.raises(ValueError, match="approximate"):
        F.gelu(x, approximate="fast")


def test_errors_are_raised_before_any_shard_runs() -> None:
    # a raw torch error from inside a shard would be a RuntimeError without the op's context
    x = _g(4, 3, p=P3, sbp=S.split(0))
    for bad in (lambda: x @ _g(2, 2, p=P3), lambda: x + _g(2, p=P3), lambda: x.expand(4, 5),
                lambda: x.permute(1, 1), lambda: x.max(dim=5)):
        with pytest.raises(sbpflow.SbpflowError):
            bad()
