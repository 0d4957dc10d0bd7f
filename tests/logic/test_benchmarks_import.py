"""Every benchmark script imports (they share helpers; a moved helper must not break one silently).

Importing runs no benchmark: each script does its work under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module(name)
    assert module.__file__ is not None and Path(module.__file__).parent == BENCHMARKS
    if not name.startswith("_"):
        assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"
    sys.modules.pop(name, None)
