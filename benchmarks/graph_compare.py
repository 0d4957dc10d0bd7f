"""Compiled steps (nn.Graph) against torch eager on one rank, and compile time per pass (issue 8).

    .venv/bin/python benchmarks/graph_compare.py            # prints
    .venv/bin/python benchmarks/graph_compare.py --write    # and writes the "graph" section of docs/benchmarks.md
    .venv/bin/python benchmarks/graph_compare.py --compile-only --write    # re-measures the compile table only

One torch thread; contenders run interleaved, medians of rounds. The GPT is the issue's (4 layers, width 256,
sequence 128, batch 8, AdamW, clipping 1.0, no dropout); torch runs the same model (benchmarks/_torch_gpt.py's
TorchGPT) from the same weights. The MLP is issue 4's (width 1024, 3 hidden layers, batch 64, MSE, AdamW, as in
benchmarks/eager_overhead.py), on one rank.

Compile times: each compile runs in a fresh process (cold planner and candidate caches, imports done), repeated,
medians. Per pass the wall clock and, in total, the CPU time of the process: on a machine shared with other
jobs the wall clock waits for a core, CPU time does not. ``ilp-unmerged`` rows give every node its own
variables (the selection before repeated layers were tied), measured in the same run at the depths of
``--unmerged-layers`` (24 by default).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _report import DOC, machine, turned, whole_turns, write_section  # noqa: E402
from _torch_gpt import TorchGPT, adamw, copy_weights  # noqa: E402

import sbpflow  # noqa: E402
from sbpflow import nn, optim  # noqa: E402
from sbpflow import sbp as S  # noqa: E402
from sbpflow.demo.train_gpt import build  # noqa: E402
from sbpflow.models.gpt import GPTConfig  # noqa: E402

GPT = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.0)
BATCH = 8
MLP_WIDTH, MLP_LAYERS, MLP_BATCH = 1024, 3, 64


def _data(cfg: GPTConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(batch, cfg.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def sbpflow_step(graph: bool, executor: str = "actors", fused: bool = False,
                 torch_compile: bool = False) -> Callable[[], float]:
    """The GPT step: eager, or compiled (``fused``: with fused segments, under torch.compile if asked)."""
    trainer = build(GPT, "dp=1", graph=graph, executor=executor)
    if trainer.graph is not None:
        trainer.graph.config.enable_fused_segments(fused, torch_compile=torch_compile)
    ids, targets = _data(GPT, BATCH)
    trainer.step(ids, targets)  # compile, fill caches and optimizer state
    return lambda: trainer.step(ids, targets)


def torch_step() -> Callable[[], float]:
    reference = build(GPT, "dp=1").model
    model = TorchGPT(GPT)
    copy_weights(reference, model)
    params = list(model.parameters())
    opt = adamw(params, lr=1e-3)
    ids, targets = (torch.from_numpy(a) for a in _data(GPT, BATCH))

    def step() -> float:
        loss = model(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.detach())

    step()
    return step


def _mlp_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(MLP_BATCH, MLP_WIDTH, generator=g), torch.randn(MLP_BATCH, MLP_WIDTH, generator=g)


def _sbpflow_mlp() -> nn.Module:
    sbpflow.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(MLP_LAYERS):
        mods += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(MLP_WIDTH, MLP_WIDTH)).to_global(sbpflow.placement("cpu", [0]),
                                                                            S.broadcast)


class _MLPStep(nn.Graph):
    def __init__(self, model: nn.Module, opt: optim.Optimizer, executor: str, fused: bool = False,
                 torch_compile: bool = False) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_executor(executor)
        self.config.enable_fused_segments(fused, torch_compile=torch_compile)

    def build(self, x: sbpflow.Tensor, y: sbpflow.Tensor) -> sbpflow.Tensor:
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss


def sbpflow_mlp_step(executor: str | None, fused: bool = False, torch_compile: bool = False) -> Callable[[], float]:
    """The MLP on one rank (parameters B on [0]): eager steps (``executor`` None) or a compiled one (``fused``:
    with fused segments, under torch.compile if asked)."""
    model = _sbpflow_mlp()
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    place = sbpflow.placement("cpu", [0])
    x, y = (sbpflow.tensor(t, placement=place, sbp=S.broadcast) for t in _mlp_data())
    if executor is not None:
        graph = _MLPStep(model, opt, executor, fused, torch_compile)
        graph(x, y)
        return lambda: float(graph(x, y).item())

    def step() -> float:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return float(loss.item())

    step()
    return step


def torch_mlp_step() -> Callable[[], float]:
    mods: list[torch.nn.Module] = []
    for _ in range(MLP_LAYERS):
        mods += [torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(MLP_WIDTH, MLP_WIDTH))
    copy_weights(_sbpflow_mlp(), model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # the kernel sbpflow's AdamW runs
    x, y = _mlp_data()

    def step() -> float:
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    step()
    return step


Timing = tuple[float, float, float, float]  # median wall s, median CPU s, and their medians of per-round ratios


def interleaved(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, Timing]:
    """Per contender: median wall and CPU seconds per step, and the medians over rounds of its wall and CPU time
    over the first contender's (torch eager's) in the same round; rounds interleave the contenders, so a round's
    ratio cancels the machine's slower drifts. CPU time is this process's (one torch thread; the actor runtime
    acts in the caller's thread on virtual ranks): on a shared machine it leaves out the time other jobs held
    the cores. Each timed step follows an untimed one of the same contender: the first step after a switch pays
    for the previous contender's working set in the caches, which steady-state training never does. The order
    turns each round (:func:`_report.turned`; callers give whole turns)."""
    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(rounds):
        for name in turned(list(contenders), r):
            fn = contenders[name]
            fn()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    first = next(iter(contenders))

    def ratio(samples: dict[str, list[float]], k: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[k], samples[first], strict=True))

    return {k: (statistics.median(wall[k]), statistics.median(cpu[k]), ratio(wall, k), ratio(cpu, k))
            for k in contenders}


PASSES = ("trace", "sbp selection", "lowering", "verify")


def compile_once(n_layer: int, spec: str, method: str) -> dict[str, Any]:
    """One compile of the benchmark GPT in this process: per-pass seconds and the selection's figures."""
    cfg = GPTConfig(vocab_size=100, block_size=32, n_layer=n_layer, n_head=4, n_embd=64, dropout=0.0)
    trainer = build(cfg, spec, graph=True, executor="inorder")
    trainer.graph.config.set_sbp_selection(method)
    ids, targets = _data(cfg, 8)
    trainer.step(ids, targets)
    report = trainer.graph._compiled().report
    sel = report.selection
    return {"times": report.times, "cpu": sum(report.cpu_times.values()), "logical": report.logical_nodes,
            "physical": report.physical_nodes, "classes": sel.classes, "variables": sel.variables,
            "vs_greedy": sel.chosen_cost / sel.greedy_cost}


def compile_row(n_layer: int, spec: str, method: str, repeats: int) -> str:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, __file__, "--one", f"{n_layer}:{spec}:{method}"], check=True,
                             capture_output=True, text=True, timeout=900)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    times = {k: statistics.median(r["times"][k] for r in runs) for k in runs[0]["times"]}
    first = runs[0]
    passes = " | ".join(f"{times[k]:.2f}" for k in PASSES)
    return (f"| {n_layer} | {spec} | {method} | {first['logical']} | {first['physical']} | {first['classes']} | "
            f"{first['variables']} | {passes} | {sum(times.values()):.2f} | "
            f"{statistics.median(r['cpu'] for r in runs):.2f} | {first['vs_greedy']:.3f} |")


def compile_table(layers: list[int], repeats: int, unmerged: list[int]) -> list[str]:
    lines = ["| layers | strategy | selection | logical nodes | physical nodes | ILP classes | ILP variables | "
             "trace | sbp selection | lowering | verify | total (wall) | total (CPU) | cost vs greedy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n_layer in layers:
        for spec in ("dp=2", "dp=2,tp=2"):
            lines.append(compile_row(n_layer, spec, "ilp", repeats))
    for n_layer in unmerged:  # the per-node program, for comparison (slow: once)
        for spec in ("dp=2", "dp=2,tp=2"):
            lines.append(compile_row(n_layer, spec, "ilp-unmerged", 1))
    return lines


HEADER = ["| contender | ms/step (wall) | vs torch eager (median of per-round ratios) | CPU ms/step | vs torch eager "
          "(CPU, same) |",
          "|---|---|---|---|---|"]


def _rows(medians: dict[str, Timing]) -> list[str]:
    return [f"| {k} | {w * 1e3:.1f} | {rw:.3f} | {c * 1e3:.1f} | {rc:.3f} |" for k, (w, c, rw, rc) in medians.items()]


def kept_step_lines() -> list[str]:
    """The step-time part of the written section, as last measured (``--compile-only`` keeps it)."""
    text = DOC.read_text() if DOC.exists() else ""
    found = re.search(r"<!-- graph:start -->\n## [^\n]*\n\n(.*?)(\n\n\(Step times as last measured[^\n]*)?"
                      r"\n\nCompile time", text, flags=re.S)
    if found is None:
        return ["(step times not measured yet: run without --compile-only)"]
    return found.group(1).split("\n")


def kept_compile_lines() -> list[str]:
    """The compile-table part of the written section, as last measured (``--steps-only`` keeps it)."""
    text = DOC.read_text() if DOC.exists() else ""
    found = re.search(r"<!-- graph:start -->.*?(\n\nCompile time.*?)\n<!-- graph:end -->", text, flags=re.S)
    if found is None:
        return ["", "(compile table not measured yet: run without --steps-only)"]
    return found.group(1).split("\n")


FUSED = "sbpflow graph, fused segments"
COMPILED = "sbpflow graph, fused segments + torch.compile"


def step_lines(rounds: int, torch_compile: bool = False) -> list[str]:
    """The step tables; ``torch_compile`` adds the contenders whose segments run under torch.compile (they
    compile for tens of seconds before the rounds)."""
    gpt_steps = {"torch eager": torch_step(), "sbpflow eager (1 rank)": sbpflow_step(False),
                 "sbpflow graph, actor runtime": sbpflow_step(True, "actors"),
                 "sbpflow graph, in-order executor": sbpflow_step(True, "inorder"),
                 FUSED: sbpflow_step(True, "actors", fused=True)}
    mlp_steps = {"torch eager": torch_mlp_step(), "sbpflow eager (1 rank)": sbpflow_mlp_step(None),
                 "sbpflow graph, actor runtime": sbpflow_mlp_step("actors"),
                 "sbpflow graph, in-order executor": sbpflow_mlp_step("inorder"),
                 FUSED: sbpflow_mlp_step("actors", fused=True)}
    if torch_compile:
        gpt_steps[COMPILED] = sbpflow_step(True, "actors", fused=True, torch_compile=True)
        mlp_steps[COMPILED] = sbpflow_mlp_step("actors", fused=True, torch_compile=True)
    gpt_rounds, mlp_rounds = whole_turns(rounds, len(gpt_steps)), whole_turns(rounds * 3, len(mlp_steps))
    gpt = interleaved(gpt_steps, gpt_rounds)
    mlp = interleaved(mlp_steps, mlp_rounds)
    lines = [
        f"`.venv/bin/python benchmarks/graph_compare.py --write` on {machine()}; medians of {gpt_rounds} "
        "interleaved rounds (the contenders' order turned by one each round), each timed step after an untimed "
        "one of the same contender. Wall times carry the "
        "waits for the shared cores; the CPU columns (this process's CPU "
        "time) leave them out, so on a loaded machine their ratios are the steadier ones. Fused segments "
        "(`config.enable_fused_segments`, on by default): each run of compute nodes one node of generated Python "
        "(sbpflow.graph.fuse), on the actor runtime; the sbpflow graph contenders without the words turn them "
        "off.",
        "",
        f"GPT step on one rank ({GPT.n_layer} layers, width {GPT.n_embd}, sequence {GPT.block_size}, batch {BATCH}, "
        "AdamW, clipping):",
        "",
        *HEADER,
    ]
    lines += _rows(gpt)
    lines += ["", f"MLP step on one rank (width {MLP_WIDTH}, {MLP_LAYERS} hidden layers, batch {MLP_BATCH}, MSE, "
              f"AdamW; {mlp_rounds} rounds):", "", *HEADER]
    return lines + _rows(mlp)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", default="2,4,12,24", help="GPT depths for the compile-time table")
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process compiles per compile-table row")
    parser.add_argument("--unmerged-layers", default="24",
                        help="GPT depths for the ilp-unmerged rows (one compile each; empty for none): about 1 s and "
                             "3.5 s at 24 layers, but minutes where the overlap of gradient all-reduces with backward "
                             "binds (slow links): the program is then a knapsack over every layer's choices")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time fused segments under torch.compile (tens of seconds of compiling first)")
    parser.add_argument("--compile-only", action="store_true",
                        help="measure only the compile table; a written section keeps the step times it had")
    parser.add_argument("--steps-only", action="store_true",
                        help="measure only the step tables; a written section keeps the compile table it had")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # LAYERS:SPEC:METHOD, one compile, JSON out
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        n_layer, spec, method = args.one.split(":")
        print(json.dumps(compile_once(int(n_layer), spec, method)))
        return
    lines = ["## Compiled steps (nn.Graph, issue 8)", ""]
    lines += kept_step_lines() if args.compile_only else step_lines(args.rounds, args.torch_compile)
    if args.compile_only:
        lines += ["", "(Step times as last measured by a full run; the compile table below was re-measured alone.)"]
    if args.steps_only:
        lines += kept_compile_lines()
        return finish(lines, args.write)
    lines += ["", "Compile time per pass in seconds (GPT width 64, sequence 32, AdamW and clipping in the graph), "
              f"measured on {machine()}: each compile in a fresh process, medians of {args.repeats} "
              "(the per-node rows: one). Passes and total in wall-clock seconds; total (CPU): the process's CPU "
              "seconds, what the wall clock would read on an idle core. ILP classes: the op nodes' classes after "
              "tying repeated layers (the program's choices); cost vs greedy: the selected plan's estimated step "
              "time over the greedy (traced) plan's.", ""]
    unmerged = [int(x) for x in args.unmerged_layers.split(",") if x]
    lines += compile_table([int(x) for x in args.layers.split(",")], args.repeats, unmerged)
    finish(lines, args.write)


def finish(lines: list[str], write: bool) -> None:
    text = "\n".join(lines)
    print(text)
    if write:
        write_section("graph", text)


if __name__ == "__main__":
    main()
