"""A planned expert-parallel plan on 4 gloo processes (issue 25 §1): the graph planner's dp4 x ep2 plan of a user's
nn.MoE model, replayed by ``config.set_plan`` on every process, trains to one device's losses and parameters
(rtol 1e-4)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from procrun import run_ranks

import sbpflow
from sbpflow import nn
from sbpflow.autoparallel.graph_plan import Plan, plan_graph
from sbpflow.nn import functional as F
from sbpflow.nn.trace_step import trace_training_step

RTOL, ATOL = 1e-4, 1e-6
TIMEOUT = 180.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe = nn.MoE(8, 12, num_experts=4, top_k=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x: Any, y: Any) -> Any:
        x = self.inp(x)
        return F.cross_entropy(self.head(x + self.moe(x)), y)


class Step(nn.Graph):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sbpflow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    def build(self, x: Any, y: Any) -> Any:
        loss = self.model(x, y)
        loss.backward()
        return loss


def train(plan_json: str | None, steps: int = 2) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    sbpflow.manual_seed(0)
    model = Net()
    step = Step(model)
    if plan_json is not None:
        step.config.set_plan(Plan.from_json(plan_json))
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = step(sbpflow.tensor(x), sbpflow.tensor(y))
        if plan_json is not None:
            loss = loss.to_global(placement=model.strategy.everywhere, sbp=[sbpflow.sbp.broadcast])
        losses.append(float(loss.numpy()))
    whole = [sbpflow.sbp.broadcast]
    params = {n: (p.to_global(placement=model.strategy.everywhere, sbp=whole) if plan_json is not None else p).numpy()
              for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def test_a_planned_ep2_plan_on_four_processes_trains_as_one_device() -> None:
    with sbpflow.meta_init():
        meta = Net()
        x, y = sbpflow.randn(16, 8), sbpflow.zeros(16, dtype=torch.int64)
    plan = plan_graph(trace_training_step(meta, (x, y)), 4, precision="traced",
                      only=lambda k: k.ep == 2 and k.tp == 1 and k.pp == 1)
    assert (plan.knobs.dp, plan.knobs.ep) == (4, 2)
    want = train(None)
    for got in run_ranks(train, 4, args=(plan.to_json(),), timeout=TIMEOUT):
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
        for name, value in want["params"].items():
            np.testing.assert_allclose(got["params"][name], value, rtol=RTOL, atol=ATOL, err_msg=name)
