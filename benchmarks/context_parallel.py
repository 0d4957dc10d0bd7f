"""Context parallelism (issue 27): the longest trainable sequence under a per-rank memory cap, checked on processes;
causal balance; torch's ``context_parallel`` on CPU.

    .venv/bin/python benchmarks/context_parallel.py            # prints
    .venv/bin/python benchmarks/context_parallel.py --write    # and writes its section of docs/benchmarks.md

**Longest sequence.** A Llama (4 layers, width 256, 8 heads, batch 1) is built under ``sbpflow.meta_init()`` and
its training step (forward, backward, AdamW) compiled by ``nn.Graph.compile_only`` on cp = 1, 2, 4, 8 virtual
ranks, ids split zigzag on the sequence (``Z(1)``, as ``sbpflow.parallelize(context=c)`` lays them out),
parameters broadcast, with eager's SBP choice (``sbp_selection="greedy"``: q, k, v stay ``Z(T)`` and attention
runs as the zigzag ring). The cap is the cp = 1 plan's ``peak_bytes`` at 4096 tokens; for each cp the longest
sequence (a multiple of 64 cp) whose plan peaks under it is found by bisection. The plan's peak counts the
registers it holds between ops (activations, parameters, gradients, optimizer state); the ring kernel's transient
buffers (the K/V block in flight; torch's flash kernel computes each block) are not in it.

**Measured.** The same search at a smaller cap (the cp = 1 plan's peak at 1024 tokens), then each cp in 1, 2, 4
trains its longest sequence on cp gloo processes (``sbpflow launch``, one thread each; one warm-up step, then
timed steps), twice. *Allocated*: glibc returns every freed block over 64 KiB at once and one arena serves every
thread, so the resident size follows the bytes in use (gloo's buffers and torch's workspaces included); its
peak growth over the RSS before the model was built, the largest over the ranks, is split into what stays
between steps (weights, gradients, AdamW's moments, the runtime's buffers, code paged in) and the step's own
peak above it. The last column bisects on launches for the longest sequence whose allocated peak stays under
cp = 1's. *Kept*: sbpflow's host cache (``sbpflow.host_memory``: freed memory stays with the process, as CUDA's
caching allocator keeps it) gives the resident peak a user sees, which also holds what the allocator keeps
free: each thread's arena keeps its own peak, and fragmentation. CPU has no allocator peak counter, so RSS is
the measure.

**Ring attention timed.** Causal attention (1, 8, T, 32), q, k, v and dy split zigzag over cp gloo processes,
forward and backward of the kernel alone, interleaved rounds (the order turned every round): sbpflow's ring
(``ops.ring_attention``) with each K/V hop overlapped with the step's math, and posted only after it (the same
messages and math); torch's ring kernels (``_templated_ring_attention`` and its backward, what
``context_parallel`` dispatches to on a GPU, with its head-tail load balance: sbpflow's zigzag layout) given
torch's CPU flash kernel, with its two K/V rotations. The outputs and gradients of all four are checked equal.

**Balance.** Under a causal mask the ring skips the blocks wholly above the diagonal; the table gives each rank's
computed (query, key) pairs (``ops.ring_attention.causal_work``), relative to the mean, for plain ``S(T)`` (rank
p computes p + 1 blocks) and the zigzag ``Z(T)`` (rank p holds chunks p and 2c-1-p).

**torch.** ``torch.distributed.tensor.experimental.context_parallel`` (ring, DTensor) is run on 2 gloo processes
on the same attention, with torch's default SDPA backends and with the math backend alone; on CPU it raises
(the errors are reported), so there is no model step time to set beside sbpflow's.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _report import add_write_flag, launch_self, machine, timed_block_cpu, turned, whole_turns, write_section  # noqa: E402
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_ring  # noqa: E402

import sbpflow  # noqa: E402
from sbpflow.models.llama import Llama, LlamaConfig  # noqa: E402
from sbpflow.ops import ring_attention as ring  # noqa: E402
from sbpflow.ops.ring_attention import causal_work  # noqa: E402
from sbpflow.ops.schema import Meta  # noqa: E402
from sbpflow.sbp import broadcast, split, zigzag  # noqa: E402

CONFIG = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 1 << 20}
BASE = 4096  # the cp = 1 sequence that sets the cap
MEASURED_BASE = 1024  # ... of the check on processes (bounded: cp = 4 trains 4x this)
MEASURED_STEPS = 3  # one warm-up, then timed
ATTENTION = (1, 8, 4096, 32)  # (B, H, T, D) of the timed ring: the Llama's heads, a longer sequence
ATTENTION_ROUNDS = 8  # interleaved rounds of the four ring contenders
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
# what the run of 2026-11-28 16:19 UTC showed (kept with the section; rewrite it when the figures change)
READING = """\
**Reading (2026-11-28):** on the allocated peak the aim holds: cp 2 trains 2.06 × and cp 4 4.00 × the cp = 1
sequence (aim 1.8 / 3.6), and at the plan's longest sequences the measured peak is 1.02 × cp = 1's. So the plan's
registers predict the per-rank bytes: no rank holds a full-sequence tensor (ids, logits and loss rows stay
zigzag), and ring buffers, gloo's buffers and the gradients' all-reduce add 1-3 MiB. What stays between steps
(84-86 MiB: weights, gradients and AdamW's moments, 56 MiB, plus the runtime and code paged in) is the same at
every cp, so it does not bound the ratio, although this model is small; the step's own peak (91-92 MiB) is
activations. The 1.38 × / 2.75 × measured last session came from the allocator, not from buffers held by the
framework. Under sbpflow's host cache, RSS also holds what malloc keeps free: 47-73 MiB per rank here, more
at cp > 1 (1.10 / 1.13 × cp = 1's at the plan's lengths). The ring kernel and the runtime's lanes allocate on
threads of their own, and each thread's glibc arena keeps its own peak. In a trial, one arena for every thread
(M_ARENA_MAX=1) took 10-25 MiB off cp 2. It was not adopted: it changes the allocator for the whole process,
and RSS under the cache varied by 30 MiB between runs. Ring: the overlapped ring is 1.02 × faster than the
blocking one at cp 2 and no faster at cp 4, because on 2 shared cores gloo's threads compete with the math for
CPU. Against torch's ring kernels on the same shards, torch takes 0.94-0.99 × sbpflow's time, within the rounds'
spread. Before this session's two kernel changes it was 0.83-0.88 ×: a zigzag step is now one flash call
instead of 2-3 plus merges, and dK/dV's hop overlaps the next step's math. torch's `context_parallel` itself
cannot run on CPU (above), so a whole-model step-time comparison needs a GPU. Steps: cp processes share 2 cores."""


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
    ids = [sbpflow.meta_tensor(1, t, dtype=torch.int64, placement=placement, sbp=(zigzag(1),)) for _ in range(2)]
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


def balance_rows() -> list[str]:
    rows = ["| cp | S(T) max / mean | S(T) min / mean | Z(T) max / mean | Z(T) min / mean |", "|---|---|---|---|---|"]
    for cp in (2, 4, 8):
        p = sbpflow.placement("cpu", list(range(cp)))
        cells = []
        for layout in (split(0), zigzag(0)):
            work = causal_work(4096, p, (layout,))
            mean = sum(work) / cp
            cells += [f"{max(work) / mean:.2f}", f"{min(work) / mean:.2f}"]
        rows.append(f"| {cp} | " + " | ".join(cells) + " |")
    return rows


# -- on processes ----------------------------------------------------------------------------------


def _rss_now_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _without_host_cache() -> None:
    """glibc then unmaps every freed block over 64 KiB at once and serves every thread from one arena: the resident
    size follows the bytes in use. Set after ``_report``'s import has applied sbpflow's host cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    for param, value in ((M_MMAP_THRESHOLD, 64 << 10), (M_TRIM_THRESHOLD, 128 << 10), (M_ARENA_MAX, 1)):
        if not libc.mallopt(param, value):
            raise RuntimeError(f"glibc refused mallopt({param}, {value})")


def measure_worker(t: int, out: str, kept: bool) -> None:
    """One process of ``sbpflow launch``: trains the Llama on a sequence of ``t`` split zigzag over every process;
    ``kept``: under sbpflow's host cache, else with freed memory returned at once."""
    torch.set_num_threads(1)
    if not kept:
        _without_host_cache()
    cp = dist.get_world_size()
    before = _rss_now_mib()
    placement = sbpflow.placement("cpu", list(range(cp)))
    sbpflow.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))  # type: ignore[arg-type]
    model.to_global(placement, (broadcast,))
    step = _Step(model, sbpflow.optim.AdamW(model.parameters(), lr=1e-4))
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=(1, t + 1))
    ids, targets = (sbpflow.tensor(a, placement=placement, sbp=(zigzag(1),)) for a in (tokens[:, :-1], tokens[:, 1:]))
    times = []
    for _ in range(MEASURED_STEPS):
        dist.barrier()
        start = time.perf_counter()
        float(step(ids, targets).numpy())
        times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    grown = torch.tensor([peak_rss - before, _rss_now_mib() - before], dtype=torch.float64)
    dist.all_reduce(grown, op=dist.ReduceOp.MAX)
    spent = torch.tensor(times[1:], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"growth": float(grown[0]), "between": float(grown[1]),
                                         "seconds": spent.tolist()}))


def torch_cp_worker(out: str) -> None:
    """torch's ring attention (``context_parallel``) on the processes, under torch's default SDPA backends and
    under the math backend alone: what each raises on CPU, or that it ran."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name, backends in (("default backends", None), ("math backend", [SDPBackend.MATH])):
        q, k, v = (torch.randn(1, 8, 256, 32) for _ in range(3))
        try:
            with sdpa_kernel(backends) if backends else torch.no_grad(), \
                    context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            results[name] = "ran"
        except Exception as e:  # noqa: BLE001  # the report quotes whatever torch raises
            cause = e.__context__ if isinstance(e, RuntimeError) and e.__context__ is not None else e
            results[name] = f"{type(cause).__name__}: {cause}".splitlines()[0]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def _sbpflow_ring(shards: list[torch.Tensor], overlap: bool) -> list[torch.Tensor]:
    """sbpflow's ring kernel on this process's zigzag shards (q, k, v, dy): out, dq, dk, dv."""
    rank = dist.get_rank()
    placement = sbpflow.placement("cpu", list(range(dist.get_world_size())))
    q_meta = Meta(ATTENTION, torch.float32)
    lse_meta = Meta(ATTENTION[:-1], torch.float32)
    layout = (zigzag(2),)
    fwd = ring.contexts(placement, (q_meta,) * 3, (q_meta, lse_meta), layout)
    bwd = ring.contexts(placement, (q_meta,) * 5 + (lse_meta,), (q_meta,) * 3, layout)
    q, k, v, dy = ({rank: t} for t in shards)
    out, lse = ring.forward({rank: fwd[rank]}, q, k, v, True, None, overlap=overlap)[rank]
    grads = ring.backward({rank: bwd[rank]}, dy, q, k, v, {rank: out}, {rank: lse}, True, None, overlap=overlap)
    return [out, *grads[rank]]


def _torch_ring(shards: list[torch.Tensor], rotation: str) -> list[torch.Tensor]:
    """torch's ring kernels (what ``context_parallel`` runs on a GPU) given torch's CPU flash kernel, on the same
    shards: torch's head-tail load balance is sbpflow's zigzag layout."""
    q, k, v, dy = shards
    group = dist.group.WORLD
    assert group is not None  # sbpflow.distributed.init() joined the default group
    torch_ring.set_rotate_method(rotation)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = torch_ring._templated_ring_attention(group, 2, flash, q, k, v, is_causal=True, dropout_p=0.0)[:2]
    grads = torch_ring._templated_ring_attention_backward(
        group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward, grad_out=dy,
        grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True, dropout_p=0.0)
    return [out, *grads[:3]]


RING_CONTENDERS: dict[str, Callable[[list[torch.Tensor]], list[torch.Tensor]]] = {
    "sbpflow ring, overlapped": lambda shards: _sbpflow_ring(shards, overlap=True),
    "sbpflow ring, blocking": lambda shards: _sbpflow_ring(shards, overlap=False),
    "torch ring, all-to-all rotation": lambda shards: _torch_ring(shards, "alltoall"),
    "torch ring, all-gather rotation (its default)": lambda shards: _torch_ring(shards, "allgather"),
}


def attention_worker(out: str) -> None:
    """Times the four ring contenders on this process's zigzag shards of one causal attention, interleaved."""
    torch.set_num_threads(1)
    placement = sbpflow.placement("cpu", list(range(dist.get_world_size())))
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(ATTENTION, generator=generator) for _ in range(4)]  # q, k, v, dy: global (B, H, T, D)
    shards = [sbpflow.tensor(t, placement=placement, sbp=(zigzag(2),)).to_local().contiguous() for t in full]
    reference = RING_CONTENDERS["sbpflow ring, overlapped"](shards)
    for name, run in RING_CONTENDERS.items():
        for got, want in zip(run(shards), reference, strict=True):
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                raise AssertionError(f"{name} differs from sbpflow's overlapped ring by "
                                     f"{(got - want).abs().max():.3g}")
    names = list(RING_CONTENDERS)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(whole_turns(ATTENTION_ROUNDS, len(names))):
        for name in turned(names, round_):
            seconds[name].append(timed_block_cpu(functools.partial(RING_CONTENDERS[name], shards), steps=1)[0])
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(seconds))


def launched(world: int, args: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        launch_self(__file__, world, [*args, "--out", out], check=True, timeout=1800)
        return dict(json.loads(Path(out).read_text()))


def allocated_mib(cp: int, t: int) -> float:
    grown = launched(cp, ["--measure", str(t), "--uncached"])["growth"]
    print(f"  cp {cp}, {t} tokens: allocated peak growth {grown:.0f} MiB", flush=True)
    return float(grown)


def measured_longest(cp: int, cap_mib: float, guess: int, grown: float) -> int:
    """The longest sequence (a multiple of 32 cp) whose allocated peak growth on ``cp`` processes stays under
    ``cap_mib``, by launches: upwards from ``guess`` (whose growth is ``grown``) while it fits, else bisected
    between the cp = 1 sequence (which fits: each rank holds a cp-th of it) and ``guess``."""
    unit = 32 * cp
    if grown <= cap_mib:
        while allocated_mib(cp, guess + unit) <= cap_mib:
            guess += unit
        return guess
    lo, hi = MEASURED_BASE, guess
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if allocated_mib(cp, mid) <= cap_mib else (lo, mid)
    return lo


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}; {min(values):.2f}-{max(values):.2f}"


def measured_rows() -> list[str]:
    cap = peak(1, MEASURED_BASE)
    with sbpflow.meta_init():
        params = sum(p.numel() for p in Llama(LlamaConfig(**CONFIG)).parameters())  # type: ignore[arg-type]
    rows = [f"Measured on processes: cap = the cp = 1 plan's peak at {MEASURED_BASE} tokens ({cap / 2**20:.1f} MiB); "
            f"{MEASURED_STEPS - 1} timed steps after one warm-up; growth of the resident size over the "
            f"process's RSS before the model is built (MiB per rank, the largest rank). Weights, gradients and "
            f"AdamW's two moments are {params * 16 / 2**20:.1f} MiB on every rank at every cp "
            f"({params / 1e6:.2f} M parameters, fp32).",
            "", "| cp | sequence (plan's longest) | plan peak | allocated: between steps | allocated: step's peak "
            "over it | allocated peak growth | / cp = 1 | longest under cp = 1's allocated peak (× cp = 1) | kept "
            "(host cache): peak growth | / cp = 1 | step (s, median; min-max) |", "|---|---|---|---|---|---|---|---|"
            "---|---|---|"]
    first: dict[str, float] = {}
    for cp in (1, 2, 4):
        t = longest(cp, cap)
        allocated = launched(cp, ["--measure", str(t), "--uncached"])
        kept = launched(cp, ["--measure", str(t)])
        first = first or {"allocated": allocated["growth"], "kept": kept["growth"]}
        fits = t if cp == 1 else measured_longest(cp, first["allocated"], t, allocated["growth"])
        rows.append(f"| {cp} | {t} | {peak(cp, t) / 2**20:.1f} | {allocated['between']:.0f} | "
                    f"{allocated['growth'] - allocated['between']:.0f} | {allocated['growth']:.0f} | "
                    f"{allocated['growth'] / first['allocated']:.2f} | {fits} ({fits / MEASURED_BASE:.2f}) | "
                    f"{kept['growth']:.0f} | {kept['growth'] / first['kept']:.2f} | {_spread(kept['seconds'])} |")
        print(rows[-1], flush=True)
    return rows


def attention_rows() -> list[str]:
    rows = [f"Ring attention alone, causal, (B, H, T, D) = {ATTENTION}, forward + backward, zigzag shards; "
            f"{whole_turns(ATTENTION_ROUNDS, len(RING_CONTENDERS))} interleaved rounds, each a warm-up call and a "
            "timed one (the slower rank's); seconds: median; min-max; the ratio is each round's against sbpflow's "
            "overlapped ring, median; min-max.", "",
            "| cp | contender | seconds | × sbpflow overlapped |", "|---|---|---|---|"]
    for cp in (2, 4):
        seconds = launched(cp, ["--attention"])
        base = seconds["sbpflow ring, overlapped"]
        for name, values in seconds.items():
            rows.append(f"| {cp} | {name} | {_spread(values)} | "
                        f"{_spread([v / b for v, b in zip(values, base, strict=True)])} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_write_flag(parser)
    parser.add_argument("--skip-measured", action="store_true", help="only the plan's figures and the balance")
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)  # a launched worker: this sequence
    parser.add_argument("--uncached", action="store_true", help=argparse.SUPPRESS)  # ... without the host cache
    parser.add_argument("--attention", action="store_true", help=argparse.SUPPRESS)  # a launched worker
    parser.add_argument("--torch-cp", action="store_true", help=argparse.SUPPRESS)  # a launched worker
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure or args.attention or args.torch_cp:
        sbpflow.distributed.init()
    if args.measure:
        measure_worker(args.measure, args.out, kept=not args.uncached)
        return
    if args.attention:
        attention_worker(args.out)
        return
    if args.torch_cp:
        torch_cp_worker(args.out)
        return
    torch.set_num_threads(1)
    cap = peak(1, BASE)
    lines = [f"Machine: {machine()}.", "",
             f"Llama {CONFIG['num_hidden_layers']} layers, width {CONFIG['hidden_size']}, "
             f"{CONFIG['num_attention_heads']} heads, batch 1, fp32, ids Z(1); "
             f"cap = the cp = 1 plan's peak at {BASE} tokens ({cap / 2**20:.1f} MiB per rank).", "",
             "| cp | longest sequence | × cp = 1 | aim 0.9 × cp |", "|---|---|---|---|"]
    base = longest(1, cap)
    for cp in (1, 2, 4, 8):
        n = base if cp == 1 else longest(cp, cap)
        lines.append(f"| {cp} | {n} | {n / base:.2f} | {0.9 * cp:.1f} |")
        print(lines[-1], flush=True)
    if not args.skip_measured:
        lines += ["", *measured_rows(), "", *attention_rows()]
        torch_cp = launched(2, ["--torch-cp"])
        said = [f"with {name}, {'it ran' if r == 'ran' else f'raises `{r}`'}" for name, r in torch_cp.items()]
        lines += ["", "torch's `context_parallel` (ring, DTensor) on 2 gloo processes, causal attention (1, 8, 256, "
                  f"32): {'; '.join(said)}."]
    lines += ["", "Causal work per rank (sequence 4096), max and min over the mean:", "", *balance_rows(), "", READING]
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section("context_parallel", "## Context parallelism: longest sequence, measured peak, causal balance\n\n"
                      + body)


if __name__ == "__main__":
    main()
