"""A GPT training step on one device: sbpflow against plain torch, side by side in one process.

Run: ``.venv/bin/python benchmarks/gpt_step.py`` (prints; ``--write`` replaces the "gpt_step" section of
docs/benchmarks.md; ``--count`` also prints the ops one sbpflow step dispatches).

Both contenders train the same model (sbpflow.models.gpt.GPT, and its torch twin with the same weights) on
the same tokens, with AdamW (weight decay on matrices) and gradient clipping at 1.0, one torch thread.
sbpflow runs on local tensors (no placement) and on a 1-rank placement (``dp=1``: global tensors, SBP
dispatch). Timed rounds interleave the contenders; the table gives medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _report import add_write_flag, machine, write_section
from _torch_gpt import tokens, torch_step

import sbpflow
from sbpflow.demo.train_gpt import build
from sbpflow.models.gpt import GPTConfig
from sbpflow.ops import schema

torch.set_num_threads(1)

LR = 3e-4
SIZES = {  # name -> (config, batch)
    "GPT 4x256, 128 tokens, batch 8": (GPTConfig(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=256,
                                                 dropout=0.0), 8),
    "tiny GPT 2x64, 32 tokens, batch 4": (GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64,
                                                    dropout=0.0), 4),
}


def sbpflow_step(cfg: GPTConfig, batch: int, strategy: str | None) -> tuple[Callable[[], float], Any]:
    trainer = build(cfg, strategy, lr=LR)
    ids, targets = trainer.inputs(*tokens(cfg, batch))
    params = list(trainer.model.parameters())  # listed once, as the torch contender does

    def step() -> float:
        _, loss = trainer.model(ids, targets)
        trainer.optimizer.zero_grad()
        loss.backward()
        sbpflow.nn.utils.clip_grad_norm_(params, 1.0)
        trainer.optimizer.step()
        return loss  # type: ignore[no-any-return]  # read outside the timed loop

    return step, trainer.model


def interleaved(contenders: dict[str, Callable[[], object]], inner: int,
                rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per step of each contender, in alternating rounds of ``inner`` steps: wall time, and this
    thread's CPU time (``time.thread_time``), which time slices lost to other jobs on a shared machine do not
    inflate (they inflate long steps more than short ones, so wall-time ratios drift up under load)."""
    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(inner):
                fn()
            wall[name].append((time.perf_counter() - start) / inner)
            cpu[name].append((time.thread_time() - start_cpu) / inner)
    return ({k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()})


def measure(name: str, cfg: GPTConfig, batch: int, rounds: int,
            show_counts: bool) -> tuple[str, dict[str, float], dict[str, float], str]:
    local, model = sbpflow_step(cfg, batch, None)
    one_rank, _ = sbpflow_step(cfg, batch, "dp=1")
    contenders: dict[str, Callable[[], object]] = {
        "torch": torch_step(cfg, batch, model, LR), "sbpflow local": local, "sbpflow 1 rank": one_rank}
    first = {k: float(fn().item()) for k, fn in contenders.items()}  # type: ignore[attr-defined]
    for fn in contenders.values():  # warm the dispatch caches
        fn()
    with schema.counting() as counts:
        local()
    top = ", ".join(f"{op} {n}" for op, n in counts.most_common(6))
    dispatches = f"{name}: {sum(counts.values())} sbpflow dispatches per step ({top}, ...)"
    if show_counts:
        print(f"{name}: {sum(counts.values())} sbpflow dispatches per step: {dict(counts.most_common())}")
    inner = 3 if cfg.n_embd >= 256 else 10
    t, cpu = interleaved(contenders, inner, rounds)
    rows = [f"| {name} | {who} | {s * 1e3:.2f} | {s / t['torch']:.3f} | {cpu[who] * 1e3:.2f} | "
            f"{cpu[who] / cpu['torch']:.3f} | {first[who]:.5f} |" for who, s in t.items()]
    return "\n".join(rows), t, cpu, dispatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds (default 9)")
    parser.add_argument("--count", action="store_true", help="print the ops one sbpflow step dispatches")
    add_write_flag(parser)
    args = parser.parse_args()
    rows, ratios, cpu_ratios, dispatches = [], {}, {}, []
    for name, (cfg, batch) in SIZES.items():
        table, t, cpu, ops = measure(name, cfg, batch, args.rounds, args.count)
        rows.append(table)
        dispatches.append(f"* {ops}")
        ratios[name] = max(t["sbpflow local"], t["sbpflow 1 rank"]) / t["torch"]
        cpu_ratios[name] = max(cpu["sbpflow local"], cpu["sbpflow 1 rank"]) / cpu["torch"]
    big, tiny = list(SIZES)
    body = "\n".join([
        "## GPT training step on one device (issue 14)",
        "",
        f"`.venv/bin/python benchmarks/gpt_step.py --write` on {machine()}. Forward, backward, clipping at 1.0 "
        f"and AdamW; {args.rounds} interleaved rounds, medians. *sbpflow local*: no placement; *sbpflow 1 "
        "rank*: global tensors on a 1-rank placement (`dp=1`).",
        "",
        "Wall: ms per step; CPU: this thread's CPU time per step (`time.thread_time`), which is not inflated "
        "by time slices other jobs take on a shared machine.",
        "",
        "| model | contender | wall ms/step | wall vs torch | CPU ms/step | CPU vs torch | first loss |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Worst ratio, {big}: **{ratios[big]:.3f}x** wall, **{cpu_ratios[big]:.3f}x** CPU (target: at most "
        f"1.05x); {tiny}: **{ratios[tiny]:.3f}x** wall, **{cpu_ratios[tiny]:.3f}x** CPU.",
        "",
        "Ops dispatched per training step (forward, backward and clipping; the optimizer runs torch's fused "
        "AdamW kernel on shards):",
        "",
        *dispatches,
    ])
    print(body)
    if args.write:
        write_section("gpt_step", body)


if __name__ == "__main__":
    main()
