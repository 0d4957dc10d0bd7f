"""Data loading overlapping compute: step time of nn.Graph fed by a DataLoader, with and without prefetch,
against torch's DataLoader (no workers, and one worker process prefetching) feeding the same step in torch.

The dataset's ``__getitem__`` costs some milliseconds of waiting (a read from a file or a network;
``time.sleep``, which frees the interpreter as I/O does), in two cases (:data:`CASES`): loading longer than
the step, and shorter. The step is an MLP training step (Adam) on 2 virtual ranks, data parallel (sbpflow),
and on one process (torch). Columns:

* load only: the loader alone (prefetch 0), the time a batch costs to read;
* compute only: the step on batches loaded beforehand;
* fed by the loader: ``graph.iterate(loader)`` with prefetch 0 (load, then compute) and prefetch 2 (the
  source actor loads the next batches while the step computes: ideally max(load, compute) per step).

Each variant runs ``--steps`` steps per round; rounds alternate between variants and the table reports medians
over rounds of the mean step time, steps 2.. of each round (the first batch of a run is never prefetched).

Run: ``.venv/bin/python benchmarks/data_prefetch.py`` (prints); ``--write`` also writes the "data_prefetch"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from _report import add_write_flag, machine, write_section

import sbpflow
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.utils.data import DataLoader, Dataset

torch.set_num_threads(1)
IN, OUT = 64, 8
THREADS = 4  # sbpflow's read_threads and torch's num_workers in the parallel-read columns


class SlowRows(Dataset):
    """Fixed random rows; each read waits ``ms`` milliseconds."""

    def __init__(self, n: int, ms: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)
        self.seconds = ms / 1e3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.seconds)
        return self.x[i], self.y[i]


def sbpflow_step(width: int) -> nn.Graph:
    p = sbpflow.placement("cpu", [0, 1])
    sbpflow.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, OUT)).to_global(p, S.broadcast)
    opt = sbpflow.optim.Adam(model.parameters(), lr=1e-3)

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)

        def build(self, x: Any, y: Any) -> Any:
            loss = (self.model(x) - y).square().mean()
            loss.backward()
            return loss

    return Step()


def torch_step(width: int) -> Callable[[torch.Tensor, torch.Tensor], float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, OUT))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def per_step(batches: Iterable[Any], run: Callable[[Any], Any]) -> float:
    """Mean seconds per step after the first (which includes the unprefetched first load)."""
    start = 0.0
    count = -1
    for batch in batches:
        run(batch)
        count += 1
        if count == 0:
            start = time.perf_counter()
    return (time.perf_counter() - start) / max(count, 1)


def variants(args: argparse.Namespace) -> dict[str, Callable[[], float]]:
    ds = SlowRows(args.batch * args.steps, args.sample_ms)
    p = sbpflow.placement("cpu", [0, 1])
    graph, tstep = sbpflow_step(args.width), torch_step(args.width)
    loaders = {k: DataLoader(ds, args.batch, placement=p, prefetch=k) for k in (0, 2)}
    loaders[-1] = DataLoader(ds, args.batch, placement=p, prefetch=2, read_threads=THREADS)
    preloaded = [loaders[0].load(0, i) for i in range(len(loaders[0]))]
    torch_preloaded = [(ds.x[i:i + args.batch], ds.y[i:i + args.batch]) for i in range(0, len(ds), args.batch)]
    torch_plain = torch.utils.data.DataLoader(ds, args.batch)
    torch_worker = torch.utils.data.DataLoader(ds, args.batch, num_workers=1, prefetch_factor=2,
                                               persistent_workers=True)
    torch_workers = torch.utils.data.DataLoader(ds, args.batch, num_workers=THREADS, prefetch_factor=2,
                                                persistent_workers=True)

    def fed(k: int) -> float:
        loader = loaders[k]
        loader.load_state_dict({"epoch": 0, "index": 0})
        return per_step(graph.iterate(loader), lambda loss: loss)

    return {
        "sbpflow load only": lambda: per_step(loaders[0].batches(), lambda b: b),
        "sbpflow compute only": lambda: per_step(preloaded, lambda b: graph(*b)),
        "sbpflow graph.iterate, prefetch 0": lambda: fed(0),
        "sbpflow graph.iterate, prefetch 2": lambda: fed(2),
        "sbpflow graph.iterate, prefetch 2, read threads": lambda: fed(-1),
        "torch compute only": lambda: per_step(torch_preloaded, lambda b: tstep(*b)),
        "torch DataLoader, 0 workers": lambda: per_step(torch_plain, lambda b: tstep(*b)),
        "torch DataLoader, 1 worker, prefetch 2": lambda: per_step(torch_worker, lambda b: tstep(*b)),
        "torch DataLoader, workers": lambda: per_step(torch_workers, lambda b: tstep(*b)),
    }


def measure(args: argparse.Namespace) -> dict[str, float]:
    runs = variants(args)
    for fn in runs.values():  # warm-up: compiles, dispatch caches, the torch worker process
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


CASES = [(4.0, 8), (1.0, 16)]  # (ms a sample, samples a batch): loading dominates; loading < compute
COLUMNS = ["sbpflow load only", "sbpflow compute only", "sbpflow graph.iterate, prefetch 0",
           "sbpflow graph.iterate, prefetch 2", "sbpflow graph.iterate, prefetch 2, read threads",
           "torch compute only", "torch DataLoader, 0 workers", "torch DataLoader, 1 worker, prefetch 2",
           "torch DataLoader, workers"]


def table(args: argparse.Namespace, rows: list[tuple[float, int, dict[str, float]]]) -> str:
    lines = [f"`.venv/bin/python benchmarks/data_prefetch.py --write` on {machine()}. A sample costs the given ms "
             "of waiting (`time.sleep`, standing for a file or network read); the step is an MLP (width "
             f"{args.width}, Adam) on 2 virtual ranks (sbpflow, data parallel) or one process (torch). ms per step, "
             f"medians over {args.rounds} interleaved rounds of {args.steps} steps (steps 2.. of each). With "
             "prefetch the ideal is max(load, compute) per step.", "",
             "| ms/sample x batch | load only | compute only | iterate, prefetch 0 | iterate, prefetch 2 | ideal "
             "max(load, compute) | prefetch 2 / prefetch 0 | iterate, prefetch 2, "
             f"{THREADS} read threads | torch compute only | torch DataLoader, 0 workers | torch DataLoader, 1 "
             f"worker (prefetch 2) | torch DataLoader, {THREADS} workers |", "|" + "---|" * 12]
    for ms, batch, m in rows:
        v = [m[c] * 1e3 for c in COLUMNS]
        lines.append(f"| {ms:g} x {batch} | {v[0]:.1f} | {v[1]:.1f} | {v[2]:.1f} | {v[3]:.1f} | {max(v[0], v[1]):.1f} "
                     f"| {v[3] / v[2]:.2f}x | {v[4]:.1f} | {v[5]:.1f} | {v[6]:.1f} | {v[7]:.1f} | {v[8]:.1f} |")
    lines += ["", "Read the prefetch columns against prefetch 0 in the same row. The source actor is a thread: the "
                  "sleeping reads overlap the step, but each read's wake-up waits for the interpreter while the "
                  "step's Python runs (up to the 5 ms switch interval), so prefetch alone stays above max(load, "
                  "compute); torch's workers are processes and do not share the interpreter. With `read_threads` "
                  "the reads of a batch wait together and that latency mostly goes. On a machine shared with other "
                  "jobs a loop that only computes gets a smaller share of the cores than one that also waits, so "
                  "the compute-only columns (and the ideal) can come out above the fed runs of the same row. The "
                  "timeline (`SBPFLOW_TRACE`) shows the lane `cpu/source:loader` loading batch t+1 while step t's "
                  "actors compute; tests/sim/test_data_loader.py asserts that overlap from the trace events."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=9)
    add_write_flag(parser)
    args = parser.parse_args()
    rows = []
    for ms, batch in CASES:
        args.sample_ms, args.batch = ms, batch
        rows.append((ms, batch, measure(args)))
    text = table(args, rows)
    print(text)
    if args.write:
        write_section("data_prefetch", "## Data loading overlapping compute (issue 9)\n\n" + text)


if __name__ == "__main__":
    main()
