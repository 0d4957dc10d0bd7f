"""GPT training on CUDA: the same numbers as on CPU, and step times against torch on the same GPU.

Run on a machine with a CUDA GPU: ``python benchmarks/cuda_check.py`` (prints; ``--write`` replaces the "cuda"
section of docs/benchmarks.md).

0. The op suites on cuda shards: every tests/sim file built on tests/harness.py (the op harness, autograd, nn,
   optim, ZeRO, ...) under ``SBPFLOW_TEST_DEVICE=cuda``, which puts the harness placements (1, 2, 3 ranks and a
   2x2 mesh) on the GPU and compares with torch on CPU; and tests/sim/test_runtime_cuda.py.

1. Equivalence: 5 AdamW steps (clipping, dropout 0.1) of a small GPT under several strategies on virtual ranks
   that all live on the GPU (rank r on ``cuda:(r % device_count)``), eager and compiled (``nn.Graph`` on the
   actor runtime: one thread on the caller's stream, and a worker thread with its own CUDA stream per lane, as
   under torch.distributed), against one CPU device: losses and every parameter within rtol 1e-4, atol 1e-5.
   TF32 is off, so float32 matmuls keep float32's precision on both sides.
2. Speed: a GPT-2-small-sized training step (forward, backward, clipping, AdamW) on one GPU: torch eager against
   sbpflow eager on a 1-rank cuda placement and the compiled step (in-order executor, actor runtime, actor
   runtime on worker threads and streams), timed in interleaved rounds with ``torch.cuda.synchronize`` around
   each; peak GPU memory per contender.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _report import add_write_flag, machine, publish
from _torch_gpt import tokens, torch_step

from sbpflow.demo.train_gpt import build, parameter_values, random_batches, train_gpt
from sbpflow.models.gpt import GPTConfig

STRATEGIES = ("dp=1", "dp=2", "tp=2", "dp=2,tp=2", "pp=2", "dp=2,tp=2,pp=2")
SMALL = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
LARGE = GPTConfig(vocab_size=50304, block_size=512, n_layer=12, n_head=12, n_embd=768, dropout=0.0)
LARGE_BATCH = 8
LR = 3e-4


def compare(ours: tuple[list[float], dict[str, np.ndarray]],
            reference: tuple[list[float], dict[str, np.ndarray]]) -> tuple[float, bool]:
    """The largest absolute difference over the losses and every parameter, and whether all are within
    rtol 1e-4, atol 1e-5 (the tolerance of the CPU equivalence tests)."""
    pairs = [(np.asarray(ours[0]), np.asarray(reference[0]))]
    pairs += [(ours[1][name], value) for name, value in reference[1].items()]
    worst = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    return worst, all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs)


def op_suites() -> str:
    """Runs the harness-based suites on cuda shards in a subprocess; returns pytest's summary line."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = [f for f in sorted(glob.glob(os.path.join(root, "tests", "sim", "test_*.py")))
             if re.search(r"^from harness import|^import harness", open(f).read(), re.M)]
    files.append(os.path.join(root, "tests", "sim", "test_runtime_cuda.py"))
    workers = ["-n", "8", "-p", "no:benchmark"] if importlib.util.find_spec("xdist") else []
    env = {**os.environ, "SBPFLOW_TEST_DEVICE": "cuda"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *files],
                          cwd=root, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    print(done.stdout[-3000:] if done.returncode else lines[-1], flush=True)
    return f"{len(files)} files: {lines[-1].strip('= ')}" if lines else f"pytest failed to run: {done.stderr[-500:]}"


def train_on_cuda(strategy: str, mode: str) -> tuple[list[float], dict[str, np.ndarray]]:
    """train_gpt's 5 steps on cuda virtual ranks: eager, compiled on the actor runtime (one thread, the caller's
    stream) or compiled with a worker thread and a CUDA stream per lane (as under torch.distributed)."""
    trainer = build(SMALL, strategy, device="cuda", graph=mode != "eager")
    if mode == "graph, thread streams":
        trainer.graph.config.set_executor("actors", threads=True)
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(SMALL.vocab_size, 5, 8, 16, seed=1)]
    return losses, parameter_values(trainer)


def equivalence() -> list[str]:
    reference = train_gpt(None, 5, config=SMALL, batch_size=8, seq_len=16)
    rows = []
    for mode in ("eager", "graph", "graph, thread streams"):
        for strategy in STRATEGIES:
            run = train_on_cuda(strategy, mode)
            worst, close = compare(run, reference)
            rows.append(f"| {mode} | {strategy} | {run[0][-1]:.5f} | {worst:.1e} | {'yes' if close else '**no**'} |")
            print(rows[-1], flush=True)
    return rows


def sbpflow_step(cfg: GPTConfig, graph: bool, executor: str | None = None,
                 threads: bool | None = None) -> tuple[Callable[[], Any], Any]:
    trainer = build(cfg, "dp=1", lr=LR, device="cuda", graph=graph, executor=executor)
    if threads:
        trainer.graph.config.set_executor("actors", threads=True)
    ids, targets = tokens(cfg, LARGE_BATCH)
    ids_t, targets_t = trainer.inputs(ids, targets)
    if graph:
        return (lambda: trainer.graph(ids_t, targets_t)), trainer.model

    def step() -> Any:
        loss = trainer.model(ids_t, targets_t)[1]  # the logits are dropped at once, as in the torch twin
        trainer.optimizer.zero_grad()
        loss.backward()
        from sbpflow.nn.utils import clip_grad_norm_
        clip_grad_norm_(list(trainer.model.parameters()), 1.0)
        trainer.optimizer.step()
        return loss

    return step, trainer.model


def timed(contenders: dict[str, Callable[[], Any]], inner: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def peak_memory(fn: Callable[[], Any]) -> float:
    """GiB allocated at the peak of one step (after warm-up), above what was held before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def speed(rounds: int) -> list[str]:
    eager, model = sbpflow_step(LARGE, graph=False)
    contenders: dict[str, Callable[[], Any]] = {
        "torch eager": torch_step(LARGE, LARGE_BATCH, model, LR, "cuda"), "sbpflow eager": eager}
    contenders["sbpflow graph, in-order"] = sbpflow_step(LARGE, graph=True, executor="inorder")[0]
    contenders["sbpflow graph, actors"] = sbpflow_step(LARGE, graph=True, executor="actors")[0]
    contenders["sbpflow graph, actors on thread streams"] = sbpflow_step(LARGE, graph=True, threads=True)[0]
    first = {}
    for name, fn in contenders.items():
        out = fn()
        first[name] = float(out.item() if isinstance(out, torch.Tensor) else out.numpy())
        fn()
    memory = {name: peak_memory(fn) for name, fn in contenders.items()}
    t = timed(contenders, inner=5, rounds=rounds)
    tokens_per_step = LARGE_BATCH * LARGE.block_size
    return [f"| {name} | {s * 1e3:.2f} | {s / t['torch eager']:.3f} | {tokens_per_step / s / 1e3:.1f} | "
            f"{memory[name]:.2f} | {first[name]:.4f} |" for name, s in t.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    add_write_flag(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_check.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    suites = op_suites()
    equal = equivalence()
    fast = speed(args.rounds)
    body = "\n".join([
        "## CUDA (issue 5)",
        "",
        f"`python benchmarks/cuda_check.py --write` on {gpu} ({machine()}).",
        "",
        f"**Op suites on cuda shards** (`SBPFLOW_TEST_DEVICE=cuda`, every harness-based tests/sim file and "
        f"tests/sim/test_runtime_cuda.py): {suites}.",
        "",
        "**Equivalence on the GPU.** 5 AdamW steps (clipping at 1.0, dropout 0.1) of a 2-layer GPT (64 wide, "
        "batch 8, 16 tokens) on virtual ranks that all live on the GPU, against one CPU device (local tensors); "
        "TF32 off. *graph*: the compiled step on the actor runtime as it runs on virtual ranks (one thread, every "
        "act on the caller's stream); *graph, thread streams*: `set_executor(\"actors\", threads=True)`, a worker "
        "thread and a CUDA stream per lane with events between streams, as under torch.distributed.",
        "",
        "| mode | strategy | last loss | largest difference (losses, parameters) | within rtol 1e-4, atol 1e-5 |",
        "|---|---|---|---|---|",
        *equal,
        "",
        f"**Speed on one GPU.** A {LARGE.n_layer}-layer GPT, {LARGE.n_embd} wide, {LARGE.n_head} heads, vocabulary "
        f"{LARGE.vocab_size}, batch {LARGE_BATCH} x {LARGE.block_size} tokens, float32 (TF32 off): forward, "
        f"backward, clipping and AdamW. {args.rounds} interleaved rounds of 5 steps, medians; peak memory is the "
        "allocator's peak during one step above what was allocated before it.",
        "",
        "| contender | ms/step | vs torch | k tokens/s | peak step memory GiB | first loss |",
        "|---|---|---|---|---|---|",
        *fast,
    ])
    publish("cuda", body, args.write)


if __name__ == "__main__":
    main()
