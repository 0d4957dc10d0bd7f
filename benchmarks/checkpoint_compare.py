"""Checkpoints on 2 processes: sbpflow.save/load against torch DCP (dcp.save/dcp.load), side by side, same state.

Run: ``.venv/bin/python benchmarks/checkpoint_compare.py`` (spawns its own 2
processes with ``sbpflow launch``; prints a table, and with ``--write``
replaces the "checkpoint" section of docs/benchmarks.md).

The state is a trained GPT's ``{"model", "optim", "step"}`` (parameters, AdamW
moments and step counts, param groups) laid out by a strategy on 2 ranks:
``tp=2`` (Megatron: most of it split, LayerNorms and position embeddings
replicated) and ``dp=2`` (everything replicated). DCP gets the very same
shards, wrapped as DTensors (``S(d)`` -> ``Shard(d)``, ``B`` -> ``Replicate()``)
in the same nested dict, and writes with its default ``FileSystemWriter``
(one file per rank, fsynced). Both contenders run in the same processes on
the same file system, in interleaved rounds; a round's time is the slower
process's, and the table reports medians. Bytes are the checkpoint
directory's size on disk (every file, metadata included). Loads go into fresh
zero tensors of the same layout and are checked against the saved values.
sbpflow loads twice: checking each file's SHA-256 (the default) and its length
only (``verify=False``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _report import machine, publish, run_or_launch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import sbpflow
from sbpflow import sbp as S
from sbpflow.demo.train_gpt import build, random_batches
from sbpflow.models.gpt import GPTConfig

WORLD = 2
CONFIG = GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=256, dropout=0.0)
STRATEGIES = ("tp=2", "dp=2")
CONTENDERS = ("sbpflow", "sbpflow verify=False", "torch DCP")


def trained_state(strategy: str) -> dict[str, Any]:
    """The GPT under ``strategy`` after one AdamW step (so the moments exist), as a checkpoint state."""
    trainer = build(CONFIG, strategy, lr=1e-3)
    ids, targets = next(random_batches(CONFIG.vocab_size, 1, 8, CONFIG.block_size, seed=1))
    trainer.step(ids, targets)
    return {"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict(), "step": 1}


def as_dtensors(node: Any, mesh: Any) -> Any:
    """The same nested state with each sbpflow tensor's own shard wrapped as a DTensor of the same layout."""
    if isinstance(node, dict):
        return {k: as_dtensors(v, mesh) for k, v in node.items()}
    if isinstance(node, list):
        return [as_dtensors(v, mesh) for v in node]
    if isinstance(node, sbpflow.Tensor):
        (s,) = [s for n, s in zip(node.placement.hierarchy, node.sbp, strict=True) if n > 1]  # the 2-rank axis
        placement = Shard(s.dim) if isinstance(s, S.Split) else Replicate()
        local = node.to_local()
        return DTensor.from_local(local, mesh, [placement], shape=node.shape,
                                  stride=torch.empty(node.shape).stride())
    return node


def zeros_like_state(node: Any) -> Any:
    """A state of the same structure and layouts with every tensor zeroed (new memory): what a fresh run holds."""
    if isinstance(node, dict):
        return {k: zeros_like_state(v) for k, v in node.items()}
    if isinstance(node, list):
        return [zeros_like_state(v) for v in node]
    if isinstance(node, tuple):
        return tuple(zeros_like_state(v) for v in node)
    if isinstance(node, sbpflow.Tensor):
        return sbpflow.zeros(*node.shape, placement=node.placement, sbp=node.sbp, dtype=node.dtype)
    if isinstance(node, DTensor):
        return DTensor.from_local(torch.zeros_like(node.to_local()), node.device_mesh, node.placements,
                                  shape=node.shape, stride=node.stride())
    return node


def tensors(node: Any) -> list[torch.Tensor]:
    """Every tensor's local shard, in structure order."""
    if isinstance(node, dict):
        return [t for v in node.values() for t in tensors(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in tensors(v)]
    if isinstance(node, sbpflow.Tensor):
        return [node.to_local()]
    if isinstance(node, DTensor):
        return [node.to_local()]
    return []


def slowest(seconds: float) -> float:
    """The slower process's time (a round ends when both are done)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def dir_bytes(path: str) -> tuple[int, int]:
    files = [p for p in Path(path).rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def compare(strategy: str, root: str, rounds: int) -> dict[str, Any]:
    ours = trained_state(strategy)
    mesh = init_device_mesh("cpu", (WORLD,))
    theirs = as_dtensors(ours, mesh)
    paths = {"sbpflow": os.path.join(root, f"sbpflow-{strategy}"), "torch DCP": os.path.join(root, f"dcp-{strategy}")}
    saves: dict[str, list[float]] = {"sbpflow": [], "torch DCP": []}
    loads: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for _ in range(rounds):
        save_times, load_times, loaded = one_round(ours, theirs, paths)
        for name, seconds in save_times.items():
            saves[name].append(seconds)
        for name, seconds in load_times.items():
            loads[name].append(seconds)
    for state in loaded:
        for got, want in zip(tensors(state), tensors(ours), strict=True):
            assert torch.equal(got, want), "a loaded tensor differs from the saved one"
    shards = sum(t.numel() * t.element_size() for t in tensors(ours))
    return {"strategy": strategy, "save": {k: statistics.median(v) for k, v in saves.items()},
            "load": {k: statistics.median(v) for k, v in loads.items()},
            "disk": {k: dir_bytes(p) for k, p in paths.items()}, "shard bytes": shards}


def one_round(ours: Any, theirs: Any, paths: dict[str, str]) -> tuple[dict[str, float], dict[str, float], list[Any]]:
    """Each contender saves, then each loads into a fresh state; returns the times and the loaded states."""
    writer = dcp.FileSystemWriter(paths["torch DCP"], overwrite=True)  # the default, said aloud (no warning)
    saves = {"sbpflow": timed(lambda: sbpflow.save(ours, paths["sbpflow"])),
             "torch DCP": timed(lambda: dcp.save(theirs, storage_writer=writer))}
    fresh = [zeros_like_state(ours), zeros_like_state(ours), zeros_like_state(theirs)]
    loads = {"sbpflow": timed(lambda: sbpflow.load(fresh[0], paths["sbpflow"])),
             "sbpflow verify=False": timed(lambda: sbpflow.load(fresh[1], paths["sbpflow"], verify=False)),
             "torch DCP": timed(lambda: dcp.load(fresh[2], checkpoint_id=paths["torch DCP"]))}
    return saves, loads, fresh


def report(results: list[dict[str, Any]], rounds: int) -> str:
    lines = [
        "## Checkpoints: sbpflow vs torch DCP (issue 11)",
        "",
        f"`.venv/bin/python benchmarks/checkpoint_compare.py --write` on {_machine()}, "
        f"{datetime.date.today().isoformat()}: 2 processes (`sbpflow launch -n 2`), gloo on 127.0.0.1, files on "
        f"the local disk (page cache warm). State: GPT {CONFIG.n_layer}x"
        f"{CONFIG.n_embd} (vocabulary {CONFIG.vocab_size}, {CONFIG.block_size} positions) with its AdamW state after "
        f"one step; DCP gets the same shards as DTensors. {rounds} interleaved rounds, median time of the slower "
        "process. Bytes: the whole checkpoint directory on disk.",
        "",
        "| strategy | contender | save ms | load ms | bytes on disk | files |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for who in CONTENDERS:
            disk = r["disk"].get(who if who != "sbpflow verify=False" else "sbpflow")
            save = r["save"].get(who)
            lines.append(f"| {r['strategy']} | {who} | {'' if save is None else f'{save * 1e3:.1f}'} | "
                         f"{r['load'][who] * 1e3:.1f} | {disk[0]:,} | {disk[1]} |")
    lines += ["", "Logical bytes of the state (each element once): " + ", ".join(
        f"{r['strategy']} {_logical(r):,}" for r in results) + ". sbpflow writes each element once (replicated "
        "boxes are spread over their holders) plus safetensors headers and `index.json`; DCP deduplicates "
        "replicated tensors too, plus its `.metadata`."]
    return "\n".join(lines)


def _logical(r: dict[str, Any]) -> int:
    return int(r["logical bytes"])


def _machine() -> str:
    return f"{machine()}, {torch.get_num_threads()} thread per process"


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # 2 processes on 2 cores: one thread each
    # DCP warns on every save over an existing checkpoint, even when told to overwrite
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    sbpflow.distributed.init()
    root = tempfile.mkdtemp(prefix="sbpflow-ckpt-bench-", dir=args.dir) if sbpflow.rank() == 0 else ""
    shared = [root]
    dist.broadcast_object_list(shared, src=0)
    results = []
    for strategy in STRATEGIES:
        result = compare(strategy, shared[0], args.rounds)
        result["logical bytes"] = logical_bytes(strategy)
        results.append(result)
    dist.barrier()
    if sbpflow.rank() == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
        body = report(results, args.rounds)
        publish("checkpoint", body, args.write)


def logical_bytes(strategy: str) -> int:
    """Bytes of every tensor of the state, counted once (its logical size)."""
    state = trained_state(strategy)
    return sum(int(np.prod(t.shape)) * t.element_size() for t in _all(state))


def _all(node: Any) -> list[sbpflow.Tensor]:
    if isinstance(node, dict):
        return [t for v in node.values() for t in _all(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _all(v)]
    return [node] if isinstance(node, sbpflow.Tensor) else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: the system temp folder)")
    parser.add_argument("--write", action="store_true", help="also write the section of docs/benchmarks.md")
    return run_or_launch(__file__, WORLD, worker, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
