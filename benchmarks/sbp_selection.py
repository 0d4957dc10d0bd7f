"""Whole-graph SBP selection (the HiGHS ILP) against the greedy, eager-like choice, on the GPT and the ResNet.

Run: ``.venv/bin/python benchmarks/sbp_selection.py [--write]`` (virtual ranks in this process; ``--write``
replaces the "sbp_selection" section of docs/benchmarks.md).

Each model's training step is compiled twice by ``nn.Graph``, with ``config.set_sbp_selection("greedy")``
and ``("ilp")``, from the same weights. Reported per case: the selection's modelled step cost for both
choices (the objective the ILP minimises, in the boxing planner's α-β seconds plus local compute), the bytes
the step's collectives really move (``sbpflow.comm.record`` over one step, summed over ranks), the ILP's
variables and solve time, and the median step time on virtual ranks.

The step times are not the cluster the model prices: the 4 virtual ranks run in this one process, each rank's
compute in turn, and their collectives are memory copies without a network's latency. A plan that trades
collectives (each a latency in the model's α-β terms) for compute replicated on every rank therefore measures
slower here than it would on 4 machines; bytes and collectives are the plan's own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import sbpflow  # noqa: E402
from sbpflow.comm import record  # noqa: E402
from sbpflow.demo.train_gpt import build  # noqa: E402
from sbpflow.models.cnn import ResNet, _TrainStep  # noqa: E402
from sbpflow.models.gpt import GPTConfig  # noqa: E402

GPT = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)
GPT_CASES = ("dp=4", "dp=2,tp=2", "tp=4", "dp=2,pp=2")
STEPS = 5


def gpt_step(strategy: str, selection: str) -> tuple[Callable[[], Any], Any]:
    trainer = build(GPT, strategy, graph=True)
    trainer.graph.config.set_sbp_selection(selection)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, GPT.vocab_size, (8, GPT.block_size))
    return (lambda: trainer.step(ids, ids)), trainer.graph


def resnet_step(selection: str) -> tuple[Callable[[], Any], Any]:
    sbpflow.manual_seed(0)
    placement = sbpflow.placement("cpu", [0, 1, 2, 3])
    model = ResNet(channels=8, num_classes=10)
    model.to_global(placement)
    graph = _TrainStep(model, sbpflow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       sbpflow.nn.CrossEntropyLoss())
    graph.config.set_sbp_selection(selection)
    gen = torch.Generator().manual_seed(0)
    x = sbpflow.tensor(torch.randn(16, 3, 16, 16, generator=gen), placement=placement, sbp=sbpflow.sbp.split(0))
    y = sbpflow.tensor(torch.randint(0, 10, (16,), generator=gen), placement=placement, sbp=sbpflow.sbp.split(0))
    return (lambda: graph(x, y)), graph


def measure(make: Callable[[], tuple[Callable[[], Any], Any]]) -> dict[str, Any]:
    step, graph = make()
    step()  # compiles
    report = graph._compiled().report
    with record() as log:
        step()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    sel = report.selection
    return {"greedy_cost": sel.greedy_cost, "chosen_cost": sel.chosen_cost, "method": sel.method,
            "solve_s": sel.solve_s, "variables": sel.variables, "bytes": log.total_bytes(),
            "collectives": len(log.events), "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the sbp_selection section")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases: list[tuple[str, Callable[[str], tuple[Callable[[], Any], Any]]]] = [
        (f"GPT {s}", lambda sel, s=s: gpt_step(s, sel)) for s in GPT_CASES]
    cases.append(("ResNet dp=4", resnet_step))
    lines = ["## SBP selection: ILP against greedy (issue 12)", "",
             f"`.venv/bin/python benchmarks/sbp_selection.py --write`; GPT {GPT.n_layer} x {GPT.n_embd}, "
             f"{GPT.block_size} tokens, batch 8; ResNet 8 channels, 16 x 16 images, batch 16; 4 virtual ranks. "
             "Step times: the 4 virtual ranks in one process, each rank's compute in turn, collectives as memory "
             "copies without latency; so a plan that replaces collectives by compute replicated on every rank "
             "measures slower here than on 4 machines, where the model's latencies apply.", "",
             "| case | modelled cost greedy | modelled cost ILP | bytes greedy | bytes ILP | collectives greedy / ILP "
             "| ILP variables | solve | step greedy | step ILP |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, make in cases:
        greedy = measure(lambda make=make: make("greedy"))
        ilp = measure(lambda make=make: make("ilp"))
        lines.append(f"| {name} | {greedy['chosen_cost'] * 1e3:.3f} ms | {ilp['chosen_cost'] * 1e3:.3f} ms "
                     f"({ilp['method']}) | {greedy['bytes'] / 1e6:.2f} MB | {ilp['bytes'] / 1e6:.2f} MB | "
                     f"{greedy['collectives']} / {ilp['collectives']} | {ilp['variables']} | "
                     f"{ilp['solve_s'] * 1e3:.0f} ms | {greedy['step_s'] * 1e3:.1f} ms | "
                     f"{ilp['step_s'] * 1e3:.1f} ms |")
        print(lines[-1], flush=True)
    body = "\n".join(lines)
    print(body)
    if args.write:
        from _report import write_section

        write_section("sbp_selection", body)


if __name__ == "__main__":
    main()
