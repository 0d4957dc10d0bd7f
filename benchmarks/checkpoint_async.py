"""Step time while saving: 20 training steps with a checkpoint every 5, asynchronous against synchronous saves
against no saves (issue 29).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/checkpoint_async.py`` (prints a table; ``--write`` replaces
the "checkpoint-async" section of docs/benchmarks.md).

The run is the demo GPT's compiled step (``nn.Graph``) under ``dp=2,tp=2`` on 4 virtual ranks in this process,
with its whole run state (``sbpflow.checkpoint.run_state``: parameters, AdamW moments, random stream) saved by a
``CheckpointManager(every=5, keep=2)`` into a temporary folder on the local disk. The three modes run in
turned order over several rounds (each mode in each place of a round); the table reports medians. "Loop" is
the 20 steps with their saves; "+ wait" adds waiting for the last asynchronous save to be on disk. "Pause" is
the time ``save`` held the training thread per checkpoint: the whole save when synchronous, the snapshot into
host staging buffers when asynchronous. The asynchronous writer is a Python thread: on a 2-core machine its
hashing and writing share the cores (and the GIL's handoffs) with the steps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from _report import add_write_flag, machine, publish, turned

from sbpflow.checkpoint import CheckpointManager, run_state
from sbpflow.demo.train_gpt import build, random_batches
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=256, dropout=0.0)
STEPS, EVERY, BATCH = 20, 5, 8
MODES = ["none", "sync", "async"]


def run(mode: str, folder: str) -> tuple[float, float, float, int]:
    """(loop seconds, loop + final wait seconds, mean pause per save, checkpoint bytes) of one run."""
    trainer = build(CONFIG, "dp=2,tp=2", lr=1e-3, graph=True)
    batches = list(random_batches(CONFIG.vocab_size, STEPS + 1, BATCH, CONFIG.block_size, seed=1))
    trainer.step(*batches[0])  # compile outside the timing
    state = run_state(model=trainer.model, optimizer=trainer.optimizer)
    manager = CheckpointManager(folder, every=EVERY, keep=2, async_save=mode == "async")
    pauses = []
    start = time.perf_counter()
    for step in range(1, STEPS + 1):
        trainer.step(*batches[step])
        if mode != "none" and manager.save(step, state):
            pauses.append(manager.pause_s)
    loop = time.perf_counter() - start
    manager.wait()
    total = time.perf_counter() - start
    size = 0
    if manager.steps():
        path = manager.path(manager.steps()[-1])
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return loop, total, statistics.mean(pauses) if pauses else 0.0, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    add_write_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[tuple[float, float, float, int]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in turned(MODES, r):
            folder = tempfile.mkdtemp(prefix=f"sbpflow-ckpt-{mode}-")
            try:
                results[mode].append(run(mode, folder))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    base = statistics.median(x[0] for x in results["none"])
    lines = [f"`PYTHONPATH=src .venv/bin/python benchmarks/checkpoint_async.py --write` on {machine()}. GPT "
             f"{CONFIG.n_layer}x{CONFIG.n_embd} (vocabulary {CONFIG.vocab_size}, {CONFIG.block_size} positions), "
             f"compiled step under dp=2,tp=2 on 4 virtual ranks, batch {BATCH}; {STEPS} steps, a checkpoint of the "
             f"run state every {EVERY} (4 saves, keep=2); {args.rounds} rounds in turned order, medians.", "",
             "| saves | loop (20 steps) | + wait for the last save | vs no saves | pause per save | checkpoint |",
             "|---|---|---|---|---|---|"]
    for mode in MODES:
        loop = statistics.median(x[0] for x in results[mode])
        total = statistics.median(x[1] for x in results[mode])
        pause = statistics.median(x[2] for x in results[mode])
        size = max(x[3] for x in results[mode])
        lines.append(f"| {mode} | {loop * 1e3:.0f} ms | {total * 1e3:.0f} ms | {loop / base:.3f}x | "
                     f"{pause * 1e3:.1f} ms | {size / 1e6:.1f} MB |" if mode != "none" else
                     f"| none | {loop * 1e3:.0f} ms | {total * 1e3:.0f} ms | 1.000x | - | - |")
    publish("checkpoint-async", "## Step time while saving: asynchronous checkpoints (issue 29)\n\n"
            + "\n".join(lines) + "\n", args.write)


if __name__ == "__main__":
    main()
