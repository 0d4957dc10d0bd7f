"""Interop with plain torch files: one consolidated ``torch.save`` file written, or any torch or flat
safetensors file read, each process copying only the parts its shards hold.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..comm import get_backend
from ..errors import CheckpointError
from ..tensor import Tensor, logical_value
from ._fill import Source, fill
from ._load import LoadReport, describe
from ._save import SaveReport, commit
from ._tree import SCALAR_TYPES, Leaf, leaves, path_name, replace_scalars


def save_torch(state: Any, path: str) -> SaveReport:
    """See :func:`sbpflow.checkpoint.save` with ``format="torch"``."""
    start = time.perf_counter()
    backend = get_backend()
    final = os.path.abspath(path)
    if os.path.isdir(final):
        raise CheckpointError(f"sbpflow.save(format='torch') writes one file, but {final} is a directory")
    leaves(state)  # checks the structure and names before any collective
    plain = _as_torch(state)
    report = SaveReport(final)
    if backend.owns(0):
        os.makedirs(os.path.dirname(final), exist_ok=True)
        partial = final + ".partial"
        with open(partial, "wb") as f:
            torch.save(plain, f)
            f.flush()
            os.fsync(f.fileno())
        commit(partial, final)
        report.files.append(os.path.basename(final))
        report.bytes_written = os.path.getsize(final)
    backend.barrier()
    report.seconds = time.perf_counter() - start
    return report


def _as_torch(node: Any) -> Any:
    """``node`` with every sbpflow tensor replaced by its logical value as a CPU torch tensor."""
    if isinstance(node, Mapping):
        return {k: _as_torch(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_as_torch(v) for v in node]
    if isinstance(node, tuple):  # named tuples too become plain tuples, which torch.load(weights_only) reads
        return tuple(_as_torch(v) for v in node)
    if isinstance(node, Tensor):
        return logical_value(node.detach()).detach().cpu().clone()
    if isinstance(node, torch.Tensor):
        return node.detach().cpu().clone()
    return node


def load_torch(state: Any, path: str) -> LoadReport:
    """See :func:`sbpflow.checkpoint.load` for a file path."""
    start = time.perf_counter()
    final = os.path.abspath(path)
    saved = _read(final)
    report = LoadReport(final, files=[os.path.basename(final)])
    items = leaves(state)
    for leaf in items:
        if leaf.is_tensor:
            report.bytes_read += fill(leaf.value, leaf.name, [_source(leaf, _lookup(saved, leaf, final))])
            report.tensors += 1
    scalars = {leaf.path: _scalar(leaf, _lookup(saved, leaf, final)) for leaf in items if not leaf.is_tensor}
    replace_scalars(state, lambda p: scalars[p])
    report.scalars = len(scalars)
    report.seconds = time.perf_counter() - start
    return report


def _read(path: str) -> Any:
    """The file's object; mapped rather than read where torch's zip format allows, so untouched parts stay on disk.

    A ``.safetensors`` file (Hugging Face weights, say) is a flat dict whose values read just the slices asked for.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    if path.endswith(".safetensors"):
        return _SafetensorsFile(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be mapped
        pass
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and torch errors alike mean "not a readable file"
        raise CheckpointError(f"{path} is not a readable torch file: {type(e).__name__}: {e}") from None


def _lookup(saved: Any, leaf: Leaf, where: str) -> Any:
    """The saved value at ``leaf.path``: nested keys, or the whole name as one key (flat state dicts)."""
    node = saved
    for depth, key in enumerate(leaf.path):
        if isinstance(node, Mapping) and key in node:
            node = node[key]
        elif isinstance(node, (list, tuple)) and isinstance(key, int) and key < len(node):
            node = node[key]
        elif isinstance(node, Mapping) and path_name(leaf.path[depth:]) in node:
            return node[path_name(leaf.path[depth:])]
        else:
            raise CheckpointError(f"the torch file {where} has no entry {leaf.name!r} (for {describe(leaf.value)})")
    return node


def _source(leaf: Leaf, value: Any) -> Source:
    if isinstance(value, torch.Tensor):
        shape, what = tuple(value.shape), f"{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    elif hasattr(value, "get_shape"):  # a safetensors slice: reads only what is indexed
        shape, what = tuple(value.get_shape()), f"{value.get_shape()} {value.get_dtype()}"
    else:
        raise CheckpointError(f"{leaf.name!r} is {describe(leaf.value)} in the state to fill, but the torch file "
                              f"holds a {type(value).__name__}")
    if shape != tuple(leaf.value.shape):
        raise CheckpointError(f"{leaf.name!r} has {describe(leaf.value)} in the state to fill, but the torch file "
                              f"holds shape {what}")
    return Source(tuple((0, n) for n in shape), lambda slices: value[slices])


class _SafetensorsFile(Mapping):  # type: ignore[type-arg]
    """A flat safetensors file as a read-only mapping from names to lazily read slices."""

    def __init__(self, path: str) -> None:
        try:
            with safe_open(path, framework="pt") as f:
                self._names = list(f.keys())
        except SafetensorError as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
        self._path = path

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        with safe_open(self._path, framework="pt") as f:
            return _Slice(f.get_slice(name), self._path, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _Slice:
    """One tensor of a safetensors file: its shape now, the parts asked for when indexed."""

    def __init__(self, meta: Any, path: str, name: str) -> None:
        self._shape, self._dtype, self._path, self._name = meta.get_shape(), meta.get_dtype(), path, name

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return str(self._dtype)

    def __getitem__(self, slices: Any) -> torch.Tensor:
        with safe_open(self._path, framework="pt") as f:
            if not self._shape:
                return f.get_tensor(self._name)
            return f.get_slice(self._name)[slices]


def _scalar(leaf: Leaf, value: Any) -> Any:
    if not isinstance(value, SCALAR_TYPES):
        raise CheckpointError(f"{leaf.name!r} is {describe(leaf.value)} in the state to fill, but the torch file "
                              f"holds a {type(value).__name__}")
    return value
