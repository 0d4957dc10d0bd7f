"""torch's grad mode is sbpflow's: ``torch.no_grad()``, ``torch.inference_mode()`` and ``torch.set_grad_enabled``
stop sbpflow ops from recording, on global and local tensors, exactly where they stop torch's."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn, sbp

P2 = sbpflow.placement("cpu", [0, 1])

OFF: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "torch.no_grad": torch.no_grad,
    "torch.inference_mode": torch.inference_mode,
    "torch.set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
    "sbpflow.no_grad": sbpflow.no_grad,
}


def _program(x: Any, w: Any) -> Any:
    h = (x @ w).relu()  # (8, 3)
    return h.sum(dim=1) * 2.0  # (8,)


def _leaves(kind: str) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    xv, wv = torch.randn(8, 4, generator=gen), torch.randn(4, 3, generator=gen)
    if kind == "local":
        x, w = sbpflow.tensor(xv.numpy()), sbpflow.tensor(wv.numpy(), requires_grad=True)
    else:  # data split over the ranks, a broadcast weight: boxing inside the program
        x = sbpflow.tensor(xv.numpy(), placement=P2, sbp=sbp.split(0))
        w = sbpflow.tensor(wv.numpy(), placement=P2, sbp=sbp.broadcast, requires_grad=True)
    return x, w, xv, wv.requires_grad_(True)


@pytest.mark.parametrize("kind", ["local", "global"])
@pytest.mark.parametrize("name", sorted(OFF))
def test_grad_mode_off_records_nothing_as_torch(name: str, kind: str) -> None:
    x, w, xv, wv = _leaves(kind)
    with OFF[name]():
        ours, theirs = _program(x, w), _program(xv, wv)
        assert sbpflow.is_grad_enabled() is torch.is_grad_enabled() is False
    assert (ours.requires_grad, ours.grad_fn is None) == (theirs.requires_grad, theirs.grad_fn is None) == (False, True)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6)
    # outside the block, recording is back, and backward gives torch's gradient
    ours, theirs = _program(x, w), _program(xv, wv)
    assert ours.requires_grad and ours.grad_fn is not None
    ours.sum().backward()
    theirs.sum().backward()
    assert w.grad is not None and wv.grad is not None
    np.testing.assert_allclose(w.grad.numpy(), wv.grad.numpy(), rtol=1e-6)


@pytest.mark.parametrize("outer, inner", [(torch.no_grad, sbpflow.enable_grad), (sbpflow.no_grad, torch.enable_grad)])
def test_enable_grad_inside_no_grad_records_from_either_side(outer: Any, inner: Any) -> None:
    x, w, _, _ = _leaves("global")
    with outer():
        assert _program(x, w).grad_fn is None
        with inner():
            assert _program(x, w).grad_fn is not None
        assert _program(x, w).grad_fn is None


def test_set_grad_enabled_as_a_call_and_decorators() -> None:
    x, w, _, _ = _leaves("global")
    torch.set_grad_enabled(False)
    try:
        assert not _program(x, w).requires_grad
    finally:
        torch.set_grad_enabled(True)
    assert torch.no_grad()(_program)(x, w).grad_fn is None
    assert sbpflow.no_grad()(_program)(x, w).grad_fn is None
    with torch.no_grad():
        assert sbpflow.enable_grad()(_program)(x, w).grad_fn is not None


def test_module_under_inference_mode() -> None:
    sbpflow.manual_seed(0)
    layer = nn.Linear(4, 3, placement=P2, sbp=sbp.broadcast)
    x = sbpflow.ones(8, 4, placement=P2, sbp=sbp.split(0))
    with torch.inference_mode():
        out = layer(x).relu()
        again = layer(x).relu()  # the same leaf boxed again: its cached copy is reused, inference tensors or not
    assert not out.requires_grad and out.grad_fn is None
    np.testing.assert_allclose(out.numpy(), again.numpy())
    expected = torch.relu(torch.ones(8, 4) @ torch.from_numpy(layer.weight.numpy()).T
                          + torch.from_numpy(layer.bias.numpy()))
    np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-6)
    loss = layer(x).sum()  # and training goes on after it
    loss.backward()
    assert layer.weight.grad is not None
