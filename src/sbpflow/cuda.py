"""``sbpflow.cuda``: whether CUDA devices are there, as ``torch.cuda`` and ``oneflow.cuda`` say.

>>> import sbpflow
>>> isinstance(sbpflow.cuda.is_available(), bool)
True
"""

from __future__ import annotations

import torch


def is_available() -> bool:
    return torch.cuda.is_available()


def device_count() -> int:
    return torch.cuda.device_count()


__all__ = ["device_count", "is_available"]
