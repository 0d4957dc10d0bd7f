"""Import circles among sbpflow's modules, counting function-level imports (benchmarks/import_graph.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", _SCRIPT)
assert _spec is not None and _spec.loader is not None
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

def _circles() -> list[list[str]]:
    modules = {import_graph.module_name(p): p for p in sorted(import_graph.SRC.rglob("*.py"))}
    edges, _, _ = import_graph.imports(modules)
    return import_graph.circles(edges)


def test_no_import_circle():
    assert _circles() == []


def test_circles_are_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.circles(edges) == [["a", "b", "c"]]
