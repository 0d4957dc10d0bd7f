"""Graph mode on 2 gloo processes: nn.Graph dp2 against torch DDP, nn.Graph tp2 against PyTorch DTensor (issues 8, 9).

Run: ``.venv/bin/python benchmarks/graph_dist_compare.py`` (spawns its own 2 processes with ``sbpflow launch``;
prints, and ``--write`` replaces the "graph_dist" section of docs/benchmarks.md).

All contenders live in the same 2 processes (gloo on 127.0.0.1, one torch thread each) with the same weights,
data and AdamW, and run interleaved: each round times every contender of a model in turn, a round's time is
the slower process's, and the table reports medians.

* Data parallel: the issue-4 MLP (width 1024, 3 hidden layers, batch 64, MSE; benchmarks/ddp_compare.py's)
  and the GPT of issue 8 (4 layers, width 256, 4 heads, sequence 128, batch 8, no dropout), each compiled by
  ``nn.Graph`` under dp2 (parameters B, batch S(0)) and run on the actor runtime, against the same torch model
  in ``DistributedDataParallel`` (25 MB buckets).
* Tensor parallel: the same GPT under tp2 in ``nn.Graph`` against torch's ``parallelize_module`` with
  ``ColwiseParallel`` on q, k, v and the MLP's first linear, ``RowwiseParallel`` on both output projections
  (Megatron's layout; embeddings, LayerNorms and the tied head replicated). Collective counts per step: sbpflow's
  from ``sbpflow.comm.record()``, DTensor's from torch's ``CommDebugMode``.
* The dp rows also time a bound: DDP's model, kernels and AdamW on each rank's half batch with no DDP and no
  collective (timing only; the two copies drift apart). It shares the 2 cores as every contender does, so a
  data-parallel step cannot beat it; with each contender's CPU per step (``process_time``, every thread), it
  shows what communication costs in CPU on these cores.

No gradient clipping on either side (DTensor's clip over a mix of DTensor and replicated tensors is not what is
measured here). The overlap line reads the dp2 GPT step's actor timeline (``SBPFLOW_TRACE`` format): each
collective's span runs from its issue to its first reader (it is in flight meanwhile), and the line gives the
share of those spans during which compute acts ran (backward ops).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _report import launch_runs, machine, publish, run_or_launch, timed_block_cpu, turned
from _torch_gpt import TorchBlock, TorchGPT, adamw, copy_weights
from ddp_compare import MLP_BATCH, MLP_LAYERS, MLP_WIDTH, mlp_data, placed_mlp, torch_mlp
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import sbpflow
from sbpflow import nn, optim
from sbpflow.comm import record
from sbpflow.demo.train_gpt import build
from sbpflow.models.gpt import GPTConfig
from sbpflow.runtime.trace import load, trace_path

WORLD = 2
FUSED = "fused segments"
COMPILED = "fused segments + torch.compile"
GPT = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.0)
GPT_BATCH, LR = 8, 1e-3
# DDP's own kernels and optimizer on each rank's half batch with every collective left out (its weights drift
# apart: timing only). The two processes still share the 2 cores, so no data-parallel step that runs these kernels
# can be faster: it is the bound for the dp targets, measured in the same rounds.
BOUND = "torch, no communication (bound)"
Step = Callable[[], Any]


# ----------------------------------------------------------------------------- sbpflow, compiled


class MLPStep(nn.Graph):
    """The MLP's training step in one plan: forward, MSE, backward, AdamW."""

    def __init__(self, model: nn.Module, opt: Any) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x: Any, y: Any) -> Any:
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss


def sbpflow_mlp(fused: bool = False, torch_compile: bool = False) -> tuple[Step, Any]:
    """The MLP's compiled step (``fused``: with fused segments, one act per run of compute nodes;
    ``torch_compile``: each segment under torch.compile)."""
    model, x, y = placed_mlp()
    graph = MLPStep(model, optim.AdamW(model.parameters(), lr=LR))
    graph.config.enable_fused_segments(fused or torch_compile, torch_compile=torch_compile)
    return (lambda: graph(x, y)), graph


def gpt_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, GPT.vocab_size, size=(GPT_BATCH, GPT.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def sbpflow_gpt(strategy: str, trace: str | None = None, fused: bool = False,
                torch_compile: bool = False) -> tuple[Step, Any]:
    """The demo's compiled training step (AdamW, decay on matrices) under ``strategy``, no clipping (``fused``:
    with fused segments; ``torch_compile``: each segment under torch.compile)."""
    trainer = build(GPT, strategy, lr=LR, clip=None, graph=True)
    trainer.graph.config.enable_fused_segments(fused or torch_compile, torch_compile=torch_compile)
    if trace is not None:
        trainer.graph.config.trace_path = trace
    ids, targets = trainer.inputs(*gpt_data())
    return (lambda: trainer.graph(ids, targets)), trainer


# ----------------------------------------------------------------------------- torch


def torch_gpt_ddp(reference: Any, communicate: bool = True) -> Step:
    """DDP's step on this rank's half batch; ``communicate=False``: the same model, kernels and optimizer with no
    DDP and no communication at all (see :data:`BOUND`)."""
    model = TorchGPT(GPT)
    copy_weights(reference, model)
    rank = dist.get_rank()
    ids, targets = (torch.from_numpy(a).chunk(WORLD)[rank] for a in gpt_data())  # local (B / 2, T)
    ddp = DDP(model) if communicate else model
    opt = adamw(list(ddp.parameters()), LR)
    return _torch_step(lambda: ddp(ids, targets), opt)


class TPBlock(TorchBlock):
    """TorchBlock with its heads counted from the local width: under ColwiseParallel q, k, v hold C / tp columns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # local (B, T, C), replicated
        hd = c // self.n_head
        h = self.ln_1(x)
        q, k, v = (self.attn[n](h).reshape(b, t, -1, hd).transpose(1, 2) for n in "qkv")  # (B, H / tp, T, hd)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["c_proj"](y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp["c_proj"](torch.nn.functional.gelu(self.mlp["c_fc"](self.ln_2(x))))


def torch_gpt_dtensor(reference: Any) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = TorchGPT(GPT)
    model.h = torch.nn.ModuleList([TPBlock(GPT.n_embd, GPT.n_head) for _ in range(GPT.n_layer)])
    copy_weights(reference, model)
    mesh = init_device_mesh("cpu", (WORLD,))
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    for block in model.h:
        parallelize_module(block, mesh, plan)
    ids, targets = (torch.from_numpy(a) for a in gpt_data())  # the whole batch on both ranks
    params = list(model.parameters())
    # torch's fused AdamW (sbpflow's kernel) per group of one kind: a kernel call takes DTensors or plain tensors
    groups = [{"params": [p for p in params if (p.ndim >= 2) == decay and isinstance(p, DTensor) == dt],
               "weight_decay": 0.1 if decay else 0.0} for decay in (True, False) for dt in (True, False)]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, betas=(0.9, 0.95), fused=True)
    return _torch_step(lambda: model(ids, targets), opt)


def _torch_step(loss_fn: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> Step:
    def step() -> torch.Tensor:
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def torch_mlp_ddp(reference: Any, communicate: bool = True) -> Step:
    model, contender = torch_mlp(reference)
    ddp = DDP(model) if communicate else model
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, fused=True)
    x_full, y_full = mlp_data()
    x, y = (a.chunk(WORLD)[dist.get_rank()] for a in (x_full, y_full))
    return _torch_step(lambda: ((ddp(x) - y) ** 2).mean(), opt)


# ----------------------------------------------------------------------------- measuring


def loss_value(loss: Any, local_mean: bool) -> float:
    """The step's loss over the whole batch (outside timing): sbpflow's is global; DDP's is this rank's half."""
    if not local_mean:
        return float(loss.item())
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / WORLD


def interleaved(steps: dict[str, Step], per_round: int, rounds: int
                ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median seconds per step of each contender, per contender the median over rounds of its time over the
    last contender's, torch's (a round's timings are back to back, so their ratio cancels slower drifts of the
    load), and median CPU seconds per step of the busier process. The order turns each round
    (:func:`_report.turned`)."""
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in steps}
    for r in range(rounds):
        for name in turned(list(steps), r):
            samples[name].append(timed_block_cpu(steps[name], per_round))
    theirs = samples[list(steps)[-1]]
    ratios = {k: statistics.median(a / b for (a, _), (b, _) in zip(v, theirs, strict=True))
              for k, v in samples.items()}
    times = {k: statistics.median(wall for wall, _ in v) for k, v in samples.items()}
    return times, ratios, {k: statistics.median(cpu for _, cpu in v) for k, v in samples.items()}


def sbpflow_counts(fn: Step) -> dict[str, int]:
    with record() as log:
        fn()
    return dict(sorted(log.counts().items()))


def dtensor_counts(fn: Step) -> dict[str, int]:
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        fn()
    return {str(getattr(op, "__name__", op)).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def overlap(trace_base: str, steps: int) -> tuple[float, float, float]:
    """This rank's timeline of ``steps`` dp2 steps: milliseconds per step during which some collective was in
    flight (the union of their spans), the share of that time with a compute act running, and collective acts
    per step."""
    events = load(trace_path(trace_base, sbpflow.rank(), WORLD))
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [(lanes[e["tid"]], e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X"]
    comm = _union([(a, z) for lane, a, z in spans if "/comm:" in lane])
    compute = sorted((a, z) for lane, a, z in spans if lane.endswith("/compute"))
    busy = sum(z - a for a, z in comm)
    both = sum(max(0.0, min(z, d) - max(a, c)) for a, z in comm for c, d in compute if c < z and d > a)
    acts = sum("/comm:" in lane for lane, _, _ in spans)
    return busy / 1e3 / steps, both / busy if busy else 0.0, acts / steps


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping spans merged: the time covered by at least one."""
    out: list[tuple[float, float]] = []
    for a, z in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], z))
        else:
            out.append((a, z))
    return out


# ----------------------------------------------------------------------------- the run


def compare(name: str, contenders: dict[str, tuple[Step, bool]], per_round: int, rounds: int,
            counts: dict[str, Callable[[Step], Any]]) -> dict[str, Any]:
    first = {k: loss_value(fn(), local) for k, (fn, local) in contenders.items()}
    steps = {k: fn for k, (fn, _) in contenders.items()}
    for fn in steps.values():
        fn()
    collectives = {k: counts[k](steps[k]) for k in counts}
    times, ratios, cpu = interleaved(steps, per_round, rounds)
    return {"name": name, "times": times, "ratios": ratios, "cpu": cpu, "first": first, "counts": collectives}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # 2 processes on 2 cores: one thread each
    sbpflow.distributed.init()
    results = []
    mlp_step, mlp_graph = sbpflow_mlp()
    mlp = {"nn.Graph dp2": (mlp_step, False), f"nn.Graph dp2, {FUSED}": (sbpflow_mlp(fused=True)[0], False)}
    if args.torch_compile:
        mlp[f"nn.Graph dp2, {COMPILED}"] = (sbpflow_mlp(torch_compile=True)[0], False)
    results.append(compare(f"MLP {MLP_WIDTH}x{MLP_LAYERS}, batch {MLP_BATCH}, dp2",
                           {BOUND: (torch_mlp_ddp(mlp_graph.model, communicate=False), True), **mlp,
                            "DDP": (torch_mlp_ddp(mlp_graph.model), True)},
                           args.steps, args.rounds, {"nn.Graph dp2": sbpflow_counts}))
    for kind in ("dp", "tp"):
        strategy = f"{kind}={WORLD}"
        step, trainer = sbpflow_gpt(strategy)
        ours = {f"nn.Graph {kind}2": (step, False),
                f"nn.Graph {kind}2, {FUSED}": (sbpflow_gpt(strategy, fused=True)[0], False)}
        if args.torch_compile:
            ours[f"nn.Graph {kind}2, {COMPILED}"] = (sbpflow_gpt(strategy, torch_compile=True)[0], False)
        bound = {BOUND: (torch_gpt_ddp(trainer.model, communicate=False), True)} if kind == "dp" else {}
        peer = ({"DDP": (torch_gpt_ddp(trainer.model), True)} if kind == "dp"
                else {"DTensor tp2": (torch_gpt_dtensor(trainer.model), False)})
        counts = {f"nn.Graph {kind}2": sbpflow_counts, **({"DTensor tp2": dtensor_counts} if kind == "tp" else {})}
        results.append(compare(f"GPT {GPT.n_layer}x{GPT.n_embd}, {GPT.block_size} tokens, batch {GPT_BATCH}, "
                               f"{kind}2", {**bound, **ours, **peer}, args.steps, args.rounds, counts))
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "dp2.json")
        traced, traced_trainer = sbpflow_gpt(f"dp={WORLD}", trace=base)
        for _ in range(3):
            traced()
        traced_trainer.graph._last.executor.close()
        lines = overlap(base, 3)
    if sbpflow.rank() == 0:
        if args.json:  # one launch of several (see main): the parent reports
            Path(args.json).write_text(json.dumps({"results": results, "timeline": lines}))
            return
        publish("graph_dist", report(results, lines, args), args.write)


def launches(args: argparse.Namespace) -> int:
    """``--launches N``: the benchmark as N fresh pairs of processes (:func:`_report.launch_runs`); the report
    gives each launch's ratio and their median, which the targets read; the rest (times, counts, timeline) is
    the first launch's."""
    forwarded = ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    if args.torch_compile:
        forwarded.append("--torch-compile")
    runs = launch_runs(__file__, WORLD, forwarded, args.launches)
    first = runs[0]
    for k, r in enumerate(first["results"]):
        per_launch = {who: [run["results"][k]["ratios"][who] for run in runs] for who in r["ratios"]}
        r["launches"] = per_launch
        r["ratios"] = {who: statistics.median(v) for who, v in per_launch.items()}
    publish("graph_dist", report(first["results"], tuple(first["timeline"]), args), args.write)
    return 0


def report(results: list[dict[str, Any]], timeline: tuple[float, float, float], args: argparse.Namespace) -> str:
    launched = f" --launches {args.launches}" if args.launches > 1 else ""
    lines = [
        "## Graph mode on 2 processes: nn.Graph vs DDP (dp2) and vs DTensor (tp2) (issues 8, 9)",
        "",
        f"`.venv/bin/python benchmarks/graph_dist_compare.py{launched} --write` on "
        f"{machine(threads=1, processes=WORLD)}: "
        "gloo on 127.0.0.1; each model's contenders run in the same 2 processes with the same weights, data and "
        f"AdamW (no clipping), {args.rounds} interleaved rounds (the order turned by one each round) of "
        f"{args.steps} steps (each after one untimed step), median step time of the slower "
        "process. sbpflow runs the compiled step (`nn.Graph`) on the actor runtime: all-reduces and all-gathers of "
        "cpu shards are issued in flight and their readers wait, so where a process has no other collective (dp2) "
        "its actors run on the caller's thread alone while gloo's threads move the bytes; tp2's all-to-alls get a "
        "communication thread. DDP: default 25 MB buckets. DTensor: `parallelize_module` with ColwiseParallel "
        "(q, k, v, c_fc) and RowwiseParallel (both c_proj), embeddings, LayerNorms and tied head replicated.",
        "",
        f"| model | contender | ms/step{' (first launch)' if launched else ''} | ratio to torch (median of "
        f"per-round ratios{', median over launches' if launched else ''}) | CPU ms/step (busier process) "
        "| first loss | collectives per step (per process) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        names = list(r["times"])
        for who in names:
            ratio = "1.000" if who == names[-1] else f"**{r['ratios'][who]:.3f}**"
            counts = r["counts"].get(who, "as above" if FUSED in who else "none" if who == BOUND
                                     else "DDP's gradient buckets (not recorded)")
            lines.append(f"| {r['name']} | {who} | {r['times'][who] * 1e3:.1f} | {ratio} | {r['cpu'][who] * 1e3:.1f} "
                         f"| {r['first'][who]:.6f} "
                         f"| {counts} |")
    if args.launches > 1:
        lines += ["", f"Ratios to torch: the median over {args.launches} launches (fresh pairs of processes, one "
                  "after another) of each launch's median of per-round ratios; each launch's ratio:", ""]
        for r in results:
            for who, values in r["launches"].items():
                if who != list(r["times"])[-1]:
                    lines.append(f"- {r['name']}, {who}: {', '.join(f'{v:.3f}' for v in values)}")
    busy, share, n = timeline
    dp = [min(r["ratios"][k] for k in list(r["times"])[:-1] if k != BOUND) for r in results if "DDP" in r["times"]]
    bounds = [f"{r['name'].split(',')[0]} {r['ratios'][BOUND]:.3f}x" for r in results if BOUND in r["times"]]
    extra = [_communication_cpu(r) for r in results if BOUND in r["times"]]
    saturation = ", ".join(f"{r['name'].split(',')[0]} {r['cpu'][BOUND] / r['times'][BOUND]:.0%}" for r in results
                     if BOUND in r["times"])
    tp = [min(r["ratios"][k] for k in list(r["times"])[:-1]) for r in results if "DTensor tp2" in r["times"]]
    lines += [
        "",
        f"Timeline of the dp2 GPT step (rank 0, actor runtime, mean of 3 steps): {n:.0f} collective acts, "
        f"{busy:.1f} ms with a collective in flight (each from its issue to its first reader: an upper bound of "
        f"its time on the wire), {share:.0%} of that while compute acts ran (the rest of backward).",
        "",
        "Fused segments (`config.enable_fused_segments`, on by default): each run of compute nodes between "
        "communication nodes is one act of generated straight-line Python; the nn.Graph contenders without the "
        "words turn them off. Targets count sbpflow's better contender per model.",
        "",
        f"The bound ({BOUND}: DDP's kernels and optimizer on each half batch, every collective left out, in the "
        f"same rounds) against DDP: {', '.join(bounds)}. A data-parallel step running torch's kernels cannot go "
        "below it on these 2 shared cores. The bound's CPU per step is this share of its wall time: "
        f"{saturation} (each process keeps its core busy); communication adds CPU on the same cores (gloo's "
        "threads copy and reduce every byte), per step over the "
        f"bound's, busier process: {'; '.join(extra)}. Overlap hides waiting, not CPU: what a collective costs in "
        "CPU is paid on the cores the compute threads need.",
        "",
        f"Targets: dp2 at most 0.95x DDP: worst {max(dp):.3f}x ({'met' if max(dp) <= 0.95 else 'missed'}); "
        f"tp2 faster than DTensor: {max(tp):.3f}x ({'met' if max(tp) < 1.0 else 'missed'}).",
    ]
    return "\n".join(lines)


def _communication_cpu(r: dict[str, Any]) -> str:
    """One dp model's CPU per step over the bound's, each contender but the bound (the first launch's)."""
    cpu, base = r["cpu"], r["cpu"][BOUND]
    others = ", ".join(f"{who} {(cpu[who] - base) * 1e3:+.1f} ms" for who in r["times"] if who != BOUND)
    return f"{r['name'].split(',')[0]}: {others}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per round (default 3)")
    parser.add_argument("--write", action="store_true", help="replace the graph_dist section of docs/benchmarks.md")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time fused segments under torch.compile (tens of seconds of compiling first)")
    parser.add_argument("--launches", type=int, default=3,
                        help="run the benchmark in this many fresh pairs of processes and report the median ratio "
                             "(default 3: one launch's ratio moves by 5-10%% on a shared 2-core machine)")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # one launch of several: rank 0 writes its results here
    args = parser.parse_args()
    if args.launches > 1 and "RANK" not in os.environ:
        return launches(args)
    return run_or_launch(__file__, WORLD, worker, args)


if __name__ == "__main__":
    sys.exit(main())
