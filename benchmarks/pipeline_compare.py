"""Pipeline parallelism on 2 and 4 gloo processes: sbpflow's compiled 1F1B against torch.distributed.pipelining.

Run: ``PYTHONPATH=src python benchmarks/pipeline_compare.py [--write]`` (spawns 2, then 4 processes with
``sbpflow launch``; ``--write`` fills the "pipeline-compare" section of docs/benchmarks.md).

The same GPT (4 blocks, width 128, 64 tokens, global batch 16, 8 micro-batches, dropout off, AdamW, gradient
clipping 1.0) is split by blocks into p = world stages, one per process. sbpflow: ``nn.Graph`` with
``pipeline_schedule`` 1f1b (registers make the schedule; the actor runtime runs it). torch:
``PipelineStage`` with ``Schedule1F1B`` and ``ScheduleGPipe``; the head is tied to the embedding as in
sbpflow's model, so its gradient is summed between the first and last stage (Megatron's way), and the
clipping norm is summed over stages. Both take the batch as tensors laid out once and give the loss on the last
stage. Timed rounds alternate between the contenders; each round's time is
the slowest process's, and the table reports medians. The first steps' losses are compared too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as TF
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import launch_runs, timed_block_cpu, turned  # noqa: E402
from _torch_gpt import TorchBlock  # noqa: E402

import sbpflow  # noqa: E402
from sbpflow.demo.train_gpt import build  # noqa: E402
from sbpflow.graph.pipeline import activation_peaks  # noqa: E402
from sbpflow.models.gpt import GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
BATCH, MICRO, LR, CLIP = 16, 8, 3e-3, 1.0
SECTION = "pipeline-compare"


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CONFIG.vocab_size, size=(BATCH, CONFIG.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


# ----------------------------------------------------------------------------- sbpflow


def sbpflow_step(p: int, fused: bool = False, group: bool = True) -> tuple[Callable[[], float], Any]:
    """The demo's trainer under pp=p with 8 micro-batches, compiled (``fused``: with fused segments, one act per
    run of compute nodes of a stage and part; ``group=False``: one accumulate node per gradient instead of one per
    stage's backward, ``graph.group``); returns its step and trainer.

    Like torch's step below: the batch is laid out once (the ids on the first stage, the targets on the last), and
    the loss is read where it is, on the last stage (``trainer.step`` would lay the arrays out again at every step
    and send the loss to every process, a synchronisation torch's contender does not have)."""
    trainer = build(CONFIG, f"pp={p}", lr=LR, clip=CLIP, graph=True, micro_batches=MICRO, schedule="1f1b")
    trainer.graph.config.enable_fused_segments(fused)
    trainer.graph.config.group_accumulates = group
    ids, targets = trainer.inputs(*data())
    last = dist.get_rank() in trainer.strategy.stages[-1].flat_ranks

    def step() -> float:
        loss = trainer.graph(ids, targets)
        return float(loss.to_local()) if last else float("nan")

    return step, trainer


# ----------------------------------------------------------------------------- torch


class TorchStage(torch.nn.Module):
    """One pipeline stage of sbpflow's GPT in torch: embeddings on the first, ln_f and the tied head on the last."""

    def __init__(self, reference: Any, blocks: list[int], first: bool, last: bool) -> None:
        super().__init__()
        c = CONFIG.n_embd
        self.first, self.last = first, last
        self.wte = torch.nn.Embedding(CONFIG.vocab_size, c) if first or last else None
        self.wpe = torch.nn.Embedding(CONFIG.block_size, c) if first else None
        self.h = torch.nn.ModuleList([TorchBlock(c, CONFIG.n_head) for _ in blocks])
        self.ln_f = torch.nn.LayerNorm(c) if last else None
        self._load(reference, blocks)

    def _load(self, reference: Any, blocks: list[int]) -> None:
        values = {n: torch.from_numpy(v) for n, v in reference.items()}
        renamed = {f"h.{i}.": f"h.{j}." for i, j in zip(blocks, range(len(blocks)), strict=True)}
        with torch.no_grad():
            for name, param in self.named_parameters():
                source = name
                for mine, theirs in renamed.items():
                    if name.startswith(theirs):
                        source = mine + name[len(theirs):]
                param.copy_(values[source])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            assert self.wte is not None and self.wpe is not None
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))  # local (B / m, T, C)
        for block in self.h:
            x = block(x)
        if self.last:
            assert self.ln_f is not None and self.wte is not None
            x = self.ln_f(x) @ self.wte.weight.T  # (B / m, T, V)
        return x


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return TF.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class SavedBytes:
    """Bytes of activations torch keeps for backward, live at once (a saved-tensors hook; CPU, no allocator).

    Every tensor autograd saves is counted once per storage from its save until autograd drops it (after its
    backward, or with the graph); parameters (and views of them, such as the head's ``wte.weight.T``) are not
    activations and are skipped. ``peak`` is the most bytes held at once since the last :meth:`reset`."""

    def __init__(self, skip: list[torch.Tensor]) -> None:
        self.skip = {q.untyped_storage().data_ptr() for q in skip}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [saves held, bytes]
        self.bytes = self.peak = 0

    def reset(self) -> None:
        self.peak = self.bytes

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.skip or t.device.type != "cpu":
            return t
        entry = self.live.setdefault(ptr, [0, storage.nbytes()])
        if entry[0] == 0:
            self.bytes += entry[1]
            self.peak = max(self.peak, self.bytes)
        entry[0] += 1
        return _Saved(self, ptr, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[ptr]


class _Saved:
    """A saved tensor as autograd holds it: dropping it (autograd freed the node's saved values) releases it."""

    __slots__ = ("owner", "ptr", "tensor")

    def __init__(self, owner: SavedBytes, ptr: int, tensor: torch.Tensor) -> None:
        self.owner, self.ptr, self.tensor = owner, ptr, tensor

    def __del__(self) -> None:
        self.owner.release(self.ptr)


def sbpflow_activation_bytes(trainer: Any, rank: int, step: Callable[[], object]) -> int:
    """The same count for sbpflow: one more step with the plan's bound kernels watched (what every act calls),
    the distinct storages of one micro-batch's activation registers on this rank (a reshape or permute that torch
    returns as a view shares its input's storage, as in torch's count; a view of the step's batch is not counted),
    times the most micro-batches the runtime's register counters saw held at once on this stage (under 1F1B all of
    them are full together at the last warm-up forward)."""
    from sbpflow.boxing.execute import InFlight

    compiled = trainer.graph._compiled()
    pipe = compiled.plan.pipeline
    stage = next(s for s, ranks in enumerate(pipe.stages) if rank in ranks)
    held = set(pipe.activations.get(stage, ()))
    storages: dict[int, dict[int, int]] = {}  # micro-batch -> {storage pointer: bytes}
    runtime = compiled.executor
    prog = runtime._prog  # the bound kernels every act of the runtime calls
    nodes = {n.id: n for n in compiled.plan.nodes}
    real = dict(prog.acts)

    inputs_seen: set[int] = set()  # storages of the step's inputs: live all step anyway, as torch's batch

    def note(node: Any, b: int, value: Any, micro: int) -> None:
        if not isinstance(value, dict) or not isinstance(value.get(rank), torch.Tensor):
            return
        storage = value[rank].untyped_storage()
        if node.kind == "input":
            inputs_seen.add(storage.data_ptr())
        elif b in held and storage.data_ptr() not in inputs_seen:
            storages.setdefault(micro, {})[storage.data_ptr()] = storage.nbytes()

    def watch(node: Any, run: Any) -> Any:
        def watched(inputs: Any, state: Any, micro: int) -> list[Any]:
            outputs = run(inputs, state, micro)
            for b, value in zip(node.outputs, outputs, strict=False):
                if isinstance(value, InFlight):  # a receive in flight: its buffer, once a reader has waited for it
                    value.waited = lambda node=node, b=b, value=value, micro=micro: note(node, b, value.result, micro)
                else:
                    note(node, b, value, micro)
            return outputs
        return watched

    prog.acts.update({nid: watch(nodes[nid], run) for nid, run in real.items()})
    runtime._program = None  # the next run binds the actors to the watched kernels
    try:
        step()
    finally:
        prog.acts.update(real)
        runtime._program = None
    per_micro = max((sum(d.values()) for d in storages.values()), default=0)
    return per_micro * activation_peaks(pipe, compiled.executor.stats.peak_slots).get(stage, 0)


def torch_step(p: int, schedule_cls: Any, reference: dict[str, np.ndarray],
               block_stage: tuple[int, ...], saved: dict[str, SavedBytes], name: str) -> Callable[[], float]:
    rank = dist.get_rank()
    blocks = [i for i, s in enumerate(block_stage) if s == rank]
    stage_module = TorchStage(reference, blocks, rank == 0, rank == p - 1)
    stage = PipelineStage(stage_module, rank, p, torch.device("cpu"))
    schedule = schedule_cls(stage, MICRO, loss_fn=_loss)
    params = list(stage_module.parameters())
    groups = [{"params": [q for q in params if q.ndim >= 2], "weight_decay": 0.1},
              {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), fused=True)  # the kernel sbpflow's AdamW runs
    tied = dist.new_group([0, p - 1])
    ids, targets = (torch.from_numpy(a) for a in data())
    counter = saved[name] = SavedBytes([*params, ids, targets])

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        counter.reset()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            if rank == 0:
                schedule.step(ids)
            elif rank == p - 1:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
        _sum_tied_grad(stage_module, tied, rank, p)
        _clip(params, stage_module, rank, p)
        opt.step()
        return float(torch.stack(losses).mean()) if losses else float("nan")

    return step


def _sum_tied_grad(module: TorchStage, group: Any, rank: int, p: int) -> None:
    """The embedding and the head share one weight: both stages' gradients summed, on both."""
    if rank in (0, p - 1) and module.wte is not None:
        grad = module.wte.weight.grad
        assert grad is not None
        dist.all_reduce(grad, group=group)


def _clip(params: list[torch.Tensor], module: TorchStage, rank: int, p: int) -> None:
    """Global-norm clipping over every stage, the tied weight counted once (on the first stage)."""
    skip = module.wte.weight if rank == p - 1 and rank != 0 and module.wte is not None else None
    sq = sum(float(q.grad.pow(2).sum()) for q in params if q.grad is not None and q is not skip)
    total = torch.tensor([sq], dtype=torch.float64)
    dist.all_reduce(total)
    scale = CLIP / (float(total.sqrt()) + 1e-6)
    if scale < 1.0:
        for q in params:
            if q.grad is not None:
                q.grad.mul_(scale)


# ----------------------------------------------------------------------------- timing


FUSED = "sbpflow 1f1b (graph, fused segments)"  # the default
PLAIN = "sbpflow 1f1b (graph, unfused)"  # enable_fused_segments(False)
UNGROUPED = "sbpflow 1f1b (graph, one accumulate per gradient)"


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    sbpflow.distributed.init()
    p = dist.get_world_size()
    sbp_step, trainer = sbpflow_step(p)
    fused_step, fused_trainer = sbpflow_step(p, fused=True)
    reference = {n: t.detach().to_global(placement=trainer.strategy.everywhere,
                                         sbp=sbpflow.sbp.broadcast).numpy()
                 for n, t in trainer.model.named_parameters()}
    block_stage = trainer.strategy.block_stage
    saved: dict[str, SavedBytes] = {}
    contenders = {PLAIN: sbp_step, FUSED: fused_step,
                  "torch Schedule1F1B": torch_step(p, Schedule1F1B, reference, block_stage, saved,
                                                   "torch Schedule1F1B"),
                  "torch ScheduleGPipe": torch_step(p, ScheduleGPipe, reference, block_stage, saved,
                                                    "torch ScheduleGPipe")}
    if args.ungrouped:  # before graph.group: the same plan with one accumulate node per gradient, timed second
        ungrouped_step, ungrouped_trainer = sbpflow_step(p, group=False)
        names = list(contenders)
        contenders = {names[0]: contenders[names[0]], UNGROUPED: ungrouped_step,
                      **{name: contenders[name] for name in names[1:]}}
    first = {name: [fn() for _ in range(2)] for name, fn in contenders.items()}  # warm-up; losses compared
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name in turned(list(contenders), r):  # a contender's place in the round turns too
            samples[name].append(timed_block_cpu(contenders[name], args.steps))
    medians = {name: statistics.median(wall for wall, _ in v) for name, v in samples.items()}
    cpu = {name: statistics.median(c for _, c in v) for name, v in samples.items()}
    compiled = trainer.graph._compiled()
    peaks = activation_peaks(compiled.plan.pipeline, compiled.executor.stats.peak_slots)
    mine = peaks.get(dist.get_rank(), 0)
    memory = {PLAIN: sbpflow_activation_bytes(trainer, dist.get_rank(), sbp_step),
              FUSED: sbpflow_activation_bytes(fused_trainer, dist.get_rank(), fused_step),
              **{name: counter.peak for name, counter in saved.items()}}
    if args.ungrouped:
        memory[UNGROUPED] = sbpflow_activation_bytes(ungrouped_trainer, dist.get_rank(), ungrouped_step)
    gathered: list[Any] = [None] * p
    dist.all_gather_object(gathered, (first, mine, compiled.executor.stats.peak_bytes, memory))
    if dist.get_rank() == 0:
        table = report(p, medians, cpu, gathered, args.rounds, args.steps)
        print(table, flush=True)
        base = medians["torch Schedule1F1B"]
        if args.json:  # one launch of several (see main): the parent reports
            ratios = {name: t / base for name, t in medians.items()}
            Path(args.json).write_text(json.dumps({"table": table, "ratios": ratios}))


def report(p: int, medians: dict[str, float], cpu: dict[str, float], gathered: list[Any], rounds: int,
           steps: int) -> str:
    base, base_cpu = medians["torch Schedule1F1B"], cpu["torch Schedule1F1B"]
    stages = " | ".join(f"stage {s} activations (MiB)" for s in range(p))
    lines = [f"### pp={p} on {p} gloo processes, {MICRO} micro-batches", "",
             f"| contender | step (ms, median) | vs torch Schedule1F1B | CPU (ms/step, busiest process) | CPU vs torch "
             f"| {stages} |",
             "|---|---|---|---|---|" + "---|" * p]
    for name, t in medians.items():
        held = " | ".join(f"{g[3][name] / 2**20:.2f}" for g in gathered)
        used = cpu[name]
        lines.append(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x | {used * 1e3:.1f} | {used / base_cpu:.2f}x "
                     f"| {held} |")
    last = gathered[p - 1][0]
    losses = ", ".join(f"{name}: {' '.join(f'{v:.5f}' for v in vals)}" for name, vals in last.items())
    peaks = ", ".join(f"stage {s}: {g[1]}" for s, g in enumerate(gathered))
    mib = ", ".join(f"stage {s}: {sum(g[2].values()) / 2**20:.1f} MiB" for s, g in enumerate(gathered))
    lines += ["", f"First two losses (last stage): {losses}.",
              f"sbpflow activations held (micro-batches, from the runtime's register counters): {peaks} "
              f"(1F1B bound p - s); peak live bytes of its registers, variables included: {mib}.",
              "Activations: bytes kept for backward at once on each stage, counted once per storage for both: "
              "torch's tensors saved by autograd (a saved-tensors hook, parameters and the batch excluded, peak over "
              "the step), "
              "sbpflow's activation registers (one micro-batch's storages, from one watched step, times the most "
              "micro-batches its register counters saw held at once).",
              "CPU: process time (every thread of the process) per step, of the process that used the most.",
              f"{rounds} rounds of {steps} steps per contender (each after one untimed step), interleaved, the "
              "contenders' order turned by one each round."]
    return "\n".join(lines)


def spread(ratios: list[dict[str, float]], table: str = "the table above is the first") -> str:
    """Each launch's step-time ratio to torch's 1F1B per contender, and their median: within a launch the rounds
    interleave the contenders, which cancels the machine's drifts but not what a launch fixes for its whole life
    (where each tensor landed, which core each process got); on this shared 2-core machine those moved a ratio
    by several percent from one launch to the next."""
    lines = [f"Step time vs torch Schedule1F1B over {len(ratios)} launches (fresh processes, one after another; "
             f"{table}):", ""]
    for name in ratios[0]:
        if name != "torch Schedule1F1B":
            values = [r[name] for r in ratios]
            lines.append(f"- {name}: {', '.join(f'{v:.2f}x' for v in values)}; median "
                         f"**{statistics.median(values):.2f}x**")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--write", action="store_true", help="write the tables into docs/benchmarks.md")
    parser.add_argument("--launches", type=int, default=3,
                        help="run each world this many times in fresh processes (the first launch's table is "
                             "written, with every launch's step-time ratio and their median; default 3)")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # a launched worker's rank 0 writes its results here
    parser.add_argument("--ungrouped", action="store_true",
                        help="also time sbpflow with one accumulate node per gradient (graph.group off)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    tables = []
    for world in args.worlds:
        extra = ["--ungrouped"] if args.ungrouped else []
        runs = launch_runs(__file__, world, ["--rounds", str(args.rounds), "--steps", str(args.steps), *extra],
                           args.launches)
        table = runs[0]["table"]
        tables.append(table[table.index("### "):].strip() if "### " in table else table.strip())
        if args.launches > 1:
            tables[-1] += "\n\n" + spread([run["ratios"] for run in runs])
            print(spread([run["ratios"] for run in runs], "each launch printed its table above"), flush=True)
    if args.write:
        from _report import machine, write_section

        head = ["## Pipeline parallelism vs torch.distributed.pipelining", "",
                f"`PYTHONPATH=src python benchmarks/pipeline_compare.py"
                f"{f' --launches {args.launches}' if args.launches > 1 else ''} --write` on {machine()}. "
                + " ".join(__doc__.split("\n\n")[2].split()), ""]
        write_section(SECTION, "\n".join(head) + "\n" + "\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
