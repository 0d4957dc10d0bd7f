"""Map-style datasets: ``len(ds)`` samples, ``ds[i]`` the i-th (a tensor, a number, or a tuple/list/dict of them).

>>> import torch
>>> ds = TensorDataset(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0]))
>>> len(ds), ds[1]
(3, (tensor([2., 3.]), tensor(1)))
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...errors import SbpflowError


class Dataset:
    """Subclass and define ``__len__`` and ``__getitem__(index)``; any object with both works as well
    (a ``torch.utils.data.Dataset`` included)."""

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} defines no __len__")

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no __getitem__")


class TensorDataset(Dataset):
    """Sample i is ``(t[i] for t in tensors)``: tensors (torch or NumPy) that share their first dim."""

    def __init__(self, *tensors: Any) -> None:
        if not tensors:
            raise SbpflowError("TensorDataset needs at least one tensor")
        self.tensors = tuple(_as_torch(t, i) for i, t in enumerate(tensors))
        sizes = [t.shape[0] for t in self.tensors]
        if len(set(sizes)) != 1:
            raise SbpflowError(f"TensorDataset's tensors must share their first dim (the sample count), but their "
                               f"shapes are {[list(t.shape) for t in self.tensors]}")

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)


def _as_torch(t: Any, i: int) -> torch.Tensor:
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    if not isinstance(t, torch.Tensor):
        raise SbpflowError(f"TensorDataset takes torch tensors or NumPy arrays, but argument {i} is {type(t).__name__}")
    if t.dim() == 0:
        raise SbpflowError(f"TensorDataset's tensors need a first dim (the samples), but argument {i} is 0-d")
    return t
