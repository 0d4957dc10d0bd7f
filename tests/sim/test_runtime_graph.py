"""Compiled nn.Graph steps on the actor runtime equal the in-order executor's, bit for bit.

The same GPT training step (AdamW, gradient accumulation) is compiled twice, once per executor; losses
and parameters must be identical after several steps, and the runtime's register counters must respect
the plan's register counts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow
from sbpflow import nn
from sbpflow.comm import SimulatedBackend
from sbpflow.models.gpt import GPT, GPTConfig, parallelize
from sbpflow.runtime.memory import dry_run

STEPS = 3


def train(executor: str, strategy: dict[str, int], m: int,
          threads: bool | None = None) -> tuple[list[float], list[np.ndarray], Any]:
    sbpflow.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    layout = parallelize(model, **strategy)
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(m)
            self.config.set_executor(executor, threads=threads)

        def build(self, ids: Any, targets: Any) -> Any:
            _, loss = self.model(ids, targets)
            loss.backward()
            return loss

    graph, rng = Step(), np.random.default_rng(0)
    ids, targets = layout.shard_inputs(rng.integers(0, 32, (8, 8)), rng.integers(0, 32, (8, 8)))
    losses = [float(graph(ids, targets).to_global(placement=layout.everywhere, sbp=sbpflow.sbp.broadcast).numpy())
              for _ in range(STEPS)]
    return losses, [p.numpy() for p in model.parameters()], graph._last


@pytest.mark.parametrize(("strategy", "m"), [({"data": 2}, 4), ({"pipeline": 2}, 4), ({"tensor": 2}, 1)],
                         ids=["dp2-m4", "pp2-m4", "tp2"])
def test_compiled_gpt_steps_on_actors_equal_the_in_order_executor(one_torch_thread: None,
                                                                   strategy: dict[str, int], m: int) -> None:
    losses, params, _ = train("inorder", strategy, m)
    got_losses, got_params, compiled = train("actors", strategy, m)
    assert got_losses == losses
    for got, expected in zip(got_params, params, strict=True):
        np.testing.assert_array_equal(got, expected)
    stats = compiled.executor.stats
    assert all(stats.peak_slots[b] <= n for b, n in stats.register_num.items() if b in stats.peak_slots)
    predicted = dry_run(compiled.plan, SimulatedBackend())
    assert (stats.acts, stats.peak_bytes, stats.peak_slots) == (predicted.acts, predicted.peak_bytes,
                                                                  predicted.peak_slots)


def test_compiled_gpt_on_worker_threads_equals_the_in_order_executor(one_torch_thread: None) -> None:
    """``set_executor("actors", threads=True)``: a thread per lane also on virtual ranks (on CUDA, a stream per
    lane); the numbers stay those of the in-order executor."""
    losses, params, _ = train("inorder", {"data": 2, "tensor": 2}, 2)
    got_losses, got_params, compiled = train("actors", {"data": 2, "tensor": 2}, 2, threads=True)
    assert compiled.executor.threaded and len(compiled.executor._workers) > 1
    assert got_losses == losses
    for got, expected in zip(got_params, params, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_threads_apply_to_the_actor_runtime_only() -> None:
    with pytest.raises(sbpflow.SbpflowError, match="threads=True applies to the 'actors' executor"):
        nn.Graph().config.set_executor("inorder", threads=True)
