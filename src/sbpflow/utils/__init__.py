"""``sbpflow.utils``: activation checkpointing (:func:`checkpoint`, :func:`checkpoint_module`) and its measure
(:func:`activation_bytes`), and OneFlow's ``global_view``."""

from __future__ import annotations

from . import global_view
from .checkpoint import activation_bytes, checkpoint, checkpoint_module

__all__ = ["activation_bytes", "checkpoint", "checkpoint_module", "global_view"]
