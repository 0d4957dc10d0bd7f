"""``sbpflow.parallelize`` on 4 gloo processes: the ViT, dp2 x tp2 by its own plan, fed plain local inputs (the same
on every process), trains as one device does (losses and parameters, rtol 1e-4)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from procrun import run_ranks

import sbpflow
from sbpflow.models.vit import ViT, ViTConfig

RTOL, ATOL = 1e-4, 1e-6
TIMEOUT = 150.0
CONFIG = ViTConfig(image_size=8, patch_size=4, width=16, depth=2, n_head=2, num_classes=5)


def train_vit(parallel: dict[str, int] | None, steps: int = 3) -> dict[str, Any]:
    """SGD-momentum steps on fixed batches; each process passes the whole batch as local tensors."""
    sbpflow.manual_seed(0)
    model = ViT(CONFIG)
    if parallel is not None:
        sbpflow.parallelize(model, **parallel)
    opt = sbpflow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        images, labels = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        _, loss = model(sbpflow.tensor(images), sbpflow.tensor(labels))
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return {"losses": losses, "params": {n: p.numpy() for n, p in model.named_parameters()},
            "held": sorted(model.blocks[0].attn.q.weight._shards or ())}


def test_vit_dp2_tp2_on_four_processes_matches_one_device() -> None:
    want = train_vit(None)
    results = run_ranks(train_vit, 4, args=({"data": 2, "tensor": 2},), timeout=TIMEOUT)
    for rank, got in enumerate(results):
        assert got["held"] == [rank]  # each process holds its own rank's shard of q, nothing more
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
        for name, value in want["params"].items():
            np.testing.assert_allclose(got["params"][name], value, rtol=RTOL, atol=ATOL, err_msg=name)
