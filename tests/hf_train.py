"""Helpers of the Llama and Mixtral tests: AdamW training (eager or compiled), transformers' gradient by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import sbpflow
from harness import per_expert
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


def batch(rows: int, vocab: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The tests' fixed batch: ``rows`` sequences of 10 tokens and their next-token targets."""
    tokens = np.random.default_rng(1).integers(0, vocab, size=(rows, 11))
    return tokens[:, :-1], tokens[:, 1:]


def train(folder: Path, parallel: dict[str, int], compiled: bool, steps: int = 3, micro_batches: int = 1,
          schedule: str | None = None, prepare: Callable[[Any], Any] | None = None
          ) -> tuple[list[float], dict[str, Any]]:
    """AdamW steps on random tokens, eager or as an nn.Graph; the losses and final parameters.

    ``prepare`` lays the loaded model out further before its optimizer is made (e.g. splits its experts).
    """
    model = from_pretrained(folder, **parallel)
    if prepare is not None:
        prepare(model)
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
    return losses, per_expert(model, lambda p: p.numpy())  # stacked experts by each expert's name


def hf_grad_of(name: str, grads: dict[str, np.ndarray]) -> np.ndarray:
    """transformers 5 stacks the experts (gate_up_proj, down_proj); the checkpoint and sbpflow keep w1/w2/w3, per
    expert (``experts.{e}.w1.weight``) or, split over an ep axis, stacked (``experts.w1``)."""
    if ".experts." not in name:
        return grads[name.replace("block_sparse_moe", "mlp")]
    prefix, rest = name.split(".block_sparse_moe.experts.")
    parts = rest.split(".")
    e, w = (slice(None), parts[0]) if len(parts) == 1 else (int(parts[0]), parts[1])
    if w == "w2":
        return grads[f"{prefix}.mlp.experts.down_proj"][e]
    gate_up = grads[f"{prefix}.mlp.experts.gate_up_proj"][e]
    half = gate_up.shape[-2] // 2
    return gate_up[..., :half, :] if w == "w1" else gate_up[..., half:, :]
