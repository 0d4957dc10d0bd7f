"""ZeRO-3 on 2 gloo processes: sbpflow.optim.zero(stage=3) against torch FSDP2 (``fully_shard``), same GPT.

Run: ``PYTHONPATH=src python benchmarks/fsdp_compare.py [--write]``. The script launches 2 processes twice
(``sbpflow launch``), once per contender, so that each process's peak resident memory belongs to one contender;
both runs use the same weights (sbpflow's seed-0 GPT, copied into the torch twin of benchmarks/ddp_compare.py),
data, AdamW, clipping, and shard every block and then the root, as FSDP2 is usually applied.

Reported per contender: median seconds per step (the slower process, after 2 warm-up steps), the bytes of
parameters, gradients and optimizer state each rank holds at rest, and the growth of peak RSS over the RSS
before the model was built (CPU has no allocator peak counter: RSS includes allocator slack and both libraries'
workspaces, so it is an upper bound on the step's working set). The losses of both must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import launch_self, machine, write_section  # noqa: E402
from _torch_gpt import TorchGPT, copy_weights  # noqa: E402

from sbpflow import optim  # noqa: E402
from sbpflow.demo.train_gpt import build  # noqa: E402
from sbpflow.models.gpt import GPTConfig  # noqa: E402

WORLD = 2
CONFIG = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=256, dropout=0.0)
BATCH, LR = 16, 1e-3


def data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, CONFIG.vocab_size, size=(BATCH, CONFIG.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def sbpflow_contender() -> tuple[Any, Any]:
    trainer = build(CONFIG, f"dp={WORLD}", seed=0, lr=LR)
    optim.zero(trainer.optimizer, 3, model=trainer.model)

    def step(i: int) -> float:
        return trainer.step(*data(i))

    return step, lambda: optim.memory_per_rank(trainer.optimizer)


def fsdp_contender() -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reference = build(CONFIG, None, seed=0, lr=LR).model
    model = TorchGPT(CONFIG)
    copy_weights(reference, model)
    del reference
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), fused=True)  # the kernel sbpflow's AdamW runs
    rank = dist.get_rank()

    def step(i: int) -> float:
        ids, targets = (torch.from_numpy(a).chunk(WORLD)[rank] for a in data(i))  # local (B / 2, T)
        loss = model(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total) / WORLD

    def memory() -> dict[str, int]:
        out = {"params": 0, "grads": 0, "state": 0}
        for p in params:
            out["params"] += _local_bytes(p)
            out["grads"] += _local_bytes(p.grad) if p.grad is not None else 0
            out["state"] += sum(_local_bytes(v) for v in opt.state[p].values() if isinstance(v, torch.Tensor)
                                and v.ndim > 0)
        return out

    return step, memory


def _local_bytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def worker(contender: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    before = rss_mib()
    step, memory = (sbpflow_contender if contender == "sbpflow" else fsdp_contender)()
    losses, times = [], []
    for i in range(steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(i))
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    result = {"losses": losses, "seconds": statistics.median(times[2:]), "memory": memory(),
              "rss_growth_mib": rss_mib() - before}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))


def launch(contender: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        launch_self(__file__, WORLD, ["--worker", contender, "--steps", str(steps), "--out", out], check=True,
                    timeout=600)
        return dict(json.loads(Path(out).read_text()))


def table(results: dict[str, dict[str, Any]]) -> str:
    mib = 2.0**20
    rows = ["| contender | step (s) | params (MiB/rank) | grads (MiB/rank) | optimizer state (MiB/rank) | "
            "peak RSS growth (MiB/rank 0) |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        m = r["memory"]
        rows.append(f"| {name} | {r['seconds']:.3f} | {m['params'] / mib:.2f} | {m['grads'] / mib:.2f} | "
                    f"{m['state'] / mib:.2f} | {r['rss_growth_mib']:.0f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    parser.add_argument("--worker", choices=["sbpflow", "fsdp2"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return 0
    results = {"sbpflow ZeRO-3": launch("sbpflow", args.steps), "torch FSDP2": launch("fsdp2", args.steps)}
    diff = np.max(np.abs(np.subtract(*[r["losses"] for r in results.values()])))
    psi = sum(p.numel() for p in build(CONFIG, None, seed=0).model.parameters())
    section = (
        "## ZeRO-3 vs torch FSDP2 (issue 11)\n\n"
        f"`PYTHONPATH=src python benchmarks/fsdp_compare.py --write` ({machine()}; 2 gloo processes, one thread "
        f"each). GPT {CONFIG.n_layer} layers, width {CONFIG.n_embd}, sequence {CONFIG.block_size}, vocabulary "
        f"{CONFIG.vocab_size} (Ψ = {psi:,}), global batch {BATCH}, AdamW, clipping 1.0, {args.steps} steps (median "
        "of the last ones). Each block and then the root is a unit (sbpflow's default units; `fully_shard` on each "
        "block and on the model). 16Ψ/N = "
        f"{16 * psi / WORLD / 2**20:.2f} MiB per rank. Largest loss difference between the two: {diff:.1e}. The "
        "machine is shared with other jobs: times are comparable within one run only.\n\n"
        + table(results)
    )
    print(section)
    if args.write:
        write_section("fsdp", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
