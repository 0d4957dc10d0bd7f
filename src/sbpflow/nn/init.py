"""In-place initialisers that keep a tensor's layout and draw from the placement-independent random stream, so
the same seed gives the same logical weights under any layout.

>>> import sbpflow
>>> p = sbpflow.placement("cpu", [0, 1])
>>> sbpflow.manual_seed(0)
>>> a = kaiming_uniform_(sbpflow.nn.Parameter(sbpflow.zeros(6, 4)), a=5 ** 0.5)
>>> sbpflow.manual_seed(0)
>>> b = kaiming_uniform_(sbpflow.nn.Parameter(sbpflow.zeros(6, 4, placement=p, sbp=sbpflow.sbp.split(0))), a=5 ** 0.5)
>>> bool((a.numpy() == b.numpy()).all()), b.sbp
(True, (Split(dim=0),))
"""

from __future__ import annotations

import math
from typing import Any

from ..autograd import no_grad
from ..creation import full, randn, uniform
from ..errors import ShapeError
from ..ops import functional as F
from ..ops.methods import bind_methods
from ..tensor import Tensor


def _layout_kwargs(t: Tensor) -> dict[str, Any]:
    if not t.is_global:
        return {"dtype": t.dtype}
    return {"placement": t.placement, "sbp": t.sbp, "dtype": t.dtype}


def _overwrite(t: Tensor, value: Tensor) -> Tensor:
    with no_grad():
        t._assign(value)
    return t


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    """Fills ``tensor`` with values drawn uniformly from ``[a, b)``."""
    if tensor.is_meta:  # sbpflow.meta_init: no data to fill (and no full-size draw to make)
        return tensor
    return _overwrite(tensor, uniform(*tensor.shape, low=a, high=b, **_layout_kwargs(tensor)))


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """Fills ``tensor`` with values from N(mean, std²)."""
    if tensor.is_meta:
        return tensor
    value = randn(*tensor.shape, **_layout_kwargs(tensor))
    with no_grad():
        value = F.add(F.mul(value, std), mean) if (std != 1.0 or mean != 0.0) else value
    return _overwrite(tensor, value)


def constant_(tensor: Tensor, val: float) -> Tensor:
    if tensor.is_meta:
        return tensor
    return _overwrite(tensor, full(tuple(tensor.shape), val, **_layout_kwargs(tensor)))


def zeros_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 0.0)


def ones_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 1.0)


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    """torch's fans: ``(in * receptive field, out * receptive field)`` for a weight of shape (out, in, *kernel)."""
    if tensor.ndim < 2:
        raise ShapeError(f"fan in and fan out need a tensor of at least 2 dims, but got shape {list(tensor.shape)}")
    receptive = 1
    for n in tensor.shape[2:]:
        receptive *= n
    return int(tensor.shape[1]) * receptive, int(tensor.shape[0]) * receptive


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for ``nonlinearity`` (torch's table)."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else param
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")


def kaiming_uniform_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
    """He uniform: bound ``gain * sqrt(3 / fan)``; ``a=sqrt(5)`` is torch's Linear/Conv default."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"kaiming_uniform_ mode must be 'fan_in' or 'fan_out', but got {mode!r}")
    fan = fan_in if mode == "fan_in" else fan_out
    bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / fan) if fan else 0.0
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
    """He normal: std ``gain / sqrt(fan)``."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"kaiming_normal_ mode must be 'fan_in' or 'fan_out', but got {mode!r}")
    fan = fan_in if mode == "fan_in" else fan_out
    return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(fan) if fan else 0.0)


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Tensor:
    """N(mean, std²) cut to ``[a, b]``, by torch's method: uniform draws between the two cut points' CDF values,
    through the inverse CDF. The uniform draw is placement independent; the rest is elementwise on each shard."""
    if tensor.is_meta:
        return tensor
    lo, hi = (_normal_cdf((a - mean) / std), _normal_cdf((b - mean) / std)) if std > 0 else (0.5, 0.5)
    uniform_(tensor, 2 * lo - 1, 2 * hi - 1)
    shards = [tensor.to_local()] if tensor.is_local else list(tensor.local_tensors().values())
    with no_grad():
        for shard in shards:
            shard.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(min=a, max=b)
    tensor._version += 1
    return tensor


def _normal_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def xavier_uniform_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    """Glorot uniform: bound ``gain * sqrt(6 / (fan_in + fan_out))``."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound)


def xavier_normal_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


def default_linear_(weight: Tensor, bias: Tensor | None) -> None:
    """torch's default for Linear and Conv layers: kaiming-uniform (a=sqrt(5)) weight, bias on +-1/sqrt(fan_in)."""
    kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = _calculate_fan_in_and_fan_out(weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        uniform_(bias, -bound, bound)


bind_methods({  # x.normal_(), x.uniform_(): the initialisers, as torch's in-place draws
    "normal_": lambda self, mean=0.0, std=1.0, *, generator=None: normal_(self, mean, std),
    "uniform_": lambda self, a=0.0, b=1.0, *, generator=None: uniform_(self, a, b),
})

__all__ = [
    "default_linear_",
    "calculate_gain", "constant_", "kaiming_normal_", "kaiming_uniform_", "trunc_normal_", "normal_", "ones_",
    "uniform_", "xavier_normal_",
    "xavier_uniform_", "zeros_",
]
