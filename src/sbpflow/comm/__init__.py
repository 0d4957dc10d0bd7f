"""Comm backends: simulated (all ranks in one process) and torch.distributed."""

from __future__ import annotations

from .base import Backend, Transfer
from .record import CommEvent, CommLog, record
from .simulated import SimulatedBackend

_backend: Backend = SimulatedBackend()


def get_backend() -> Backend:
    """The backend that global tensors in this process use."""
    return _backend


def set_backend(backend: Backend) -> Backend:
    """Installs ``backend``; returns the previous one."""
    global _backend
    previous, _backend = _backend, backend
    return previous


__all__ = ["Backend", "Transfer", "CommEvent", "CommLog", "record", "SimulatedBackend", "get_backend", "set_backend"]
