"""Compile time at scale (issue 8): a GPT-3-175B-shaped training step compiled metadata-only for 1024 ranks.

    .venv/bin/python benchmarks/compile_scale.py            # prints
    .venv/bin/python benchmarks/compile_scale.py --write    # and writes its section of docs/benchmarks.md

The model is built under ``sbpflow.meta_init()`` (96 layers, width 12288, 96 heads, sequence 2048, vocabulary
51200: 175 billion parameters, 700 GB in fp32, none of it allocated), laid out TP8 x PP16 x DP8 (1024 virtual
ranks, each stage a (data, tensor) mesh of 64 ranks) by ``models.gpt.parallelize``, and its training step
(forward, backward, clipping 1.0, AdamW) is compiled by ``nn.Graph.compile_only`` for micro-batches of one
sequence per data-parallel rank. Every pass runs as in a real compile: trace, dead code, SBP selection,
lowering, pipeline schedule, verifier (every process group's collective sequence) and memory plan (every rank).

Each depth runs in a fresh process, so that caches and peak RSS belong to it alone. There is no torch peer for
compiling a graph; figures are wall seconds, with the process's CPU seconds beside them (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _report import add_write_flag, machine, write_section  # noqa: E402

PASSES = ("trace", "dead code", "sbp selection", "lowering", "pipeline", "verify", "memory plan")
GPT3 = {"vocab_size": 51200, "block_size": 2048, "n_head": 96, "n_embd": 12288, "dropout": 0.0}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def compile_once(layers: int, data: int, tensor: int, pipeline: int, micro_batches: int,
                 selection: str) -> dict[str, Any]:
    """Builds the meta GPT and compiles its step; returns times per pass, sizes and peak RSS (this process)."""
    import torch

    import sbpflow
    from sbpflow.demo.train_gpt import TrainStep
    from sbpflow.models.gpt import GPT, GPTConfig, parallelize

    torch.set_num_threads(1)
    rss_before = _rss_mb()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with sbpflow.meta_init():
        model = GPT(GPTConfig(n_layer=layers, **GPT3))
    strategy = parallelize(model, data=data, tensor=tensor, pipeline=pipeline)
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    step = TrainStep(model, opt, 1.0, micro_batches=micro_batches, executor="inorder")
    step.config.set_sbp_selection(selection)
    batch = data * micro_batches  # one sequence per data-parallel rank and micro-batch
    ids = sbpflow.meta_tensor(batch, GPT3["block_size"], dtype=torch.int64, placement=strategy.stages[0],
                              sbp=strategy.input_sbp)
    targets = sbpflow.meta_tensor(batch, GPT3["block_size"], dtype=torch.int64, placement=strategy.stages[-1],
                                  sbp=strategy.input_sbp)
    build_s = time.perf_counter() - wall0
    compiled = step.compile_only(ids, targets)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    start = time.perf_counter()
    program = compiled.plan.for_rank(0)
    per_rank_s = time.perf_counter() - start
    report = compiled.report
    return {
        "layers": layers, "ranks": len(compiled.plan.world), "build": build_s, "wall": wall, "cpu": cpu,
        "times": {k: report.times.get(k, 0.0) for k in PASSES}, "logical": report.logical_nodes,
        "physical": report.physical_nodes, "rank0_nodes": len(program), "rank0_s": per_rank_s,
        "rank0_collectives": len(compiled.plan.collectives(0)),
        "params": sum(p.numel() for p in model.parameters()),
        "peak_gb": max(compiled.plan.peak_bytes.values()) / 1e9,
        "rss_before": rss_before, "rss_peak": _rss_mb(),
        "selection": report.selection.method if report.selection else "",
    }


def run_fresh(layers: int, selection: str, args: argparse.Namespace) -> dict[str, Any]:
    """``compile_once`` in a fresh interpreter (its own caches and peak RSS); a run past ``--timeout`` is a row
    that says so."""
    try:
        out = subprocess.run([sys.executable, __file__, "--child", str(layers), "--tp", str(args.tp), "--pp",
                              str(args.pp), "--dp", str(args.dp), "--micro-batches", str(args.micro_batches),
                              "--selection", selection],
                             check=True, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "selection": selection, "timeout": args.timeout}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| layers | ranks | selection | logical nodes | physical nodes | build | "
             + " | ".join(PASSES) + " | total (wall) | CPU | peak RSS (before) | rank 0: nodes, collectives |",
             "|" + "---|" * (10 + len(PASSES))]
    for r in rows:
        if "timeout" in r:
            lines.append(f"| {r['layers']} | | {r['selection']} | did not finish within {r['timeout']} s |")
            continue
        passes = " | ".join(f"{r['times'][k]:.2f}" for k in PASSES)
        lines.append(f"| {r['layers']} | {r['ranks']} | {r['selection']} | {r['logical']} | {r['physical']} | "
                     f"{r['build']:.2f} | "
                     f"{passes} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['rss_peak']:.0f} MB ({r['rss_before']:.0f}) "
                     f"| {r['rank0_nodes']}, {r['rank0_collectives']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    add_write_flag(parser)
    parser.add_argument("--layers", default="96", help="GPT depths to compile (comma separated)")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--selection", default="ilp,greedy", help="SBP selection methods (nn.Graph config)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per compile")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(compile_once(args.child, args.dp, args.tp, args.pp, args.micro_batches, args.selection)))
        return
    rows = [run_fresh(int(n), sel, args) for n in args.layers.split(",") for sel in args.selection.split(",")]
    last = next(r for r in reversed(rows) if "timeout" not in r)
    text = "\n".join([
        "## Compile time at scale: GPT-3 175B shape, 1024 virtual ranks (issue 8)",
        "",
        f"`.venv/bin/python benchmarks/compile_scale.py --write` on {machine()}; one run per depth and method, each "
        "in a fresh process. On a shared machine the CPU seconds (this process's own) are the figure to weigh; "
        "wall seconds include waiting for a core.",
        "",
        f"The GPT-3 shape (width {GPT3['n_embd']}, {GPT3['n_head']} heads, sequence {GPT3['block_size']}, "
        f"vocabulary {GPT3['vocab_size']}; {last['params'] / 1e9:.0f} billion parameters at {last['layers']} "
        f"layers) is built under `sbpflow.meta_init()` and laid out TP{args.tp} x PP{args.pp} x DP{args.dp} "
        f"({args.tp * args.pp * args.dp} ranks). `nn.Graph.compile_only` compiles its training step (AdamW, "
        f"clipping, {args.micro_batches} micro-batches of one sequence per data-parallel rank) metadata-only: "
        "seconds per pass, total wall and CPU seconds of build plus compile, and the process's peak RSS (with "
        "the RSS after imports: Python, torch and sbpflow); `selection` is the SBP selection method and what it "
        f"settled on. The plan predicts a peak of {last['peak_gb']:.1f} GB on the busiest rank "
        "(fp32 weights, AdamW state, activations).",
        "",
        *table(rows),
        "",
        f"A process extracts its own program from the shared plan (`plan.for_rank(0)`) in {last['rank0_s']:.2f} s.",
    ])
    print(text)
    if args.write:
        write_section("compile_scale", text)


if __name__ == "__main__":
    main()
