"""Which op outputs a consumer may write into, for compiled steps (nn.Graph).

Eager mode never writes into an op's result behind the user's back; a compiled plan knows every reader of
every buffer, so the lowering may (:func:`sbpflow.graph.lower.overwrite_inputs`), with the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Ops whose every output is a tensor of its own: never an input, never a view of one (torch's native kernels).
FRESH_OUTPUTS = frozenset({"add", "linear", "matmul_nd", "linear_weight_grad", "layer_norm_backward",
                           "gelu_backward", "bucket_flatten"})


def _add_into(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return target.add_(other)


# op -> kernel(target, other) that writes the op's result into ``target`` (either operand of a commutative op);
# the bits are the same: b.add_(a) is a + b (IEEE addition commutes)
OVERWRITING: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"add": _add_into}
