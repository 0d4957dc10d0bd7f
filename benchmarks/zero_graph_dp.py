"""ZeRO-1 in nn.Graph against plain data parallelism, on 4 gloo processes, before and after gather buckets.

Run: ``.venv/bin/python benchmarks/zero_graph_dp.py [--rounds R] [--steps S] [--families a,b] [--write]``
(spawns its own 4 processes with ``sbpflow launch``; ``--write`` replaces the "zero_graph_dp" section of
docs/benchmarks.md).

Per family (the models of ``plan_any_model_measured.py``), three compiled training steps on dp=4, timed in
interleaved rounds (the order turned by one each round): plain data parallelism, ZeRO-1 with the updated shards
all-gathered one parameter at a time (``config.gather_buckets = False``: what nn.Graph did before), and ZeRO-1
with them gathered in flat buckets (the default). The report gives each one's median step and spread, the CPU of
the busiest process, and the collectives and nodes one rank's plan holds (the numbers of the three are the
same: tests/sim/test_zero.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from _report import machine, rounds_main, timed_block_cpu, turned  # noqa: E402
from plan_any_model_measured import FAMILIES, _family, _step_class  # noqa: E402

WORLD = 4
CONTENDERS = {"plain dp4": (0, True), "zero1, one all-gather per parameter": (1, False),
              "zero1, gather buckets": (1, True)}
# what the last written run showed (kept with the section; rewrite it when the figures change)
READING = """\
**Reading.** The 2-4x of ZeRO-1 over plain dp4 in `nn.Graph` was a real overhead: after the step, each updated
parameter slice was all-gathered back on its own (GPT: 32 collectives per rank per step against plain dp's 2; a
collective between stretches of compute costs 2-3 ms on this loaded host). `graph/gather_bucket.py` packs those
all-gathers into flat buckets (`bucket_flatten`, one all-gather, `bucket_unshard`): 3 collectives per rank, and
ZeRO-1 at 1.21-1.41x plain dp4 in this run (GPT, Llama, MoE, ViT; 1.24-1.74x in the 12:50 run: the load moves
these by a few tenths). What is left there: one all-gather more than plain dp (stage 1 all-reduces the gradients,
then gathers the slices), the slices and per-parameter assigns (164 nodes against 10).
The CNN was at 2.11x (12:50 run) with 27 collectives: 25 all-gathers of BatchNorm activations (its batch
statistics) in forward and backward, picked because ZeRO-1 capped the SBP selection's kept activations at the
traced layouts'. Plain dp4 has none: at batch 2 per rank its selection computes the whole batch on every rank
(one input gather; 853 kB kept for backward against 214 kB, peak 1096 kB against 365 kB capped), which the
alpha-beta model prices lower than two collectives per BatchNorm statistic. ZeRO-1 shards only the update, so
its forward and backward are the plain step's and need no cap to keep the plain step's peak: the cap ("auto")
now applies under ZeRO 2 and 3 only. ZeRO-1's CNN step then selects plain dp4's layouts (5 collectives: plain's
4 and the gather bucket), runs at 1.05x plain dp4 (1.10x in a second run, 15:45) and peaks at 1068 kB against
plain's 1096 kB (tests/sim/test_memory_prediction.py). A user who wants the 337 kB peak of the split layouts
asks for it with `set_sbp_selection("ilp", activation_cap="traced")`, and pays the 27 collectives; auto plans do
so (`configure_graph`), since the planner priced the split layouts' activations.
"""



def _contender(kind: str, zero: int, buckets: bool) -> tuple[Any, Any]:
    import sbpflow
    from sbpflow.autoparallel.apply import _lay_out_inputs

    warnings.simplefilter("ignore")
    make, loss, (x, y) = _family(kind)
    sbpflow.manual_seed(0)
    model = make()
    strategy = sbpflow.parallelize(model, data=WORLD)
    step = _step_class()(model, loss)
    step.config.gather_buckets = buckets
    if zero:
        step.config.enable_zero(stage=zero)
    args = _lay_out_inputs(strategy, (sbpflow.tensor(x), sbpflow.tensor(y)))
    step(*args)  # compile
    return (lambda: step(*args)), step


def _plan_counts(step: Any) -> dict[str, int]:
    """One rank's collectives and acts in the compiled plan."""
    import torch.distributed as dist

    plan = step._last.plan
    mine = [n for n in plan.nodes if dist.get_rank() in n.ranks and n.kind not in ("variable", "input")]
    return {"collectives": sum(n.kind == "boxing" and n.boxing.steps[0].kind != "local" for n in mine),
            "nodes": len(mine)}


def worker(out: str, rounds: int, steps: int, families: list[str]) -> None:
    import torch.distributed as dist

    import sbpflow

    sbpflow.distributed.init()
    result: dict[str, Any] = {}
    for kind in families:
        runs, counts = {}, {}
        for name, (zero, buckets) in CONTENDERS.items():
            runs[name], step = _contender(kind, zero, buckets)
            counts[name] = _plan_counts(step)
        timed: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(rounds):
            for name in turned(sorted(runs), r):
                wall, busy = timed_block_cpu(runs[name], steps)
                timed[name].append(wall)
                cpu[name].append(busy)
        result[kind] = {"measured": timed, "cpu": cpu, "counts": counts}
        dist.barrier()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(result))


def report(result: dict[str, Any], rounds: int, steps: int) -> str:
    lines = [f"Machine: {machine(processes=WORLD)}; {rounds} interleaved rounds of {steps} steps, batch 8, "
             "nn.Graph steps (AdamW, one micro-batch), dp=4 on 4 gloo processes.", "",
             "| model | step | collectives / plan nodes per rank | measured ms (median) | spread (min-max) | "
             "x plain dp4 | CPU ms per step, busiest process |", "|---|---|---|---|---|---|---|"]
    for kind, r in result.items():
        meas = {n: statistics.median(v) for n, v in r["measured"].items()}
        for name in CONTENDERS:
            v, c = r["measured"][name], r["counts"][name]
            lines.append(f"| {kind} | {name} | {c['collectives']} / {c['nodes']} | {meas[name] * 1e3:.1f} | "
                         f"{min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} | {meas[name] / meas['plain dp4']:.2f} | "
                         f"{statistics.median(r['cpu'][name]) * 1e3:.1f} |")
    return "\n".join(lines)


def main() -> int:
    return rounds_main(__file__, WORLD, __doc__ or "", FAMILIES, worker, report, "zero_graph_dp",
                       "## ZeRO-1 in nn.Graph against plain data parallelism: gather buckets "
                       "(benchmarks/zero_graph_dp.py)", "\n" + READING)


if __name__ == "__main__":
    raise SystemExit(main())
