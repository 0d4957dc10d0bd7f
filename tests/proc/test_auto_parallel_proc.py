"""``config.enable_auto_parallel`` on 4 gloo processes (issue 25 §4): each process plans the ViT's traced step
(the same plan on every process), lays the model out by it and trains on plain local batches; the losses and
parameters equal one device's (rtol 1e-4)."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from procrun import run_ranks

import sbpflow
from sbpflow import nn
from sbpflow.models.vit import ViT, ViTConfig

RTOL, ATOL = 1e-4, 1e-6
TIMEOUT = 180.0
CONFIG = ViTConfig(image_size=8, patch_size=4, width=16, depth=2, n_head=2, num_classes=5)


class Step(nn.Graph):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # SGD: attention's k bias gets a zero gradient up to rounding, which Adam would scale up to lr
        self.add_optimizer(sbpflow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    def build(self, images: Any, labels: Any) -> Any:
        _, loss = self.model(images, labels)
        loss.backward()
        return loss


def train(auto: bool, steps: int = 2) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # a plan may run pipeline stages on one micro-batch (PipelineWarning)
    sbpflow.manual_seed(0)
    model = ViT(CONFIG)
    step = Step(model)
    if auto:
        step.config.enable_auto_parallel(devices=4)
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        images, labels = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
        loss = step(sbpflow.tensor(images), sbpflow.tensor(labels))
        if auto:
            loss = loss.to_global(placement=model.strategy.everywhere, sbp=[sbpflow.sbp.broadcast])
        losses.append(float(loss.numpy()))
    params = {n: (p.to_global(placement=model.strategy.everywhere, sbp=[sbpflow.sbp.broadcast]) if auto
                  else p).numpy() for n, p in model.named_parameters()}
    plan = replace(step.auto_plan, search={}).to_json() if auto else None  # all but the search's time
    return {"losses": losses, "params": params, "plan": plan}


def test_auto_plan_of_the_vit_on_four_processes_trains_as_one_device() -> None:
    want = train(False)
    results = run_ranks(train, 4, args=(True,), timeout=TIMEOUT)
    assert len({r["plan"] for r in results}) == 1  # every process chose the same plan
    for got in results:
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
        for name, value in want["params"].items():
            np.testing.assert_allclose(got["params"][name], value, rtol=RTOL, atol=ATOL, err_msg=name)
