"""AdamW training of a Hugging Face folder's model, eager or compiled, for the Llama and Mixtral tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import sbpflow
from sbpflow.models import from_pretrained


class TrainStep(sbpflow.nn.Graph):
    def __init__(self, model: Any, opt: Any, micro_batches: int = 1, schedule: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(micro_batches)
        if schedule is not None:
            self.config.set_pipeline_schedule(schedule)

    def build(self, ids: Any, targets: Any) -> Any:
        _, loss = self.model(ids, targets)
        loss.backward()
        return loss


def train(folder: Path, parallel: dict[str, int], compiled: bool, steps: int = 3, micro_batches: int = 1,
          schedule: str | None = None) -> tuple[list[float], dict[str, Any]]:
    """AdamW steps on random tokens, eager or as an nn.Graph; the losses and final parameters."""
    model = from_pretrained(folder, **parallel)
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(model, opt, micro_batches, schedule) if compiled else None
    rng = np.random.default_rng(2)
    losses = []
    for _ in range(steps):
        tokens = rng.integers(0, 64, size=(4, 9))
        ids, targets = model.strategy.shard_inputs(tokens[:, :-1], tokens[:, 1:]) if model.strategy else (
            sbpflow.tensor(tokens[:, :-1]), sbpflow.tensor(tokens[:, 1:]))
        if step is not None:
            losses.append(step(ids, targets).item())
            continue
        opt.zero_grad()
        _, loss = model(ids, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.numpy() for n, p in model.named_parameters()}
