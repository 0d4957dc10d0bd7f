"""Checkpointing a training run so that resuming it is bit-exact.

A run's state is more than its weights: the optimizer's moments and step
counts, the LR schedule, the random stream (dropout masks) and how far the
batch stream has gone. :func:`training_state` gathers all of it as one nested
dict; :func:`save_training` writes it with :func:`sbpflow.save` and
:func:`resume_training` fills a freshly built run from it, in that run's own
strategy (any other one works too, resharding on load).

The batch position is the demo's DataLoader's ``state_dict()`` (epoch, batch:
the batches its steps took, whatever its source actor had prefetched), and a
resumed loader continues from there; without a loader (a stream that is a pure
function of its seed) it is a count of batches drawn, for the caller to skip.

>>> import os, tempfile
>>> from sbpflow.demo.train_gpt import build
>>> from sbpflow.models.gpt import GPTConfig
>>> cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=8)
>>> path = os.path.join(tempfile.mkdtemp(), "step-3")
>>> _ = save_training(path, build(cfg, "dp=2"), None, step=3)
>>> resume_training(path, build(cfg, "tp=2", seed=1), None)
3
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

import sbpflow
from sbpflow import random as sbp_random
from sbpflow.utils.data import DataLoader

if TYPE_CHECKING:  # train_gpt drives this module
    from .train_gpt import Trainer


def rng_state() -> dict[str, Any]:
    """sbpflow's random stream (seed and draws made) and torch's own generator."""
    return {"seed": sbp_random.initial_seed(), "counter": sbp_random.counter(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    sbp_random.manual_seed(state["seed"])
    sbp_random.set_counter(state["counter"])
    torch.set_rng_state(state["torch"])


def training_state(trainer: Trainer, schedule: Any, step: int, loader: DataLoader | None = None) -> dict[str, Any]:
    """Everything a resumed run needs, as tensors (sharing the run's storage) and Python scalars."""
    return {
        "model": trainer.model.state_dict(),
        "optim": trainer.optimizer.state_dict(),
        "schedule": schedule.state_dict() if schedule is not None else {},
        "rng": rng_state(),
        "data": loader.state_dict() if loader is not None else {"batches": step},  # see the module docstring
        "step": step,
    }


def save_training(path: str, trainer: Trainer, schedule: Any, step: int,
                  loader: DataLoader | None = None) -> sbpflow.checkpoint.SaveReport:
    """Saves the run after ``step`` steps at ``path`` (a directory, replaced atomically)."""
    return sbpflow.save(training_state(trainer, schedule, step, loader), path)


def resume_training(path: str, trainer: Trainer, schedule: Any, loader: DataLoader | None = None) -> int:
    """Fills a freshly built run (and its loader's position) from the checkpoint at ``path``; returns the number
    of steps it had done."""
    state = training_state(trainer, schedule, 0, loader)
    state["rng"]["torch"] = torch.empty_like(state["rng"]["torch"])  # a buffer of the saved state's shape
    sbpflow.load(state, path)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optim"])
    if schedule is not None:
        schedule.load_state_dict(state["schedule"])
    set_rng_state(state["rng"])
    if loader is not None:
        loader.load_state_dict(state["data"])
    return int(state["step"])


def latest_checkpoint(path: str) -> str:
    """``path`` itself if it is a checkpoint, else its newest ``step-N`` checkpoint (``--resume out/checkpoints``)."""
    if os.path.exists(os.path.join(path, "index.json")) or os.path.isfile(path):
        return path
    steps = [name for name in os.listdir(path) if name.startswith("step-") and name[5:].isdigit()] \
        if os.path.isdir(path) else []
    if not steps:
        raise sbpflow.CheckpointError(f"{path} is neither a checkpoint nor a folder of step-N checkpoints")
    return os.path.join(path, max(steps, key=lambda name: int(name[5:])))


def checkpoint_path(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:06d}")


# ---------------------------------------------------------------- the demo's --resume and --checkpoint-every


def resume_from_args(args: argparse.Namespace, trainer: Trainer, schedule: Any, loader: DataLoader,
                     print_fn: Callable[[str], None]) -> int:
    """``--resume DIR``: fills the run and moves ``loader`` to the checkpoint's position; the first step to train."""
    if args.resume is None:
        return 0
    try:
        path = latest_checkpoint(args.resume)
        step = resume_training(path, trainer, schedule, loader)
    except sbpflow.SbpflowError as e:
        raise SystemExit(f"sbpflow demo: --resume {args.resume}: {e}") from None
    if step >= args.steps:
        raise SystemExit(f"sbpflow demo: the checkpoint {path} is at step {step}, and --steps is {args.steps}: "
                         "nothing is left to train (raise --steps)")
    print_fn(f"resumed from {path} at step {step}")
    return step


def checkpoint_from_args(args: argparse.Namespace, trainer: Trainer, schedule: Any, step: int,
                         print_fn: Callable[[str], None], loader: DataLoader | None = None) -> None:
    """``--checkpoint-every N``: saves after every N-th step (and the last one)."""
    every = args.checkpoint_every
    if every <= 0 or (step % every and step != args.steps):
        return
    path = checkpoint_path(os.path.join(args.out, "checkpoints"), step)
    report = save_training(path, trainer, schedule, step, loader)
    print_fn(f"checkpoint: {path} ({len(report.files)} files, {report.bytes_written:,} bytes, "
             f"{report.seconds * 1e3:.0f} ms)")
