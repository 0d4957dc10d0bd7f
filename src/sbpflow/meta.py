"""Metadata-only tensors: a model of any size, built without memory for its weights, to compile.

>>> import sbpflow
>>> with sbpflow.meta_init():
...     layer = sbpflow.nn.Linear(100_000, 100_000)          # 10^10 parameters: 40 GB if it held data
>>> layer.weight.is_meta, list(layer.weight.shape)
(True, [100000, 100000])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from .errors import MetaTensorError

if TYPE_CHECKING:
    from .tensor import Tensor

_DEPTH = [0]  # nesting depth of meta_init blocks in force


@contextmanager
def meta_init(enabled: bool = True) -> Iterator[None]:
    """Tensors created inside are meta tensors; ``enabled=False`` is a no-op.

    Every tensor the creation functions make (every parameter a constructor registers, every initialiser's
    draw) has a logical shape, a dtype and, once placed, a placement and SBP, but no data: a local one wraps a
    torch ``meta`` tensor, a global one holds no shards. Ops on them compute metadata only, as tracing does, so
    ``nn.Graph.compile_only`` compiles a step on them; reading their data, or running a compiled step on them,
    raises a MetaTensorError naming the tensor."""
    _DEPTH[0] += 1 if enabled else 0
    try:
        yield
    finally:
        _DEPTH[0] -= 1 if enabled else 0


def enabled() -> bool:
    """Whether a :func:`meta_init` block is in force."""
    return _DEPTH[0] > 0


def local(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor on the meta device: a local meta tensor's storage-less value."""
    return torch.empty(shape, dtype=dtype, device="meta")


def refuse(t: Tensor, what: str) -> None:
    """Raises the error for reading data (``what``) from the meta tensor ``t``."""
    raise MetaTensorError(
        f"{what} of a meta tensor ({t._describe()}): it was built under sbpflow.meta_init() and holds metadata "
        "only, no data; meta tensors can be compiled (nn.Graph.compile_only), not run or read; build the model "
        "outside meta_init() (or load a checkpoint into a real one) to run it"
    )
