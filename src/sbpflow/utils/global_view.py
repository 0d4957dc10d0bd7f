"""OneFlow's ``utils.global_view``: ``to_global`` and ``to_local`` over a tensor or a nested list, tuple or dict.

>>> import sbpflow
>>> from sbpflow.utils import global_view
>>> p = sbpflow.placement("cpu", [0, 1])
>>> out = global_view.to_global({"x": sbpflow.ones(2)}, placement=p, sbp=sbpflow.sbp.broadcast)
>>> out["x"].placement == p, global_view.to_local(out)["x"].tolist()
(True, [1.0, 1.0])
"""

from __future__ import annotations

from typing import Any

from ..placement import Placement
from ..tensor import Tensor

__all__ = ["to_global", "to_local"]


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def to_global(obj: Any, placement: Placement | None = None, sbp: Any = None, **kwargs: Any) -> Any:
    """Every tensor in ``obj`` made global on ``placement`` with ``sbp``; other leaves unchanged."""
    return _map(obj, lambda t: t.to_global(placement, sbp, **kwargs))


def to_local(obj: Any) -> Any:
    """Every global tensor in ``obj`` as this process's shard (a local sbpflow tensor); local ones unchanged."""
    return _map(obj, lambda t: Tensor._from_local(t.to_local()) if t.is_global else t)
