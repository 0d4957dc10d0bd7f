"""Late references to ``ops.functional`` for the op modules it imports (elementwise, matrix, reduction, shape).

Their gradient functions call functional helpers (``sum_to``, ``transpose`` ...), which cannot be imported at
module level without an import cycle. An import statement inside a gradient function costs about a
microsecond on every call (importlib resolves the package each time); :func:`functional` looks the module up
once and then hands it back from a global.
"""

from __future__ import annotations

from types import ModuleType

_FUNCTIONAL: ModuleType | None = None


def functional() -> ModuleType:
    """``sbpflow.ops.functional``, imported on the first call."""
    global _FUNCTIONAL
    if _FUNCTIONAL is None:
        from . import functional as module

        _FUNCTIONAL = module
    return _FUNCTIONAL
