"""Building a layer's parameters directly in a layout (``placement=`` / ``sbp=`` on every layer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..creation import zeros
from ..errors import SbpError
from ..placement import Placement
from ..sbp import broadcast
from ..tensor import Tensor
from .module import Module, Parameter


def layout_for(name: str, placement: Placement | None, sbp: Any, layer: str) -> dict[str, Any]:
    """``placement``/``sbp`` keyword arguments for parameter ``name`` of ``layer``.

    ``sbp`` is ``None`` (broadcast), one SBP (or n-D tuple) for every parameter,
    or a mapping ``{parameter name: sbp}`` whose missing names get broadcast.
    """
    if placement is None:
        if sbp is not None:
            raise SbpError(f"{layer}: sbp= needs placement= as well")
        return {}
    if not isinstance(placement, Placement):
        raise SbpError(f"{layer}: placement= needs an sbpflow.placement, but got {placement!r}")
    if isinstance(sbp, Mapping):
        chosen = sbp.get(name)
    else:
        chosen = sbp
    return {"placement": placement, "sbp": (broadcast,) * placement.ndim if chosen is None else chosen}


def empty_param(shape: tuple[int, ...], name: str, placement: Placement | None, sbp: Any, layer: str,
                dtype: torch.dtype | None = None) -> Parameter:
    """A zero parameter of logical ``shape`` in the requested layout, ready for an ``nn.init`` initialiser."""
    kwargs = layout_for(name, placement, sbp, layer)
    try:
        return Parameter(zeros(*shape, dtype=dtype, **kwargs))
    except SbpError as e:
        # One SBP for every parameter is the common case, so say which parameter it does not fit (often the
        # 1-D bias under a split(1) meant for the weight) and how to give each its own.
        raise SbpError(
            f"{layer}: parameter {name!r} of shape {list(shape)} cannot take sbp {kwargs['sbp']} on {placement} "
            f"({e}); pass one SBP per parameter, e.g. sbp={{'weight': ..., 'bias': sbpflow.sbp.broadcast}}"
        ) from None


def weight_and_bias(module: Module, weight_shape: tuple[int, ...], bias: bool, placement: Placement | None,
                    sbp: Any, layer: str, dtype: torch.dtype | None = None) -> None:
    """Registers ``weight`` (of ``weight_shape``) and, if asked, ``bias`` (one per output row) on ``module``."""
    module.weight = empty_param(weight_shape, "weight", placement, sbp, layer, dtype)
    if bias:
        module.bias = empty_param((weight_shape[0],), "bias", placement, sbp, layer, dtype)
    else:
        module.register_parameter("bias", None)


def empty_buffer(shape: tuple[int, ...], name: str, placement: Placement | None, layer: str,
                 dtype: torch.dtype | None = None) -> Tensor:
    """A zero buffer, broadcast over ``placement`` when one is given."""
    return zeros(*shape, dtype=dtype, **layout_for(name, placement, None, layer))
