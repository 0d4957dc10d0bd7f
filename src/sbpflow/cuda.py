"""``sbpflow.cuda``: torch.cuda's queries, and ``cuda.amp`` (sbpflow's autocast and GradScaler), as ported code
calls them.

>>> import sbpflow
>>> isinstance(sbpflow.cuda.is_available(), bool), sbpflow.cuda.amp.GradScaler is sbpflow.GradScaler
(True, True)
"""

from __future__ import annotations

from typing import Any

import torch

from . import amp

__all__ = ["amp", "device_count", "is_available", "is_bf16_supported", "set_device"]


def is_available() -> bool:
    return torch.cuda.is_available()


def device_count() -> int:
    return torch.cuda.device_count()


def is_bf16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def set_device(device: Any) -> None:
    """torch.cuda.set_device; sbpflow places each rank's shards by its placement, so this only sets torch's
    current device (what plain torch code in the same process uses)."""
    torch.cuda.set_device(device)
