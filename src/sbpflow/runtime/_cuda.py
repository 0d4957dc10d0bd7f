"""CUDA streams and events for the actor runtime's worker threads (used when a placement is ``cuda``).

Each worker thread runs its acts on a CUDA stream of its own, so a communication thread's
collective can overlap the compute thread's kernels. Registers carry an event recorded after the
write; a reader on another stream waits for it on the GPU (``wait_event``), never on the host, and
marks the tensors it read as used by its stream (``record_stream``) so that the caching allocator
does not hand their memory out again before the reader's kernels ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class CudaLane:
    """One worker thread's stream on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, fn: Callable[[], Any], read: Iterable[Any]) -> tuple[Any, Any]:
        """Runs ``fn`` on this stream after the writes of the ``read`` slots; returns its result and an event."""
        for slot in read:
            if slot.event is not None:
                self.stream.wait_event(slot.event)
            for t in _tensors(slot.value):
                if t.is_cuda:
                    t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            result = fn()
            event = torch.cuda.Event()
            event.record(self.stream)
        return result, event

    def follow_caller(self) -> None:
        """Start of a run (in the caller's thread): this stream waits for the caller's stream, which wrote the
        feeds and last updated the variables."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """The host waits for this stream (end of a run: outputs are read on the default stream)."""
        self.stream.synchronize()


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    """The shards of a register value: ``{rank: tensor}``, or a list of them (pack)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
