"""Creating tensors from data, constants, ranges and random streams: local ones, or global ones whose shards
each rank builds for itself (a rank never materialises the whole random tensor).

>>> import sbpflow
>>> x = sbpflow.arange(7, placement=sbpflow.placement("cpu", [0, 1, 2]), sbp=sbpflow.sbp.split(0))
>>> [t.tolist() for t in x.local_tensors().values()]
[[0, 1, 2], [3, 4], [5, 6]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import meta as _meta
from . import random as _rng
from ._layout import Box, logical_pieces, shard_box, zigzag_axis
from .comm import get_backend
from .errors import ArgumentError, AutogradError, DTypeError, SbpError, ShapeError
from .placement import Placement
from .sbp import NdSbp, Partial, broadcast, normalize
from .tensor import Tensor, logical_value, shards_from_full


def _shape_arg(size: Sequence[Any]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    for n in size:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ShapeError(f"tensor sizes must be non-negative ints, but got {list(size)}")
    return tuple(int(n) for n in size)


def _check_layout(placement: Any, sbp: Any, ndim: int, what: str) -> NdSbp | None:
    if placement is None:
        if sbp is not None:
            raise SbpError(f"{what}: sbp= needs placement= as well")
        return None
    if not isinstance(placement, Placement):
        raise SbpError(f"{what}: placement= needs an sbpflow.placement, but got {placement!r}")
    if sbp is None:
        sbp = (broadcast,) * placement.ndim
    return normalize(sbp, placement, ndim, what=what)


def _dtype_arg(dtype: Any, what: str) -> torch.dtype | None:
    """``dtype=`` must be a torch dtype: a string such as ``"float16"`` is refused here, by name, rather than
    failing deep inside with an AttributeError."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    raise DTypeError(f"{what}: dtype= needs a torch.dtype such as torch.float16, but got {dtype!r} "
                     f"of type {type(dtype).__name__}")


def _device_arg(device: Any, placement: Any, what: str) -> torch.device | None:
    """``device=`` as torch takes it, for local tensors; a global tensor's device type is its placement's."""
    if device is None:
        return None
    if placement is not None:
        raise ArgumentError(f"{what}: device= is for local tensors; a global tensor lives on its placement "
                            f"({placement}), so pass placement=sbpflow.placement({device!r}, ranks) instead")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ArgumentError(f"{what}: device= needs a device such as 'cpu' or 'cuda:0', but got {device!r} ({e})"
                            ) from None


def _to_device(t: Tensor, device: torch.device | None) -> Tensor:
    if device is None or t._local is None or t._local.device == device:
        return t
    return Tensor._from_local(t._local.to(device))


def _finish(t: Tensor, requires_grad: bool) -> Tensor:
    if requires_grad:
        t.requires_grad_(True)
    return t


def _build(shape: tuple[int, ...], dtype: torch.dtype, placement: Placement, nd: NdSbp,
           make: Callable[[Box, torch.device], torch.Tensor], requires_grad: bool) -> Tensor:
    """Each owned rank builds its own shard with ``make(box, device)``; partial sums keep it on coordinate 0.
    Under ``meta_init()`` no rank builds anything: a meta tensor (layout only)."""
    if _meta.enabled():
        return _finish(Tensor._meta(shape, dtype, placement, nd), requires_grad)
    backend = get_backend()
    shards = {}
    for r in backend.owned(placement.flat_ranks):
        box = shard_box(shape, placement, nd, r)
        device = backend.device_for(placement.type, r)
        coords = placement.coords(r)
        zero = any(isinstance(s, Partial) and s.op == "sum" and c != 0 for s, c in zip(nd, coords, strict=True))
        # A zero piece of a partial sum is never drawn: a rank only generates values it keeps.
        shards[r] = torch.zeros(_box_shape(box), dtype=dtype, device=device) if zero else _make(
            make, logical_pieces(shape, placement, nd, r), nd, device)
    return _finish(Tensor._from_shards(shape, dtype, placement, nd, shards), requires_grad)


def _make(make: Callable[[Box, torch.device], torch.Tensor], pieces: tuple[Box, ...], nd: NdSbp,
          device: torch.device) -> torch.Tensor:
    """A shard made from its logical pieces: one box, or a zigzag split's two chunks end to end."""
    if len(pieces) == 1:
        return make(pieces[0], device)
    axis = zigzag_axis(nd)
    assert axis is not None
    return torch.cat([make(box, device) for box in pieces], dim=nd[axis].dim)  # type: ignore[union-attr]


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


# -- from data -----------------------------------------------------------------------------------


def tensor(data: Any, *, placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None,
           requires_grad: bool = False, device: Any = None) -> Tensor:
    """A tensor holding ``data`` (list, NumPy array, torch tensor or sbpflow tensor) as its logical value.

    >>> import sbpflow
    >>> sbpflow.tensor([1.0, 2.0]).numpy().tolist()
    [1.0, 2.0]
    """
    dev = _device_arg(device, placement, "sbpflow.tensor")
    value = _to_torch(data, _dtype_arg(dtype, "sbpflow.tensor"))
    nd = _check_layout(placement, sbp, value.dim(), f"sbpflow.tensor of shape {list(value.shape)}")
    if _meta.enabled():
        return _finish(_meta_of(tuple(value.shape), value.dtype, placement, nd), requires_grad)
    if nd is None or placement is None:
        local = Tensor._from_local(value.clone() if isinstance(data, torch.Tensor) else value)
        return _finish(_to_device(local, dev), requires_grad)
    shards = shards_from_full(value, placement, nd)
    get_backend().check_replicas(placement, nd, shards, f"sbpflow.tensor of shape {list(value.shape)}")
    return _finish(Tensor._from_shards(tuple(value.shape), value.dtype, placement, nd, shards), requires_grad)


def as_tensor(data: Any, dtype: torch.dtype | None = None, device: Any = None) -> Tensor:
    """``data`` itself when it is an sbpflow tensor of that dtype, else a new local tensor, as ``torch.as_tensor``.

    >>> import sbpflow
    >>> x = sbpflow.tensor(3.0)
    >>> sbpflow.as_tensor(x) is x, sbpflow.as_tensor(2).tolist()
    (True, 2)
    """
    if isinstance(data, Tensor) and (dtype is None or dtype == data.dtype) and device is None:
        return data
    if isinstance(data, Tensor) and data.is_global:
        return data if dtype is None else data.to(dtype)  # type: ignore[attr-defined]
    return tensor(data, dtype=dtype, device=device)


def from_numpy(array: np.ndarray) -> Tensor:
    """A local tensor of ``array``'s values, as ``torch.from_numpy`` (it shares the array's memory)."""
    if not isinstance(array, np.ndarray):
        raise ArgumentError(f"from_numpy needs a NumPy array, but got {type(array).__name__}")
    return Tensor._from_local(torch.from_numpy(array))


def _meta_of(shape: tuple[int, ...], dtype: torch.dtype, placement: Placement | None, nd: NdSbp | None) -> Tensor:
    """A meta tensor (see :mod:`sbpflow.meta`): local without a placement, else global without shards."""
    if placement is None or nd is None:
        return Tensor._from_local(_meta.local(shape, dtype))
    return Tensor._meta(shape, dtype, placement, nd)


def _to_torch(data: Any, dtype: torch.dtype | None) -> torch.Tensor:
    if isinstance(data, Tensor):
        data = logical_value(data)
    if isinstance(data, torch.Tensor):
        return data.detach().to(dtype) if dtype is not None else data.detach()
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(data)).to(dtype) if dtype else torch.from_numpy(data.copy())
    try:
        return torch.tensor(data, dtype=dtype)
    except (ValueError, TypeError) as e:
        raise ShapeError(f"sbpflow.tensor needs rectangular numeric data, but {_short(data)} is not: {e}") from None


def _short(data: Any) -> str:
    text = repr(data)
    return text if len(text) < 80 else text[:77] + "..."


# -- constants and ranges ------------------------------------------------------------------------


def full(*size: Any, fill_value: Any = None, placement: Placement | None = None, sbp: Any = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False, device: Any = None) -> Tensor:
    """``full(2, 3, fill_value=7.0)`` or ``full((2, 3), 7.0)``."""
    if fill_value is None and len(size) == 2 and isinstance(size[0], (tuple, list, torch.Size)):
        fill_value = size[1]
        size = (size[0],)
    shape = _shape_arg(size)
    dev = _device_arg(device, placement, f"full({list(shape)})")
    dtype = _dtype_arg(dtype, f"full({list(shape)})")
    if dtype is None:
        dtype = torch.tensor(fill_value).dtype if not isinstance(fill_value, float) else torch.get_default_dtype()
    nd = _check_layout(placement, sbp, len(shape), f"full({list(shape)})")
    if nd is None or placement is None:
        if _meta.enabled():
            return _finish(_meta_of(shape, dtype, None, None), requires_grad)
        return _finish(Tensor._from_local(torch.full(shape, fill_value, dtype=dtype, device=dev)), requires_grad)
    return _build(shape, dtype, placement, nd,
                  lambda box, dev: torch.full(_box_shape(box), fill_value, dtype=dtype, device=dev), requires_grad)


def zeros(*size: Any, placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None,
          requires_grad: bool = False, device: Any = None) -> Tensor:
    return full(_shape_arg(size), 0.0 if dtype is None else 0, placement=placement, sbp=sbp,
                dtype=_dtype_arg(dtype, "zeros") or torch.get_default_dtype(), requires_grad=requires_grad,
                device=device)


def ones(*size: Any, placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None,
         requires_grad: bool = False, device: Any = None) -> Tensor:
    return full(_shape_arg(size), 1.0 if dtype is None else 1, placement=placement, sbp=sbp,
                dtype=_dtype_arg(dtype, "ones") or torch.get_default_dtype(), requires_grad=requires_grad,
                device=device)


def arange(start: Any, end: Any = None, step: Any = 1, *, placement: Placement | None = None, sbp: Any = None,
           dtype: torch.dtype | None = None, requires_grad: bool = False, device: Any = None) -> Tensor:
    dev = _device_arg(device, placement, "arange")
    dtype = _dtype_arg(dtype, "arange")
    if end is None:
        start, end = 0, start
    n, dtype = _arange_size(start, end, step, dtype)
    nd = _check_layout(placement, sbp, 1, f"arange({start}, {end}, {step})")
    if nd is None or placement is None:
        if _meta.enabled():
            return _finish(_meta_of((n,), dtype, None, None), requires_grad)
        return _finish(Tensor._from_local(torch.arange(start, end, step, dtype=dtype, device=dev)), requires_grad)

    def make(box: Box, dev: torch.device) -> torch.Tensor:
        lo, hi = box[0]
        return (torch.arange(lo, hi, dtype=torch.float64 if dtype.is_floating_point else torch.int64) * step
                + start).to(dtype=dtype, device=dev)

    return _build((n,), dtype, placement, nd, make, requires_grad)


def _arange_size(start: Any, end: Any, step: Any, dtype: torch.dtype | None) -> tuple[int, torch.dtype]:
    """``arange``'s length and dtype. Integer bounds (positions in every forward of a model) are counted
    directly; anything else asks torch on the meta device, which also raises torch's own errors, but costs
    about 100 us a call."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step))
    if ints and step != 0 and (end - start) * step >= 0:
        return -((start - end) // step), dtype or torch.int64  # ceil((end - start) / step)
    ref = torch.arange(start, end, step, dtype=dtype, device="meta")
    return ref.shape[0], ref.dtype


# -- random --------------------------------------------------------------------------------------


def _random(kind: str, size: Sequence[Any], placement: Placement | None, sbp: Any, dtype: torch.dtype | None,
            requires_grad: bool, low: float = 0.0, high: float = 1.0, device: Any = None) -> Tensor:
    name = "randn" if kind == "normal" else "rand"
    shape = _shape_arg(size)
    dev = _device_arg(device, placement, name)
    dtype = _dtype_arg(dtype, name) or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise DTypeError(f"{name} needs a floating-point dtype, but got {dtype}")
    key = _rng.next_key()
    nd = _check_layout(placement, sbp, len(shape), f"random tensor of shape {list(shape)}")
    if nd is None or placement is None:
        if _meta.enabled():
            return _finish(_meta_of(shape, dtype, None, None), requires_grad)
        full_box = tuple((0, n) for n in shape)
        value = _rng.fill(key, shape, full_box, kind, dtype, dev or torch.device("cpu"), low, high)
        return _finish(Tensor._from_local(value), requires_grad)
    tiles: dict[int, torch.Tensor] = {}  # shared by this process's ranks (read only: fill copies out of it)
    return _build(shape, dtype, placement, nd,
                  lambda box, dev: _rng.fill(key, shape, box, kind, dtype, dev, low, high, tiles), requires_grad)


def randn(*size: Any, placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None,
          requires_grad: bool = False, device: Any = None) -> Tensor:
    """Standard normal values; the logical value depends on the seed and call order only."""
    return _random("normal", size, placement, sbp, dtype, requires_grad, device=device)


def rand(*size: Any, placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None,
         requires_grad: bool = False, device: Any = None) -> Tensor:
    """Uniform values on [0, 1); the logical value depends on the seed and call order only."""
    return _random("uniform", size, placement, sbp, dtype, requires_grad, device=device)


def uniform(*size: Any, low: float = 0.0, high: float = 1.0, placement: Placement | None = None, sbp: Any = None,
            dtype: torch.dtype | None = None, requires_grad: bool = False, device: Any = None) -> Tensor:
    return _random("uniform", size, placement, sbp, dtype, requires_grad, low, high, device=device)


# -- like --------------------------------------------------------------------------------------


def empty(*size: Any, placement: Placement | None = None, sbp: Any = None, dtype: torch.dtype | None = None,
          requires_grad: bool = False, device: Any = None) -> Tensor:
    """torch.empty: sbpflow fills it with zeros (uninitialised memory would differ between replicas of a B tensor)."""
    return zeros(*size, placement=placement, sbp=sbp, dtype=dtype, requires_grad=requires_grad, device=device)


def empty_like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return zeros_like(x, dtype=dtype)


def multinomial(probs: Tensor, num_samples: int, replacement: bool = False, *, generator: Any = None) -> Tensor:
    """Indices drawn from each row of ``probs`` (weights, not necessarily summing to one), as torch.multinomial.

    The draw comes from sbpflow's stream (the same on every process), over the logical value; the result is
    broadcast on ``probs``' placement, or local for a local ``probs``.

    >>> import sbpflow
    >>> sbpflow.multinomial(sbpflow.tensor([[0.0, 1.0, 0.0]]), 1).tolist()
    [[1]]
    """
    key = _rng.next_key()
    gen = torch.Generator().manual_seed(key % (2**63))
    value = logical_value(probs).detach().cpu().to(torch.float64)
    drawn = torch.multinomial(value, num_samples, replacement, generator=gen)
    if not probs.is_global:
        return Tensor._from_local(drawn.to(probs.device))
    nd = (broadcast,) * probs.placement.ndim
    return Tensor._from_shards(tuple(drawn.shape), drawn.dtype, probs.placement, nd,
                               shards_from_full(drawn.to(probs.device), probs.placement, nd))


def _like_layout(x: Tensor) -> tuple[Placement | None, Any]:
    """A constant needs no partial: partial axes become B (free to slice later)."""
    if not x.is_global:
        return None, None
    return x.placement, tuple(broadcast if isinstance(s, Partial) else s for s in x.sbp)


def full_like(x: Tensor, fill_value: Any, dtype: torch.dtype | None = None) -> Tensor:
    placement, sbp = _like_layout(x)
    return full(tuple(x.shape), fill_value, placement=placement, sbp=sbp, dtype=dtype or x.dtype)


def zeros_like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return full_like(x, 0, dtype)


def ones_like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return full_like(x, 1, dtype)


def randn_like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    placement, sbp = _like_layout(x)
    return randn(tuple(x.shape), placement=placement, sbp=sbp, dtype=dtype or x.dtype)


def rand_like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    placement, sbp = _like_layout(x)
    return rand(tuple(x.shape), placement=placement, sbp=sbp, dtype=dtype or x.dtype)


def _no_grad_check(requires_grad: bool, dtype: torch.dtype) -> None:
    if requires_grad and not dtype.is_floating_point:
        raise AutogradError(f"only floating-point tensors can require gradients, but got dtype {dtype}")


def meta_tensor(*size: Any, dtype: torch.dtype | None = None, placement: Any = None, sbp: Any = None,
                requires_grad: bool = False) -> Tensor:
    """A meta tensor of logical shape ``size`` (a graph input's metadata for ``compile_only``).

    >>> import sbpflow
    >>> x = sbpflow.meta_tensor(8, 2048, dtype=torch.int64, placement=sbpflow.placement("cpu", [0, 1]),
    ...                         sbp=sbpflow.sbp.split(0))
    >>> x
    MetaTensor(shape [8, 2048] int64 on cpu:[0, 1] sbp (S(0)))
    """
    with _meta.meta_init():
        return zeros(*size, dtype=dtype, placement=placement, sbp=sbp, requires_grad=requires_grad)
