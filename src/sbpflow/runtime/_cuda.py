"""CUDA streams and events for the actor runtime's worker threads, so that communication overlaps compute."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class CudaLane:
    """One worker thread's stream on ``device``, set once as the thread's current stream.

    An act whose output another stream reads records an event after the write, and the register carries it;
    the reader waits for it on the GPU (``wait_event``), never on the host, and marks what it read as used by
    its stream (``record_stream``), so the caching allocator does not reuse that memory before the reader's
    kernels ran. Readers on the writer's stream need neither: stream order serialises them. Without threads
    (virtual ranks) there are no lanes: every act runs on the caller's stream, in an order that respects
    every message.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def enter(self) -> None:
        """Makes this stream the calling thread's current one (PyTorch keeps one per thread): a worker thread
        calls it once, so an act needs no stream switch."""
        torch.cuda.set_stream(self.stream)

    def current(self) -> Any:
        """A context in which the calling thread's current stream is this one (the caller, for one run)."""
        return torch.cuda.stream(self.stream)

    def run(self, fn: Callable[[], Any], read: Iterable[Any], signal: bool) -> tuple[Any, Any]:
        """Runs ``fn`` (on the current stream, this lane's) after the writes of the ``read`` slots made on other
        streams; returns its result and, if ``signal`` (a reader on another stream), (stream, event)."""
        stream = self.stream
        for slot in read:
            mark = slot.event
            if mark is None or mark[0] is stream:
                continue  # written on this stream: stream order already puts the write first
            stream.wait_event(mark[1])
            for t in _tensors(slot.value):
                if t.is_cuda:
                    t.record_stream(stream)
        result = fn()
        if not signal:
            return result, None
        event = torch.cuda.Event()
        event.record(stream)
        return result, (stream, event)

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
