"""Basic layers: Linear, Embedding, Dropout, activations, Flatten, Identity, initialised as torch's and built
directly in a layout with ``placement=`` and ``sbp=`` (one SBP, or ``{name: sbp}``).

>>> import sbpflow
>>> from sbpflow import nn, sbp
>>> p = sbpflow.placement("cpu", [0, 1])
>>> col = nn.Linear(4, 6, placement=p, sbp={"weight": sbp.split(0), "bias": sbp.split(0)})
>>> col(sbpflow.randn(3, 4, placement=p, sbp=sbp.broadcast)).sbp
(Split(dim=1),)
"""

from __future__ import annotations

from typing import Any

import torch

from ..autograd import no_grad
from ..creation import arange
from ..errors import ShapeError
from ..ops import functional as F
from ..placement import Placement
from ..sbp import Split, broadcast
from ..tensor import Tensor
from . import init
from ._build import empty_param, weight_and_bias
from .module import Module


class Linear(Module):
    """``y = x W^T + b`` with ``W`` of shape (out_features, in_features), torch's default init."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, placement: Placement | None = None,
                 sbp: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        weight_and_bias(self, (out_features, in_features), bias, placement, sbp, "Linear", dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.default_linear_(self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table of ``num_embeddings`` rows; N(0, 1) init, the ``padding_idx`` row zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ShapeError(f"Embedding padding_idx must be within [-{num_embeddings}, {num_embeddings}), "
                                 f"but got {padding_idx}")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.weight = empty_param((num_embeddings, embedding_dim), "weight", placement, sbp, "Embedding", dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.normal_(self.weight)
        if self.padding_idx is not None:
            self._zero_padding_row()

    def _zero_padding_row(self) -> None:
        # A row mask (not an indexed write) keeps the weight's layout, whatever it is split on.

        if self.weight.is_global:
            rows = arange(self.num_embeddings, placement=self.weight.placement, sbp=_rows_sbp(self.weight))
        else:
            rows = arange(self.num_embeddings)
        with no_grad():
            keep = F.unsqueeze(F.ne(rows, self.padding_idx), 1)  # (num_embeddings, 1), logical
            value = F.where(keep, self.weight, 0.0)
            if value.is_global:
                value = F.to_global(value, self.weight.placement, self.weight.sbp)
            self.weight._assign(value)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


def _rows_sbp(weight: Tensor) -> tuple[Any, ...]:
    """The SBP of a row index vector that lines up with ``weight``'s rows (split where the rows are)."""
    return tuple(s if isinstance(s, Split) and s.dim == 0 else broadcast for s in weight.sbp)


class Dropout(Module):
    """Zeroes elements with probability ``p`` in training and scales the rest by ``1 / (1 - p)``."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1], but got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ReLU(Module):
    def __init__(self, inplace: bool = False) -> None:  # torchvision passes inplace=True: out of place here
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class SiLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class Identity(Module):
    def forward(self, x: Any) -> Any:
        return x


class Flatten(Module):
    """Flattens dims ``start_dim..end_dim`` into one (logical dims; a split on them maps through reshape)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        return F.flatten(x, self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x: Tensor) -> Tensor:
        return F.leaky_relu(x, self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Softmax(Module):
    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return F.softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Unflatten(Module):
    """Splits dim ``dim`` into ``sizes`` (logical dims; the outer size keeps a split of ``dim``)."""

    def __init__(self, dim: int, unflattened_size: tuple[int, ...]) -> None:
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.unflatten(x, self.dim, self.unflattened_size)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"


class PixelShuffle(Module):
    """(N, C*r*r, H, W) -> (N, C, H*r, W*r)."""

    def __init__(self, upscale_factor: int) -> None:
        super().__init__()
        self.upscale_factor = upscale_factor

    def forward(self, x: Tensor) -> Tensor:
        return F.pixel_shuffle(x, self.upscale_factor)

    def extra_repr(self) -> str:
        return f"upscale_factor={self.upscale_factor}"
