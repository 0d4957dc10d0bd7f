"""Per-op eager overhead on 2 processes: sbpflow against torch DTensor, with plain torch as the floor.

Run: ``.venv/bin/python benchmarks/ops_2proc.py`` (spawns its own 2 processes with ``sbpflow launch``;
prints, and ``--write`` replaces the "ops_2proc" section of docs/benchmarks.md).

Each op runs on a logical (n, n) tensor split on rows over 2 processes (``S(0)``, DTensor's ``Shard(0)``),
with a broadcast (``B``, ``Replicate()``) second operand where there is one, so that no op needs
communication: what is measured is dispatch. *torch* runs the same op on one process's shard, the work
each process really does. Rounds alternate the contenders; a round's time is the slower process's, and
the table gives medians. sbpflow's communication is recorded and must be empty.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _report import machine, publish, run_or_launch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import record

WORLD = 2
OPS: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "relu": lambda a, b: a.relu(),
    "matmul": lambda a, b: a @ b,
    "sum(dim=1)": lambda a, b: a.sum(1),
    "transpose": lambda a, b: a.transpose(0, 1),
}


def slowest(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call of ``fn`` as the slower process saw them (both start together)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / inner], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def contenders(n: int, mesh: Any) -> dict[str, tuple[tuple[Any, Any], tuple[Any, Any]]]:
    """Per contender: (operands of the elementwise and reduction ops, operands of matmul)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    rank = dist.get_rank()
    place = sbpflow.placement("cpu", list(range(WORLD)))
    ours = (sbpflow.tensor(a, placement=place, sbp=S.split(0)), sbpflow.tensor(b, placement=place, sbp=S.broadcast))
    theirs = (distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()]))
    local = (a.chunk(WORLD)[rank], b.chunk(WORLD)[rank])  # the same shapes as one process's shards
    return {"torch": (local, (local[0], b)), "sbpflow": (ours, ours), "DTensor": (theirs, theirs)}


def op_rows(n: int, mesh: Any, inner: int, rounds: int) -> tuple[list[str], dict[str, dict[str, int]]]:
    operands = contenders(n, mesh)
    rows, comm = [], {}
    for name, f in OPS.items():
        calls = {who: (lambda f=f, ab=(mm if name == "matmul" else ew): f(*ab))
                 for who, (ew, mm) in operands.items()}
        for call in calls.values():  # warm caches
            call()
        with record() as log:
            out = calls["sbpflow"]()
        comm[name] = log.counts()
        _check_same(out, calls["DTensor"](), name)
        samples: dict[str, list[float]] = {who: [] for who in calls}
        for _ in range(rounds):
            for who, call in calls.items():
                samples[who].append(slowest(call, inner))
        t = {who: statistics.median(s) * 1e6 for who, s in samples.items()}
        rows.append(f"| {name} | {n}x{n} | {t['torch']:.1f} | {t['sbpflow']:.1f} | {t['DTensor']:.1f} | "
                    f"{t['sbpflow'] - t['torch']:.1f} | {t['DTensor'] - t['torch']:.1f} | "
                    f"{t['sbpflow'] / t['DTensor']:.2f} |")
    return rows, comm


def _check_same(ours: Any, theirs: DTensor, name: str) -> None:
    """Both contenders compute the same logical result (outside timing)."""
    want = theirs.full_tensor()
    got = torch.from_numpy(ours.numpy())
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise AssertionError(f"{name}: sbpflow and DTensor disagree")


def report(rows: list[str], comm: dict[str, dict[str, int]], rounds: int) -> str:
    return "\n".join([
        "## Per-op overhead on 2 processes: sbpflow vs DTensor (issue 14)",
        "",
        f"`.venv/bin/python benchmarks/ops_2proc.py --write` on {machine(threads=1, processes=WORLD)}: "
        "2 processes (`sbpflow launch -n 2`, gloo), a logical (n, n) operand split on rows (`S(0)` / "
        "`Shard(0)`) and a broadcast one (`B` / `Replicate()`): no op communicates. *torch*: the same op on one "
        f"process's shard. Microseconds per call, medians of {rounds} interleaved rounds, slower process.",
        "",
        "| op | logical shape | torch (shard) | sbpflow | DTensor | sbpflow overhead | DTensor overhead | "
        "sbpflow / DTensor |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"sbpflow collectives per op: {comm}.",
    ])


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    sbpflow.distributed.init()
    mesh = init_device_mesh("cpu", (WORLD,))
    rows, comm = op_rows(64, mesh, inner=200, rounds=args.rounds)
    big, _ = op_rows(512, mesh, inner=20, rounds=args.rounds)
    if dist.get_rank() == 0:
        body = report(rows + big, comm, args.rounds)
        publish("ops_2proc", body, args.write)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds (default 9)")
    parser.add_argument("--write", action="store_true", help="replace the ops_2proc section of docs/benchmarks.md")
    return run_or_launch(__file__, WORLD, worker, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
