"""A training run's whole state, for bit-exact resumption: :func:`run_state`.

Weights, optimizer moments, LR schedule, GradScaler, random streams and the DataLoader's position, gathered
as one nested dict to save and handed back to their owners after a load, for eager and ``nn.Graph`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import random as sbp_random
from ..errors import CheckpointError


def rng_state() -> dict[str, Any]:
    """sbpflow's random stream (its seed and the draws made) and torch's default generator."""
    return {"seed": sbp_random.initial_seed(), "counter": sbp_random.counter(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Puts back a :func:`rng_state`."""
    sbp_random.manual_seed(state["seed"])
    sbp_random.set_counter(state["counter"])
    torch.set_rng_state(state["torch"])


@dataclass
class RunState:
    """The parts of a run (any may be None) and the number of steps it has taken; see :func:`run_state`."""

    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    loader: Any = None
    scaler: Any = None
    step: int = 0

    def tree(self, fresh: bool = False) -> dict[str, Any]:
        """The state now, as tensors (sharing the run's storage) and Python scalars, for :func:`sbpflow.save`;
        ``fresh``: a tree to fill by :func:`sbpflow.load` (the optimizer's state tensors made first)."""
        tree: dict[str, Any] = {}
        if self.model is not None:
            tree["model"] = self.model.state_dict()
        if self.optimizer is not None:
            if fresh and hasattr(self.optimizer, "init_state"):
                self.optimizer.init_state()
            tree["optim"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            tree["schedule"] = self.scheduler.state_dict()
        if self.scaler is not None:
            tree["scaler"] = self.scaler.state_dict()
        if self.loader is not None:
            tree["data"] = self.loader.state_dict()
        rng = rng_state()
        if fresh:
            rng["torch"] = torch.empty_like(rng["torch"])  # a buffer of the saved state's shape
        tree["rng"] = rng
        tree["step"] = self.step
        return tree

    def apply(self, tree: dict[str, Any]) -> int:
        """Hands every part of a loaded ``tree`` back to its owner; returns (and keeps) its step."""
        missing = [k for k, part in (("model", self.model), ("optim", self.optimizer), ("schedule", self.scheduler),
                                     ("scaler", self.scaler), ("data", self.loader)) if part is not None
                   and k not in tree]
        if missing:
            raise CheckpointError(f"the run state to restore has no {missing} (a checkpoint of another run?)")
        if self.model is not None:
            self.model.load_state_dict(tree["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(tree["optim"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(tree["schedule"])
        if self.scaler is not None:
            self.scaler.load_state_dict(tree["scaler"])
        if self.loader is not None:
            self.loader.load_state_dict(tree["data"])
        set_rng_state(tree["rng"])
        self.step = int(tree["step"])
        return self.step


def run_state(*, model: Any = None, optimizer: Any = None, scheduler: Any = None, loader: Any = None,
              scaler: Any = None, step: int = 0) -> RunState:
    """The run to checkpoint and restore: its model (parameters and buffers), optimizer state, LR scheduler,
    GradScaler, DataLoader position, random stream and step count. Pass it to
    :class:`~sbpflow.checkpoint.CheckpointManager`'s ``save`` and ``restore``.

    >>> import sbpflow
    >>> model = sbpflow.nn.Linear(2, 2)
    >>> state = run_state(model=model, optimizer=sbpflow.optim.SGD(model.parameters(), lr=0.1), step=3)
    >>> sorted(state.tree())
    ['model', 'optim', 'rng', 'step']
    """
    return RunState(model, optimizer, scheduler, loader, scaler, step)
