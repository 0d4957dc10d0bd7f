"""A training run that changes its model and optimizer between steps, compiled or eager (nn.Graph's guards).

The same run on one device in eager mode is the reference: a compiled step that missed a change (a frozen
weight still updated, a replaced parameter's old tensor trained, dropout on after ``eval()``, an optimizer
state loaded into new tensors but the old ones updated) gives other numbers from that step on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

import sbpflow
from harness import MeanSquareStep
from sbpflow import nn, sbp
from sbpflow.nn.graph import GraphRecompileWarning


class Net(nn.Module):
    def __init__(self, placement: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16, placement=placement, sbp=sbp.broadcast)
        self.bn = nn.BatchNorm1d(16, placement=placement, sbp=sbp.broadcast)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 3, placement=placement, sbp=sbp.broadcast)

    def forward(self, x: Any) -> Any:
        return self.fc2(self.drop(self.bn(self.fc1(x)).relu()))


class Step(MeanSquareStep):
    """The guarded step (MSE); its name is the one nn.Graph's recompile warnings start with."""


def _new_weight(placement: Any) -> nn.Parameter:
    sbpflow.manual_seed(7)
    return nn.Parameter(sbpflow.randn(3, 16, placement=placement, sbp=sbp.broadcast) * 0.1)


FC2_WEIGHT = 4  # its index in the optimizer's group: fc1.weight, fc1.bias, bn.weight, bn.bias, fc2.weight, ...


def _replace_fc2(model: Net, opt: Any, into_optimizer: bool) -> None:
    model.fc2.weight = _new_weight(model.fc2.weight.placement)
    if into_optimizer:
        opt.param_groups[0]["params"][FC2_WEIGHT] = model.fc2.weight


# (name of the change, the change); each is followed by one step, and the last ones go back to earlier states
CHANGES: list[tuple[str, Callable[[Net, Any], None]]] = [
    ("first step", lambda m, o: None),
    ("freeze fc1.weight", lambda m, o: m.fc1.weight.requires_grad_(False)),
    ("replace fc2.weight (model only)", lambda m, o: _replace_fc2(m, o, into_optimizer=False)),
    ("replace fc2.weight (and optimizer)", lambda m, o: _replace_fc2(m, o, into_optimizer=True)),
    ("eval", lambda m, o: m.eval()),
    ("new momentum", lambda m, o: o.param_groups[0].update(momentum=0.5)),
    ("load optimizer state", lambda m, o: o.load_state_dict(o.state_dict())),
    ("replace bn.running_mean", lambda m, o: setattr(m.bn, "running_mean", m.bn.running_mean * 0.5)),
    ("train again", lambda m, o: m.train()),
    ("unfreeze fc1.weight", lambda m, o: m.fc1.weight.requires_grad_(True)),
]


def batch(step: int, placement: Any) -> tuple[Any, Any]:
    sbpflow.manual_seed(100 + step)
    x = sbpflow.randn(8, 6, placement=placement, sbp=sbp.split(0))
    y = sbpflow.randn(8, 3, placement=placement, sbp=sbp.split(0))
    return x, y


def changing_run(placement: Any, graph: bool) -> dict[str, Any]:
    """Per step: the loss, every parameter and buffer of the model, the optimizer's state tensors and (compiled)
    the number of cached plans and recompile warnings."""
    sbpflow.manual_seed(0)
    model = Net(placement)
    opt = sbpflow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = Step(model, opt) if graph else None
    out: dict[str, Any] = {"loss": [], "state": [], "plans": [], "warnings": []}
    for i, (_, change) in enumerate(CHANGES):
        change(model, opt)
        x, y = batch(i, placement)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", GraphRecompileWarning)
            loss = step(x, y) if step is not None else _eager_step(model, opt, x, y)
        out["loss"].append(loss.item())
        out["state"].append(_values(model, opt))
        out["plans"].append(len(step._cache) if step is not None else 0)
        out["warnings"].append([str(w.message) for w in caught if issubclass(w.category, GraphRecompileWarning)])
    return out


def _eager_step(model: Net, opt: Any, x: Any, y: Any) -> Any:
    opt.zero_grad()
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    return loss


def _values(model: Net, opt: Any) -> dict[str, np.ndarray]:
    values = {name: t.numpy().copy() for name, t in model.state_dict().items()}  # not views of live shards
    for k, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
        if buf is not None:
            values[f"optim.{k}.momentum_buffer"] = buf.numpy().copy()
    return values


def assert_same_run(ours: dict[str, Any], reference: dict[str, Any], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for i, (name, _) in enumerate(CHANGES):
        np.testing.assert_allclose(ours["loss"][i], reference["loss"][i], rtol=rtol, err_msg=f"loss after {name}")
        assert sorted(ours["state"][i]) == sorted(reference["state"][i]), name
        for key, value in reference["state"][i].items():
            np.testing.assert_allclose(ours["state"][i][key], value, rtol=rtol, atol=atol,
                                       err_msg=f"{key} after {name}")
