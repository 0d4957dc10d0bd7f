"""Autograd: requires_grad, backward, .grad accumulation, no_grad, detach, retain_grad, hooks,
and the layouts and collectives that gradients get (DDP: one all-reduce per broadcast weight)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
import sbpflow.ops.functional as F
from harness import PLACEMENTS, PSUM, B, randn
from sbpflow import sbp as S
from sbpflow.comm import record


def _pair(a: torch.Tensor, placement: sbpflow.Placement | None, sbp: object) -> tuple[sbpflow.Tensor, torch.Tensor]:
    return sbpflow.tensor(a, placement=placement, sbp=sbp, requires_grad=True), a.clone().requires_grad_(True)


@pytest.mark.parametrize("pname", ["1", "2", "3", "2x2"])
def test_ddp_weight_grad_is_one_all_reduce_and_keeps_the_leaf_layout(pname: str) -> None:
    p = PLACEMENTS[pname]
    x = sbpflow.tensor(randn(7, 4), placement=p, sbp=(S.split(0),) * p.ndim)
    w, tw = _pair(randn(4, 6, seed=1), p, (B,) * p.ndim)
    loss = (x @ w).relu().sum()
    with record() as log:
        loss.backward()
    if p.size == 1:
        assert log.counts() == {}  # P -> B on one rank is a relabel: nothing runs
    elif p.ndim == 1:
        assert log.counts() == {"all_reduce": 1}
    else:  # (P, P) -> (B, B): the planner's hierarchical reduce-scatter/all-gather beats two all-reduces
        assert set(log.counts()) <= {"all_reduce", "reduce_scatter", "all_gather"}
    assert w.grad is not None and w.grad.placement == p and w.grad.sbp == (B,) * p.ndim
    (randn(7, 4) @ tw).relu().sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_intermediate_grad_keeps_its_partial_sbp() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(randn(6, 4), placement=p, sbp=S.split(0))
    w, tw = _pair(randn(4, 3, seed=1), p, B)
    t = w * 1.0  # an intermediate on B
    t.retain_grad()
    with record() as log:
        (x @ t).sum().backward()
    assert t.grad is not None and t.grad.sbp == (PSUM,)  # x^T @ dy over the split batch: a partial sum
    assert w.grad.sbp == (B,) and log.counts() == {"all_reduce": 1}
    (randn(6, 4) @ (tw * 1.0)).sum().backward()
    np.testing.assert_allclose(t.grad.numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sbp", [S.split(0), S.split(1), B, PSUM])
def test_leaf_grad_has_the_leaf_layout(sbp: object) -> None:
    p = PLACEMENTS["3"]
    a = randn(5, 4)
    x, tx = _pair(a, p, sbp)
    (x.exp() * 2).sum().backward()
    (tx.exp() * 2).sum().backward()
    assert x.grad.placement == p and x.grad.sbp == (sbp,)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5)


@pytest.mark.parametrize("placement", [None, PLACEMENTS["2"]])
def test_grads_accumulate_across_backward_calls(placement: sbpflow.Placement | None) -> None:
    sbp = S.split(0) if placement is not None else None
    x, tx = _pair(randn(4, 3), placement, sbp)
    for _ in range(3):
        (x * x).sum().backward()
        (tx * tx).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5)
    assert placement is None or x.grad.sbp == (S.split(0),)


def test_backward_with_explicit_gradient_and_shared_inputs() -> None:
    p = PLACEMENTS["2x2"]
    x, tx = _pair(randn(4, 6), p, (S.split(0), S.split(1)))
    g = randn(4, 6, seed=5)
    y = x * x + x.sigmoid() * x
    y.backward(sbpflow.tensor(g, placement=p, sbp=(B, S.split(0))))
    (tx * tx + tx.sigmoid() * tx).backward(g)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_no_grad_detach_and_requires_grad_flags() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(randn(4, 3), placement=p, sbp=S.split(0), requires_grad=True)
    with sbpflow.no_grad():
        y = x * 2
        with sbpflow.enable_grad():
            z = x * 2
    assert y.grad_fn is None and not y.requires_grad and z.grad_fn is not None and z.requires_grad
    d = x.detach()
    assert d.is_leaf and not d.requires_grad and d.sbp == x.sbp
    assert not sbpflow.tensor(randn(2)).requires_grad
    assert (x > 0).grad_fn is None  # boolean results never require grad

    @sbpflow.no_grad()
    def double(t: sbpflow.Tensor) -> sbpflow.Tensor:
        return t * 2

    assert double(x).grad_fn is None and sbpflow.is_grad_enabled()
    assert (x.detach() * x).grad_fn is not None


def test_leaf_and_intermediate_hooks() -> None:
    p = PLACEMENTS["3"]
    x, tx = _pair(randn(5, 2), p, S.split(0))
    seen: list[tuple[object, ...]] = []
    x.register_hook(lambda g: seen.append(g.sbp) or g * 3)
    h = x.tanh()
    remove = h.register_hook(lambda g: g + 1)
    h.sum().backward()
    tx.register_hook(lambda g: g * 3)
    th = tx.tanh()
    th.register_hook(lambda g: g + 1)
    th.sum().backward()
    assert seen and x.grad.sbp == (S.split(0),)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5)
    remove()
    x.grad = None
    x.tanh().sum().backward()  # the intermediate's hook is gone, the leaf's stays
    tx.grad = None
    tx.tanh().sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5)


def test_retain_graph_and_second_backward_error() -> None:
    x = sbpflow.tensor(randn(3), placement=PLACEMENTS["2"], sbp=S.split(0), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), (4 * randn(3)).numpy(), rtol=1e-5)
    with pytest.raises(sbpflow.AutogradError, match="second time.*retain_graph"):
        y.backward()


def test_backward_errors_name_the_problem() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(randn(4, 3), placement=p, sbp=S.split(0), requires_grad=True)
    with pytest.raises(sbpflow.AutogradError, match=r"scalar output.*shape \[4, 3\].*gradient="):
        (x * 2).backward()
    with pytest.raises(sbpflow.AutogradError, match="requires_grad=False"):
        sbpflow.tensor(randn(1)).backward()
    with pytest.raises(sbpflow.AutogradError, match=r"output's shape \[4, 3\]"):
        (x * 2).backward(sbpflow.tensor(randn(3), placement=p, sbp=B))
    y = x * 1.0
    z = y * y
    with sbpflow.no_grad():
        y.add_(1.0)
    with pytest.raises(sbpflow.AutogradError, match="modified in place"):
        z.sum().backward()
    with pytest.raises(sbpflow.AutogradError, match="floating-point"):
        sbpflow.tensor(torch.arange(3)).requires_grad_()


def test_local_tensor_autograd_matches_torch() -> None:
    x, tx = _pair(randn(3, 4), None, None)
    w, tw = _pair(randn(4, 2, seed=1), None, None)
    F.gelu(x @ w).mean().backward()
    torch.nn.functional.gelu(tx @ tw).mean().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_grad_of_a_dropped_multi_output_sibling() -> None:
    p = PLACEMENTS["2"]
    x, tx = _pair(randn(4, 5), p, S.split(0))
    values = x.max(dim=1).values  # the indices tensor is dropped at once
    values.sum().backward()
    tx.max(dim=1).values.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy())


def test_ops_reading_only_layouts_keep_no_activation_alive() -> None:
    """add and reshape keep their inputs' layouts only (as torch saves nothing for them): an activation only they
    read is freed after forward, and the gradients are unchanged."""
    import weakref

    x = sbpflow.ones(2, 3, requires_grad=True)
    h = x * 2.0
    alive = weakref.ref(h)
    z = (h + 1.0).reshape(3, 2)
    del h
    assert alive() is None
    z.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full((2, 3), 2.0))


def test_backward_frees_what_each_node_saved_as_it_goes() -> None:
    from sbpflow.utils.checkpoint import activation_bytes

    x = sbpflow.ones(4, requires_grad=True)
    y = (x * x).exp().sum()
    assert activation_bytes(y) > 0
    y.backward()
    assert activation_bytes(y) == 0
    with pytest.raises(sbpflow.AutogradError, match="second time"):
        y.backward()


def test_a_hook_runs_after_its_tensor_object_is_gone() -> None:
    x = sbpflow.ones(3, requires_grad=True)
    seen = []
    y = x * 2.0
    y.register_hook(lambda g: seen.append(g.tolist()))
    z = (y + 1.0).sum()  # add holds y's layout, not y
    del y
    z.backward()
    assert seen == [[1.0, 1.0, 1.0]]
