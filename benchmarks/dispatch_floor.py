"""The host calibration's dispatch floor, timed on its tiny language model (sbpflow.nn) and on a tiny GPT.

Run: ``.venv/bin/python benchmarks/dispatch_floor.py [--rounds 8] [--write]`` (``--write`` replaces the
"dispatch_floor" section of docs/benchmarks.md).

``calibrate_host`` prices sbpflow's dispatch by the CPU seconds per op of a tiny training step on one rank. The
planner may not import a shipped model, so that step is a two-block pre-LN language model built from
``sbpflow.nn`` inside ``calibrate_host``; this compares it with the tiny ``sbpflow.models.gpt.GPT`` it replaced
(vocabulary 16, 8 tokens, 2 blocks of width 16, 2 heads, AdamW, batch 2), both timed by the same loop
(thread CPU time, best of 3 runs of 10 steps), in interleaved rounds on one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _report import add_write_flag, machine, write_section  # noqa: E402

import sbpflow  # noqa: E402
from sbpflow import optim  # noqa: E402
from sbpflow.autoparallel import calibrate_host  # noqa: E402
from sbpflow.models.gpt import GPT, GPTConfig  # noqa: E402
from sbpflow.ops import schema  # noqa: E402


class OneRank:
    """The slice of torch.distributed that ``calibrate_host._dispatch`` calls, for one process."""

    def barrier(self) -> None:
        pass

    def get_world_size(self) -> int:
        return 1

    def all_gather_object(self, out: list[Any], value: Any) -> None:
        out[0] = value


def counted(step: Callable[[], None]) -> int:
    """Ops one call of ``step`` dispatches."""
    with schema.counting() as ops:
        step()
    return sum(ops.values())


def training_step(model: Any) -> Callable[[], None]:
    """One AdamW step of ``model`` (ids, targets -> loss, or (logits, loss)) on rank 0, as the floor runs it."""
    strategy = sbpflow.parallelize(model)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    ids, targets = (rng.integers(0, 16, (2, 8)) for _ in range(2))

    def step() -> None:
        x, y = strategy.shard_inputs(ids, targets)
        out = model(x, y)
        loss = out[1] if isinstance(out, tuple) else out
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    return step


def gpt_floor() -> tuple[float, int]:
    """CPU seconds per op of the tiny GPT's step on rank 0 (the floor's model before), and its ops per step."""
    sbpflow.manual_seed(0)
    step = training_step(GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16)))
    ops = counted(step)
    return calibrate_host._cpu_per_call(step, 10) / ops, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    add_write_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    where = machine()
    sbpflow.manual_seed(0)
    lm_ops = counted(training_step(calibrate_host._TinyLM()))
    gpt, lm = [], []
    for _ in range(args.rounds):
        per_op, gpt_ops = gpt_floor()
        gpt.append(per_op)
        lm.append(calibrate_host._dispatch(OneRank())[0])
    rows = [("tiny GPT (sbpflow.models.gpt, before)", gpt, gpt_ops),
            ("tiny LM from sbpflow.nn (calibrate_host now)", lm, lm_ops)]
    body = ["## Dispatch floor of the host calibration (issue 25)", "",
            f"`.venv/bin/python benchmarks/dispatch_floor.py --rounds {args.rounds} --write` on {where}. "
            "CPU microseconds per dispatched op of a tiny training step on one rank, median (min to max) over "
            f"{args.rounds} interleaved rounds.", "",
            "| step timed | ops per step | us per op | spread |", "|---|---|---|---|"]
    for name, values, ops in rows:
        body.append(f"| {name} | {ops} | {statistics.median(values) * 1e6:.1f} | "
                    f"{min(values) * 1e6:.1f} to {max(values) * 1e6:.1f} |")
    ratio = statistics.median(lm) / statistics.median(gpt)
    body += ["", f"Ratio of the medians (LM / GPT): {ratio:.3f}. The floor keeps its meaning: the CPU cost of one "
             "dispatched op of a small language model's step, the mix of ops the host model prices."]
    text = "\n".join(body)
    print(text)
    if args.write:
        write_section("dispatch_floor", text)


if __name__ == "__main__":
    main()
