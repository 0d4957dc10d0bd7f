"""A training script that survives: restores from its newest checkpoint, saves every 2 steps (asynchronously),
and (first attempt only, with ``--kill-at K``) loses one rank (``--kill-rank``) by ``os._exit`` once K steps are
done, just before or just after their save began (``--kill-when``).

Run by tests/proc/test_restart_proc.py under ``sbpflow launch --max-restarts 1``. Rank 0 appends
``attempt step loss`` lines to ``OUT/losses.txt`` and, at the end, the logical parameters to ``OUT/params.npz``.

    python -m sbpflow.cli launch -n 2 --max-restarts 1 tests/proc/resilient_train.py dp=2 OUT --kill-at 3
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import sbpflow
from sbpflow.checkpoint import CheckpointManager, run_state
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, dropout=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy", help="a strategy, or dp: data parallel on every process launched")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=-1, help="the number of steps done when a rank leaves")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-when", choices=("before-save", "after-save"), default="after-save")
    parser.add_argument("--stop-at", type=int, default=-1, help="end (cleanly) after this step's checkpoint")
    args = parser.parse_args()
    attempt = sbpflow.distributed.config().restart_count
    strategy = f"dp={sbpflow.world_size()}" if args.strategy == "dp" else args.strategy  # elastic: as launched
    trainer = build(CONFIG, strategy, lr=1e-2, graph=args.graph, micro_batches=args.micro_batches)
    state = run_state(model=trainer.model, optimizer=trainer.optimizer)
    manager = CheckpointManager(os.path.join(args.out, "ckpt"), every=2, keep=2)
    start = manager.restore(state)
    batches = list(random_batches(CONFIG.vocab_size, args.steps, 8, 8, seed=1))
    for step in range(start, args.steps):
        loss = trainer.step(*batches[step])
        if sbpflow.rank() == 0:
            with open(os.path.join(args.out, "losses.txt"), "a") as f:
                f.write(f"{attempt} {sbpflow.world_size()} {step} {loss!r}\n")
        doomed = step + 1 == args.kill_at and attempt == 0 and sbpflow.rank() == args.kill_rank
        if doomed and args.kill_when == "before-save":
            os._exit(7)  # a rank lost between steps
        manager.save(step + 1, state)
        if doomed:
            os._exit(7)  # a rank lost mid-run, its writer thread (and the save it began) with it
        if step + 1 == args.stop_at:
            break
    manager.wait()
    values = parameter_values(trainer)  # collectives (gathers): every process reads them
    if sbpflow.rank() == 0:
        np.savez(os.path.join(args.out, "params.npz"), **values)


if __name__ == "__main__":
    main()
