"""The graph planner's predicted memory against the compiled step's own peak (``plan.peak_bytes``).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/memory_prediction.py [--families a,b] [--write]`` (``--write``
replaces the "memory_prediction" section of docs/benchmarks.md).

Per family (the models of ``plan_any_model_measured.py``, batch 8) and per plan kind (dp4, ZeRO-1, ZeRO-3,
tp2 x dp2, pp2 x dp2, on 4 virtual ranks): the auto plan restricted to that kind (no recompute) is laid out,
configured and compiled as ``config.set_plan`` does, and one step runs. The table gives the planner's bytes on
the fullest device by component and the compiler's peak on the fullest rank (the memory plan's dry run, the
runtime's own accounting).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from _report import add_write_flag, machine, write_section  # noqa: E402
from plan_any_model_measured import FAMILIES, _family, _step_class  # noqa: E402

KINDS = {"dp4": {"tp": 1, "pp": 1, "dp": 4, "zero": 0}, "zero1": {"tp": 1, "pp": 1, "dp": 4, "zero": 1},
         "zero3": {"tp": 1, "pp": 1, "dp": 4, "zero": 3}, "tp2 dp2": {"tp": 2, "pp": 1, "dp": 2, "zero": 0},
         "pp2 dp2": {"tp": 1, "pp": 2, "dp": 2, "zero": 0}}
# what the last written run showed (kept with the section; rewrite it when the figures change)
READING = """\
**Reading.** Every compiled peak is under the prediction, by 2-34% (the user's models of
tests/sim/test_memory_prediction.py: 0.60-0.98 over 30 plans, and one over it, below). What the planner prices for a
plan that runs the traced step, besides weights, gradients, optimizer state and the activations kept per
micro-batch in flight: the gradient bucket under data parallelism, the step's inputs, backward's working set (3x
the largest op's inputs and outputs: a fused backward segment holds its ops' gradients and intermediates at once;
3 is the smallest whole factor that bounds every case measured, a BatchNorm CNN under ZeRO-3 needing 2.3), and
under ZeRO-1/2 the update phase (the updated shards gathered into a flat bucket and copied out, with the new
weight and state shards) where it outgrows backward's peak (the small MLP of the issue: 135.7 kB compiled, 146.1
predicted; the bucket term before priced 159.6). Before, a BatchNorm CNN's auto dp4 plan peaked at 3.1x the
prediction (its SBP selection computed the whole batch on every rank; auto plans now cap kept activations at the
traced layouts'), pipeline plans of CNNs at 1.4-1.5x (the backward working set and the inputs), and ZeRO-3 at up
to 1.33x. Where the prediction is loosest: ZeRO-3 (0.66-0.79: the gradient bucket is priced whole, as under plain
data parallelism) and plans on a 2-D mesh (tp2 x dp2: 0.69-0.78, the gradient bucket is not live at their peak).
The one plan over its prediction: the user's causal LM on tp2 x dp2 (55.4 kB against 51.6 kB), whose SBP
selection gathers a qkv output gradient over the tensor axis in backward, a copy the per-rank working set (split
by tp, as its activations) does not price (an xfail in the test). Mixed-precision predictions (the accelerator
what-if, the 175B rows) are unchanged: these terms apply to plans of the traced step only.
"""



def measure(kind: str, plan_kind: str) -> dict[str, Any]:
    import torch

    import sbpflow
    from sbpflow.autoparallel.apply import plan_model

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    want = KINDS[plan_kind]
    make, loss, (x, y) = _family(kind)
    sbpflow.manual_seed(0)
    step = _step_class()(make(), loss)
    args = (sbpflow.tensor(x), sbpflow.tensor(y))
    plan = plan_model(step, args, 4, only=lambda k: all(getattr(k, a) == v for a, v in want.items())
                      and k.recompute == "none" and k.cp == 1)
    step.config.set_plan(plan)
    step(*args)
    return {"knobs": str(plan.knobs), "predicted": plan.memory_per_device, "memory": dict(plan.memory),
            "peak": max(step._last.plan.peak_bytes.values())}


def report(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    lines = [f"Machine: {machine()}; 4 virtual ranks, batch 8, AdamW, fp32, one step compiled per plan.", "",
             "| model | plan | predicted kB (by component) | compiled peak kB | peak / predicted |",
             "|---|---|---|---|---|"]
    for kind, _, r in rows:
        parts = ", ".join(f"{n} {v / 1e3:.1f}" for n, v in r["memory"].items() if v)
        lines.append(f"| {kind} | {r['knobs']} | {r['predicted'] / 1e3:.1f} ({parts}) | {r['peak'] / 1e3:.1f} | "
                     f"{r['peak'] / r['predicted']:.3f} |")
    ratios = [r["peak"] / r["predicted"] for _, _, r in rows]
    lines += ["", f"Peak / predicted over {len(rows)} plans: {min(ratios):.3f} to {max(ratios):.3f}."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--kinds", default=",".join(KINDS))
    add_write_flag(parser)
    args = parser.parse_args()
    rows = [(kind, plan_kind, measure(kind, plan_kind)) for kind in args.families.split(",")
            for plan_kind in args.kinds.split(",")]
    body = report(rows)
    print(body)
    if args.write:
        write_section("memory_prediction", "## Memory predictions against compiled peaks "
                      "(benchmarks/memory_prediction.py)\n\n" + body + "\n\n" + READING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
