"""All ranks in this process: shards are torch tensors, collectives are local copies.

Reductions run in group order, so results are deterministic and match what a
real backend computes up to floating-point summation order.
"""

from __future__ import annotations

import torch

from .base import Backend, Completed, reduce_tensors


class SimulatedBackend(Backend):
    """Owns every rank. Rank ``r`` of a cuda placement lives on ``cuda:(r % device_count)``."""

    name = "simulated"

    def owns(self, rank: int) -> bool:
        return True

    def device_for(self, device_type: str, rank: int) -> torch.device:
        if device_type == "cuda":
            return torch.device("cuda", rank % torch.cuda.device_count())
        return torch.device("cpu")

    def _all_gather(self, group, inputs, shapes, dtype):  # type: ignore[no-untyped-def]
        return {r: [inputs[g].to(inputs[r].device) for g in group] for r in group}

    def _all_reduce(self, group, inputs, op, donate=False):  # type: ignore[no-untyped-def]
        total = reduce_tensors([inputs[g] for g in group], op)
        return {r: total.to(inputs[r].device, copy=True) for r in group}

    def _all_reduce_async(self, group, inputs, op, donate=False):  # type: ignore[no-untyped-def]
        # every rank is here: the reduction completes when issued, with the blocking one's values
        return Completed(self._all_reduce(group, inputs, op))

    def _reduce_scatter(self, group, inputs, op):  # type: ignore[no-untyped-def]
        return {
            r: reduce_tensors([inputs[g][j].to(inputs[r][j].device) for g in group], op)
            for j, r in enumerate(group)
        }

    def _all_to_all(self, group, inputs, recv_shapes, dtype):  # type: ignore[no-untyped-def]
        # A piece from another rank is copied: it may be a view of that rank's shard, and a received
        # tensor must never share memory with another rank's (as on a real backend).
        return {r: [inputs[g][j] if g == r else inputs[g][j].clone() for g in group] for j, r in enumerate(group)}

    def _broadcast(self, group, root, inputs, shape, dtype, device_type):  # type: ignore[no-untyped-def]
        return {r: inputs[root].to(self.device_for(device_type, r), copy=True) for r in group}

    def _reduce(self, group, root, inputs, op, shape, dtype):  # type: ignore[no-untyped-def]
        return {root: reduce_tensors([inputs[g] for g in group], op)}

    def _send_recv(self, transfers, tensors, device_type):  # type: ignore[no-untyped-def]
        # Payloads are views of the sender's shard; the receiver gets its own copy unless it sent to itself.
        return {i: tensors[i] if t.src == t.dst else tensors[i].clone() for i, t in enumerate(transfers)}
