"""``sbpflow.jit``: torch.jit's queries that model files branch on. sbpflow's tracer is ``nn.Graph``: code runs
under it while a graph is built, so ``is_tracing()`` says whether that is happening now.

>>> import sbpflow
>>> sbpflow.jit.is_tracing(), sbpflow.jit.is_scripting()
(False, False)
"""

from __future__ import annotations

from .graph import trace

__all__ = ["is_scripting", "is_tracing"]


def is_tracing() -> bool:
    return trace.tracing() is not None


def is_scripting() -> bool:
    return False  # sbpflow never scripts: the Python runs, eagerly or under nn.Graph's tracer
