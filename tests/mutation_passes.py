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
import difflib
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PASSES = {  # pass file -> its own tests (besides tests/fuzz)
    "select.py": ["tests/sim/test_graph_select.py", "tests/logic/test_select_costs.py"],
    "lower.py": ["tests/sim/test_graph.py"],
    "pipeline.py": ["tests/sim/test_pipeline_plans.py", "tests/sim/test_pipeline_interleaved_labels.py",
                    "tests/sim/test_pipeline.py"],
    "schedule.py": ["tests/logic/test_schedule.py"],
    "late_reduce.py": ["tests/sim/test_late_reduce.py"],
    "bucket.py": ["tests/sim/test_update_split_plans.py", "tests/sim/test_graph_bucket.py"],
    "group.py": ["tests/sim/test_pipeline_plans.py", "tests/sim/test_grouped_accumulate.py"],
    "accumulate.py": ["tests/logic/test_accumulate_before_send.py"],
    "update_split.py": ["tests/sim/test_update_split_plans.py", "tests/sim/test_update_split.py"],
    "fuse.py": ["tests/sim/test_pipeline_plans.py", "tests/sim/test_fused_segments.py"],
}
SAME_NAME = "`sub.op and sub.name`: a fusable node has an op and a compute node is named for it, so both give the op"
# Survivors reviewed by hand that change nothing a caller can observe: "file line N: change" -> why.
EQUIVALENT: dict[str, str] = {
    "fuse.py line 242:51: and/or swapped": SAME_NAME,
    "fuse.py line 296:37: and/or swapped": SAME_NAME,
    "fuse.py line 299:34: and/or swapped": SAME_NAME,
    "accumulate.py line 148:14: 0 -> 1": "a new node's id; renumber() gives every node its position right after",
    "select.py line 98:80: 0 -> 1": "the placement of an op with no output; every op has one (no meta returns none)",
    "select.py line 135:13: Eq -> NotEq": "the Python type of a scalar argument; signature rules only ask whether an "
                                       "argument is a scalar (its type serves meta inference, not selection)",
    "select.py line 290:56: 4 -> 5": "the item size of an empty tensor, which is always multiplied by its 0 elements",
    "select.py line 576:81: Gt -> GtE": "a mesh axis of one rank joins the per-axis sweeps, where every op keeps its "
                                     "choice on it: the same programs and plan (only the method's name differs)",
    "select.py line 608:15: Eq -> NotEq": "whether to reuse the first sweep's program; the reuse it allows (every op "
                                       "changed) solves a neighbourhood already beaten, so the plan is the same",
    "pipeline.py line 80:20: 1 -> 2": "pre-phase steps get priority -2, not -1: below every action's index either way",
    "pipeline.py line 316:34: 1 -> 2": "a default node id for a buffer with no producer; no node has id -1 or -2",
    "pipeline.py line 122:31: Gt -> GtE": "GPipe with one micro-batch gets a control edge of lead 0 from the last "
                                       "stage's forward to its backward: one micro-batch already runs F before B",
    "late_reduce.py line 59:27: 1 -> 2": "new buffer ids start one higher: still fresh",
    "late_reduce.py line 71:20: 1 -> 2": "new buffer ids are two apart: still fresh and distinct",
    "late_reduce.py line 119:85: 0 -> 1": "a gradient all-reduce's bytes read on its second rank: it has two or "
                                       "more, and a whole tensor has the same bytes on each",
    "late_reduce.py line 120:33: GtE -> Gt": "a move whose saved transfer time equals the latency exactly costs the "
                                          "same either way",
    "bucket.py line 239:20: 1 -> 2": "new buffer ids are two apart: still fresh and distinct",
    "bucket.py line 148:75: 0 -> 1": "a solo all-reduce's bytes read on its second rank: it has two or more, and a "
                                  "whole tensor has the same bytes on each",
    "bucket.py line 258:96: 3 -> 4": "a bucket's collective is named after its first 4 inputs, not 3: a label",
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
    line = f"{getattr(node, 'lineno', 0)}:{getattr(node, 'col_offset', 0)}"  # one line can hold two sites
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
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        node.value = node.value + 1
        what = f"line {line}: {node.value - 1} -> {node.value}"
    return ast.unparse(tree), what


def picks(name: str, count: int, per_file: int) -> list[int]:
    """The sampled mutant indices of one file: seeded by the file's name, so every run draws the same ones."""
    return sorted(random.Random(name).sample(range(count), min(per_file, count)))


def run_mutant(scratch: Path, name: str, source: str, tests: list[list[str]], timeout: float) -> str:
    """Run each test group in turn (the pass's own tests first: they are the fast ones) until one fails."""
    target = scratch / "src" / "sbpflow" / "graph" / name
    original = target.read_text()
    target.write_text(source)
    deadline = time.time() + timeout
    try:
        for group in tests:
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore", *group]
            env = {"PYTHONPATH": str(scratch / "src"), "SBPFLOW_FUZZ_N": "60", "PATH": "/usr/bin:/bin"}
            done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True,
                                  timeout=max(deadline - time.time(), 1.0))
            if done.returncode != 0:
                return "killed"
        return "survived"
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        target.write_text(original)


def show(name: str, per_file: int) -> None:
    """Print each sampled mutant of one file as a diff, without running it."""
    source = (REPO / "src" / "sbpflow" / "graph" / name).read_text()
    plain = ast.unparse(ast.parse(source)).splitlines()
    for k in picks(name, len(sites(ast.parse(source))), per_file):
        made = mutate(source, k)
        assert made is not None
        print(f"== {name} #{k} {made[1]}")
        diff = difflib.unified_diff(plain, made[0].splitlines(), lineterm="", n=2)
        print("\n".join(list(diff)[2:]))


def scratch_copy() -> Path:
    scratch = Path(tempfile.mkdtemp(prefix="sbpflow-mutants-"))
    for part in ("src", "tests", "pyproject.toml"):
        src = REPO / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, scratch / part)
    return scratch


def run_file(name: str, per_file: int, timeout: float, jobs: int, tests: list[str] | None = None,
             skip_equivalent: bool = False) -> tuple[str, list[str]]:
    """Run one file's sampled mutants (``jobs`` at a time, each worker in its own scratch copy): its table row and
    its survivors."""
    source = (REPO / "src" / "sbpflow" / "graph" / name).read_text()
    count = len(sites(ast.parse(source)))
    chosen = picks(name, count, per_file)
    scratches: queue.Queue[Path] = queue.Queue()
    for _ in range(jobs):
        scratches.put(scratch_copy())

    def one(k: int) -> tuple[str, str]:
        made = mutate(source, k)
        assert made is not None
        if skip_equivalent and f"{name} {made[1]}" in EQUIVALENT:
            print(f"{name} {made[1]}: survived (equivalent, not run)", flush=True)
            return made[1], "survived"
        scratch = scratches.get()
        try:
            groups = [tests] if tests else [PASSES[name], ["tests/fuzz/test_fuzz.py"]]
            result = run_mutant(scratch, name, made[0], groups, timeout)
        finally:
            scratches.put(scratch)
        print(f"{name} {made[1]}: {result}", flush=True)
        return made[1], result

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(one, chosen))
    while not scratches.empty():
        shutil.rmtree(scratches.get(), ignore_errors=True)
    survived = [what for what, result in results if result == "survived"]
    equivalent = [what for what in survived if f"{name} {what}" in EQUIVALENT]
    killed = sum(result == "killed" for _, result in results)
    timed_out = sum(result == "timeout" for _, result in results)
    caught = killed + timed_out
    row = (f"| graph/{name} | {count} | {len(chosen)} | {killed} | {timed_out} | {len(equivalent)} | "
           f"{len(survived) - len(equivalent)} | {caught / max(len(chosen) - len(equivalent), 1):.0%} |")
    return row, [f"{name} {what}" for what in survived]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-file", type=int, default=20, help="mutants per pass file (sampled, seeded)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--write", action="store_true", help="write the table into docs/testing.md")
    parser.add_argument("--only", nargs="*", default=list(PASSES), help="pass files to mutate (default: all)")
    parser.add_argument("--show", action="store_true", help="print the sampled mutants as diffs, run nothing")
    parser.add_argument("--tests", nargs="*", help="run these tests instead (a quick look while writing tests)")
    parser.add_argument("--skip-equivalent", action="store_true",
                        help="count the mutants of EQUIVALENT as survivors without running them (saves time)")
    args = parser.parse_args()
    if args.show:
        for name in args.only:
            show(name, args.per_file)
        return
    rows, survivors, start = [], [], time.time()
    for name in args.only:
        row, survived = run_file(name, args.per_file, args.timeout, args.jobs, args.tests, args.skip_equivalent)
        print(row, flush=True)
        rows.append(row)
        survivors += survived
    header = ("| file | mutation sites | mutants run | killed | timed out | equivalent | survived "
              "| caught (of non-equivalent) |")
    table = "\n".join([header,
                       "|---|---|---|---|---|---|---|---|", *rows])
    print(table)
    print(f"{time.time() - start:.0f} s")
    print("survivors:\n" + "\n".join(s + (" (equivalent)" if s in EQUIVALENT else "") for s in survivors))
    if args.write:
        write_table(table, survivors)


def write_table(table: str, survivors: list[str]) -> None:
    doc = REPO / "docs" / "testing.md"
    text = doc.read_text()
    marker = "<!-- mutation_passes -->"
    lines = [f"* {s}: equivalent, {EQUIVALENT[s]}" if s in EQUIVALENT else f"* {s}" for s in survivors]
    block = f"{marker}\n{table}\n\nSurviving mutants:\n\n" + "\n".join(lines) + f"\n{marker}"
    head, _, rest = text.partition(marker)
    _, _, tail = rest.partition(marker)
    doc.write_text(head + block + tail)


if __name__ == "__main__":
    main()
