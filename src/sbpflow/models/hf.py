"""Hugging Face checkpoint folders: ``config.json`` plus ``model.safetensors`` (or a sharded index), read by
parameter name, each process reading only the boxes its ranks hold; and written for ``from_pretrained``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
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
    """Copies every tensor of ``folder`` into ``model``'s parameter of the same name, keeping its layout.

    Names in ``skip`` (a tied head) are ignored; any other extra or missing name is an error.
    """
    files = {k: v for k, v in weight_files(folder).items() if k not in set(skip)}
    own = dict(model.named_parameters())
    if set(files) != set(own):
        raise SbpflowError(f"from_pretrained into {type(model).__name__}: the checkpoint's tensors must match the "
                           f"model's parameters, but missing: {sorted(set(own) - set(files))}, "
                           f"unexpected: {sorted(set(files) - set(own))}")
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                _fill(own[name], name, f.get_slice(name))


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


def save_folder(folder: str | Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """Writes ``config.json`` and one ``model.safetensors`` of the tensors' logical values.

    Every process must call it (reading a global tensor's logical value is collective); process 0 writes.
    """
    values = {name: torch.from_numpy(t.detach().numpy()).contiguous() for name, t in tensors.items()}
    if sbpflow.rank() != 0:
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(values, str(folder / WEIGHTS), metadata={"format": "pt"})


__all__ = ["load_weights", "read_config", "save_folder", "weight_files"]
