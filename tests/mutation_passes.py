"""Mutation check of the graph passes: small AST mutants of each pass file, each run against the random programs.

A mutant flips one comparison (``<`` and ``<=``, ``==`` and ``!=``, ...), one boolean operator (``and`` and
``or``), negates one ``if`` condition, or moves one small integer constant by one. Each mutant is written into a
scratch copy of the repository (never into this tree) and runs the fixed random programs of tests/fuzz (the
oracle: one rank in eager mode) and the pass's own test file; it is killed when any fails or errors, and counted
as timed out past ``--timeout`` seconds (a hang is a catch too).

Run: ``.venv/bin/python tests/mutation_passes.py --per-file 10 --write`` (writes the table into docs/testing.md).
"""

from __future__ import annotations

import argparse
import ast
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PASSES = {  # pass file -> its own tests (besides tests/fuzz)
    "select.py": ["tests/sim/test_graph_select.py"], "lower.py": ["tests/sim/test_graph.py"],
    "pipeline.py": ["tests/sim/test_pipeline.py"], "schedule.py": ["tests/logic/test_schedule.py"],
    "late_reduce.py": ["tests/sim/test_late_reduce.py"], "bucket.py": ["tests/sim/test_graph_bucket.py"],
    "group.py": ["tests/sim/test_grouped_accumulate.py"],
    "accumulate.py": ["tests/logic/test_accumulate_before_send.py"],
    "update_split.py": ["tests/sim/test_update_split.py"], "fuse.py": ["tests/sim/test_fused_segments.py"],
}
FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


def sites(tree: ast.AST) -> list[tuple[str, ast.AST, int]]:
    """Every place a mutant can be made: (kind, node, index)."""
    out: list[tuple[str, ast.AST, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            out += [("compare", node, i) for i, op in enumerate(node.ops) if type(op) in FLIPS]
        elif isinstance(node, ast.BoolOp):
            out.append(("boolop", node, 0))
        elif isinstance(node, ast.If):
            out.append(("negate", node, 0))
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 8:
            out.append(("constant", node, 0))
    return out


def mutate(source: str, k: int) -> tuple[str, str] | None:
    """Source with mutant ``k`` applied, and a one-line description; None when ``k`` is past the last site."""
    tree = ast.parse(source)
    found = sites(tree)
    if k >= len(found):
        return None
    kind, node, i = found[k]
    line = getattr(node, "lineno", 0)
    if kind == "compare":
        assert isinstance(node, ast.Compare)
        old = node.ops[i]
        node.ops[i] = FLIPS[type(old)]()
        what = f"line {line}: {type(old).__name__} -> {type(node.ops[i]).__name__}"
    elif kind == "boolop":
        assert isinstance(node, ast.BoolOp)
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        what = f"line {line}: and/or swapped"
    elif kind == "negate":
        assert isinstance(node, ast.If)
        node.test = ast.UnaryOp(ast.Not(), node.test)
        what = f"line {line}: if negated"
    else:
        assert isinstance(node, ast.Constant)
        node.value = node.value + 1
        what = f"line {line}: {node.value - 1} -> {node.value}"
    return ast.unparse(tree), what


def run_mutant(scratch: Path, name: str, source: str, tests: list[str], timeout: float) -> str:
    target = scratch / "src" / "sbpflow" / "graph" / name
    original = target.read_text()
    target.write_text(source)
    try:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore", *tests]
        env = {"PYTHONPATH": str(scratch / "src"), "SBPFLOW_FUZZ_N": "60", "PATH": "/usr/bin:/bin"}
        done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, timeout=timeout)
        return "survived" if done.returncode == 0 else "killed"
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        target.write_text(original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-file", type=int, default=10, help="mutants per pass file (sampled, seeded)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--write", action="store_true", help="write the table into docs/testing.md")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="sbpflow-mutants-"))
    for part in ("src", "tests", "pyproject.toml"):
        src = REPO / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, scratch / part)
    rows, survivors, start = [], [], time.time()
    for name, own in PASSES.items():
        source = (REPO / "src" / "sbpflow" / "graph" / name).read_text()
        count = len(sites(ast.parse(source)))
        picks = sorted(random.Random(name).sample(range(count), min(args.per_file, count)))
        outcome = {"killed": 0, "survived": 0, "timeout": 0}
        for k in picks:
            made = mutate(source, k)
            assert made is not None
            result = run_mutant(scratch, name, made[0], ["tests/fuzz/test_fuzz.py", *own], args.timeout)
            outcome[result] += 1
            if result == "survived":
                survivors.append(f"{name} {made[1]}")
            print(f"{name} {made[1]}: {result}", flush=True)
        caught = outcome["killed"] + outcome["timeout"]
        rows.append(f"| graph/{name} | {count} | {len(picks)} | {outcome['killed']} | {outcome['timeout']} | "
                    f"{outcome['survived']} | {caught / max(len(picks), 1):.0%} |")
    shutil.rmtree(scratch, ignore_errors=True)
    table = "\n".join(["| file | mutation sites | mutants run | killed | timed out | survived | caught |",
                       "|---|---|---|---|---|---|---|", *rows])
    print(table)
    print(f"{time.time() - start:.0f} s")
    print("survivors:\n" + "\n".join(survivors))
    if args.write:
        doc = REPO / "docs" / "testing.md"
        text = doc.read_text()
        marker = "<!-- mutation_passes -->"
        block = f"{marker}\n{table}\n\nSurviving mutants:\n\n" + "\n".join(f"* {s}" for s in survivors) + f"\n{marker}"
        if marker in text:
            head, _, rest = text.partition(marker)
            _, _, tail = rest.partition(marker)
            text = head + block + tail
        else:
            text = text.rstrip() + "\n\n## Mutation check of the graph passes\n\n" + block + "\n"
        doc.write_text(text)


if __name__ == "__main__":
    main()
