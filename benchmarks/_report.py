"""What every benchmark shares: the machine line of its figures, writing its section of docs/benchmarks.md, and
one host allocator setting for every contender (sbpflow.host_memory).

Scripts print their tables; only ``--write`` replaces their section in docs/benchmarks.md (between markers,
keeping the other sections), so stale figures are replaced rather than appended.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sbpflow.host_memory import freed_host_memory_kept, keep_freed_host_memory

# every contender of every benchmark, torch's peers included, runs on the same host allocator settings: the
# ones sbpflow sets when it prepares a plan or runs a backward (sbpflow.host_memory), applied here at import so
# that a process running only torch gets them too
keep_freed_host_memory()

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by its script; rerun the command it names to refresh it.\n"


def machine(threads: int = 1, processes: int = 1) -> str:
    """Cores, threads, torch version, date and load: what a reader needs to weigh the figures.

    The load average at the start says whether other work shared the machine (its figures are then noisier,
    though interleaved medians hit every contender alike).
    """
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cores = os.cpu_count() or 0
    shared = f", shared with other jobs (load average {load:.1f} at start)" if load > 0.5 * cores else ""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    procs = f"{processes} processes x " if processes > 1 else ""
    cache = ", freed host memory kept for every contender" if freed_host_memory_kept() else ""
    return (f"{platform.processor() or platform.machine()}, {cores} cores{shared}, {procs}{threads} torch "
            f"thread{'s' if threads > 1 else ''}, torch {torch.__version__}{cache}, {when}")


def add_write_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", action="store_true",
                        help=f"replace this script's section of {DOC.relative_to(DOC.parent.parent)} "
                             "(otherwise only print)")


def write_section(name: str, body: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text:
        text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)


def launch_self(script: str, world: int, args: list[str], **run: Any) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` again as ``world`` processes (``sbpflow launch``, gloo on loopback, one thread each); the
    copies see ``RANK`` and act as workers. ``run`` goes to :func:`subprocess.run` (check, timeout, capture)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "sbpflow.cli", "launch", "-n", str(world), str(Path(script).resolve()), *args]
    return subprocess.run(cmd, env=env, text=True, **run)


def launch_runs(script: str, world: int, args: list[str], launches: int) -> list[Any]:
    """``script`` run ``launches`` times as ``world`` fresh processes, one after another, each given ``--json
    PATH`` where its rank 0 writes what it measured; their JSON values, in launch order (a failed launch raises).

    Within one launch a benchmark's rounds interleave its contenders, which cancels the machine's drifts, but not
    what a launch fixes for its whole life (where each tensor landed, which core each process got): on a shared
    2-core machine the same contender's ratio moved by 5-10% from one launch to the next, so multi-process
    benchmarks report each launch's ratio and their median."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(launches):
            path = Path(tmp) / f"launch{i}.json"
            launch_self(script, world, [*args, "--json", str(path)], check=True)
            runs.append(json.loads(path.read_text()))
    return runs


def timed_block_cpu(fn: Callable[[], object], steps: int, warmup: int = 1) -> tuple[float, float]:
    """Seconds per step of ``steps`` steps as the slower process saw them (all start together), and the CPU
    seconds per step (every thread of the process: communication threads included) of the process that used the
    most, after ``warmup`` untimed steps: interleaved contenders share the caches, and the first step after a
    switch pays for the previous contender's working set (steady-state training never switches)."""
    dist.barrier()
    for _ in range(warmup):
        fn()
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    spent = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64) / steps
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return float(spent[0]), float(spent[1])


def turned(names: list[str], round_: int) -> list[str]:
    """The contenders' order in round ``round_``: turned by one place a round, so that over the rounds each takes
    every place in a round (as often, over a whole number of turns: :func:`whole_turns`). A place alone moved a
    step by a few percent here (graph_compare's fused and unfused GPT graphs, timed in both orders: 0.964 and
    1.031 of each other), so a fixed order favours some contender."""
    k = round_ % len(names)
    return names[k:] + names[:k]


def whole_turns(rounds: int, contenders: int) -> int:
    """``rounds`` rounded up to a multiple of ``contenders``."""
    return -(-rounds // contenders) * contenders


def publish(name: str, body: str, write: bool) -> None:
    """Prints a section's text and, with ``--write``, replaces section ``name`` of docs/benchmarks.md with it."""
    print(body)
    if write:
        write_section(name, body)


def run_or_launch(script: str, world: int, worker: Callable[[argparse.Namespace], None],
                  args: argparse.Namespace) -> int:
    """A multi-process benchmark's entry: a launched copy (``RANK`` set) runs ``worker``; the command the user
    typed relaunches ``script`` as ``world`` processes and returns their exit status."""
    if "RANK" in os.environ:
        worker(args)
        return 0
    return launch_self(script, world, sys.argv[1:], check=False).returncode


def rounds_main(script: str, world: int, doc: str, families: list[str],
                worker: Callable[[str, int, int, list[str]], None],
                report: Callable[[dict[str, Any], int, int], str], section: str, heading: str,
                tail: str = "") -> int:
    """Entry of a benchmark that times model families in interleaved rounds on ``world`` processes. A launched
    copy (``--worker PATH``) runs ``worker(PATH, rounds, steps, families)``, which writes the JSON result to
    PATH; the command the user typed launches them, prints ``report`` of the result and, with ``--write``,
    replaces section ``section`` of docs/benchmarks.md (``heading``, the report, ``tail``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--families", default=",".join(families))
    parser.add_argument("--worker", default=None)
    add_write_flag(parser)
    args = parser.parse_args()
    chosen = args.families.split(",")
    if args.worker is not None:
        worker(args.worker, args.rounds, args.steps, chosen)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        launch_self(script, world, ["--worker", out, "--rounds", str(args.rounds), "--steps", str(args.steps),
                                    "--families", args.families], check=True)
        result = json.loads(Path(out).read_text())
    body = report(result, args.rounds, args.steps)
    print(body)
    if args.write:
        write_section(section, f"{heading}\n\n{body}\n{tail}")
    return 0
