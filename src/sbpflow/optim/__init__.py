"""Optimizers, learning-rate schedules and gradient clipping for sbpflow parameters.

Updates run shard by shard on local torch tensors; optimizer state has its
parameter's placement and SBP (see :mod:`sbpflow.optim.optimizer` for the
``state_sbp`` hook that shards it, ZeRO style).
"""

from __future__ import annotations

from . import lr_scheduler
from .adam import Adam, AdamW
from .adaptive import Adagrad, RMSprop
from .clip import clip_grad_norm_, clip_grad_value_
from .optimizer import Optimizer
from .sgd import SGD
from .zero import ZeroPlan, memory_per_rank, zero, zero_sbp

__all__ = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Optimizer", "clip_grad_norm_", "clip_grad_value_",
           "lr_scheduler", "ZeroPlan",
           "memory_per_rank", "zero", "zero_sbp"]
