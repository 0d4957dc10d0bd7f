"""Data-parallel training on 2 processes: sbpflow against torch DistributedDataParallel, side by side.

Run: ``.venv/bin/python benchmarks/ddp_compare.py`` (spawns its own 2 processes
with ``sbpflow launch``; prints, and ``--write`` replaces the "ddp" section of docs/benchmarks.md).

Both contenders live in the same 2 processes, over the same gloo transport
(sbpflow's torch.distributed backend; DDP on the default process group), with
the same weights, data, loss and AdamW. Timed rounds alternate between them;
each round's time is the slower process's, and the table reports medians.

Three models: an MLP (width 1024, 3 hidden layers, global batch 64, MSE); issue 14's
GPT (4 blocks, width 256, 4 heads, 128 tokens, global batch 8), the one its target
names; and the demo's smaller GPT (3 blocks, width 128, 64 tokens, global batch 16),
whose kernels are small enough that per-op dispatch shows. Both GPTs train with
AdamW, gradient clipping 1.0 and no dropout. sbpflow lays them out data parallel:
parameters B, inputs S(0), so backward all-reduces the parameter gradients (in
buckets by default).

Bytes communicated, one definition for both: the payload bytes each process
hands to all-reduce per step (the size of the tensors reduced). sbpflow's come
from ``sbpflow.comm.record()`` (its events count ring traffic summed over the
group's ranks, ``2 (p - 1)`` times the payload); DDP's from a comm hook around
``allreduce_hook`` that adds up the sizes of the gradient buckets it reduces.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _report import machine, publish, run_or_launch, timed_block_cpu  # noqa: E402
from _torch_gpt import TorchGPT, adamw, copy_weights
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import sbpflow
from sbpflow import nn, optim
from sbpflow import sbp as S
from sbpflow.autograd import coalesce_grad_reductions
from sbpflow.comm import get_backend, record
from sbpflow.demo.train_gpt import build
from sbpflow.models.gpt import GPTConfig

WORLD = 2
MLP_WIDTH, MLP_LAYERS, MLP_BATCH = 1024, 3, 64
GPT_LR = 3e-3


@dataclass(frozen=True)
class GPTCase:
    """A GPT and its global batch: issue 14's (the target's) and the demo's smaller one (dispatch-bound)."""

    config: GPTConfig
    batch: int

    @property
    def name(self) -> str:
        c = self.config
        return f"GPT {c.n_layer}x{c.n_embd}, {c.block_size} tokens, batch {self.batch}"


GPT_ISSUE = GPTCase(GPTConfig(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.0), 8)
GPT_SMALL = GPTCase(GPTConfig(vocab_size=96, block_size=64, n_layer=3, n_head=4, n_embd=128, dropout=0.0), 16)
SBP, SBP_PER_LEAF = "sbpflow", "sbpflow per-leaf"  # the default (buckets); under coalesce_grad_reductions(False)


@dataclass
class Contender:
    """One training step, its model's parameters by name (logical values) and its last loss."""

    step: Callable[..., float]  # step(phases=None) -> the loss over the whole batch
    params: Callable[[], dict[str, np.ndarray]]
    phases: dict[str, list[float]] = field(default_factory=dict)  # phase -> seconds, filled by profiled steps


# ----------------------------------------------------------------------------- the MLP


def mlp_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(MLP_BATCH, MLP_WIDTH, generator=g), torch.randn(MLP_BATCH, MLP_WIDTH, generator=g)


def placed_mlp() -> tuple[nn.Module, Any, Any]:
    """The MLP data parallel over the processes: parameters B, the batch S(0) (each process holds 32 rows)."""
    place = sbpflow.placement("cpu", list(range(WORLD)))
    sbpflow.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(MLP_LAYERS):
        mods += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(MLP_WIDTH, MLP_WIDTH)).to_global(place, S.broadcast)
    x_full, y_full = mlp_data()
    x = sbpflow.tensor(x_full, placement=place, sbp=S.split(0))  # logical (64, 1024), local (32, 1024)
    y = sbpflow.tensor(y_full, placement=place, sbp=S.split(0))
    return model, x, y


def sbpflow_mlp(coalesce: bool) -> tuple[Contender, Any]:
    """Parameters B on ranks [0, 1], the batch S(0): each process computes on its 32 rows."""
    model, x, y = placed_mlp()
    opt = optim.AdamW(model.parameters(), lr=1e-3)

    def step(phases: Phases | None = None) -> float:
        phases = phases or Phases()
        with phases("forward"):
            loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        with phases("backward"), coalesce_grad_reductions(coalesce):
            loss.backward()
        with phases("optimizer"):
            opt.step()
        return float(loss.item())

    return Contender(step, lambda: {n: p.numpy() for n, p in model.named_parameters()}), model


def torch_mlp(reference: Any) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], Contender]]:
    """The same MLP in torch, weights copied from sbpflow's; DDP wraps it, each process gets its half batch."""
    mods: list[torch.nn.Module] = []
    for _ in range(MLP_LAYERS):
        mods += [torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(MLP_WIDTH, MLP_WIDTH))
    copy_weights(reference, model)
    rank = dist.get_rank()
    x_full, y_full = mlp_data()
    x, y = x_full.chunk(WORLD)[rank], y_full.chunk(WORLD)[rank]  # local (32, 1024)

    def contender(ddp: torch.nn.Module) -> Contender:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)

        def step(phases: Phases | None = None) -> float:
            phases = phases or Phases()
            with phases("forward"):
                loss = ((ddp(x) - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            with phases("backward"):
                loss.backward()
            with phases("optimizer"):
                opt.step()
            return _global_mean(loss)

        return Contender(step, lambda: _torch_params(ddp))

    return model, contender


# ----------------------------------------------------------------------------- the GPT


def gpt_data(case: GPTCase) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, case.config.vocab_size, size=(case.batch, case.config.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def sbpflow_gpt(case: GPTCase, coalesce: bool) -> tuple[Contender, Any]:
    """The demo's trainer (AdamW, weight decay on matrices, clipping 1.0) under dp=2."""
    trainer = build(case.config, f"dp={WORLD}", lr=GPT_LR)
    ids, targets = trainer.inputs(*gpt_data(case))
    model = trainer.model
    params = list(model.parameters())  # listed once, as the torch contender does

    def step(phases: Phases | None = None) -> float:
        phases = phases or Phases()
        with phases("forward"):
            _, loss = model(ids, targets)
        trainer.optimizer.zero_grad()
        with phases("backward"), coalesce_grad_reductions(coalesce):
            loss.backward()
        with phases("optimizer"):
            sbpflow.nn.utils.clip_grad_norm_(params, 1.0)
            trainer.optimizer.step()
        return float(loss.item())

    return Contender(step, lambda: {n: p.numpy() for n, p in model.named_parameters()}), model


def torch_gpt(case: GPTCase, reference: Any) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], Contender]]:
    model = TorchGPT(case.config)
    copy_weights(reference, model)
    rank = dist.get_rank()
    ids_full, targets_full = gpt_data(case)
    ids = torch.from_numpy(ids_full).chunk(WORLD)[rank]  # local (B / 2, T)
    targets = torch.from_numpy(targets_full).chunk(WORLD)[rank]

    def contender(ddp: torch.nn.Module) -> Contender:
        params = list(ddp.parameters())
        opt = adamw(params, GPT_LR)

        def step(phases: Phases | None = None) -> float:
            phases = phases or Phases()
            with phases("forward"):
                loss = ddp(ids, targets)
            opt.zero_grad(set_to_none=True)
            with phases("backward"):
                loss.backward()
            with phases("optimizer"):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            return _global_mean(loss)

        return Contender(step, lambda: _torch_params(ddp))

    return model, contender


# ----------------------------------------------------------------------------- shared pieces


def _torch_params(ddp: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n.removeprefix("module."): p.detach().numpy().copy() for n, p in ddp.named_parameters()}


def _global_mean(loss: torch.Tensor) -> float:
    """The loss over the whole batch (outside timing, for the equality check only)."""
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / WORLD


class Phases:
    """Wall time per phase of one step; a no-op unless ``active``."""

    def __init__(self, active: bool = False) -> None:
        self.active = active
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> Any:
        phases = self

        class _Timer:
            def __enter__(self) -> None:
                self.start = time.perf_counter()

            def __exit__(self, *exc: object) -> None:
                if phases.active:
                    phases.seconds[name] = phases.seconds.get(name, 0.0) + time.perf_counter() - self.start

        return _Timer()


class BucketBytes:
    """DDP comm hook state: bytes and calls of the gradient buckets all-reduced."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        self.bytes += buffer.numel() * buffer.element_size()
        self.calls += 1
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default process group


def ddp_bytes(model: torch.nn.Module, make: Callable[[torch.nn.Module], Contender]) -> tuple[int, int]:
    """Payload bytes and calls DDP all-reduces in one step (second step: the first one rebuilds buckets)."""
    counter = BucketBytes()
    ddp = DDP(copy.deepcopy(model))
    ddp.register_comm_hook(counter, lambda state, bucket: state.hook(bucket))
    contender = make(ddp)
    contender.step()
    counter.bytes = counter.calls = 0
    contender.step()
    return counter.bytes, counter.calls


def sbpflow_bytes(contender: Contender) -> tuple[int, int, dict[str, int]]:
    """Payload bytes handed to all-reduce by this process in one step, calls, and all collective counts."""
    with record() as log:
        contender.step()
    payload = sum(e.bytes // (2 * (len(e.ranks) - 1)) for e in log.events if e.kind == "all_reduce")
    return payload, log.counts().get("all_reduce", 0), log.counts()


def timed_block(fn: Callable[[], object], steps: int, warmup: int = 1) -> float:
    """Seconds per step of ``steps`` steps, as the slower process saw them (:func:`_report.timed_block_cpu`)."""
    return timed_block_cpu(fn, steps, warmup)[0]


def interleaved(contenders: dict[str, Contender], steps: int, rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, c in contenders.items():
            samples[name].append(timed_block(c.step, steps))
    return {k: statistics.median(v) for k, v in samples.items()}


def profile(contenders: dict[str, Contender], steps: int) -> dict[str, dict[str, float]]:
    """Median seconds per phase (forward, backward, optimizer) of ``steps`` steps, alternating contenders;
    sbpflow's all-reduce time is measured around its backend's primitives: the blocking one, and the asynchronous
    one's issue and wait (the time backward is held up by communication, not the time it is in flight)."""
    backend = get_backend()
    inner, inner_async = backend._all_reduce, backend._all_reduce_async
    comm = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                comm[0] += time.perf_counter() - start
        return call

    def timed_all_reduce_async(*args: Any, **kwargs: Any) -> Any:
        handle = timed(inner_async)(*args, **kwargs)
        return SimpleNamespace(wait=timed(handle.wait))

    samples: dict[str, dict[str, list[float]]] = {k: {} for k in contenders}
    backend._all_reduce = timed(inner)  # type: ignore[method-assign]
    backend._all_reduce_async = timed_all_reduce_async  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            for name, c in contenders.items():
                phases = Phases(active=True)
                comm[0] = 0.0
                dist.barrier()
                c.step(phases)  # type: ignore[call-arg]
                if name != "DDP":
                    phases.seconds["all-reduce calls (in backward)"] = comm[0]
                for phase, s in phases.seconds.items():
                    samples[name].setdefault(phase, []).append(s)
    finally:
        del backend._all_reduce, backend._all_reduce_async
    return {k: {p: statistics.median(v) for p, v in d.items()} for k, d in samples.items()}


# ----------------------------------------------------------------------------- one model, both contenders


def compare(name: str, make_sbpflow: Callable[[bool], tuple[Contender, Any]], make_torch: Callable[[Any], Any],
            steps: int, rounds: int) -> dict[str, Any]:
    ours, reference = make_sbpflow(True)
    per_leaf, _ = make_sbpflow(False)
    torch_model, make_ddp = make_torch(reference)
    payload_ddp, calls_ddp = ddp_bytes(torch_model, make_ddp)
    theirs = make_ddp(DDP(torch_model))  # the built-in all-reduce (no Python hook) is what gets timed
    contenders = {SBP: ours, SBP_PER_LEAF: per_leaf, "DDP": theirs}

    # Same start, same data: the first losses agree, and after the warm-up steps so do the parameters.
    first = {k: c.step() for k, c in contenders.items()}
    for _ in range(2):
        for c in contenders.values():
            c.step()
    params = {k: c.params() for k, c in contenders.items()}
    drift = max(float(np.max(np.abs(params[k][n] - p))) for n, p in params["DDP"].items() for k in (SBP, SBP_PER_LEAF))
    measured = {k: sbpflow_bytes(contenders[k]) for k in (SBP, SBP_PER_LEAF)}
    theirs.step()  # keeps every contender at the same step count

    times = interleaved(contenders, steps, rounds)
    phases = profile(contenders, steps=5)
    return {"name": name, "times": times, "first losses": first, "param drift": drift,
            "bytes": {k: m[0] for k, m in measured.items()} | {"DDP": payload_ddp},
            "calls": {k: m[1] for k, m in measured.items()} | {"DDP": calls_ddp},
            "sbpflow counts": {k: m[2] for k, m in measured.items()},
            "phases": phases, "param bytes": sum(p.nbytes for p in params["DDP"].values())}


# ----------------------------------------------------------------------------- the report


def report(results: list[dict[str, Any]], rounds: int) -> str:
    lines = [
        "## sbpflow vs torch DDP (issues 5, 14)",
        "",
        f"`.venv/bin/python benchmarks/ddp_compare.py --write` on {_machine()}: 2 processes (`sbpflow launch -n 2`), "
        "gloo "
        "on 127.0.0.1, one torch thread per process, eager mode. The contenders run in the same processes with "
        f"the same weights, data and AdamW; {rounds} interleaved rounds (each block after one untimed step), "
        "median step time of the slower "
        "process. "
        f"*{SBP}*: the default, flat all-reduces of DDP-sized buckets (1 MiB first, then 25 MiB) issued "
        f"asynchronously during backward as their gradients become final; *{SBP_PER_LEAF}*: the opt-out, "
        "backward under `sbpflow.autograd.coalesce_grad_reductions(False)`, one all-reduce per parameter gradient; "
        "*DDP*: `DistributedDataParallel` with its default 25 MB buckets.",
        "",
        "Bytes: payload bytes each process hands to all-reduce per step (the size of the reduced tensors; calls "
        "in parentheses). sbpflow's come from `sbpflow.comm.record()` (which counts ring traffic over all ranks, "
        "2(p-1) times the payload, divided back here) and include the 4-byte loss; DDP's from a comm hook "
        "wrapping `allreduce_hook` that sums its buckets' sizes.",
        "",
        "| model | contender | ms/step | ratio to DDP | all-reduce bytes (calls) | first loss | max param diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t, b, c, f = r["times"], r["bytes"], r["calls"], r["first losses"]
        for who in (SBP, SBP_PER_LEAF, "DDP"):
            ratio = f"**{t[who] / t['DDP']:.3f}**" if who != "DDP" else "1.000"
            drift = f"{r['param drift']:.1e}" if who != "DDP" else "(reference)"
            lines.append(f"| {r['name']} | {who} | {t[who] * 1e3:.2f} | {ratio} | {b[who]:,} ({c[who]}) | "
                         f"{f[who]:.6f} | {drift} |")
    lines += ["", "Parameter bytes: " + ", ".join(f"{r['name']} {r['param bytes']:,}" for r in results) + ".",
              "", "Where a step's time goes (median ms per phase on each process's own clock, so a phase includes "
              "waiting for the peer; the optimizer phase includes gradient clipping for the GPT):", "",
              "| model | contender | forward | backward | of which waiting for sbpflow all-reduces | optimizer |",
              "|---|---|---|---|---|---|"]
    for r in results:
        for who, ph in r["phases"].items():
            comm = ph.get("all-reduce calls (in backward)")
            lines.append(f"| {r['name']} | {who} | {ph['forward'] * 1e3:.2f} | {ph['backward'] * 1e3:.2f} | "
                         f"{'' if comm is None else f'{comm * 1e3:.2f}'} | {ph['optimizer'] * 1e3:.2f} |")
    targeted = [r for r in results if r["name"] != GPT_SMALL.name]  # the issue's target: its MLP and its GPT
    for who in (SBP, SBP_PER_LEAF):
        worst = max(r["times"][who] / r["times"]["DDP"] for r in targeted)
        lines.append(f"\nWorst ratio over the MLP and issue 14's GPT, {who}: **{worst:.3f}x** (target: at most 1.10x).")
    small = next(r for r in results if r["name"] == GPT_SMALL.name)
    lines.append(f"\nThe smaller GPT, where dispatch weighs most: {small['times'][SBP] / small['times']['DDP']:.3f}x "
                 "by default (no target; see the one-device overhead table).")
    lines.append("")
    lines += [f"sbpflow collectives of one {r['name']} step per process: {r['sbpflow counts']}" for r in results]
    return "\n".join(lines)


def _machine() -> str:
    return machine(threads=1, processes=WORLD)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # 2 processes on 2 cores: one thread each
    sbpflow.distributed.init()
    results = [
        compare(f"MLP {MLP_WIDTH}x{MLP_LAYERS}, batch {MLP_BATCH}", sbpflow_mlp, torch_mlp, args.steps, args.rounds),
        *(compare(case.name, partial(sbpflow_gpt, case), partial(torch_gpt, case), args.steps, args.rounds)
          for case in (GPT_ISSUE, GPT_SMALL)),
    ]
    if sbpflow.rank() == 0:
        body = report(results, args.rounds)
        publish("ddp", body, args.write)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (default 15)")
    parser.add_argument("--steps", type=int, default=4, help="steps per contender per round (default 4)")
    parser.add_argument("--write", action="store_true", help="replace the ddp section of docs/benchmarks.md "
                        "(otherwise only print)")
    return run_or_launch(__file__, WORLD, worker, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
