"""``sbpflow.nn.functional``: every op of :mod:`sbpflow.ops.functional`, under torch's familiar name.

>>> import sbpflow
>>> import sbpflow.nn.functional as F
>>> F.relu(sbpflow.tensor([-1.0, 2.0])).tolist()
[0.0, 2.0]
"""

from __future__ import annotations

from typing import Any

from ..ops import functional as _ops
from ..ops.functional import *  # noqa: F401,F403

__all__ = list(_ops.__all__)


def __getattr__(name: str) -> Any:
    # Ops that a family module adds after import still resolve here.
    return getattr(_ops, name)
