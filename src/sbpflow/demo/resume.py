"""The demo's checkpoints: its run's whole state saved and resumed bit-exactly, in any strategy (resharding on
load), one checkpoint or a folder of them (``--checkpoint-every N``, ``--resume``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sbpflow
from sbpflow.checkpoint import CheckpointManager, RunState, run_state
from sbpflow.utils.data import DataLoader

if TYPE_CHECKING:  # train_gpt drives this module
    from .train_gpt import Trainer


def demo_run_state(trainer: Trainer, schedule: Any, step: int = 0, loader: DataLoader | None = None) -> RunState:
    """The demo run's whole state, for :func:`sbpflow.checkpoint.run_state`'s users (save, restore, manager)."""
    return run_state(model=trainer.model, optimizer=trainer.optimizer, scheduler=schedule, loader=loader, step=step)


def training_state(trainer: Trainer, schedule: Any, step: int, loader: DataLoader | None = None) -> dict[str, Any]:
    """Everything a resumed run needs (:func:`sbpflow.checkpoint.run_state`'s tree), as tensors (sharing the
    run's storage) and Python scalars."""
    tree = demo_run_state(trainer, schedule, step, loader).tree()
    if loader is None:
        # without a loader the batch stream is a pure function of its seed: a count of batches drawn, for the
        # caller to skip (a loader's state_dict counts the batches its steps took, whatever was prefetched)
        tree["data"] = {"batches": step}
    return tree


def save_training(path: str, trainer: Trainer, schedule: Any, step: int,
                  loader: DataLoader | None = None) -> sbpflow.checkpoint.SaveReport:
    """Saves the run after ``step`` steps at ``path`` (a directory, replaced atomically)."""
    return sbpflow.save(training_state(trainer, schedule, step, loader), path)


def resume_training(path: str, trainer: Trainer, schedule: Any, loader: DataLoader | None = None) -> int:
    """Fills a freshly built run (and its loader's position) from the checkpoint at ``path``; returns the number
    of steps it had done.

    >>> import os, tempfile
    >>> from sbpflow.demo.train_gpt import build
    >>> from sbpflow.models.gpt import GPTConfig
    >>> cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> path = os.path.join(tempfile.mkdtemp(), "step-3")
    >>> _ = save_training(path, build(cfg, "dp=2"), None, step=3)
    >>> resume_training(path, build(cfg, "tp=2", seed=1), None)
    3
    """
    run = demo_run_state(trainer, schedule, 0, loader)
    tree = run.tree(fresh=True)
    sbpflow.load(tree, path)
    return run.apply(tree)


def resume_from_args(args: argparse.Namespace, state: RunState, print_fn: Callable[[str], None]) -> int:
    """``--resume PATH``: fills the run (and moves its loader) from the checkpoint at PATH or, for a folder of
    ``step-N`` checkpoints, from its newest complete one (:meth:`CheckpointManager.restore`); the first step to
    train."""
    if args.resume is None:
        return 0
    path = args.resume
    try:
        folder = CheckpointManager(path) if os.path.isdir(path) else None
        if folder is not None and folder.steps():
            step = folder.restore(state)
            path = folder.path(step)
        else:
            tree = state.tree(fresh=True)
            sbpflow.load(tree, path)
            step = state.apply(tree)
    except sbpflow.SbpflowError as e:
        raise SystemExit(f"sbpflow demo: --resume {args.resume}: {e}") from None
    if step >= args.steps:
        raise SystemExit(f"sbpflow demo: the checkpoint {path} is at step {step}, and --steps is {args.steps}: "
                         "nothing is left to train (raise --steps)")
    print_fn(f"resumed from {path} at step {step}")
    return step


def manager_from_args(args: argparse.Namespace) -> CheckpointManager | None:
    """``--checkpoint-every N``: a manager saving into OUT/checkpoints every N steps, asynchronously, all kept."""
    if args.checkpoint_every <= 0:
        return None
    return CheckpointManager(os.path.join(args.out, "checkpoints"), every=args.checkpoint_every, keep=0)


def checkpoint_from_args(args: argparse.Namespace, manager: CheckpointManager | None, state: RunState, step: int,
                         print_fn: Callable[[str], None]) -> None:
    """After ``step`` steps: saves every N-th step and the last one (a writer thread writes the files)."""
    if manager is not None and manager.save(step, state, force=step == args.steps):
        print_fn(f"checkpoint: {manager.path(step)} (written in the background; the step paused "
                 f"{manager.pause_s * 1e3:.0f} ms)")
