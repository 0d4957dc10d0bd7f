"""Sharded checkpoints that reshard: save under one strategy, load under any other.

A checkpoint is a directory: one safetensors file per rank that owns data to
write (``rank-00003.safetensors``) and ``index.json``, which records every
entry's logical shape, dtype, placement and SBP, which box of it each file
holds, and each file's length and SHA-256 (see :mod:`._index`).

* :func:`save` writes only what each process owns, and each element once:
  broadcast copies are written by one rank, partial values are reduced first.
  It is atomic: the files go to ``PATH.partial``, are fsynced, and the
  directory is renamed into place, so a crash leaves the last checkpoint whole.
* :func:`load` fills the given state in place, in *its* placements and SBPs
  (another world size, mesh or strategy), each process reading only the parts
  of the files its shards hold, with no communication.

>>> import os, tempfile, sbpflow
>>> p = sbpflow.placement("cpu", [0, 1])
>>> w = sbpflow.arange(6.0, placement=p, sbp=sbpflow.sbp.split(0))
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> _ = sbpflow.save({"w": w, "step": 7}, path)
>>> state = {"w": sbpflow.zeros(6, placement=p, sbp=sbpflow.sbp.broadcast), "step": 0}
>>> _ = sbpflow.load(state, path)
>>> state["w"].tolist(), state["step"]
([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 7)
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError
from ._index import Index
from ._load import LoadReport, load_sharded, read_index
from ._manager import CheckpointManager
from ._run import RunState, rng_state, run_state, set_rng_state
from ._save import SaveReport, save_sharded
from ._torch_format import load_torch, save_torch

FORMATS = ("sbpflow", "torch")


def save(state: Any, path: str | os.PathLike[str], *, format: str = "sbpflow") -> SaveReport:
    """Saves ``state`` at ``path``; every process calls it with the same structure. Returns what it wrote here.

    ``state`` nests dicts, lists and tuples of sbpflow tensors (global or
    local), torch tensors and Python scalars, e.g. ``{"model":
    model.state_dict(), "optim": opt.state_dict(), "step": 7}``. Local and torch
    tensors are taken to be the same on every process and written once.

    ``format="sbpflow"`` writes the sharded directory described in this
    module's docstring; ``format="torch"`` writes one consolidated
    ``torch.save`` file of logical values, for use outside sbpflow.
    """
    if format not in FORMATS:
        raise CheckpointError(f"sbpflow.save(format=...) is one of {FORMATS}, but got {format!r}")
    if format == "torch":
        return save_torch(state, os.fspath(path))
    return save_sharded(state, os.fspath(path))


def load(state: Any, path: str | os.PathLike[str], *, verify: bool = True) -> LoadReport:
    """Fills ``state`` in place from the checkpoint at ``path``; returns what this process read.

    Tensors keep their own placement and SBP (the state decides the layout,
    as with torch DCP); Python scalars are replaced by the saved ones. Every
    leaf of ``state`` must be in the checkpoint; saved entries the state does
    not name are left unread. ``path`` is a directory written by :func:`save`
    or a torch file (``torch.save`` of nested dicts, a plain state dict
    included). Files are checked against the index before they are read:
    their length, and their SHA-256 unless ``verify=False``.

    To restore a fresh model and optimizer, let them list their state first:

        opt.init_state()
        st = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
        sbpflow.load(st, path)
        model.load_state_dict(st["model"]); opt.load_state_dict(st["optim"])
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return load_torch(state, path)
    return load_sharded(state, path, verify)


__all__ = ["FORMATS", "CheckpointManager", "Index", "LoadReport", "RunState", "SaveReport", "load", "read_index",
           "rng_state", "run_state", "save", "set_rng_state"]
