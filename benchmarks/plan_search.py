"""The planner at scale (issue 12): the GPT-3 175B anchor, the search on 1024 A100-80GB, search time vs depth.

Run: ``.venv/bin/python benchmarks/plan_search.py [--write]`` (prints; ``--write`` also replaces the
"plan_search" section of docs/benchmarks.md). Metadata only: no devices are used.

1. The anchor: Megatron-LM's hand plan for GPT-3 175B (Narayanan et al., SC'21: 1024 A100-80GB, TP 8, PP 16,
   DP 8, batch 1536, micro-batch 1, full recompute) reached 140 TFLOP/s per GPU. The prediction, its error
   and its breakdown: with the block ILP's SBP choice (what ``sbpflow plan`` predicts) and with Megatron-LM
   2021's exact layout (the residual stream whole on every rank).
2. The search for the same model and cluster: the chosen plan against Megatron's, and the effort.
3. Search time against depth (2 to 96 layers at GPT-3's width on 1024 devices), branch and bound against
   costing every candidate.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _report import machine, write_section  # noqa: E402

from sbpflow.autoparallel import PROFILES, Cluster, ParallelPlan, TransformerSpec, predict, search  # noqa: E402
from sbpflow.autoparallel.block_sbp import cached_solve  # noqa: E402
from sbpflow.autoparallel.block_sbp import megatron as megatron_layers  # noqa: E402
from sbpflow.autoparallel.explain import explain, seconds, why_lost  # noqa: E402
from sbpflow.autoparallel.predict import TIME_KEYS  # noqa: E402

GPT3 = TransformerSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
CLUSTER = Cluster(1024, PROFILES["a100-80gb"], 8)
MEGATRON = ParallelPlan(tp=8, pp=16, dp=8, micro_batch=1, zero=0, recompute="full")
MEGATRON_2021 = replace(MEGATRON, layout="megatron")
PUBLISHED_TFLOPS = 140.0
DEPTHS = (2, 4, 8, 16, 32, 64, 96)


def anchor() -> list[str]:
    lines = ["### The anchor: GPT-3 175B, Megatron-LM's plan", "",
             "`sbpflow plan --layers 96 --hidden 12288 --heads 96 --seq 2048 --vocab 51200 --batch 1536 "
             "--devices 1024 --device a100-80gb --tp 8 --pp 16 --dp 8 --micro-batch 1`", "",
             "Megatron-LM counted the FLOPs its runs executed, full recompute included (eq. 3): the hardware figure. "
             "The model figure counts forward and backward alone.", "",
             "| | step | hardware TFLOP/s per GPU | model TFLOP/s per GPU | MFU | memory per GPU |",
             "|---|---|---|---|---|---|",
             f"| published (Narayanan et al. 2021) | | {PUBLISHED_TFLOPS:.0f} | | | |"]
    rows = [("predicted, the block ILP's SBPs (`sbpflow plan`)", predict(GPT3, CLUSTER, MEGATRON, 1536)),
            ("predicted, Megatron-LM 2021's layout (stream whole)", predict(GPT3, CLUSTER, MEGATRON_2021, 1536))]
    for name, p in rows:
        error = p.tflops_per_device / PUBLISHED_TFLOPS - 1
        lines.append(f"| {name} | {p.step_time:.2f} s | {p.tflops_per_device:.1f} ({error:+.1%}) | "
                     f"{p.model_tflops_per_device:.1f} | {p.mfu:.1%} | {p.memory_per_device / 1e9:.1f} GB |")
    lines += ["", "| SBPs inside each block | " + " | ".join(TIME_KEYS) + " |", "|---|" + "---|" * len(TIME_KEYS)]
    for name, p in rows:
        lines.append(f"| {name.split(', ')[1]} | " + " | ".join(seconds(p.breakdown[k]) for k in TIME_KEYS) + " |")
    ilp = rows[0][1].block
    assert ilp is not None
    stream = "split over tokens (sequence parallelism)" if dict(ilp.choices)["x"] == "S(0)" else "whole"
    lines += ["", f"The block ILP's choice for this plan (memory is short: weights must be split): {ilp}. "
              f"Megatron-LM's column/row layers: {'yes' if megatron_layers(ilp) else 'no'}; the residual stream and "
              f"LayerNorms {stream}."]
    return lines


def chosen() -> list[str]:
    megatron = predict(GPT3, CLUSTER, MEGATRON, 1536)
    cached_solve.cache_clear()  # time the search cold: every block ILP it needs solved anew
    result = search(GPT3, CLUSTER, 1536)
    b = result.best
    return ["", "### The search, same model and cluster", "",
            "| plan | stages | step | hardware TFLOP/s | model TFLOP/s | memory |", "|---|---|---|---|---|---|",
            f"| Megatron: {megatron.plan} | {len(megatron.stage_layers)} | {megatron.step_time:.2f} s | "
            f"{megatron.tflops_per_device:.1f} | {megatron.model_tflops_per_device:.1f} | "
            f"{megatron.memory_per_device / 1e9:.1f} GB |",
            f"| chosen: {b.plan} | {len(b.stage_layers)} | {b.step_time:.2f} s | {b.tflops_per_device:.1f} | "
            f"{b.model_tflops_per_device:.1f} | {b.memory_per_device / 1e9:.1f} GB |", "",
            f"{result.candidates} candidates, {result.costed} costed exactly, {result.seconds:.2f} s. "
            f"The chosen plan is {1 - b.step_time / megatron.step_time:.1%} faster than Megatron's in this model; "
            f"Megatron's against it: {why_lost(megatron, b)}. Both priced with the block ILP's SBPs "
            f"(chosen: {'Megatron-LM' if b.block and megatron_layers(b.block) else 'other'} layers, stream "
            f"{dict(b.block.choices)['x'] if b.block else '-'})."]


def sensitivity() -> list[str]:
    """What the anchor rests on: the prediction with each assumption moved, the others kept."""
    base = PROFILES["a100-80gb"]
    cases = [("as assumed", base), ("eta_matmul 0.5", replace(base, eta_matmul=0.5)),
             ("eta_matmul 0.7", replace(base, eta_matmul=0.7)),
             ("NVLink x0.5", replace(base, intra_bandwidth=base.intra_bandwidth / 2)),
             ("inter-node x0.5", replace(base, inter_bandwidth=base.inter_bandwidth / 2)),
             ("HBM x0.5", replace(base, mem_bandwidth=base.mem_bandwidth / 2)),
             ("launch floor 20 us", replace(base, launch_s=20e-6))]
    lines = ["", "What the anchor rests on (each assumption moved alone):", "",
             "| assumption | hardware TFLOP/s per GPU | vs 140 |", "|---|---|---|"]
    for name, profile in cases:
        p = predict(GPT3, Cluster(1024, profile, 8), MEGATRON, 1536)  # the ILP may choose differently per profile
        lines.append(f"| {name} | {p.tflops_per_device:.1f} | {p.tflops_per_device / PUBLISHED_TFLOPS - 1:+.1%} |")
    return lines


def depths() -> list[str]:
    lines = ["", "### Search time against depth (hidden 12288, 96 heads, 1024 A100-80GB, batch 1536)", "",
             "| layers | candidates | costed | search | exhaustive | chosen |", "|---|---|---|---|---|---|"]
    for layers in DEPTHS:
        spec = TransformerSpec(layers=layers, hidden=12288, heads=96, seq=2048, vocab=51200)
        cached_solve.cache_clear()  # both searches cold: their block ILPs solved anew
        start = time.perf_counter()
        fast = search(spec, CLUSTER, 1536)
        fast_s = time.perf_counter() - start
        cached_solve.cache_clear()
        start = time.perf_counter()
        full = search(spec, CLUSTER, 1536, exhaustive=True)
        full_s = time.perf_counter() - start
        assert abs(full.best.step_time - fast.best.step_time) <= 1e-9 * full.best.step_time
        lines.append(f"| {layers} | {fast.candidates} | {fast.costed} | {fast_s:.2f} s | {full_s:.2f} s | "
                     f"{fast.best.plan} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the plan_search section of docs/benchmarks.md")
    args = parser.parse_args()
    body = ["## Planning at scale (issue 12)", "",
            f"`.venv/bin/python benchmarks/plan_search.py --write` on {machine()}. Predictions from metadata: "
            "device profile a100-80gb (public specs; efficiencies as `sbpflow plan` prints them).", "",
            *anchor(), *sensitivity(), *chosen(), *depths()]
    text = "\n".join(body)
    print(text)
    print()
    print(explain(GPT3, CLUSTER, predict(GPT3, CLUSTER, MEGATRON, 1536)))
    if args.write:
        write_section("plan_search", text)


if __name__ == "__main__":
    main()
