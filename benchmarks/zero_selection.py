"""ZeRO and the SBP selection: peak memory, link traffic and step time of the selected plan (issue 25, 3b).

Usage: PYTHONPATH=src python benchmarks/zero_selection.py [--write]

The GPT of the issue (4 blocks of width 64, 16 tokens, vocabulary 64) on dp=2 virtual ranks, at batch 16 and at
batch 128 with every block checkpointed, compiled by nn.Graph without ZeRO and with ZeRO 1-3, under the ILP
selection and (ZeRO-3) the traced layouts ("greedy"). Per row: the compiler's predicted peak per rank
(``plan.peak_bytes``), the bytes the step's collectives move (``sbpflow.comm.record``: received, summed over
ranks), its collectives by kind, the selection's modelled step time, and the median measured step on virtual
ranks (both ranks' compute in turn in this process, collectives as memory copies: not a cluster's time).
Runs on any checkout: PYTHONPATH=/path/to/other/src measures another version of the selection.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _report import machine  # noqa: E402

from sbpflow.comm import record  # noqa: E402
from sbpflow.demo.train_gpt import build, random_batches  # noqa: E402
from sbpflow.models.gpt import GPTConfig  # noqa: E402

GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
CASES = ((16, False), (128, True))  # (batch, checkpointed blocks)
ROWS = ((0, "ilp"), (1, "ilp"), (2, "ilp"), (3, "ilp"), (3, "greedy"))  # (ZeRO stage, selection)
STEPS = 3


def measure(batch: int, checkpointed: bool, zero: int, selection: str) -> dict[str, Any]:
    trainer = build(GPT, "dp=2", seed=0, graph=True, zero=zero)
    trainer.graph.config.set_sbp_selection(selection)
    for block in trainer.model.h:
        block.config.activation_checkpointing = checkpointed
    (ids, targets), = random_batches(GPT.vocab_size, 1, batch, GPT.block_size, seed=1)
    trainer.step(ids, targets)  # compiles
    with record() as log:
        trainer.step(ids, targets)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        trainer.step(ids, targets)
        times.append(time.perf_counter() - start)
    plan = trainer.graph.plan
    kinds = Counter(e.kind for e in log.events)
    return {"peak": max(plan.peak_bytes.values()), "bytes": log.total_bytes(),
            "kinds": ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
            "model_s": trainer.graph._compiled().report.selection.chosen_cost, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the zero_selection section")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = ["## ZeRO and the SBP selection: peak, link bytes, step (issue 25, 3b)", "",
             f"`PYTHONPATH=src .venv/bin/python benchmarks/zero_selection.py --write`; GPT {GPT.n_layer} x "
             f"{GPT.n_embd}, {GPT.block_size} tokens, vocabulary {GPT.vocab_size}, AdamW, dp=2 virtual ranks; "
             f"{machine()}. Peak: the compiler's `plan.peak_bytes`; bytes: received over both ranks per step; "
             "model: the selection's modelled step; step: median measured on virtual ranks.", "",
             "| batch | checkpointed | ZeRO | selection | peak | link bytes | collectives | model | step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch, checkpointed in CASES:
        for zero, selection in ROWS:
            r = measure(batch, checkpointed, zero, selection)
            lines.append(f"| {batch} | {'yes' if checkpointed else 'no'} | {zero or '-'} | {selection} | "
                         f"{r['peak'] / 2**20:.2f} MiB | {r['bytes'] / 1e6:.2f} MB | {r['kinds']} | "
                         f"{r['model_s'] * 1e3:.2f} ms | {r['step_s'] * 1e3:.1f} ms |")
            print(lines[-1], flush=True)
    body = "\n".join(lines)
    print(body)
    if args.write:
        from _report import write_section

        write_section("zero_selection", body)


if __name__ == "__main__":
    main()
