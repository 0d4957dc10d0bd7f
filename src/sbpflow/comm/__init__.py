"""Comm backends: simulated (all ranks in one process) and torch.distributed (one process per rank)."""

from __future__ import annotations

from .. import distributed
from .base import Backend, Transfer
from .record import CommEvent, CommLog, record
from .simulated import SimulatedBackend
from .torch_dist import TorchDistBackend

_backend: Backend | None = None


def get_backend() -> Backend:
    """The backend that global tensors in this process use (set up on first use, see sbpflow.distributed)."""
    if _backend is None:
        return distributed.init()
    return _backend


def set_backend(backend: Backend | None) -> Backend | None:
    """Installs ``backend`` (None: choose again on next use); returns the previous one."""
    global _backend
    previous, _backend = _backend, backend
    return previous


def _make_backend(cfg: distributed.Config) -> Backend:
    return TorchDistBackend(cfg) if cfg.launched else SimulatedBackend()


# distributed.init (below this package) starts a process's backend through these
distributed.register_comm(distributed.CommHooks(make=_make_backend, installed=lambda: _backend, install=set_backend))


__all__ = ["Backend", "Transfer", "CommEvent", "CommLog", "record", "SimulatedBackend", "get_backend", "set_backend"]
