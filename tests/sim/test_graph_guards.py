"""nn.Graph's guards: a compiled step notices changes to its model and optimizer after its first call.

Every change of :data:`guards.CHANGES` (a frozen weight, a replaced parameter, ``eval()``, a new hyperparameter,
optimizer state loaded into new tensors, a replaced buffer) is followed by a step; the compiled run on two
virtual ranks must give one device's eager numbers after each, compiling again with a warning that names the
change, and reusing its earlier plans when the model goes back to an earlier state.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import pytest

import sbpflow
from guards import CHANGES, Net, Step, assert_same_run, batch, changing_run
from sbpflow.nn.graph import GraphRecompileWarning

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P1 = sbpflow.placement("cpu", [0])
P2 = sbpflow.placement("cpu", [0, 1])


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], dict[str, Any]]:
    return changing_run(P2, graph=True), changing_run(P1, graph=False)


def test_every_change_gives_one_devices_eager_numbers(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    assert_same_run(*runs)


def test_each_change_compiles_again_with_a_warning_naming_it(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    said = dict(zip([name for name, _ in CHANGES], runs[0]["warnings"], strict=True))
    assert said["first step"] == []
    expected = {
        "freeze fc1.weight": "model.fc1.weight.requires_grad changed",
        "replace fc2.weight (model only)": "model.fc2.weight is another tensor",
        "replace fc2.weight (and optimizer)": "model.fc2.weight is another tensor",  # the first change it meets
        "eval": "model.training changed",
        "new momentum": "optimizer 0's param group 0 'momentum' changed",
        "load optimizer state": "the optimizer state 'momentum_buffer' of a parameter of optimizer 0's param "
                                "group 0 is another tensor",
        "replace bn.running_mean": "model.bn.running_mean is another tensor",
        "train again": "model.training changed",
        "unfreeze fc1.weight": "model.fc1.weight.requires_grad changed",
    }
    for name, text in expected.items():
        assert len(said[name]) == 1 and text in said[name][0], (name, said[name])
        assert said[name][0].startswith("Step: compiling again because "), said[name]


def test_going_back_reuses_an_earlier_plan() -> None:
    sbpflow.manual_seed(0)
    model = Net(P2)
    step = Step(model, sbpflow.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(0, P2)
    step(x, y)
    train_plan = step._last
    model.eval()
    with pytest.warns(GraphRecompileWarning, match="model.training changed"):
        step(x, y)
    eval_plan = step._last
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphRecompileWarning)
        for mode, plan in [(True, train_plan), (False, eval_plan), (True, train_plan)]:
            model.train(mode)
            step(x, y)  # an earlier plan again: no warning, no compile
            assert step._last is plan
    assert len(step._cache) == 2


def test_the_guard_is_cheap() -> None:
    """The per-call guard is a walk over modules and parameters: well under a step's dispatch floor."""
    sbpflow.manual_seed(0)
    model = Net(P2)
    step = Step(model, sbpflow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step(*batch(0, P2))
    start = time.perf_counter()
    for _ in range(1000):
        step._guard()
    per_call = (time.perf_counter() - start) / 1000
    assert per_call < 1e-3, per_call  # generous bound for a loaded CI machine; benchmarks/graph_guard.py measures


def test_a_forward_hook_added_later_compiles_again() -> None:
    sbpflow.manual_seed(0)
    model = Net(P2)
    step = Step(model, sbpflow.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(0, P2)
    step(x, y)
    handle = model.fc2.register_forward_hook(lambda m, args, out: out * 0.0)  # the model now predicts zeros
    with pytest.warns(GraphRecompileWarning, match="model.fc2's hooks or submodules changed"):
        loss = step(x, y).item()
    np.testing.assert_allclose(loss, float((y.numpy() ** 2).mean()), rtol=1e-6)
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphRecompileWarning)
        assert step(x, y).item() != pytest.approx(loss)  # the hook-less plan again
