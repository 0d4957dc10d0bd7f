"""The planner against measurements: a GPT under every hand plan of issue 4 and the auto plan, 4 gloo processes.

Run: ``.venv/bin/python benchmarks/plan_validation.py [--write]`` (calibrates this machine, then spawns its
own 4 processes with ``sbpflow launch``; ``--write`` replaces the "plan_validation" section of
docs/benchmarks.md).

1. ``sbpflow calibrate``'s measurements (quick) give the profile: GEMM and memory throughput, gloo α-β
   between 4 processes. Two corrections say what this machine is: with more processes than cores, each
   process gets ``cores / processes`` of the compute; and the per-kernel floor is sbpflow's eager dispatch
   of a small op (measured here), not a CUDA launch.
2. The planner predicts each plan's step: dp4, tp2 x dp2, pp2 x dp2, tp4, pp2 x tp2, and its own choice
   (eager steps are one micro-batch: stages do not overlap), with AdamW and no gradient clipping.
3. Every process trains each plan in interleaved rounds; a plan's time is the median over rounds of rank 0's
   wall time per step between barriers.

The table gives predicted and measured times, the Spearman rank correlation between them, and the auto plan
against the best measured hand plan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from _report import launch_self  # noqa: E402

import sbpflow  # noqa: E402
from sbpflow import optim  # noqa: E402
from sbpflow.autoparallel import Cluster, DeviceProfile, Fixed, ParallelPlan, predict, search  # noqa: E402
from sbpflow.autoparallel.apply import gpt_spec  # noqa: E402
from sbpflow.autoparallel.calibrate import calibrate  # noqa: E402
from sbpflow.demo.train_gpt import Trainer  # noqa: E402
from sbpflow.models.gpt import GPT, GPTConfig, parallelize  # noqa: E402

WORLD = 4
CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 16
HAND = {"dp4": (1, 1, 4), "tp2 x dp2": (2, 1, 2), "pp2 x dp2": (1, 2, 2), "tp4": (4, 1, 1), "pp2 x tp2": (2, 2, 1)}


# ----------------------------------------------------------------------------- the parent: profile and predictions


def dispatch_floor(repeats: int = 2000) -> float:
    """Seconds sbpflow's eager dispatch adds to a tiny op on a one-rank placement (the kernel floor here)."""
    placement = sbpflow.placement("cpu", [0])
    x = sbpflow.ones(4, 4, placement=placement, sbp=sbpflow.sbp.broadcast)
    for _ in range(100):
        x + x  # noqa: B018  (warm the dispatch cache)
    start = time.perf_counter()
    for _ in range(repeats):
        x + x  # noqa: B018
    return (time.perf_counter() - start) / repeats


def local_profile() -> tuple[DeviceProfile, str]:
    torch.set_num_threads(1)
    measured, found = calibrate("here-4-processes", processes=WORLD, quick=True)
    share = min(1.0, (os.cpu_count() or 1) / WORLD)
    floor = dispatch_floor()
    profile = replace(measured, peak_flops=measured.peak_flops * share, mem_bandwidth=measured.mem_bandwidth * share,
                      launch_s=floor)
    note = (f"calibrated: GEMM {found.matmul_flops[max(found.matmul_flops)] / 1e9:.1f} GFLOP/s (best "
            f"{measured.peak_flops / 1e9:.1f}), memcpy {measured.mem_bandwidth / 1e9:.1f} GB/s, gloo alpha "
            f"{found.alpha * 1e6:.0f} us, {1 / found.beta / 1e9:.2f} GB/s over {WORLD} processes; compute share "
            f"{share:.2f} per process ({os.cpu_count()} cores); dispatch floor {floor * 1e6:.1f} us per op")
    return profile, note


def plans(profile: DeviceProfile) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """Each plan's prediction and its stage cuts: the hand plans, then the planner's own choice."""
    spec = gpt_spec(GPT(CONFIG))
    cluster = Cluster(WORLD, profile, WORLD)
    out = {}
    for name, (tp, pp, dp) in HAND.items():
        p = predict(spec, cluster, ParallelPlan(tp, pp, dp, BATCH // dp, 0, "none"), BATCH)
        out[name] = (p, p.stage_layers)
    best = search(spec, cluster, BATCH, Fixed(zero=0, recompute="none", micro_batches=1)).best
    out[f"auto ({best.plan.tp}/{best.plan.pp}/{best.plan.dp})"] = (best, best.stage_layers)
    return out


# ----------------------------------------------------------------------------- the workers: measurements


def trainer(tp: int, cuts: tuple[int, ...], dp: int) -> Trainer:
    sbpflow.manual_seed(0)
    model = GPT(CONFIG)
    strategy = parallelize(model, data=dp, tensor=tp, pipeline=cuts)
    return Trainer(model, strategy, optim.AdamW(model.parameters(), lr=1e-3), clip=None)


def worker(spec_path: str, out_path: str, rounds: int, steps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    sbpflow.distributed.init()
    wanted = json.loads(Path(spec_path).read_text())
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    targets = rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    trainers = {name: trainer(tp, tuple(cuts), dp) for name, (tp, cuts, dp) in wanted.items()}
    for t in trainers.values():
        t.step(ids, targets)  # warm-up: dispatch caches, gloo pairs
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, t in trainers.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                t.step(ids, targets)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    if sbpflow.rank() == 0:
        Path(out_path).write_text(json.dumps({name: statistics.median(v) for name, v in times.items()}))


def measure(wanted: dict[str, tuple[int, tuple[int, ...], int]], rounds: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = str(Path(tmp) / "plans.json"), str(Path(tmp) / "times.json")
        Path(spec_path).write_text(json.dumps(wanted))
        launch_self(__file__, WORLD, ["--worker", spec_path, out_path, "--rounds", str(rounds), "--steps", str(steps)],
                    check=True)
        return {k: float(v) for k, v in json.loads(Path(out_path).read_text()).items()}


# ----------------------------------------------------------------------------- the report


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected among times)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def report(predicted: dict[str, Any], measured: dict[str, float], note: str) -> str:
    names = list(predicted)
    lines = ["## Planner against measurements (issue 12)", "",
             f"`.venv/bin/python benchmarks/plan_validation.py --write`: GPT {CONFIG.n_layer} x {CONFIG.n_embd}, "
             f"{CONFIG.n_head} heads, {CONFIG.block_size} tokens, vocabulary {CONFIG.vocab_size}, batch {BATCH}, "
             f"AdamW, eager, {WORLD} gloo processes on {os.cpu_count()} cores. Profile {note}.", "",
             "| plan | stages | predicted ms | measured ms | measured / predicted |", "|---|---|---|---|---|"]
    for name in names:
        p = predicted[name][0]
        lines.append(f"| {name} | {list(p.stage_layers)} | {p.step_time * 1e3:.1f} | {measured[name] * 1e3:.1f} | "
                     f"{measured[name] / p.step_time:.2f} |")
    rho = spearman([predicted[n][0].step_time for n in names], [measured[n] for n in names])
    hand = [n for n in names if n in HAND]
    best_hand = min(hand, key=lambda n: measured[n])
    auto = names[-1]
    lines += ["", f"Spearman rank correlation, predicted vs measured: **{rho:.2f}** over {len(names)} plans.",
              f"Auto plan {auto}: {measured[auto] * 1e3:.1f} ms measured, "
              f"{measured[auto] / measured[best_hand] - 1:+.1%} against the best measured hand plan "
              f"({best_hand}, {measured[best_hand] * 1e3:.1f} ms); target: within +10%."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="steps per plan per round (default 3)")
    parser.add_argument("--write", action="store_true", help="replace the plan_validation section")
    parser.add_argument("--worker", nargs=2, metavar=("PLANS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.rounds, args.steps)
        return 0
    profile, note = local_profile()
    predicted = plans(profile)
    wanted = {name: (p.plan.tp, cuts, p.plan.dp) for name, (p, cuts) in predicted.items()}
    measured = measure(wanted, args.rounds, args.steps)
    body = report(predicted, measured, note)
    print(body)
    if args.write:
        from _report import write_section

        write_section("plan_validation", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
