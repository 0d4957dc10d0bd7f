"""Mistakes torch users make raise sbpflow's own errors, of the builtin type torch users catch (issue 13, part 4).

Each case failed before with a raw ``ValueError``/``AttributeError``/``TypeError`` from deep inside, or with a
message that did not name the culprit.
"""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.errors import ArgumentError, DTypeError, IndexOutOfRangeError, SbpError, SbpflowError

P2 = sbpflow.placement("cpu", [0, 1])
P3 = sbpflow.placement("cpu", [0, 1, 2])


@pytest.mark.parametrize("seed", ["abc", 1.5, None, True])
def test_manual_seed_needs_an_int(seed: object) -> None:
    with pytest.raises(ArgumentError, match=r"manual_seed needs an int seed, but got"):
        sbpflow.manual_seed(seed)  # type: ignore[arg-type]
    assert issubclass(ArgumentError, ValueError)


def test_manual_seed_takes_integer_scalars() -> None:
    sbpflow.manual_seed(torch.tensor(3))  # type: ignore[arg-type]  # has __index__, as torch accepts it
    a = sbpflow.randn(3).numpy()
    sbpflow.manual_seed(3)
    assert (a == sbpflow.randn(3).numpy()).all()


@pytest.mark.parametrize("make", [sbpflow.randn, sbpflow.rand, sbpflow.zeros, sbpflow.ones])
def test_dtype_must_be_a_torch_dtype(make: object) -> None:
    with pytest.raises(DTypeError, match=r"dtype= needs a torch.dtype such as torch.float16, but got 'float16'"):
        make(2, 3, dtype="float16")  # type: ignore[operator]
    assert issubclass(DTypeError, TypeError)


def test_device_is_accepted_for_local_tensors_and_refused_with_a_placement() -> None:
    sbpflow.manual_seed(1)
    x = sbpflow.randn(2, 3, device="cpu")
    sbpflow.manual_seed(1)
    assert x.device == torch.device("cpu") and (x.numpy() == sbpflow.randn(2, 3).numpy()).all()
    assert sbpflow.zeros(2, device=torch.device("cpu")).tolist() == [0.0, 0.0]
    assert sbpflow.tensor([1.0], device="cpu").tolist() == [1.0]
    with pytest.raises(ArgumentError, match=r"randn: device= is for local tensors"):
        sbpflow.randn(2, 3, device="cpu", placement=P2, sbp=S.broadcast)
    with pytest.raises(ArgumentError, match=r"device= needs a device such as 'cpu'"):
        sbpflow.randn(2, device="nowhere")


@pytest.mark.parametrize("make", [
    lambda ps: sbpflow.optim.SGD(ps, lr=-1),
    lambda ps: sbpflow.optim.SGD(ps, lr=0.1, nesterov=True),
    lambda ps: sbpflow.optim.Adam(ps, lr=-1),
    lambda ps: sbpflow.optim.AdamW(ps, betas=(1.0, 0.9)),
])
def test_optimizer_hyperparameters(make: object) -> None:
    params = nn.Linear(2, 2).parameters()
    with pytest.raises(ArgumentError) as info:
        make(params)  # type: ignore[operator]
    assert isinstance(info.value, ValueError)


def test_linear_message_names_the_bias() -> None:
    with pytest.raises(SbpError, match=r"Linear: parameter 'bias' of shape \[9\] cannot take sbp S\(1\).*"
                                       r"sbp=\{'weight': \.\.\., 'bias'"):
        nn.Linear(7, 9, placement=P3, sbp=S.split(1))
    layer = nn.Linear(7, 9, placement=P3, sbp={"weight": S.split(1), "bias": S.broadcast})  # the advice works
    assert layer.weight.sbp == (S.split(1),)


def test_index_out_of_range_is_an_index_error() -> None:
    x = sbpflow.randn(3, 4, placement=P2, sbp=S.split(0))
    for bad in (lambda: x[5], lambda: x[:, -5], lambda: x[0, 0, 0],
                lambda: x.index_select(0, sbpflow.tensor([0, 3], placement=P2, sbp=S.broadcast)),
                lambda: x.sum(dim=2)):
        with pytest.raises(IndexError) as info:
            bad()
        assert isinstance(info.value, IndexOutOfRangeError) and isinstance(info.value, SbpflowError)
    with pytest.raises(IndexError):  # torch agrees on every case above; one for the record
        torch.zeros(3, 4)[5]
