"""Hugging Face checkpoint folders: ``config.json`` plus ``model.safetensors`` (or a sharded index), read by
parameter name, each process reading only the boxes its ranks hold; and written for ``from_pretrained``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import sbpflow
from sbpflow._layout import shard_box
from sbpflow.comm import get_backend
from sbpflow.errors import SbpflowError
from sbpflow.nn.module import Module
from sbpflow.nn.moe import StackedExperts
from sbpflow.tensor import Tensor

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise SbpflowError(f"from_pretrained needs {path}, a Hugging Face config, but it does not exist")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def weight_files(folder: str | Path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` from the sharded index, or from the single ``model.safetensors``."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in index.items()}
    if not (folder / WEIGHTS).is_file():
        raise SbpflowError(f"from_pretrained needs {folder / WEIGHTS} or {folder / INDEX}, but neither exists")
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        return {name: folder / WEIGHTS for name in f.keys()}  # noqa: SIM118 - safe_open is not a Mapping


def load_weights(model: Module, folder: str | Path, skip: Iterable[str] = ()) -> None:
    """Copies every tensor of ``folder`` into ``model``'s parameter of the same name, keeping its layout; stacked
    experts (split over an ep axis) read each expert's tensor into their slot (:func:`checkpoint_names`).

    Names in ``skip`` (a tied head) are ignored; any other extra or missing name is an error.
    """
    files = {k: v for k, v in weight_files(folder).items() if k not in set(skip)}
    own = dict(model.named_parameters())
    names = checkpoint_names(model)
    wanted = {n for ns in names.values() for n in ns}
    if set(files) != wanted:
        raise SbpflowError(f"from_pretrained into {type(model).__name__}: the checkpoint's tensors must match the "
                           f"model's parameters, but missing: {sorted(wanted - set(files))}, "
                           f"unexpected: {sorted(set(files) - wanted)}")
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(files.values())}
        for name, param in own.items():
            sources = [handles[files[n]].get_slice(n) for n in names[name]]
            if names[name] == [name]:
                _fill(param, name, sources[0])
            else:
                _fill_stacked(param, names[name], sources)


def checkpoint_names(model: Module) -> dict[str, list[str]]:
    """Each parameter's tensor names in a Hugging Face folder: its own name, or for a stacked experts' weight
    ``prefix.w1`` one ``prefix.{e}.w1.weight`` per expert (an :class:`~sbpflow.nn.moe.Expert`'s name)."""
    stacked = {name for name, m in model.named_modules() if isinstance(m, StackedExperts)}
    out = {}
    for name, p in model.named_parameters():
        prefix, _, weight = name.rpartition(".")
        out[name] = [f"{prefix}.{e}.{weight}.weight" for e in range(p.shape[0])] if prefix in stacked else [name]
    return out


def _fill_stacked(param: Tensor, names: list[str], sources: list[Any]) -> None:
    """A stacked (E, ...) parameter from its E experts' tensors: each rank reads its experts' boxes only."""
    shape = tuple(param.shape)
    for name, source in zip(names, sources, strict=True):
        if tuple(source.get_shape()) != shape[1:]:
            raise SbpflowError(f"from_pretrained: checkpoint tensor {name} has shape {list(source.get_shape())}, "
                               f"but each expert of the model's stacked parameter has shape {list(shape[1:])}")
    placement, sbp = param.placement, param.sbp
    shards = {}
    for r in get_backend().owned(placement.flat_ranks):
        (e0, e1), *box = shard_box(shape, placement, sbp, r)
        pieces = [sources[e][tuple(slice(a, b) for a, b in box)].to(param.dtype) for e in range(e0, e1)]
        shards[r] = torch.stack(pieces).to(get_backend().device_for(placement.type, r))
    param._take_storage(Tensor._from_shards(shape, param.dtype, placement, sbp, shards))
    param._version += 1


def _fill(param: Tensor, name: str, source: Any) -> None:
    shape = tuple(source.get_shape())
    if shape != tuple(param.shape):
        raise SbpflowError(f"from_pretrained: checkpoint tensor {name} has shape {list(shape)}, but the model's "
                           f"parameter has shape {list(param.shape)}")
    if not param.is_global:
        param._take_storage(sbpflow.tensor(source[:].to(param.dtype)))
    else:
        placement, sbp = param.placement, param.sbp
        shards = {}
        for r in get_backend().owned(placement.flat_ranks):  # only this process's ranks: their boxes alone
            box = shard_box(shape, placement, sbp, r)
            piece = source[tuple(slice(a, b) for a, b in box)].to(param.dtype)
            shards[r] = piece.to(get_backend().device_for(placement.type, r), copy=True)  # its own memory
        param._take_storage(Tensor._from_shards(shape, param.dtype, placement, sbp, shards))
    param._version += 1


def save_folder(folder: str | Path, config: dict[str, Any], model: Module) -> None:
    """Writes ``config.json`` and one ``model.safetensors`` of the model's parameters' logical values, stacked
    experts as one tensor per expert (:func:`checkpoint_names`).

    Every process must call it (reading a global tensor's logical value is collective); process 0 writes.
    """
    names = checkpoint_names(model)
    values = {}
    for name, t in model.named_parameters():
        value = torch.from_numpy(t.detach().numpy())
        pieces = [value] if names[name] == [name] else list(value.unbind(0))
        values.update({n: v.contiguous() for n, v in zip(names[name], pieces, strict=True)})
    if sbpflow.rank() != 0:
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(values, str(folder / WEIGHTS), metadata={"format": "pt"})


__all__ = ["checkpoint_names", "load_weights", "read_config", "save_folder", "weight_files"]
