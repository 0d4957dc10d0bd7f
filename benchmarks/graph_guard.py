"""What nn.Graph's guard costs per call: the walk over modules, parameters, buffers and optimizer state that
decides whether the cached plan still fits the model (a frozen weight, a replaced parameter, ``eval()`` ...).

Rows: GPTs under the demo's AdamW (two param groups), placed dp=2 on virtual ranks. The two small ones are
compiled and stepped, so the guard is set against the whole call ``graph(ids, targets)``; the large shapes are
built under ``sbpflow.meta_init()`` (no memory for weights: the guard reads identities and flags only) with their
optimizer state made, and time the guard alone. Medians of rounds of many calls, in wall time.

Run: ``.venv/bin/python benchmarks/graph_guard.py`` (prints); ``--write`` also writes the "graph_guard" section
of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _report import add_write_flag, machine, publish

import sbpflow
from sbpflow.demo.train_gpt import TrainStep, build, random_batches
from sbpflow.models.gpt import GPTConfig

torch.set_num_threads(1)
ROUNDS = 7
CALLS = 500  # guard calls per round
STEPS = 5  # compiled steps per round (the small GPTs)

# name: (config, batch, whether to compile and step it)
MODELS: dict[str, tuple[GPTConfig, int, bool]] = {
    "tiny GPT (2 layers, width 64, seq 32)": (GPTConfig(100, 32, 2, 4, 64, dropout=0.0), 8, True),
    "GPT 4x256 (seq 128, issue 8's)": (GPTConfig(1000, 128, 4, 4, 256, dropout=0.0), 8, True),
    "GPT-2 small shape (12x768), meta": (GPTConfig(50304, 1024, 12, 12, 768, dropout=0.0), 0, False),
    "GPT-2 XL shape (48x1600), meta": (GPTConfig(50304, 1024, 48, 25, 1600, dropout=0.0), 0, False),
}


def _median_seconds(fn: Any, calls: int) -> float:
    per_round = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_round.append((time.perf_counter() - start) / calls)
    return statistics.median(per_round)


def measure(name: str, config: GPTConfig, batch: int, run: bool) -> str:
    if run:
        trainer = build(config, "dp=2", graph=True)
        batches = list(random_batches(config.vocab_size, STEPS + 1, batch, config.block_size, seed=1))
        trainer.step(*batches[0])  # compiles
        step_s = _median_seconds(lambda: [trainer.step(*b) for b in batches[1:]], 1) / STEPS
    else:
        with sbpflow.meta_init():
            trainer = build(config, "dp=2")
        trainer.optimizer.init_state()
        trainer.graph = TrainStep(trainer.model, trainer.optimizer, None, 1, None, None)
        step_s = float("nan")
    graph = trainer.graph
    guard_s = _median_seconds(graph._guard, CALLS)
    params = sum(1 for _ in trainer.model.parameters())
    modules = sum(1 for _ in trainer.model.modules())
    entries = len(graph._guard())
    share = f"{100 * guard_s / step_s:.3f}%" if run else "-"
    step = f"{step_s * 1e3:.1f}" if run else "-"
    return (f"| {name} | {modules} | {params} | {entries} | {guard_s * 1e6:.1f} | {guard_s / entries * 1e9:.0f} | "
            f"{step} | {share} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_write_flag(parser)
    args = parser.parse_args()
    rows = [measure(name, *spec) for name, spec in MODELS.items()]
    body = "\n".join([
        "## nn.Graph's guard per call (issue 28)",
        "",
        f"`.venv/bin/python benchmarks/graph_guard.py --write` on {machine()}, dp=2 on virtual ranks, AdamW in two "
        "param groups (the demo's). The guard runs at every call of a compiled step: it walks every module "
        "(identity, training mode, hooks), parameter (identity, requires_grad), buffer, optimizer param group "
        "(parameters, hyperparameters other than lr) and optimizer state tensor, and builds one tuple, the plan "
        f"cache's key. Medians of {ROUNDS} rounds of {CALLS} guard calls; the step column is a whole "
        "`graph(ids, targets)` call (batch 8) for the two models small enough to run here.",
        "",
        "| model | modules | parameters | guard entries | guard (µs per call) | ns per entry | step (ms) | "
        "guard / step |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    publish("graph_guard", body, args.write)


if __name__ == "__main__":
    main()
