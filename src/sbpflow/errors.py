"""sbpflow's own exception types.

User mistakes raise these (never ``assert``), with messages that state the rule
first and then the offending value.
"""

from __future__ import annotations


class SbpflowError(Exception):
    """Base class of every error sbpflow raises on purpose."""


class PlacementError(SbpflowError, ValueError):
    """An invalid placement: bad device type, ranks or mesh."""


class SbpError(SbpflowError, ValueError):
    """An invalid SBP, or SBPs that do not fit a tensor or placement."""


class ShapeError(SbpflowError, ValueError):
    """Shapes that an op cannot accept."""


class IndexOutOfRangeError(ShapeError, IndexError):
    """An index past the end of a dim; also an ``IndexError``, which torch users catch for this."""


class ArgumentError(SbpflowError, ValueError):
    """An argument value a function cannot accept (a seed, a learning rate, a device), with torch's ValueError."""


class DTypeError(SbpflowError, TypeError):
    """Dtypes that an op cannot accept."""


class BoxingError(SbpflowError, RuntimeError):
    """A conversion between SBPs or placements that cannot be planned or run."""


class OpError(SbpflowError, RuntimeError):
    """An op that cannot run on the given inputs (no rule, bad arguments)."""


class LocalGlobalError(OpError):
    """Local and global tensors given together to one op, module or optimizer (``module`` names the module)."""

    module: str | None = None


class AutogradError(SbpflowError, RuntimeError):
    """Misuse of reverse-mode differentiation."""


class CommError(SbpflowError, RuntimeError):
    """A communication failure: a timeout, a mismatch between ranks, a dead peer."""


class CheckpointError(SbpflowError, RuntimeError):
    """A checkpoint that cannot be written or read: missing, corrupt, or not matching the state to fill."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files are damaged (truncated, altered, missing, unreadable, a damaged index): its data
    is never read, and ``CheckpointManager.restore`` falls back to the checkpoint before it."""


class CheckpointWarning(UserWarning):
    """A checkpoint skipped by ``CheckpointManager.restore`` because it is damaged; the message names the file."""


class AutocastWarning(UserWarning):
    """A torch.autocast block is active around sbpflow ops, which it does not change (see ops.registry)."""


class PlanError(SbpflowError, ValueError):
    """A parallel plan that cannot exist for the model and cluster (degrees that do not divide, no plan fits)."""


class MetaTensorError(SbpflowError, RuntimeError):
    """Data was asked of a meta tensor (built under ``sbpflow.meta_init()``), which holds metadata only."""
