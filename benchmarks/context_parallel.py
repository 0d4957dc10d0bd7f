"""Context parallelism (issue 27): the longest trainable sequence under a per-rank memory cap, and causal balance.

    .venv/bin/python benchmarks/context_parallel.py            # prints
    .venv/bin/python benchmarks/context_parallel.py --write    # and writes its section of docs/benchmarks.md

**Longest sequence.** A Llama (4 layers, width 256, 8 heads, batch 1) is built under ``sbpflow.meta_init()`` and
its training step (forward, backward, AdamW) compiled by ``nn.Graph.compile_only`` on cp = 1, 2, 4, 8 virtual
ranks, ids split on the sequence, parameters broadcast, with eager's SBP choice (``sbp_selection="greedy"``: q,
k, v stay ``S(T)`` and attention runs as a ring). The cap is the cp = 1 plan's ``peak_bytes`` at 4096 tokens;
for each cp the longest sequence (a multiple of 64 cp) whose plan peaks under it is found by bisection. The
plan's peak counts the registers it holds between ops (activations, parameters, gradients, optimizer state);
the ring kernel's transient buffers (the K/V block in flight; torch's flash kernel computes each block) are not
in it.

**Balance.** Under a causal mask the ring skips the blocks wholly above the diagonal; the table gives each
rank's computed (query, key) pairs, relative to the mean, for plain ``S(T)`` (the layout shipped: member p
computes p + 1 blocks; a zig-zag layout that would even this out is not done).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _report import add_write_flag, machine, write_section  # noqa: E402

import sbpflow  # noqa: E402
from sbpflow._layout import split_range  # noqa: E402
from sbpflow.models.llama import Llama, LlamaConfig  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402

CONFIG = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 1 << 20}
BASE = 4096  # the cp = 1 sequence that sets the cap


class _Step(sbpflow.nn.Graph):
    def __init__(self, model: Llama, opt: sbpflow.optim.Optimizer) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.sbp_selection = "greedy"

    def build(self, ids: sbpflow.Tensor, targets: sbpflow.Tensor) -> sbpflow.Tensor:
        _, loss = self.model(ids, targets)
        loss.backward()
        return loss


def peak(cp: int, t: int) -> int:
    """The compiled step's largest per-rank ``peak_bytes`` for a sequence of ``t`` tokens over ``cp`` ranks."""
    placement = sbpflow.placement("cpu", list(range(cp)))
    with sbpflow.meta_init():
        model = Llama(LlamaConfig(**CONFIG))  # type: ignore[arg-type]
    model.to_global(placement, (broadcast,))
    step = _Step(model, sbpflow.optim.AdamW(model.parameters(), lr=1e-4))
    ids = [sbpflow.meta_tensor(1, t, dtype=torch.int64, placement=placement, sbp=(split(1),)) for _ in range(2)]
    return max(step.compile_only(*ids).plan.peak_bytes.values())


def longest(cp: int, cap: int) -> int:
    unit = 64 * cp
    lo, hi = unit, unit
    while peak(cp, hi) <= cap:
        lo, hi = hi, hi * 2
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if peak(cp, mid) <= cap else (lo, mid)
    return lo


def causal_work(cp: int, t: int) -> list[int]:
    """(query, key) pairs each ring member computes under a causal mask (whole blocks; skipped ones: none)."""
    rows = [split_range(t, cp, p) for p in range(cp)]
    return [sum((q1 - q0) * (k1 - k0) for k0, k1 in rows if k0 <= q1 - 1) for q0, q1 in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_write_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cap = peak(1, BASE)
    lines = [f"Machine: {machine()}.", "",
             f"Llama {CONFIG['num_hidden_layers']} layers, width {CONFIG['hidden_size']}, "
             f"{CONFIG['num_attention_heads']} heads, batch 1, fp32; "
             f"cap = the cp = 1 plan's peak at {BASE} tokens ({cap / 2**20:.1f} MiB per rank).", "",
             "| cp | longest sequence | × cp = 1 | aim 0.9 × cp |", "|---|---|---|---|"]
    base = longest(1, cap)
    for cp in (1, 2, 4, 8):
        n = base if cp == 1 else longest(cp, cap)
        lines.append(f"| {cp} | {n} | {n / base:.2f} | {0.9 * cp:.1f} |")
        print(lines[-1], flush=True)
    lines += ["", "Causal work per rank under plain S(T) (sequence 4096), max and min over the mean:", "",
              "| cp | max / mean | min / mean |", "|---|---|---|"]
    for cp in (2, 4, 8):
        work = causal_work(cp, 4096)
        mean = sum(work) / cp
        lines.append(f"| {cp} | {max(work) / mean:.2f} | {min(work) / mean:.2f} |")
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section("context_parallel", "## Context parallelism: longest sequence and causal balance\n\n" + body)


if __name__ == "__main__":
    main()
