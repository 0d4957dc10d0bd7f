"""The runtime's error, apart from the executors that raise it (every runtime module imports it)."""

from __future__ import annotations

from ..errors import SbpflowError


class ExecutionError(SbpflowError):
    """A node of a physical plan failed; the message names the node and its op."""
