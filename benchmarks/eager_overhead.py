"""Eager overhead of sbpflow against plain torch, side by side in one run.

1. Per-op dispatch: the same op on the same shapes in torch, in sbpflow on local
   tensors, on a 1-rank placement and on 2 virtual ranks (batch split).
2. A training step of an MLP (width 1024, batch 64, 3 hidden layers, AdamW).

Run: ``.venv/bin/python benchmarks/eager_overhead.py`` (prints; ``--write`` replaces its section of
docs/benchmarks.md).
Timings interleave the contenders and report medians, so background load hits
all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _report import add_write_flag, machine, write_section

import sbpflow
from sbpflow import nn, optim
from sbpflow import sbp as S

torch.set_num_threads(1)


def timeit(fn: Callable[[], object], inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def interleaved(contenders: dict[str, Callable[[], object]], inner: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each contender, measured in alternating rounds."""
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for fn in contenders.values():
        timeit(fn, max(1, inner // 4))  # warm caches
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name].append(timeit(fn, inner))
    return {k: statistics.median(v) for k, v in samples.items()}


# -- 1. per-op dispatch -----------------------------------------------------------------------------

OPS: dict[str, Callable[..., object]] = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "relu": lambda a, b: a.relu(),
    "matmul": lambda a, b: a @ b,
    "sum(dim=1)": lambda a, b: a.sum(1),
    "transpose": lambda a, b: a.transpose(0, 1),
}


def op_rows(size: int, inner: int, rounds: int) -> list[str]:
    ta, tb = torch.randn(size, size), torch.randn(size, size)
    local = (sbpflow.tensor(ta), sbpflow.tensor(tb))
    p1 = sbpflow.placement("cpu", [0])
    one = (sbpflow.tensor(ta, placement=p1, sbp=S.split(0)), sbpflow.tensor(tb, placement=p1, sbp=S.broadcast))
    p2 = sbpflow.placement("cpu", [0, 1])
    two = (sbpflow.tensor(ta, placement=p2, sbp=S.split(0)), sbpflow.tensor(tb, placement=p2, sbp=S.broadcast))
    rows = []
    for name, f in OPS.items():
        t = interleaved({
            "torch": lambda f=f: f(ta, tb), "local": lambda f=f: f(*local), "1 rank": lambda f=f: f(*one),
            "2 ranks": lambda f=f: f(*two),
        }, inner, rounds)
        rows.append(
            f"| {name} | {size}x{size} | {t['torch'] * 1e6:.1f} | {t['local'] * 1e6:.1f} | {t['1 rank'] * 1e6:.1f} "
            f"| {t['2 ranks'] * 1e6:.1f} | {(t['1 rank'] - t['torch']) * 1e6:.1f} |"
        )
    return rows


# -- 2. MLP training step -------------------------------------------------------------------------


def torch_mlp(width: int, layers: int) -> Callable[[], object]:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(64, width), torch.randn(64, width)

    def step() -> object:
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    return step


def sbpflow_mlp(width: int, layers: int, placement: sbpflow.Placement | None) -> Callable[[], object]:
    sbpflow.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(width, width))
    x, y = sbpflow.randn(64, width), sbpflow.randn(64, width)
    if placement is not None:
        model.to_global(placement, S.broadcast)
        x = x.to_global(placement, S.broadcast).to_global(sbp=S.split(0))
        y = y.to_global(placement, S.broadcast).to_global(sbp=S.split(0))
    opt = optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> object:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    return step


def mlp_rows(rounds: int) -> tuple[list[str], float]:
    width, layers = 1024, 3
    t = interleaved({
        "torch": torch_mlp(width, layers),
        "local": sbpflow_mlp(width, layers, None),
        "1 rank": sbpflow_mlp(width, layers, sbpflow.placement("cpu", [0])),
        "2 ranks": sbpflow_mlp(width, layers, sbpflow.placement("cpu", [0, 1])),
    }, inner=5, rounds=rounds)
    rows = [f"| {k} | {v * 1e3:.2f} | {v / t['torch']:.3f} |" for k, v in t.items()]
    return rows, max(t["local"], t["1 rank"]) / t["torch"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    add_write_flag(parser)
    args = parser.parse_args()
    rows = op_rows(64, inner=200, rounds=args.rounds) + op_rows(512, inner=20, rounds=args.rounds)
    mlp, worst = mlp_rows(args.rounds)
    body = "\n".join([
        "## Eager overhead (issue 4)",
        "",
        f"`make bench` or `.venv/bin/python benchmarks/eager_overhead.py --write` on {machine()}. "
        "Medians of interleaved rounds.",
        "",
        "Per-op time in microseconds (2 ranks: both virtual ranks' kernels run in this process).",
        "",
        "| op | shape | torch | sbpflow local | sbpflow 1 rank | sbpflow 2 ranks | overhead 1 rank |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "MLP training step (width 1024, batch 64, 3 hidden layers, AdamW), ms per step:",
        "",
        "| contender | ms/step | vs torch |",
        "|---|---|---|",
        *mlp,
        "",
        f"Worst single-rank ratio: **{worst:.3f}x** (target: at most 1.15x).",
    ])
    print(body)
    if args.write:
        write_section("eager_overhead", body)


if __name__ == "__main__":
    main()
