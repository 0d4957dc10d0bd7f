"""Overhead of the actor runtime: µs per act, and a step on the runtime against the in-order executor.

Plans are hand-built (sbpflow.runtime.builder) on 2 virtual ranks, with tiny tensors so that what is
timed is the executors, not the kernels:

1. a chain of N elementwise ops (one compute thread, no communication);
2. the same chain with an all-reduce every 8 ops (acts alternate between the compute lane and a comm lane);
3. a micro-batched step: m = 4, unpack/repeat/accumulate/pack around a matmul chain with collectives;
4. a compiled GPT training step (nn.Graph, AdamW) on dp2 and dp2 x tp2, executor "inorder" vs "actors".

Each row: the step time (CPU time of the process) of ``run_plan`` and of ``ActorRuntime.run``, µs per act
of each, and what the runtime adds per act (its register bookkeeping; on virtual ranks the caller's thread
plays every lane through ``Board.play``, so there are no thread hand-offs here: those cost on real
processes, where they buy overlap: benchmarks/graph_dist_compare.py). Timings alternate between the
contenders in rounds and report medians, so background load hits all alike.

Run: ``.venv/bin/python benchmarks/runtime_overhead.py`` (prints); ``--write`` also writes the
"runtime_overhead" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _report import machine, write_section

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.runtime import ActorRuntime, run_plan
from sbpflow.runtime.builder import PlanBuilder

torch.set_num_threads(1)
P2 = sbpflow.placement("cpu", [0, 1])


def chain(n: int, comm_every: int = 0) -> PhysicalPlan:
    """input -> n ops (relu/neg alternating; an all-reduce after every ``comm_every`` ops) -> output."""
    b = PlanBuilder()
    x = b.input("x", (16, 16), P2, (S.split(0),))
    for i in range(n):
        x = b.compute("relu" if i % 2 else "neg", x)
        if comm_every and (i + 1) % comm_every == 0:
            x = b.boxing(b.compute("sum", x, dim=(0,), out_sbp=(S.partial_sum,)), (S.broadcast,))
            x = b.compute("mul", b.compute("unsqueeze", x, dim=0), b.input(f"ones{i}", (16, 16), P2, (S.split(0),)))
    b.output("y", x)
    return b.build()


def micro_step(layers: int, m: int = 4) -> PhysicalPlan:
    """A training-shaped step: per micro-batch a matmul chain, a loss all-reduce and a gradient all-reduce."""
    b = PlanBuilder(micro_batches=m)
    x = b.unpack(b.input("x", (64, 16), P2, (S.split(0),)))
    w = b.variable("w", (16, 16), P2, (S.broadcast,))
    wk = b.repeat(w)
    h = x
    for _ in range(layers):
        h = b.compute("relu", b.compute("matmul", h, wk))
    loss = b.boxing(b.compute("sum", h, out_sbp=(S.partial_sum,)), (S.broadcast,))
    grad = b.compute("matmul", b.compute("permute", x, dims=(1, 0), out_sbp=(S.split(1),)), h,
                     out_sbp=(S.partial_sum,))
    b.output("w_grad", b.accumulate(b.boxing(grad, (S.broadcast,))))
    b.output("loss", b.pack(loss, "mean"))
    return b.build()


def feeds_for(plan: PhysicalPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    feeds: dict[str, Any] = {}
    variables: dict[str, Any] = {}
    for node in plan.nodes:
        if node.kind in ("input", "variable"):
            buf = plan.bufs[node.outputs[0]]
            target = feeds if node.kind == "input" else variables
            target[node.name] = {r: torch.randn(buf.local_shape(r)) for r in (0, 1)}
    return feeds, variables


def interleaved(contenders: dict[str, Callable[[], object]], inner: int, rounds: int) -> dict[str, float]:
    """Median CPU seconds of this process per call, and (key "ratio") the median over rounds of the second
    contender's time over the first's in the same round. Both executors run on the caller's thread here (virtual
    ranks, one torch thread), so CPU time is their cost, and time the scheduler gives other jobs is not counted;
    a round's two timings are taken back to back, so their ratio cancels slower drifts of the machine's load, and
    in turns (AB, BA, AB, ...): the one that runs right after the other (its caches holding the other's data)
    is not always the same one (on this shared machine that order alone moved a GPT row's ratio by several percent)."""
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for fn in contenders.values():
        fn()
    names = list(contenders)
    for k in range(rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            fn = contenders[name]
            start = time.process_time()
            for _ in range(inner):
                fn()
            samples[name].append((time.process_time() - start) / inner)
    first, second = samples.values()
    result = {k: statistics.median(v) for k, v in samples.items()}
    result["ratio"] = statistics.median(b / a for a, b in zip(first, second, strict=True))
    return result


def row(name: str, plan: PhysicalPlan, inner: int, rounds: int) -> str:
    backend = SimulatedBackend()
    feeds, variables = feeds_for(plan)
    with ActorRuntime(plan, backend) as rt:
        rt.run(feeds, variables)
        acts = rt.stats.acts
        times = interleaved({
            "in-order": lambda: run_plan(plan, feeds, variables, backend),
            "actors": lambda: rt.run(feeds, variables),
        }, inner, rounds)
    return table_row(name, acts, times)


def table_row(name: str, acts: int, seconds: dict[str, float]) -> str:
    io, rt = seconds["in-order"] * 1e6, seconds["actors"] * 1e6
    return (f"| {name} | {acts} | {io:.0f} | {rt:.0f} | {seconds['ratio']:.3f}x | {io / acts:.1f} | {rt / acts:.1f} "
            f"| {(rt - io) / acts:.1f} |")


# (vocab, sequence, layers, width, batch): a tiny GPT, where the executors' own work is most of a step, and
# issue 8's GPT, where the kernels are
TINY_GPT = (64, 32, 2, 64, 8)
ISSUE_GPT = (256, 128, 4, 256, 8)


def gpt_row(strategy: dict[str, int], m: int, rounds: int, shape: tuple[int, ...] = TINY_GPT,
            inner: int = 2) -> tuple[str, float]:
    """The same compiled GPT step (two models, same weights) on each executor; the step includes nn.Graph's
    own per-call work, as a user sees it."""
    import numpy as np

    from sbpflow import nn
    from sbpflow.models.gpt import GPT, GPTConfig, parallelize

    vocab, seq, layers, width, batch = shape

    def make(executor: str) -> tuple[Callable[[], object], Any]:
        sbpflow.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=4, n_embd=width,
                              dropout=0.0))
        layout = parallelize(model, **strategy)
        opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-3)

        class Step(nn.Graph):
            def __init__(self) -> None:
                super().__init__()
                self.model = model
                self.add_optimizer(opt)
                self.config.set_gradient_accumulation_steps(m)
                self.config.set_executor(executor)

            def build(self, ids: Any, targets: Any) -> Any:
                _, loss = self.model(ids, targets)
                loss.backward()
                return loss

        graph, rng = Step(), np.random.default_rng(0)
        ids, targets = layout.shard_inputs(rng.integers(0, vocab, (batch, seq)), rng.integers(0, vocab, (batch, seq)))
        return (lambda: graph(ids, targets)), graph

    run_io, _ = make("inorder")
    run_rt, graph = make("actors")
    times = interleaved({"in-order": run_io, "actors": run_rt}, inner, 3 * rounds)
    acts = graph._last.executor.stats.acts
    short = {"data": "dp", "tensor": "tp", "pipeline": "pp"}
    size = "tiny GPT" if shape == TINY_GPT else f"GPT {layers}x{width}"
    name = f"{size} step, " + " x ".join(f"{short[k]}{v}" for k, v in strategy.items()) + f", m={m} (nn.Graph)"
    return table_row(name, acts, times), times["ratio"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cases = [
        ("chain of 200 ops, no comm", chain(200), 10),
        ("chain of 200 ops, all-reduce every 8", chain(200, comm_every=8), 5),
        ("micro-batched step (m=4, 8 layers)", micro_step(8), 10),
    ]
    header = ["| plan | acts | in-order step (µs) | actor runtime step (µs) | runtime / in-order (median of per-round "
              "ratios) | in-order µs/act | runtime µs/act | runtime overhead µs/act |",
              "|---|---|---|---|---|---|---|---|"]
    rows = [row(name, plan, inner, args.rounds) for name, plan, inner in cases]
    gpt = [gpt_row(strategy, m, args.rounds) for strategy, m in (({"data": 2}, 1), ({"data": 2}, 4),
                                                                 ({"data": 2, "tensor": 2}, 1))]
    issue = [gpt_row(strategy, m, args.rounds, ISSUE_GPT, inner=1) for strategy, m in (({"data": 2}, 1),
                                                                                        ({"data": 2}, 4))]
    rows += [text for text, _ in gpt + issue]
    worst = max(ratio for _, ratio in gpt)
    worst_issue = max(ratio for _, ratio in issue)
    body = "\n".join([
        "## Actor runtime overhead (issue 9)",
        "",
        f"`.venv/bin/python benchmarks/runtime_overhead.py --write` on {machine()}, 2 virtual ranks, 16x16 float "
        "shards (executor cost, not kernel cost); medians of interleaved rounds, in CPU time of the process (on "
        "virtual ranks both executors act on the caller's thread, so CPU time is their cost; wall time on this "
        "shared machine mostly measures other jobs). An act is one node on one "
        "micro-batch over all of this process's ranks; µs/act = step / acts (kernels included), the overhead "
        "column is (runtime step - in-order step) / acts. The GPT rows time `graph(ids, targets)` as a user calls "
        "it, AdamW: the tiny GPT (2 layers, width 64, seq 32, batch 8) is where the executors' own work weighs "
        "most, issue 8's GPT (4 layers, width 256, seq 128, batch 8, both ranks' kernels in this one process) "
        "is the step the issue names. Two shared cores under other jobs' load: expect noise of a few percent "
        "between runs. The summary lines' aim (issue 9): the GPT step on the runtime within 5% of the in-order "
        "executor.",
        "",
        *header,
        *rows,
        "",
        f"Issue 8's GPT step on the actor runtime against the in-order executor: worst {worst_issue:.3f}x (aim: "
        f"at most 1.05x, {'met' if worst_issue <= 1.05 else 'missed'}); the tiny GPT's worst {worst:.3f}x "
        f"({'within' if worst <= 1.05 else 'beyond'} the aim).",
    ])
    print(body)
    if args.write:
        write_section("runtime_overhead", body)


if __name__ == "__main__":
    main()
