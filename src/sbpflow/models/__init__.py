"""Reference models built from sbpflow.nn."""

from __future__ import annotations

from typing import Any

from .cnn import ResNet, train_cnn

__all__ = ["ResNet", "from_pretrained", "train_cnn"]


def __getattr__(name: str) -> Any:
    # ``sbpflow`` imports this package before its own top-level functions exist, and the language models
    # use them at class definition (``@sbpflow.no_grad()``): load them on first use.
    if name == "from_pretrained":
        from .auto import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'sbpflow.models' has no attribute {name!r}")
