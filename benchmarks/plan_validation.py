"""The planner against measurements: a GPT under every hand plan of issue 4 and the auto plan, 4 gloo processes.

Run: ``.venv/bin/python benchmarks/plan_validation.py [--rounds R] [--write]`` (spawns its own 4 processes
with ``sbpflow launch``; ``--write`` replaces the "plan_validation" section of docs/benchmarks.md).

What is predicted is what these processes run: eager steps (one micro-batch, AdamW, no clipping) of
sbpflow's GPT, four processes on a host with fewer cores, shared with other jobs. The host model
(``sbpflow.autoparallel.host``) prices dispatch floors, torch kernels at each rank's shapes, the sharing of
cores, and every collective the plan issues, from a profile of primitives that ``calibrate_host`` measures
(never a plan). So that a loaded machine is the same machine for both, each round first calibrates, then
times every plan; each round's predictions use that round's profile.

1. The processes calibrate five times and the planner picks its plan (``host_search``: every tp x pp x dp and
   every stage cut, each by its median prediction over the five); rank 0's choice is everyone's.
2. Each of ``--rounds`` rounds: calibrate, then every plan runs ``--steps`` steps between barriers (rank 0's
   wall time per step; each rank's thread CPU time per step), in an order rotated by one plan per round.
3. The report: per plan the median over rounds of predicted and measured times, the spread of the measured
   ones, CPU per rank predicted and measured, collectives per rank predicted and recorded; the Spearman rank
   correlation of the medians and of each round; the auto plan against the best measured hand plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from _report import launch_self, machine  # noqa: E402

import sbpflow  # noqa: E402
from sbpflow import optim  # noqa: E402
from sbpflow.autoparallel import ParallelPlan, TransformerSpec  # noqa: E402
from sbpflow.autoparallel.calibrate_host import calibrate_host  # noqa: E402
from sbpflow.autoparallel.host import HostProfile, host_plans, host_search, plan_shapes, predict_host  # noqa: E402
from sbpflow.demo.train_gpt import Trainer  # noqa: E402
from sbpflow.models.gpt import GPT, GPTConfig, parallelize  # noqa: E402

WORLD = 4
CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 16
HAND = {"dp4": (1, (4,), 4), "tp2 x dp2": (2, (4,), 2), "pp2 x dp2": (1, (2, 2), 2), "tp4": (4, (4,), 1),
        "pp2 x tp2": (2, (2, 2), 1)}
SPEC = TransformerSpec(layers=CONFIG.n_layer, hidden=CONFIG.n_embd, heads=CONFIG.n_head, seq=CONFIG.block_size,
                       vocab=CONFIG.vocab_size)
CHOICE_CALIBRATIONS = 5  # the auto plan: each candidate's median prediction over this many calibrations


def profile_from(data: dict[str, Any]) -> HostProfile:
    """A profile from its JSON form (tuples came back as lists)."""
    def tup(x: Any) -> Any:
        return tuple(tup(v) for v in x) if isinstance(x, list) else x

    return HostProfile(**{k: tup(v) for k, v in data.items()})


def predict_plan(profile: HostProfile, tp: int, cuts: tuple[int, ...], dp: int) -> Any:
    return predict_host(SPEC, ParallelPlan(tp, len(cuts), dp, BATCH // dp, 0, "none"), cuts, BATCH, profile)


# ----------------------------------------------------------------------------- the workers: measurements


def trainer(tp: int, cuts: tuple[int, ...], dp: int) -> Trainer:
    sbpflow.manual_seed(0)
    model = GPT(CONFIG)
    strategy = parallelize(model, data=dp, tensor=tp, pipeline=cuts)
    return Trainer(model, strategy, optim.AdamW(model.parameters(), lr=1e-3), clip=None)


def calibrated() -> dict[str, Any]:
    shapes = plan_shapes(SPEC, host_plans(SPEC, WORLD, BATCH), BATCH)
    return {k: v for k, v in calibrate_host(shapes).__dict__.items()}


def collectives_per_rank(t: Trainer, ids: np.ndarray, targets: np.ndarray) -> int:
    """Collectives one step issues that this rank takes part in (recorded)."""
    with sbpflow.comm.record() as log:
        t.step(ids, targets)
    return sum(sbpflow.rank() in e.ranks for e in log.events)


def worker(out_path: str, rounds: int, steps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    sbpflow.distributed.init()
    auto = host_search(SPEC, [profile_from(calibrated()) for _ in range(CHOICE_CALIBRATIONS)], BATCH)[0]
    wanted = dict(HAND)
    auto_name = f"auto ({auto.plan.tp}/{auto.plan.pp}/{auto.plan.dp} {list(auto.stage_layers)})"
    wanted[auto_name] = (auto.plan.tp, auto.stage_layers, auto.plan.dp)
    chosen: list[Any] = [None] * WORLD
    dist.all_gather_object(chosen, wanted)  # rank 0's choice is everyone's
    wanted = chosen[0]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    targets = rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    trainers = {name: trainer(tp, tuple(cuts), dp) for name, (tp, cuts, dp) in wanted.items()}
    colls = {name: collectives_per_rank(t, ids, targets) for name, t in trainers.items()}  # also the warm-up
    log: list[dict[str, Any]] = []
    order = list(trainers)
    for r in range(rounds):
        entry: dict[str, Any] = {"profile": calibrated(), "wall": {}, "cpu": {}}
        for name in order[r % len(order):] + order[:r % len(order)]:  # each round starts one plan later
            t = trainers[name]
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                t.step(ids, targets)
            cpu = (time.thread_time() - cpu) / steps
            dist.barrier()
            entry["wall"][name] = (time.perf_counter() - start) / steps
            entry["cpu"][name] = cpu
        log.append(entry)
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, ([e["cpu"] for e in log], colls))
    if sbpflow.rank() == 0:
        result = {"plans": wanted, "auto": auto_name, "rounds": log,
                  "cpu": [[c[r] for c, _ in everyone] for r in range(rounds)],
                  "collectives": [c for _, c in everyone]}
        Path(out_path).write_text(json.dumps(result))


def measure(rounds: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "times.json")
        launch_self(__file__, WORLD, ["--worker", out_path, "--rounds", str(rounds), "--steps", str(steps)],
                    check=True)
        return dict(json.loads(Path(out_path).read_text()))


# ----------------------------------------------------------------------------- the report


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation; tied values (the auto plan predicted like the hand plan it equals) share their rank."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(result: dict[str, Any], started: str) -> str:
    plans = {name: (tp, tuple(cuts), dp) for name, (tp, cuts, dp) in result["plans"].items()}
    names, auto = list(plans), result["auto"]
    rounds = result["rounds"]
    preds = [{n: predict_plan(profile_from(r["profile"]), *plans[n]) for n in names} for r in rounds]
    pred = {n: statistics.median(p[n].step_time for p in preds) for n in names}
    meas = {n: statistics.median(r["wall"][n] for r in rounds) for n in names}
    cpu_meas = {n: statistics.median(max(rank[n] for rank in rnd) for rnd in result["cpu"]) for n in names}
    cpu_pred = {n: statistics.median(max(p[n].cpu_per_rank) for p in preds) for n in names}
    recorded = {n: max(rank[n] for rank in result["collectives"]) for n in names}
    profiles = [profile_from(r["profile"]) for r in rounds]

    def sharing(k: int) -> str:
        values = [p.factor(k) for p in profiles]
        return f"{min(values):.1f}-{max(values):.1f}"

    lines = [
        "## Planner against measurements (issue 12)", "",
        f"`.venv/bin/python benchmarks/plan_validation.py --write` on {started}. GPT {CONFIG.n_layer} x "
        f"{CONFIG.n_embd}, {CONFIG.n_head} heads, {CONFIG.block_size} tokens, vocabulary {CONFIG.vocab_size}, "
        f"batch {BATCH}, AdamW, **eager** steps (one micro-batch; what `sbpflow.auto_parallel` gives by default), "
        f"{WORLD} gloo processes. {len(rounds)} interleaved rounds: each calibrates the host "
        "(`calibrate_host`: dispatch floor, torch kernels at each rank's shapes, AdamW, sharing of cores by k "
        "busy processes, the wait of an all-reduce after compute, sbpflow's all-reduce a + b n on groups of "
        "2 and 4, send/receive), then times every plan; each round's predictions use that round's profile; the "
        "plans' order rotates by one each round. Medians over rounds; the spread is the measured minimum to "
        "maximum.", "",
        f"Sharing measured in the rounds, wall s per CPU s (other jobs on the machine): {WORLD} processes busy "
        f"{sharing(WORLD)}, 2 busy {sharing(2)}, 1 busy {sharing(1)}; wait of a blocking all-reduce after "
        f"compute {min(p.sync_s for p in profiles) * 1e3:.2f}-{max(p.sync_s for p in profiles) * 1e3:.2f} ms. "
        "Dispatch floor: "
        f"{statistics.median(p.dispatch_s for p in profiles) * 1e6:.1f} us per op (owner), "
        f"{statistics.median(p.foreign_dispatch_s for p in profiles) * 1e6:.1f} us (outside the placement).", "",
        "| plan | stages | collectives per rank: predicted / recorded | CPU ms per rank: predicted / measured | "
        "predicted ms | measured ms (spread) | measured / predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in names:
        p = preds[0][n]
        spread = [r["wall"][n] for r in rounds]
        lines.append(f"| {n} | {list(plans[n][1])} | {p.collectives} / {recorded[n]} | {ms(cpu_pred[n])} / "
                     f"{ms(cpu_meas[n])} | {ms(pred[n])} | {ms(meas[n])} ({ms(min(spread))}-{ms(max(spread))}) | "
                     f"{meas[n] / pred[n]:.2f} |")
    rho = spearman([pred[n] for n in names], [meas[n] for n in names])
    per_round = [spearman([p[n].step_time for n in names], [r["wall"][n] for n in names])
                 for p, r in zip(preds, rounds, strict=True)]
    hand = [n for n in names if n in HAND]
    best = min(hand, key=lambda n: meas[n])
    gaps = [r["wall"][auto] / min(r["wall"][n] for n in hand) - 1 for r in rounds]
    breakdown = preds[0][auto].breakdown
    lines += [
        "", f"Spearman rank correlation of the medians, predicted vs measured: **{rho:.2f}** over {len(names)} "
        f"plans; per round: {', '.join(f'{x:.2f}' for x in per_round)}.",
        f"Auto plan {auto} (the planner's choice from {CHOICE_CALIBRATIONS} calibrations before the rounds, each "
        f"plan by its median prediction): {ms(meas[auto])} ms measured, "
        f"**{meas[auto] / meas[best] - 1:+.1%}** against the best measured hand plan ({best}, {ms(meas[best])} ms); "
        "per round against that round's best hand plan: "
        f"{', '.join(f'{g:+.1%}' for g in gaps)}. Target: within +10%.",
        *([f"The auto plan is the hand plan {same[0]} (its own trainer, timed separately): the gap between the "
           "two is the measurement's noise."] if (same := [n for n in hand if plans[n] == plans[auto]]) else []),
        "Predicted breakdown of the auto plan (first round, ms): "
        + ", ".join(f"{k} {ms(v)}" for k, v in breakdown.items()) + ".",
    ]
    lines += [
        "", "What the prediction leaves out, seen here: CPU per rank is predicted 15-35% low (the kernels are "
        "timed as plain torch at each rank's shapes and the dispatch floor on a tiny GPT; sbpflow's copies "
        "around them and four processes' cache contention are not priced); pp2 x tp2's first stage boxes its "
        "split weight gradients leaf by leaf (all-gathers and reduce-scatters that eager backward issues and the "
        "model does not count: an inefficiency of the eager pipeline backward, not modelled); a process that "
        "the sharing left behind makes every blocking collective wait longer than the 2 ms calibration shows. "
        "Steps are eager, not `nn.Graph`: `sbpflow.auto_parallel` applies its plan to eager training by "
        "default, and compiling six plans on four processes of a loaded 2-core machine costs minutes while "
        "the actor runtime adds its own per-act cost that this model does not price.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="steps per plan per round (default 3)")
    parser.add_argument("--write", action="store_true", help="replace the plan_validation section")
    parser.add_argument("--worker", nargs=1, metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.rounds, args.steps)
        return 0
    started = machine(processes=WORLD)
    body = report(measure(args.rounds, args.steps), started)
    print(body)
    if args.write:
        from _report import write_section

        write_section("plan_validation", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
