"""Sharded checkpoints that reshard: save under one strategy, load under any other.

A checkpoint is a folder of one safetensors file per writing rank plus ``index.json`` (see :mod:`._index`).

>>> import os, tempfile, sbpflow
>>> p = sbpflow.placement("cpu", [0, 1])
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> _ = sbpflow.save({"w": sbpflow.arange(6.0, placement=p, sbp=sbpflow.sbp.split(0)), "step": 7}, path)
>>> state = {"w": sbpflow.zeros(6, placement=p, sbp=sbpflow.sbp.broadcast), "step": 0}
>>> _ = sbpflow.load(state, path)
>>> state["w"].tolist(), state["step"]
([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 7)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointWarning, CorruptCheckpointError
from ..tensor import Tensor
from ._index import Index, TensorEntry, dtype_of
from ._load import LoadReport, load_sharded, read_index
from ._manager import CheckpointManager
from ._run import RunState, rng_state, run_state, set_rng_state
from ._save import SaveReport, save_sharded
from ._torch_format import load_torch, save_torch

FORMATS = ("sbpflow", "torch")


def save(state: Any, path: str | os.PathLike[str], *, format: str = "sbpflow") -> SaveReport:
    """Saves ``state`` at ``path``; every process calls it with the same structure. Returns what it wrote here.

    Each process writes only what it owns, each element once: broadcast copies by one rank, partial values
    reduced first. Atomic: files go to ``PATH.partial``, are fsynced, and the folder is renamed into place.

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


def load(state: Any, path: str | os.PathLike[str] | None = None, *, verify: bool = True) -> Any:
    """Fills ``state`` in place from the checkpoint at ``path``; returns what this process read.

    ``state`` may be in other placements and SBPs than the saved one (another world size, mesh or strategy);
    each process reads only the parts of the files its shards hold, with no communication.

    ``load(path)`` alone is OneFlow's and torch's form: it returns the saved state itself (nested dicts and
    lists, tensors as local sbpflow tensors), ready for ``model.load_state_dict``.

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
    if path is None:
        return _load_whole(os.fspath(state), verify)
    path = os.fspath(path)
    if os.path.isfile(path):
        return load_torch(state, path)
    return load_sharded(state, path, verify)


def _load_whole(path: str, verify: bool) -> Any:
    """The saved state, rebuilt from the index: local tensors of the saved shapes and dtypes, then filled."""
    if os.path.isfile(path):
        return _as_sbpflow(torch.load(path, map_location="cpu", weights_only=True))
    entries = list(read_index(path).entries.values())
    if not entries:
        return {}
    root: Any = [] if isinstance(entries[0].path[0], int) else {}
    for entry in entries:
        node = root
        for key, after in zip(entry.path[:-1], entry.path[1:], strict=True):
            node = _child(node, key, [] if isinstance(after, int) else {})
        leaf = Tensor._from_local(torch.zeros(entry.shape, dtype=dtype_of(entry.dtype))) if isinstance(
            entry, TensorEntry) else None
        _child(node, entry.path[-1], leaf)
    load_sharded(root, path, verify)
    return root


def _child(node: Any, key: Any, empty: Any) -> Any:
    """``node[key]``, set to ``empty`` first where it is missing (a list grows to take the index)."""
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def _as_sbpflow(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return Tensor._from_local(value)
    if isinstance(value, dict):
        return {k: _as_sbpflow(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_sbpflow(v) for v in value)
    return value


__all__ = ["FORMATS", "CheckpointManager", "CheckpointWarning", "CorruptCheckpointError", "Index", "LoadReport",
           "RunState", "SaveReport", "load", "read_index", "rng_state", "run_state", "save", "set_rng_state"]
