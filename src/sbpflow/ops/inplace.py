"""Which op outputs a consumer may write into, for compiled steps (nn.Graph).

Eager mode never writes into an op's result behind the user's back. A compiled plan knows every reader of every
buffer, so where a node is the only reader of an input that an op of :data:`FRESH_OUTPUTS` made (new memory, no
view of anything else, nothing else holding it), the lowering lets the node write its result there
(``PNode.overwrites``, :func:`sbpflow.graph.lower.overwrite_inputs`) with the in-place form in
:data:`OVERWRITING`. The bits are the same: ``b.add_(a)`` is ``a + b`` (IEEE addition commutes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Ops whose every output is a tensor of its own: never an input, never a view of one (torch's native kernels).
FRESH_OUTPUTS = frozenset({"add", "linear", "matmul_nd", "linear_weight_grad", "layer_norm_backward",
                           "gelu_backward", "bucket_flatten"})


def _add_into(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return target.add_(other)


# op -> kernel(target, other) that writes the op's result into ``target`` (either operand of a commutative op)
OVERWRITING: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"add": _add_into}
