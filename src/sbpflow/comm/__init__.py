"""Comm backends: simulated (all ranks in one process) and torch.distributed (one process per rank)."""

from __future__ import annotations

from .base import Backend, Transfer
from .record import CommEvent, CommLog, record
from .simulated import SimulatedBackend

_backend: Backend | None = None


def get_backend() -> Backend:
    """The backend that global tensors in this process use (set up on first use, see sbpflow.distributed)."""
    if _backend is None:
        from ..distributed import init

        return init()
    return _backend


def set_backend(backend: Backend | None) -> Backend | None:
    """Installs ``backend`` (None: choose again on next use); returns the previous one."""
    global _backend
    previous, _backend = _backend, backend
    return previous


__all__ = ["Backend", "Transfer", "CommEvent", "CommLog", "record", "SimulatedBackend", "get_backend", "set_backend"]
