"""``sbpflow.nn.utils``: gradient clipping (implemented in :mod:`sbpflow.optim.clip`)."""

from __future__ import annotations

from ..optim.clip import clip_grad_norm_, clip_grad_value_

__all__ = ["clip_grad_norm_", "clip_grad_value_"]
