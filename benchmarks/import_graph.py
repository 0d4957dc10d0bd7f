"""Count sbpflow's import circles and function-level imports, from the source (ast, nothing imported).

A circle is a strongly connected component of more than one module in the graph of module-to-module
imports, counting imports inside functions: an import that runs late still ties the two modules together.

    python benchmarks/import_graph.py          # counts and each circle's modules
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(modules: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]], int]:
    """Edges among sbpflow modules (all), the function-level subset, and the count of function-level statements."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    late: dict[str, set[str]] = {m: set() for m in modules}
    statements = 0

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        nested: set[int] = set()
        typing_only: set[int] = set()
        for block in ast.walk(tree):  # `if TYPE_CHECKING:` imports never run: they tie no modules together
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
                typing_only.update(id(n) for n in ast.walk(block))
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            names: list[str] = []
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(mod, path.name == "__init__.py", node)
                names = [f"{base}.{a.name}" for a in node.names]
            found = {t for t in (target(n) for n in names if n.startswith("sbpflow")) if t and t != mod}
            edges[mod] |= found
            if id(node) in nested and found:
                late[mod] |= found
                statements += 1
    return edges, late, statements


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def main() -> None:
    modules = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
    edges, late, statements = imports(modules)
    found = circles(edges)
    n_edges = sum(len(e) for e in edges.values())
    n_late = sum(len(e) for e in late.values())
    print(f"{len(modules)} modules, {n_edges} module-to-module imports, {n_late} of them inside functions "
          f"({statements} statements)")
    print(f"{len(found)} circles")
    for comp in sorted(found, key=len, reverse=True):
        print(f"  {len(comp)}: {', '.join(comp)}")


if __name__ == "__main__":
    main()
