"""Issue 28 §1b on 4 gloo processes: torch's grad mode holds for global ops, and refused calls (a local norm fed a
global input, a global norm fed a local one, an optimizer step with one bad gradient) change no state on any
process."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from sbpflow import nn, sbp

TIMEOUT = 180.0


def _state(module: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.numpy().copy() for name, t in module.state_dict().items()}


def _refused(call: Any) -> str:
    try:
        call()
    except sbpflow.SbpflowError as e:
        return type(e).__name__
    return "accepted"


def job() -> dict[str, Any]:
    torch.set_num_threads(1)
    p4 = sbpflow.placement("cpu", [0, 1, 2, 3])
    sbpflow.manual_seed(0)
    w = sbpflow.randn(8, 4, placement=p4, sbp=sbp.split(0)).requires_grad_()
    out: dict[str, Any] = {"rank": sbpflow.rank()}
    for name, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode),
                       ("sbpflow.no_grad", sbpflow.no_grad)):
        with mode():
            y = (w * 2).sum(0)
        out[name] = (y.requires_grad, y.grad_fn is None)
    out["enabled"] = (w * 2).sum(0).requires_grad

    local_bn = nn.BatchNorm2d(3)
    local_bn(sbpflow.randn(4, 3, 2, 2))  # running stats off their initial values
    global_bn = nn.BatchNorm2d(3, placement=p4, sbp=sbp.broadcast)
    global_bn(sbpflow.randn(8, 3, 2, 2, placement=p4, sbp=sbp.split(0)))
    before = {"local": _state(local_bn), "global": _state(global_bn)}
    out["local_bn"] = _refused(lambda: local_bn(sbpflow.randn(8, 3, 2, 2, placement=p4, sbp=sbp.split(0))))
    out["global_bn"] = _refused(lambda: global_bn(sbpflow.randn(4, 3, 2, 2)))
    out["bn_unchanged"] = all(
        np.array_equal(before[k][n], v) for k, m in (("local", local_bn), ("global", global_bn))
        for n, v in _state(m).items())

    params = [nn.Parameter(sbpflow.randn(4, 3, placement=p4, sbp=sbp.broadcast)),
              nn.Parameter(sbpflow.randn(8, placement=p4, sbp=sbp.split(0)))]
    opt = sbpflow.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.05}], lr=0.1)
    for p in params:
        p.grad = sbpflow.ones(tuple(p.shape), placement=p4, sbp=p.sbp)
    opt.step()
    saved = [(p.numpy().copy(), {k: v.numpy().copy() if hasattr(v, "numpy") else v for k, v in opt.state[p].items()})
             for p in params]
    params[1].grad = sbpflow.ones(5, placement=p4, sbp=sbp.broadcast)  # the second group's gradient is bad
    out["adamw"] = _refused(opt.step)
    out["adamw_unchanged"] = all(
        np.array_equal(value, p.numpy()) and all(
            np.array_equal(np.asarray(state[k]), np.asarray(v.numpy() if hasattr(v, "numpy") else v))
            for k, v in opt.state[p].items())
        for p, (value, state) in zip(params, saved, strict=True))
    return out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_grad_mode_and_refused_calls_on_four_processes() -> None:
    for out in run_ranks(job, 4, timeout=TIMEOUT):
        rank = out["rank"]
        for mode in ("no_grad", "inference_mode", "sbpflow.no_grad"):
            assert out[mode] == (False, True), (rank, mode)
        assert out["enabled"], rank
        assert (out["local_bn"], out["global_bn"]) == ("LocalGlobalError", "LocalGlobalError"), rank
        assert out["bn_unchanged"], rank
        assert out["adamw"] == "ShapeError" and out["adamw_unchanged"], rank
