"""Reverse-mode autodiff over sbpflow ops: the recording state (mode), the recorded node, and the engine.

This package's namespace is the mode, which even Tensor reads; ``sbpflow.autograd.node`` is what dispatch
records, and ``sbpflow.autograd.engine`` runs backward and binds ``Tensor.backward``.
"""

from __future__ import annotations

from .mode import _mode, coalesce_grad_reductions, enable_grad, is_grad_enabled, no_grad, note_output_hooks

__all__ = ["_mode", "coalesce_grad_reductions", "enable_grad", "is_grad_enabled", "no_grad",
           "note_output_hooks"]
