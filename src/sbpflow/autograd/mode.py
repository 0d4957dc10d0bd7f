"""Whether ops record gradients (no_grad, enable_grad) and how backward reduces them (coalesce_grad_reductions).

Pure state, below the ops: dispatch reads it on every op, and the engine on every backward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import AutogradError

DEFAULT_BUCKET_MB = 25.0  # DDP's default bucket_cap_mb
FIRST_BUCKET_MB = 1.0  # DDP's first bucket: small, so that communication starts early in backward


class _Mode(threading.local):
    coalesce = True  # see coalesce_grad_reductions: DDP-style buckets by default
    bucket_bytes = int(DEFAULT_BUCKET_MB * 2**20)


_mode = _Mode()


class _Hooks:
    seen = False  # whether any tensor ever got a hook or retain_grad() (note_output_hooks)


output_hooks = _Hooks()


def note_output_hooks() -> None:
    """Called by ``Tensor.register_hook`` and ``retain_grad``: from now on backward looks for hooks and retained
    gradients on every node's outputs (until then it skips that scan; the flag is never cleared, since a hooked
    tensor may live on anywhere)."""
    output_hooks.seen = True


def is_grad_enabled() -> bool:
    """Whether ops record gradients. sbpflow's grad mode is torch's (thread-local, one C call to read), so
    ``torch.no_grad()``, ``torch.inference_mode()`` and ``torch.set_grad_enabled`` turn it off as
    :class:`no_grad` does, and each side's ``enable_grad`` turns it back on.

    >>> import torch, sbpflow
    >>> x = sbpflow.ones(2, requires_grad=True)
    >>> with torch.no_grad():
    ...     (x * 2).requires_grad
    False
    """
    return torch.is_grad_enabled()


@contextmanager
def _set_grad(enabled: bool) -> Iterator[None]:
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(enabled)
    try:
        yield
    finally:
        torch.set_grad_enabled(previous)


class no_grad:
    """Context manager and decorator that turns off gradient recording (``torch.no_grad()`` does too)."""

    _enabled = False  # the grad mode inside

    def __enter__(self) -> None:
        self._previous = torch.is_grad_enabled()
        torch.set_grad_enabled(self._enabled)

    def __exit__(self, *exc: object) -> None:
        torch.set_grad_enabled(self._previous)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with _set_grad(self._enabled):
                return fn(*args, **kwargs)

        wrapped.__name__ = getattr(fn, "__name__", "wrapped")
        wrapped.__doc__ = fn.__doc__
        return wrapped


class enable_grad(no_grad):
    """Context manager and decorator that turns gradient recording back on (``torch.enable_grad()`` does too)."""

    _enabled = True


@contextmanager
def coalesce_grad_reductions(enabled: bool = True, bucket_cap_mb: float = DEFAULT_BUCKET_MB) -> Iterator[None]:
    """Backward passes inside the block reduce the partial-sum gradients of broadcast leaves together, in flat
    buckets of up to ``bucket_cap_mb`` MiB per (placement, dtype, SBP) instead of one all-reduce per leaf, as
    DDP does. This is the default; ``coalesce_grad_reductions(False)`` opts out for the block (each leaf's
    gradient then boxes to the leaf's layout on its own, at the end of backward).

    A leaf's gradient joins its bucket as soon as backward has sent it its last contribution, so buckets fill
    in backward order; as in DDP, the first bucket of each (placement, dtype, SBP) holds up to 1 MiB only, so
    that communication starts early. A full bucket whose boxing to B is one all-reduce per group is issued
    asynchronously (``Backend.all_reduce_async``) while backward goes on, the rest at the end of backward, which
    then waits for all of them. Gradients that reduce otherwise (e.g. partial on several mesh axes) get one flat
    boxing per (placement, dtype, SBP) at the end of backward.

    Values are the same (a sum of concatenated buffers is the concatenation of the sums); what changes is the
    number of collectives, whose fixed latency dominates with many small gradients, and their overlap with
    backward's compute.

    >>> import sbpflow
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> w1 = sbpflow.ones(3, placement=p, sbp=sbpflow.sbp.broadcast, requires_grad=True)
    >>> w2 = sbpflow.ones(2, placement=p, sbp=sbpflow.sbp.broadcast, requires_grad=True)
    >>> x = sbpflow.ones(4, 1, placement=p, sbp=sbpflow.sbp.split(0))
    >>> with sbpflow.comm.record() as log, coalesce_grad_reductions():
    ...     ((x * w1).sum() + (x * w2).sum()).backward()
    >>> log.counts(), w1.grad.numpy().tolist()
    ({'all_reduce': 1}, [4.0, 4.0, 4.0])
    """
    if not bucket_cap_mb > 0:
        raise AutogradError(f"coalesce_grad_reductions(bucket_cap_mb=...) must be positive, but got {bucket_cap_mb}")
    previous = _mode.coalesce, _mode.bucket_bytes
    _mode.coalesce, _mode.bucket_bytes = enabled, max(1, int(bucket_cap_mb * 2**20))
    try:
        yield
    finally:
        _mode.coalesce, _mode.bucket_bytes = previous
