"""Reference models built from sbpflow.nn."""

from __future__ import annotations

from .cnn import ResNet, train_cnn

__all__ = ["ResNet", "train_cnn"]
