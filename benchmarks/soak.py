"""Soak: many compiled GPT steps with asynchronous checkpoints, watching resident memory, open file descriptors
and threads for leaks (issue 29).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/soak.py`` (``--steps 2000`` on 4 virtual ranks in this
process, then ``--proc-steps 500`` on 2 processes under ``sbpflow launch``); prints a table, plots
``out/soak.png`` and, with ``--write``, replaces the "soak" section of docs/benchmarks.md.

The run is the demo GPT (2 layers, width 64, dropout 0.1) trained by its compiled step (``nn.Graph``) under
``dp=2,tp=2`` (virtual) or ``dp=2`` (processes), fed by a placed, shuffled ``DataLoader`` through
``Graph.iterate`` (a source actor thread each epoch), with a ``CheckpointManager(every=100, keep=2)`` writing the
run state asynchronously (a writer thread each save). Every 50 steps each process samples its resident set
size (``/proc/self/statm``), its open file descriptors (``/proc/self/fd``) and its threads
(``/proc/self/task``), after the last save is on disk. The check: growth between step 200 and the end at most 2%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from _report import add_write_flag, launch_self, machine, publish
from torch.utils.data import Dataset

import sbpflow
from sbpflow.checkpoint import CheckpointManager, run_state
from sbpflow.demo.train_gpt import build
from sbpflow.models.gpt import GPTConfig
from sbpflow.utils.data import DataLoader

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
SAMPLE_EVERY, WARM = 50, 200
OUT = Path(__file__).resolve().parent.parent / "out"


class Tokens(Dataset):
    """Windows of a fixed random token stream: (ids, targets shifted by one)."""

    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, CONFIG.vocab_size, (n + CONFIG.block_size + 1,), generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[i:i + CONFIG.block_size + 1]
        return w[:-1], w[1:]


def sample() -> tuple[float, int, int]:
    """(resident MB, open file descriptors, threads) of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    return rss, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def soak(strategy: str, steps: int, folder: str) -> list[tuple[int, float, int, int]]:
    trainer = build(CONFIG, strategy, lr=1e-3, graph=True)
    assert trainer.graph is not None and trainer.strategy is not None
    p = trainer.strategy.stages[0]
    loader = DataLoader(Tokens(), 8, shuffle=True, drop_last=True, placement=p, sbp=trainer.strategy.input_sbp)
    manager = CheckpointManager(folder, every=100, keep=2)
    state = run_state(model=trainer.model, optimizer=trainer.optimizer, loader=loader)
    samples = []
    for step, _loss in enumerate(trainer.graph.iterate(loader, steps=steps), start=1):
        manager.save(step, state)
        if step % SAMPLE_EVERY == 0:
            manager.wait()
            samples.append((step, *sample()))
    manager.wait()
    return samples


def growth(samples: list[tuple[int, float, int, int]], k: int) -> float:
    warm = next(s for s in samples if s[0] >= WARM)
    return samples[-1][k] / warm[k] - 1.0


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    samples = soak("dp=2", args.proc_steps, args.folder)
    with open(os.path.join(args.folder, f"samples-{sbpflow.rank()}.json"), "w") as f:
        json.dump(samples, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--proc-steps", type=int, default=500)
    parser.add_argument("--folder", default=None)
    add_write_flag(parser)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    torch.set_num_threads(1)
    runs: dict[str, list[tuple[int, float, int, int]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        runs[f"4 virtual ranks, {args.steps} steps"] = soak("dp=2,tp=2", args.steps, os.path.join(folder, "v"))
        proc = os.path.join(folder, "p")
        os.makedirs(proc)
        launch_self(__file__, 2, ["--proc-steps", str(args.proc_steps), "--folder", proc], check=True)
        for r in range(2):
            with open(os.path.join(proc, f"samples-{r}.json")) as f:
                runs[f"2 processes (rank {r}), {args.proc_steps} steps"] = [tuple(s) for s in json.load(f)]
    lines = [f"`PYTHONPATH=src .venv/bin/python benchmarks/soak.py --write` on {machine()}. GPT "
             f"{CONFIG.n_layer}x{CONFIG.n_embd}, compiled step fed by a DataLoader, an asynchronous checkpoint every "
             f"100 steps (keep=2); samples every {SAMPLE_EVERY} steps. Growth: from step {WARM} to the end "
             "(aim: at most 2%). Plot: out/soak.png.", "",
             "| run | resident MB at 200 -> end | growth | fds | threads |", "|---|---|---|---|---|"]
    ok = True
    for name, samples in runs.items():
        warm = next(s for s in samples if s[0] >= WARM)
        end = samples[-1]
        g = [growth(samples, k) for k in (1, 2, 3)]
        ok &= all(x <= 0.02 for x in g)
        lines.append(f"| {name} | {warm[1]:.1f} -> {end[1]:.1f} | {g[0] * 100:+.2f}% | {warm[2]} -> {end[2]} | "
                     f"{warm[3]} -> {end[3]} |")
    lines += ["", f"Every figure within 2% after warm-up: {'yes' if ok else 'NO'}."]
    _plot(runs)
    publish("soak", "## Soak: memory, file descriptors and threads stay flat (issue 29)\n\n" + "\n".join(lines)
            + "\n", args.write)
    if not ok:
        sys.exit(1)


def _plot(runs: dict[str, list[tuple[int, float, int, int]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, samples in runs.items():
        a = np.array(samples, dtype=float)
        for ax, k in zip(axes, (1, 2, 3), strict=True):
            ax.plot(a[:, 0], a[:, k], marker=".", label=name)
    for ax, title in zip(axes, ("resident MB", "open file descriptors", "threads"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.axvline(WARM, color="grey", lw=0.5)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    OUT.mkdir(exist_ok=True)
    fig.savefig(OUT / "soak.png", dpi=100)


if __name__ == "__main__":
    main()
