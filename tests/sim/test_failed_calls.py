"""A refused call changes no state: norms' running statistics, optimizers, schedules, loaders and modules are
checked before they mutate, and mixing local modules with global inputs (or the other way round) raises a
:class:`sbpflow.LocalGlobalError` that names the module, the tensors' shapes, placement and SBP."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn, sbp
from sbpflow.nn import functional as F
from sbpflow.optim.lr_scheduler import LinearWarmup
from sbpflow.utils.data import DataLoader, TensorDataset

P2 = sbpflow.placement("cpu", [0, 1])
P23 = sbpflow.placement("cpu", [2, 3])


def _module_state(module: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.numpy().copy() for name, t in module.state_dict().items()}


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[name]), np.asarray(value), err_msg=name)


def _trained_bn(placement: Any = None) -> nn.BatchNorm2d:
    """A BatchNorm2d whose running statistics are not the initial zeros and ones (a multiply would show)."""
    layout = {} if placement is None else {"placement": placement, "sbp": sbp.broadcast}
    bn = nn.BatchNorm2d(3, **layout)
    sbpflow.manual_seed(0)
    bn(sbpflow.randn(4, 3, 2, 2, **({} if placement is None else {"placement": placement, "sbp": sbp.split(0)})))
    return bn


# ----------------------------------------------------------------------------- norms and modules


@pytest.mark.parametrize("momentum", [0.1, None])
def test_local_batchnorm_refuses_a_global_input_unchanged(momentum: float | None) -> None:
    bn = _trained_bn()
    bn.momentum = momentum
    before = _module_state(bn)
    x = sbpflow.randn(4, 3, 2, 2, placement=P2, sbp=sbp.split(0))
    with pytest.raises(sbpflow.LocalGlobalError) as info:
        bn(x)
    text = str(info.value)
    for part in ("BatchNorm2d holds local tensors", "weight: local shape [3]", "shape [4, 3, 2, 2]", "cpu:[0, 1]",
                 "S(0)", ".to_global(placement, sbp)"):
        assert part in text, (part, text)
    _assert_same(before, _module_state(bn))
    assert int(bn.num_batches_tracked.item()) == 1


def test_global_batchnorm_refuses_a_local_input_or_another_placement_unchanged() -> None:
    bn = _trained_bn(P2)
    before = _module_state(bn)
    with pytest.raises(sbpflow.LocalGlobalError, match=r"BatchNorm2d holds global tensors .*cpu:\[0, 1\].*local shape "
                       r"\[4, 3, 2, 2\]"):
        bn(sbpflow.randn(4, 3, 2, 2))
    with pytest.raises(sbpflow.PlacementError, match=r"BatchNorm2d holds tensors on cpu:\[0, 1\].*cpu:\[2, 3\]"):
        bn(sbpflow.randn(4, 3, 2, 2, placement=P23, sbp=sbp.split(0)))
    _assert_same(before, _module_state(bn))


def test_functional_batch_norm_checks_before_updating_running_stats() -> None:
    mean, var = sbpflow.tensor(np.full(3, 0.5, np.float32)), sbpflow.tensor(np.full(3, 2.0, np.float32))
    x = sbpflow.randn(4, 3, placement=P2, sbp=sbp.split(0))
    with pytest.raises(sbpflow.LocalGlobalError, match=r"batch_norm needs running_mean and the input both local"):
        F.batch_norm(x, mean, var, training=True)
    np.testing.assert_array_equal(mean.numpy(), np.full(3, 0.5, np.float32))
    np.testing.assert_array_equal(var.numpy(), np.full(3, 2.0, np.float32))


def test_a_mixed_op_names_the_innermost_module() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    with pytest.raises(sbpflow.LocalGlobalError) as info:
        model(sbpflow.randn(5, 3, placement=P2, sbp=sbp.split(0)))
    text = str(info.value)
    assert text.startswith("Linear holds local tensors (weight: local shape [4, 3] float32), but got input 0: "
                           "shape [5, 3] float32 on cpu:[0, 1] sbp (S(0))"), text
    assert "op 'linear' got local and global tensors together" in text
    assert info.value.module == "Linear"


def test_module_load_state_dict_checks_every_entry_first() -> None:
    model = nn.Sequential(nn.Linear(3, 4, placement=P2, sbp=sbp.broadcast), nn.Linear(4, 2))
    before = _module_state(model)
    bad = {name: np.ones(value.shape, np.float32) for name, value in before.items()}
    bad["1.bias"] = np.ones(5, np.float32)  # the last entry is the wrong one
    with pytest.raises(sbpflow.ShapeError, match=r"'1.bias' has shape \[2\] in the module.*shape \[5\]"):
        model.load_state_dict(bad)
    _assert_same(before, _module_state(model))


# ----------------------------------------------------------------------------- optimizers and schedules


def _optimizer_state(opt: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gi, group in enumerate(opt.param_groups):
        for key, value in group.items():
            if key != "params":
                out[f"group{gi}.{key}"] = value
        for pi, p in enumerate(group["params"]):
            out[f"group{gi}.param{pi}"] = p.numpy().copy()
            for name, value in opt.state[p].items():
                out[f"group{gi}.param{pi}.{name}"] = value.numpy().copy() if hasattr(value, "numpy") else value
    return out


def _two_group_optimizer(kind: str) -> tuple[Any, list[nn.Parameter]]:
    sbpflow.manual_seed(0)
    params = [nn.Parameter(sbpflow.randn(4, 3, placement=P2, sbp=sbp.broadcast)),
              nn.Parameter(sbpflow.randn(3, placement=P2, sbp=sbp.split(0)))]
    groups = [{"params": [params[0]]}, {"params": [params[1]], "lr": 0.05}]
    opt = sbpflow.optim.SGD(groups, lr=0.1, momentum=0.9) if kind == "sgd" else sbpflow.optim.AdamW(groups, lr=0.1)
    for p in params:
        p.grad = sbpflow.ones(tuple(p.shape), placement=P2, sbp=p.sbp)
    opt.step()  # state exists (momentum buffers, Adam's moments and step counts)
    return opt, params


BAD_GRADS = {
    "shape": (lambda p: sbpflow.ones(5, placement=P2, sbp=sbp.broadcast), sbpflow.ShapeError,
              r"SGD.step|AdamW.step", r"parameter with shape \[3\] float32 on cpu:\[0, 1\] sbp \(S\(0\)\) has a "
              r"gradient with shape \[5\]"),
    "local": (lambda p: sbpflow.ones(3), sbpflow.LocalGlobalError, r"SGD.step|AdamW.step",
              r"local or global as its parameter is.*sbp \(S\(0\)\) has a gradient with local shape \[3\]"),
}


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("bad", sorted(BAD_GRADS))
def test_optimizer_step_with_a_bad_gradient_changes_no_group(kind: str, bad: str) -> None:
    opt, params = _two_group_optimizer(kind)
    make, error, who, text = BAD_GRADS[bad]
    params[1].grad = make(params[1])  # the second group's: the first group must not have been updated either
    before = _optimizer_state(opt)
    with pytest.raises(error, match=text) as info:
        opt.step()
    assert any(name in str(info.value) for name in who.split("|"))
    _assert_same(before, _optimizer_state(opt))


def test_optimizer_step_with_a_partial_parameter_changes_no_group() -> None:
    opt, params = _two_group_optimizer("sgd")
    partial = nn.Parameter(sbpflow.ones(3, placement=P2, sbp=sbp.partial_sum))
    partial.grad = sbpflow.ones(3, placement=P2, sbp=sbp.partial_sum)
    opt.add_param_group({"params": [partial]})
    before = _optimizer_state(opt)
    with pytest.raises(sbpflow.SbpError, match=r"needs a split or broadcast SBP.*P\(sum\)"):
        opt.step()
    _assert_same(before, _optimizer_state(opt))


def test_optimizer_load_state_dict_with_a_bad_entry_changes_nothing() -> None:
    opt, _ = _two_group_optimizer("adamw")
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 123.0  # would be loaded first
    saved["state"][1]["exp_avg"] = torch.zeros(7)  # the last parameter's moment has the wrong shape
    before = _optimizer_state(opt)
    with pytest.raises(sbpflow.SbpflowError, match=r"optimizer state of shape \[7\] does not fit the parameter"):
        opt.load_state_dict(saved)
    with pytest.raises(sbpflow.SbpflowError, match=r"needs a dict with 'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})
    _assert_same(before, _optimizer_state(opt))


def test_lr_schedule_refuses_changed_groups_and_bad_state_unchanged() -> None:
    opt, _ = _two_group_optimizer("sgd")
    sched = LinearWarmup(opt, warmup_steps=4)
    sched.step()
    before = (_optimizer_state(opt), dict(sched.state_dict()))
    with pytest.raises(sbpflow.SbpflowError, match=r"made for 2 param groups, but the optimizer now has 3"):
        opt.add_param_group({"params": [nn.Parameter(sbpflow.ones(2, placement=P2, sbp=sbp.broadcast))]})
        sched.step()
    opt.param_groups.pop()
    with pytest.raises(sbpflow.SbpflowError, match=r"LinearWarmup.load_state_dict needs the keys"):
        sched.load_state_dict({"last_epoch": 3})
    with pytest.raises(sbpflow.SbpflowError, match=r"3 base lrs, but this one needs an int and 2"):
        sched.load_state_dict({**sched.state_dict(), "base_lrs": [0.1, 0.1, 0.1]})
    after = (_optimizer_state(opt), dict(sched.state_dict()))
    _assert_same(before[0], after[0])
    assert before[1] == after[1]


def test_data_loader_load_state_dict_with_bad_input_changes_nothing() -> None:
    loader = DataLoader(TensorDataset(torch.arange(20.0).reshape(10, 2)), batch_size=2, shuffle=True, seed=3)
    loader.load_state_dict({"epoch": 1, "index": 2})
    before = loader.state_dict()
    bad_states = [{"epoch": 1}, {"epoch": "one", "index": 0}, {"epoch": 2, "index": 9},
                  {"epoch": 2, "index": 0, "seed": 4}, [("epoch", 1)]]
    for bad in bad_states:
        with pytest.raises(sbpflow.SbpflowError, match="DataLoader.load_state_dict"):
            loader.load_state_dict(bad)  # type: ignore[arg-type]
        assert loader.state_dict() == before, bad
    assert loader.batch_indices(loader.epoch, loader.index) == DataLoader(
        TensorDataset(torch.arange(20.0).reshape(10, 2)), batch_size=2, shuffle=True, seed=3).batch_indices(1, 2)


def test_grad_scaler_refuses_bad_gradients_before_dividing_any() -> None:
    opt, params = _two_group_optimizer("sgd")
    params[0].grad = sbpflow.full((4, 3), 8.0, placement=P2, sbp=sbp.broadcast)
    params[1].grad = sbpflow.ones(3)  # local, for a global parameter
    scaler = sbpflow.amp.GradScaler(init_scale=4.0)
    before = _optimizer_state(opt)
    with pytest.raises(sbpflow.LocalGlobalError, match=r"SGD.step: a gradient must be local or global"):
        scaler.step(opt)
    np.testing.assert_array_equal(params[0].grad.numpy(), np.full((4, 3), 8.0, np.float32))  # not divided by 4
    _assert_same(before, _optimizer_state(opt))
    params[1].grad = sbpflow.ones(3, placement=P2, sbp=sbp.split(0))
    scaler.step(opt)  # not marked as unscaled by the refused call: this one unscales and steps
    np.testing.assert_array_equal(params[0].grad.numpy(), np.full((4, 3), 2.0, np.float32))


def test_implicit_broadcast_takes_local_tensors_as_broadcast_and_ends_with_its_block() -> None:
    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    w = sbpflow.randn(4, 6, placement=mesh, sbp=(sbp.split(0), sbp.split(1))).requires_grad_()
    pos = sbpflow.arange(6).float().requires_grad_()
    with pytest.raises(ValueError), sbpflow.implicit_broadcast():
        raise ValueError("leaves the block")
    with pytest.raises(sbpflow.LocalGlobalError, match=r"op 'add' .*local shape \[6\].*implicit_broadcast"):
        w + pos  # the block above ended: mixing is refused again
    with sbpflow.implicit_broadcast():
        y = (w + pos) * pos
    assert y.placement == mesh and y.sbp == (sbp.split(0), sbp.split(1))
    y.sum().backward()
    wv, pv = w.numpy(), pos.numpy()
    np.testing.assert_allclose(y.numpy(), (wv + pv) * pv, rtol=1e-6)
    np.testing.assert_allclose(pos.grad.numpy(), (wv + 2 * pv).sum(0), rtol=1e-5)  # a local gradient, summed
    assert pos.grad.is_local
