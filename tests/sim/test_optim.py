"""Optimizers, LR schedules and gradient clipping against torch.optim, local and under S/B layouts."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import PLACEMENTS, B, randn
from sbpflow import nn, optim
from sbpflow import sbp as S
from sbpflow.comm import record
from sbpflow.errors import SbpError
from sbpflow.optim.lr_scheduler import CosineAnnealingLR, LinearWarmup, WarmupCosine

SHAPES = [(5, 3), (7,), (4, 6)]

# name -> (placement key or None, one n-D SBP per parameter in SHAPES)
LAYOUTS: dict[str, tuple[str | None, list[Any]]] = {
    "local": (None, [None, None, None]),
    "1": ("1", [(B,), (B,), (S.split(1),)]),
    "2": ("2", [(S.split(0),), (B,), (S.split(1),)]),
    "3-uneven": ("3", [(S.split(0),), (S.split(0),), (S.split(1),)]),
    "2x2": ("2x2", [(S.split(0), S.split(1)), (B, S.split(0)), (S.split(1), B)]),
}


def _params(layout: str, seed: int = 0) -> tuple[list[nn.Parameter], list[torch.nn.Parameter]]:
    pkey, sbps = LAYOUTS[layout]
    placement = PLACEMENTS[pkey] if pkey else None
    ours, theirs = [], []
    for i, (shape, s) in enumerate(zip(SHAPES, sbps, strict=True)):
        value = randn(*shape, seed=seed + i)
        ours.append(nn.Parameter(sbpflow.tensor(value, placement=placement, sbp=s)))
        theirs.append(torch.nn.Parameter(value.clone()))
    return ours, theirs


def _set_grads(ours: list[nn.Parameter], theirs: list[torch.nn.Parameter], step: int) -> None:
    for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
        g = randn(*q.shape, seed=100 * step + i)
        q.grad = g.clone()
        p.grad = sbpflow.tensor(g, placement=p.placement, sbp=p.sbp) if p.is_global else sbpflow.tensor(g)


def _run(make_ours: Any, make_theirs: Any, layout: str, steps: int = 4) -> None:
    ours, theirs = _params(layout)
    opt, ref = make_ours(ours), make_theirs(theirs)
    for step in range(steps):
        _set_grads(ours, theirs, step)
        with record() as log:
            opt.step()
        ref.step()
        assert log.counts() == {}, "a per-shard update needs no communication"
        for p, q in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)
    for p in ours:  # state tensors have the parameter's layout
        for value in opt.state[p].values():
            if isinstance(value, sbpflow.Tensor) and p.is_global:
                assert value.placement == p.placement and value.sbp == p.sbp


SGD_CASES = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1},
]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kwargs", SGD_CASES, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_sgd_matches_torch(layout: str, kwargs: dict[str, Any]) -> None:
    _run(lambda ps: optim.SGD(ps, **kwargs), lambda ps: torch.optim.SGD(ps, **kwargs), layout)


ADAM_CASES = [
    (optim.Adam, torch.optim.Adam, {"lr": 0.01}),
    (optim.Adam, torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.1, "amsgrad": True}),
    (optim.AdamW, torch.optim.AdamW, {"lr": 0.01}),
    (optim.AdamW, torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1, "eps": 1e-6, "amsgrad": True}),
]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", range(len(ADAM_CASES)))
def test_adam_matches_torch(layout: str, case: int) -> None:
    ours_cls, torch_cls, kwargs = ADAM_CASES[case]
    _run(lambda ps: ours_cls(ps, **kwargs), lambda ps: torch_cls(ps, **kwargs), layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kwargs", [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.02, "maximize": True},
                                    {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}], ids=["wd", "max", "ams"])
def test_adamw_is_torchs_fused_kernel_bit_for_bit(layout: str, kwargs: dict[str, Any]) -> None:
    """Every shard runs torch's fused AdamW: the same bits as torch.optim.AdamW(fused=True) where a shard is the
    whole tensor; elsewhere within rounding (the kernel's vector body and scalar tail round differently, and a
    shard boundary moves which elements fall in the tail)."""
    ours, theirs = _params(layout)
    opt, ref = optim.AdamW(ours, **kwargs), torch.optim.AdamW(theirs, fused=True, **kwargs)
    for step in range(3):
        _set_grads(ours, theirs, step)
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs, strict=True):
            if layout in ("local", "1"):
                np.testing.assert_array_equal(p.numpy(), q.detach().numpy())
            else:
                np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_adam_fused_declines_what_its_kernel_cannot_take() -> None:
    """Mixed dtypes and non-contiguous parameters take the foreach sequence instead: same values as torch."""
    from sbpflow.ops.optimizer import adam_fused_

    def args(p: torch.Tensor) -> tuple[list[torch.Tensor], ...]:
        return [p], [torch.ones_like(p)], [torch.zeros_like(p)], [torch.zeros_like(p)], [], [torch.tensor(1.0)]

    kw = {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "decoupled": True,
          "maximize": False}
    strided = torch.zeros(4, 3).t()  # written in place: flat memory order would be wrong
    assert not adam_fused_(*args(strided), **kw) and torch.equal(strided, torch.zeros(3, 4))
    p = torch.zeros(3)
    ps, gs, ms, vs, maxs, steps = args(p)
    assert not adam_fused_(ps, [g.double() for g in gs], ms, vs, maxs, steps, **kw)
    assert adam_fused_(ps, [torch.ones(1).expand(3)], ms, vs, maxs, steps, **kw)  # an expanded gradient is read whole
    np.testing.assert_allclose(p.numpy(), [-0.1] * 3, rtol=1e-6)

    w, v = nn.Parameter(sbpflow.tensor(torch.zeros(4, 3).t())), torch.nn.Parameter(torch.zeros(3, 4))
    opt, ref = optim.AdamW([w], lr=0.1), torch.optim.AdamW([v], lr=0.1)
    for step in range(3):
        g = randn(3, 4, seed=step)
        w.grad, v.grad = sbpflow.tensor(g), g.clone()
        opt.step()
        ref.step()
    np.testing.assert_allclose(w.numpy(), v.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_param_groups_have_their_own_lr() -> None:
    ours, theirs = _params("2")
    opt = optim.AdamW([{"params": ours[:2]}, {"params": ours[2:], "lr": 0.1}], lr=0.01)
    ref = torch.optim.AdamW([{"params": theirs[:2]}, {"params": theirs[2:], "lr": 0.1}], lr=0.01)
    for step in range(3):
        _set_grads(ours, theirs, step)
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.1]


def test_step_after_backward_keeps_params_leaves() -> None:
    p2 = PLACEMENTS["2"]
    lin = nn.Linear(4, 3, placement=p2, sbp={"weight": S.split(0), "bias": S.split(0)})
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in lin.state_dict().items()})
    opt = optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = randn(6, 4)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        lin(sbpflow.tensor(x, placement=p2, sbp=B)).sum().backward()
        ref(x).sum().backward()
        opt.step()
        ref_opt.step()
    np.testing.assert_allclose(lin.weight.numpy(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert lin.weight.is_leaf and lin.weight.requires_grad and lin.weight.sbp == (S.split(0),)
    opt.zero_grad()
    assert all(p.grad is None for p in lin.parameters())


class ZeroAdamW(optim.AdamW):
    """ZeRO-1: state split over the (data-parallel) mesh while parameters stay broadcast."""

    def state_sbp(self, param: sbpflow.Tensor) -> Any:
        return (S.split(0),) if param.sbp == (B,) else param.sbp


def test_state_sbp_hook_shards_state_zero_style() -> None:
    ours, theirs = _params("1")
    p2 = PLACEMENTS["2"]
    for p in ours:
        nn.module.relayout_(p, p2, B)
    opt, ref = ZeroAdamW(ours, lr=0.01), torch.optim.AdamW(theirs, lr=0.01)
    for step in range(3):
        _set_grads(ours, theirs, step)
        with record() as log:
            opt.step()
        ref.step()
        assert log.counts() == {"all_gather": 3}  # one per parameter: the updated slices back into B
    for p, q in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert p.sbp == (B,)
        assert opt.state[p]["exp_avg"].sbp == (S.split(0),)


def test_partial_parameter_raises_sbpflow_error() -> None:
    p = nn.Parameter(sbpflow.ones(4, placement=PLACEMENTS["2"], sbp=S.partial_sum))
    p.grad = sbpflow.ones(4, placement=PLACEMENTS["2"], sbp=S.partial_sum)
    with pytest.raises(SbpError, match=r"SGD updates parameters shard by shard.*P\(sum\)"):
        optim.SGD([p], lr=0.1).step()


@pytest.mark.parametrize("cls", [optim.SGD, optim.AdamW])
def test_state_dict_round_trip_across_layouts(cls: Any) -> None:
    kwargs = {"lr": 0.05, "momentum": 0.9} if cls is optim.SGD else {"lr": 0.05}
    a, theirs = _params("2")
    opt_a = cls(a, **kwargs)
    for step in range(2):
        _set_grads(a, theirs, step)
        opt_a.step()
    saved = opt_a.state_dict()
    b, _ = _params("3-uneven")  # same parameter values would be needed: copy them over
    for pa, pb in zip(a, b, strict=True):
        pb._assign(pa.to_global(pb.placement, pb.sbp))
    opt_b = cls(b, **kwargs)
    opt_b.load_state_dict(saved)
    for p in b:
        for value in opt_b.state[p].values():
            if isinstance(value, sbpflow.Tensor):
                assert value.placement == p.placement and value.sbp == p.sbp
    for step in range(2, 4):
        _set_grads(a, theirs, step)
        _set_grads(b, theirs, step)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a, b, strict=True):
        np.testing.assert_allclose(pa.numpy(), pb.numpy(), rtol=1e-6, atol=1e-7)


# -- LR schedules --------------------------------------------------------------------------------------------


def _lrs(sched: Any, steps: int) -> list[float]:
    out = [sched.get_last_lr()[0]]
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def _opts(lr: float = 0.5) -> tuple[optim.SGD, torch.optim.SGD]:
    return optim.SGD([nn.Parameter(sbpflow.zeros(2))], lr=lr), torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))],
                                                                                lr=lr)


def test_linear_warmup_matches_torch_linear_lr() -> None:
    ours, theirs = _opts()
    got = _lrs(LinearWarmup(ours, warmup_steps=5, start_factor=0.2), 8)
    want = _lrs(torch.optim.lr_scheduler.LinearLR(theirs, start_factor=0.2, end_factor=1.0, total_iters=5), 8)
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_cosine_matches_torch() -> None:
    ours, theirs = _opts()
    got = _lrs(CosineAnnealingLR(ours, T_max=10, eta_min=0.01), 10)
    want = _lrs(torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=10, eta_min=0.01), 10)
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_warmup_cosine_matches_torch_sequential() -> None:
    ours, theirs = _opts()
    got = _lrs(WarmupCosine(ours, warmup_steps=3, total_steps=10, min_lr=0.05, start_factor=0.1), 12)
    warm = torch.optim.lr_scheduler.LinearLR(theirs, start_factor=0.1, total_iters=3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=7, eta_min=0.05)
    want = _lrs(torch.optim.lr_scheduler.SequentialLR(theirs, [warm, cos], milestones=[3]), 10)
    np.testing.assert_allclose(got[:11], want, rtol=1e-9)
    assert got[11] == pytest.approx(0.05) and got[12] == pytest.approx(0.05)  # held at min_lr after total_steps


def test_scheduler_sets_every_group() -> None:
    w1, w2 = nn.Parameter(sbpflow.zeros(1)), nn.Parameter(sbpflow.zeros(1))
    opt = optim.SGD([{"params": [w1]}, {"params": [w2], "lr": 2.0}], lr=1.0)
    sched = LinearWarmup(opt, warmup_steps=4)
    sched.step()
    assert sched.get_last_lr() == [0.25, 0.5]
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.5]


# -- clipping ------------------------------------------------------------------------------------------------


def _clip_case(norm_type: float) -> tuple[list[nn.Parameter], list[torch.nn.Parameter]]:
    p2, other = PLACEMENTS["2"], sbpflow.placement("cpu", [2, 3, 4])
    layouts = [(p2, S.split(0)), (p2, S.split(1)), (p2, B), (other, S.split(0)), (other, B)]
    shapes = [(5, 3), (4, 7), (6,), (7, 2), (3,)]
    ours, theirs = [], []
    for i, ((pl, s), shape) in enumerate(zip(layouts, shapes, strict=True)):
        value, grad = randn(*shape, seed=i), randn(*shape, seed=50 + i)
        p = nn.Parameter(sbpflow.tensor(value, placement=pl, sbp=s))
        p.grad = sbpflow.tensor(grad, placement=pl, sbp=s)
        q = torch.nn.Parameter(value.clone())
        q.grad = grad.clone()
        ours.append(p)
        theirs.append(q)
    return ours, theirs


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch_across_layouts_and_placements(norm_type: float, max_norm: float) -> None:
    ours, theirs = _clip_case(norm_type)
    total = nn.utils.clip_grad_norm_(ours, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert isinstance(total, float)
    assert total == pytest.approx(float(want), rel=1e-5)
    for p, q in zip(ours, theirs, strict=True):
        assert p.grad is not None and q.grad is not None
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_local_and_empty() -> None:
    w = nn.Parameter(sbpflow.tensor([3.0, 4.0]))
    assert nn.utils.clip_grad_norm_([w], 1.0) == 0.0  # no gradients yet
    w.grad = sbpflow.tensor([3.0, 4.0])
    assert nn.utils.clip_grad_norm_(w, 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(w.grad.numpy(), [0.6, 0.8], rtol=1e-5)


def test_clip_grad_norm_dispatches_per_layout_not_per_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve gradients in two layouts on one placement: foreach norms per layout, one all-reduce (issue 14)."""
    from sbpflow.ops import schema

    p2 = PLACEMENTS["2"]
    ours, theirs = [], []
    for i in range(12):
        value, grad = randn(4, 3, seed=i), randn(4, 3, seed=50 + i)
        p = nn.Parameter(sbpflow.tensor(value, placement=p2, sbp=S.split(0) if i % 2 else B))
        p.grad = sbpflow.tensor(grad, placement=p2, sbp=p.sbp)
        q = torch.nn.Parameter(value.clone())
        q.grad = grad.clone()
        ours.append(p)
        theirs.append(q)
    dispatched = []
    inner = schema.apply
    monkeypatch.setattr(schema, "apply", lambda op, args, attrs: dispatched.append(op.name) or inner(op, args, attrs))
    with record() as log:
        total = nn.utils.clip_grad_norm_(ours, 0.5)
    assert total == pytest.approx(float(torch.nn.utils.clip_grad_norm_(theirs, 0.5)), rel=1e-5)
    for p, q in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-7)  # type: ignore[union-attr]
    assert dispatched == ["add"]  # the P(sum) piece of the split gradients plus the B piece of the others
    assert log.counts() == {"all_reduce": 1}
