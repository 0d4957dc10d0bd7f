"""Counter-based random streams whose logical values ignore placement and SBP.

A model initialised under any strategy starts from the same weights, and no rank holds a whole tensor.

>>> import sbpflow
>>> sbpflow.manual_seed(0)
>>> a = sbpflow.randn(4, 5)
>>> sbpflow.manual_seed(0)
>>> b = sbpflow.randn(4, 5, placement=sbpflow.placement("cpu", [0, 1]), sbp=sbpflow.sbp.split(1))
>>> bool((a.numpy() == b.numpy()).all())
True
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from ._layout import Box, Shape, box_shape
from .errors import ArgumentError

# Each random call takes the stream's next key (seed, call counter). The logical tensor is cut into a fixed grid
# of tiles that depends only on its shape; tile i is drawn from a generator seeded by mix(key, i), and a rank
# draws just the tiles that meet its shard.
TILE_ELEMS = 1 << 16
_MASK64 = (1 << 64) - 1


class _Stream(threading.local):
    seed = 0
    counter = 0


_stream = _Stream()


class KeyHook(Protocol):
    """Who turns a draw's key into something else: nn.Graph's tracer makes it "the n-th draw of the step"."""

    random_keys: int  # draws made under the hook

    def next_random_key(self, key: int) -> int: ...


KEY_HOOKS: list[KeyHook] = []  # the hook in force is the last (graph.trace.Tracer.active pushes the tracer)


def manual_seed(seed: int) -> None:
    """Restarts sbpflow's random stream (and torch's) at ``seed``."""
    seed = _check_seed(seed)
    _stream.seed = seed
    _stream.counter = 0
    torch.manual_seed(seed)


def _check_seed(seed: object) -> int:
    """Seeds are ints (NumPy and torch integer scalars included); ``"abc"`` or ``1.5`` would silently mean something
    else after ``int()``, or fail inside it with a message that does not name the seed."""
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise ArgumentError(f"manual_seed needs an int seed, but got {seed!r} of type {type(seed).__name__}")
    return int(seed.__index__())


def initial_seed() -> int:
    return _stream.seed


def next_key() -> int:
    """The key of the next random call; every process draws the same sequence."""
    _stream.counter += 1
    key = _mix(_stream.seed, _stream.counter)
    return KEY_HOOKS[-1].next_random_key(key) if KEY_HOOKS else key


def mix_key(seed: int, counter: int) -> int:
    """The key of draw number ``counter`` (1-based) after ``manual_seed(seed)``."""
    return _mix(seed, counter)


def counter() -> int:
    """Draws made since the last ``manual_seed`` (tracing a graph puts it back: a trace draws nothing)."""
    return _stream.counter


def set_counter(value: int) -> None:
    _stream.counter = value


def get_state() -> tuple[int, int, int]:
    """``(seed, counter, traced draws)``: where the stream stands, for :func:`replay` (activation checkpointing).

    While nn.Graph traces, a draw is "the n-th of the step" (a RandomKey), so the tracer's count is part of it."""
    return _stream.seed, _stream.counter, KEY_HOOKS[-1].random_keys if KEY_HOOKS else 0


def _set_state(state: tuple[int, int, int]) -> None:
    _stream.seed, _stream.counter = state[0], state[1]
    if KEY_HOOKS:
        KEY_HOOKS[-1].random_keys = state[2]


@contextmanager
def replay(state: tuple[int, int, int]) -> Iterator[None]:
    """Draws inside the block repeat those made from ``state`` (the same keys, so the same dropout masks);
    the stream is put back afterwards, as if the block drew nothing."""
    saved = get_state()
    _set_state(state)
    try:
        yield
    finally:
        _set_state(saved)


def advance(n: int) -> tuple[int, int]:
    """Skips ``n`` draws (a compiled step drew them); returns ``(seed, counter before)``."""
    before = _stream.counter
    _stream.counter += n
    return _stream.seed, before


def _mix(a: int, b: int) -> int:
    """splitmix64 of a pair, folded into torch's 63-bit seed range."""
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def tile_edge(ndim: int) -> int:
    """Tile edge for a tensor of ``ndim`` dims: about TILE_ELEMS elements per tile."""
    return max(1, math.ceil(TILE_ELEMS ** (1.0 / ndim))) if ndim else 1


TILE_CACHE_SIZE = 64  # tiles kept between the ranks of one creation call (at most 64 x 256 KiB)


def fill(key: int, shape: Shape, box: Box, kind: str, dtype: torch.dtype, device: torch.device,
         low: float = 0.0, high: float = 1.0, cache: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """The part ``box`` of the logical random tensor of ``shape`` drawn with ``key``.

    ``kind`` is ``"normal"`` (standard normal) or ``"uniform"`` (on [low, high)). ``cache``, shared by the
    ranks one process builds for one call, keeps recent tiles: with thousands of virtual ranks holding a row
    or two each, a tile meets hundreds of consecutive shards and would otherwise be drawn once per shard.
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.empty(box_shape(box), dtype=work)
    if out.numel() == 0 or not shape:
        if not shape:
            out = _tile(key, 0, (), kind, work)
        return _finish(out, kind, low, high, dtype, device)
    edge = tile_edge(len(shape))
    grid = [math.ceil(n / edge) for n in shape]
    ranges = [range(lo // edge, (hi - 1) // edge + 1) for lo, hi in box]
    for tile in itertools.product(*ranges):
        index = 0
        for t, g in zip(tile, grid, strict=True):
            index = index * g + t
        start = [t * edge for t in tile]
        tshape = tuple(min(edge, n - s) for n, s in zip(shape, start, strict=True))
        values = _cached_tile(cache, key, index, tshape, kind, work)
        src, dst = [], []
        for (lo, hi), s, n in zip(box, start, tshape, strict=True):
            a, b = max(lo, s), min(hi, s + n)
            src.append(slice(a - s, b - s))
            dst.append(slice(a - lo, b - lo))
        out[tuple(dst)] = values[tuple(src)]
    return _finish(out, kind, low, high, dtype, device)


def _cached_tile(cache: dict[int, torch.Tensor] | None, key: int, index: int, shape: Shape, kind: str,
                 dtype: torch.dtype) -> torch.Tensor:
    if cache is None:
        return _tile(key, index, shape, kind, dtype)
    values = cache.get(index)
    if values is None:
        if len(cache) >= TILE_CACHE_SIZE:
            cache.clear()
        values = cache[index] = _tile(key, index, shape, kind, dtype)
    return values


def _tile(key: int, index: int, shape: Shape, kind: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(_mix(key, index))
    if kind == "normal":
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.rand(shape, generator=g, dtype=dtype)


def _finish(out: torch.Tensor, kind: str, low: float, high: float, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    if kind == "uniform" and (low != 0.0 or high != 1.0):
        out = out * (high - low) + low
    return out.to(device=device, dtype=dtype)
