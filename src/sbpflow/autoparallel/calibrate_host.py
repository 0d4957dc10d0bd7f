"""Calibrating a :class:`~sbpflow.autoparallel.host.HostProfile`: microbenchmarks run by every process of a job.

Call :func:`calibrate_host` on every process of a running ``torch.distributed`` (gloo) job, as ``sbpflow
launch`` starts one; each measurement is a primitive, never a plan:

    dispatch floor       a training step of a tiny language model (built from sbpflow.nn) placed on rank 0
                         alone: CPU seconds per dispatched op on rank 0 (owner) and on the others (outside
                         the placement)
    GEMM, elementwise    one core's rates (thread CPU time, so other jobs on the machine do not count)
    sharing              k processes run the same CPU loop while the rest wait: wall / CPU of each, k = 1..N
    collectives          sbpflow's P -> B boxing (one all-reduce) on groups of 2 and of N at 4 B, 64 KiB and
                         1 MiB, every group at once: wall and this thread's CPU, a + b·n fitted per group
                         size; send/receive between pairs

The machine is measured as it is at that moment (other jobs included), so a validation measures it in the
same rounds as the plans it predicts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..creation import zeros
from ..errors import SbpflowError
from ..nn.container import ModuleList
from ..nn.layers import Embedding, Linear
from ..nn.module import Module
from ..nn.normalization import LayerNorm
from ..nn.parallelize import parallelize
from ..ops import schema
from ..ops.functional import (
    cross_entropy,
    gelu,
    linear,
    permute_reshape,
    reshape,
    reshape_permute,
    scaled_dot_product_attention,
)
from ..optim import AdamW
from ..placement import Placement
from ..random import manual_seed
from ..sbp import broadcast, partial_sum
from ..tensor import Tensor
from .host import BlockShape, HeadShape, HostProfile

SIZES = (4, 64 << 10, 1 << 20)


def fit_line(times: dict[int, float]) -> tuple[float, float]:
    """``a + b·n`` through (bytes, seconds) by least squares on relative residuals, both >= 0.

    >>> [round(v, 9) for v in fit_line({4: 1e-4 + 4e-9, 1 << 20: 1e-4 + (1 << 20) * 1e-9})]
    [0.0001, 1e-09]
    """
    if len(times) < 2:
        raise SbpflowError(f"a line needs times at two sizes at least, but got {sorted(times)}")
    n = np.array(sorted(times), dtype=float)
    t = np.array([times[int(k)] for k in n])
    design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(n), rcond=None)
    return max(float(a), 0.0), max(float(b), 0.0)


def _cpu_per_call(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.thread_time() - start) / repeats)
    return best


class _TinyBlock(Module):
    """A pre-LN transformer block written with ``sbpflow.nn``: the op mix of a language model's step."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = LayerNorm(width), LayerNorm(width)
        self.q, self.k, self.v, self.proj = (Linear(width, width) for _ in range(4))
        self.up, self.down = Linear(width, 4 * width), Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # logical (B, T, C)
        y = self.ln_1(x)
        q, k, v = (reshape_permute(f(y), (b, t, self.heads, c // self.heads), (0, 2, 1, 3))
                   for f in (self.q, self.k, self.v))  # logical (B, H, T, hd)
        att = permute_reshape(scaled_dot_product_attention(q, k, v, is_causal=True), (0, 2, 1, 3), (b, t, c))
        x = x + self.proj(att)
        return x + self.down(gelu(self.up(self.ln_2(x))))


class _TinyLM(Module):
    """Embedding, two blocks, final norm and a tied head with cross-entropy: a tiny language model's step."""

    def __init__(self, vocab: int = 16, width: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.wte = Embedding(vocab, width)
        self.h = ModuleList([_TinyBlock(width, heads) for _ in range(layers)])
        self.ln_f = LayerNorm(width)

    def forward(self, ids: Tensor, targets: Tensor) -> Tensor:
        b, t = ids.shape  # logical (B, T)
        x = self.wte(ids)  # logical (B, T, C)
        for block in self.h:
            x = block(x)
        logits = linear(self.ln_f(x), self.wte.weight)  # logical (B, T, V)
        return cross_entropy(reshape(logits, (b * t, -1)), reshape(targets, (b * t,)))


def _dispatch(dist: Any) -> tuple[float, float]:
    """(owner, outsider) CPU seconds per op of a tiny language model's training step placed on rank 0."""
    manual_seed(0)
    model = _TinyLM()
    strategy = parallelize(model)  # one rank: rank 0
    opt = AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    ids, targets = (rng.integers(0, 16, (2, 8)) for _ in range(2))

    def step() -> None:
        x, y = strategy.shard_inputs(ids, targets)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    with schema.counting() as ops:
        step()
    dist.barrier()
    per_op = _cpu_per_call(step, 10) / sum(ops.values())
    everyone = _gather(dist, per_op)
    return everyone[0], statistics.median(everyone[1:]) if len(everyone) > 1 else everyone[0]


def _gather(dist: Any, value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _rates() -> tuple[float, float]:
    a, b = torch.randn(512, 128), torch.randn(128, 384)
    gemm = 2 * 512 * 128 * 384 / _cpu_per_call(lambda: torch.mm(a, b), 20)
    x, y, z = torch.randn(1 << 18), torch.randn(1 << 18), torch.empty(1 << 18)
    elementwise = 3 * 4 * (1 << 18) / _cpu_per_call(lambda: torch.add(x, y, out=z), 50)
    return gemm, elementwise


def _adamw(params: int = 1 << 20, tensors: int = 16) -> float:
    """CPU seconds per parameter of torch's foreach AdamW step."""
    weights = [torch.zeros(params // tensors, requires_grad=True) for _ in range(tensors)]
    for w in weights:
        w.grad = torch.ones_like(w)
    opt = torch.optim.AdamW(weights, lr=1e-3, foreach=True)
    return _cpu_per_call(opt.step, 5) / params


def _busy(seconds: float) -> None:
    a = torch.randn(64, 64)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        torch.mm(a, a)


def _sharing(dist: Any, world: int, seconds: float = 0.05, repeats: int = 3) -> tuple[tuple[int, float], ...]:
    """(k, wall seconds per CPU second) with k = 1..world processes busy at once, the rest waiting."""
    rank = dist.get_rank()
    factors = []
    for k in range(1, world + 1):
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if rank < k:
                _busy(seconds)
            samples.append((time.perf_counter() - start) / seconds)
        everyone = _gather(dist, statistics.median(samples))
        factors.append((k, max(1.0, statistics.median(everyone[:k]))))
    return tuple(factors)


def _sync_cost(dist: Any, work: float = 2e-3, n: int = 10, repeats: int = 3) -> float:
    """Seconds a blocking all-reduce of 4 B costs after ``work`` CPU seconds, beyond the work and the
    collective each timed alone: waiting for the process that the cores' sharing left behind."""
    flag = torch.zeros(1)

    def loop(compute: bool, reduce: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            if compute:
                _busy(work)
            if reduce:
                dist.all_reduce(flag)
        return (time.perf_counter() - start) / n

    samples = []
    for _ in range(repeats):
        both, alone, bare = loop(True, True), loop(True, False), loop(False, True)
        samples.append(both - alone - bare)
    return max(0.0, statistics.median(_gather(dist, statistics.median(samples))))


def _all_reduce_lines(dist: Any, group_size: int, repeats: int = 8) -> tuple[tuple[float, float], tuple[float, float]]:
    """Partial sums boxed to B by sbpflow (one all-reduce each) on every group of ``group_size`` consecutive
    ranks at once: (wall a, b) and (this thread's CPU a, b) per collective, ``a + b·n`` for n bytes."""
    world = dist.get_world_size()
    placements = [Placement("cpu", list(range(g, g + group_size))) for g in range(0, world, group_size)]
    walls, cpus = {}, {}
    for nbytes in SIZES:
        parts = [zeros(max(nbytes // 4, 1), placement=p, sbp=partial_sum) for p in placements]

        def reduce_all(parts: list[Any] = parts) -> None:
            for x in parts:
                x.to_global(sbp=broadcast)

        reduce_all()
        dist.barrier()
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(repeats):
            reduce_all()
        cpu = (time.thread_time() - cpu) / repeats
        wall = (time.perf_counter() - start) / repeats
        walls[nbytes] = statistics.median(_gather(dist, wall))
        cpus[nbytes] = statistics.median(_gather(dist, cpu))
    return fit_line(walls), fit_line(cpus)


def _p2p_line(dist: Any, repeats: int = 10) -> tuple[float, float]:
    """Pairs (r, r + world/2) exchange a tensor: one send and one receive each, every pair at once."""
    world, rank = dist.get_world_size(), dist.get_rank()
    half = world // 2
    peer = rank + half if rank < half else rank - half
    times = {}
    for nbytes in SIZES:
        out, into = torch.zeros(max(nbytes // 4, 1)), torch.zeros(max(nbytes // 4, 1))

        def exchange(out: torch.Tensor = out, into: torch.Tensor = into) -> None:
            works = [dist.isend(out, peer), dist.irecv(into, peer)]
            for w in works:
                w.wait()

        exchange()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            exchange()
        times[nbytes] = statistics.median(_gather(dist, (time.perf_counter() - start) / repeats))
    return fit_line(times)


def calibrate_host(shapes: list[BlockShape | HeadShape] = ()) -> HostProfile:  # type: ignore[assignment]
    """Measures this host as every process of the running job sees it; every process gets the same profile.
    ``shapes``: the block and head shapes whose torch kernels to time (``host.plan_shapes``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise SbpflowError("calibrate_host runs on every process of a torch.distributed job (sbpflow launch -n N)")
    world = dist.get_world_size()
    if world < 2 or world % 2:
        raise SbpflowError(f"calibrate_host measures groups of 2 and of all processes: it needs an even number of "
                           f"processes, but the job has {world}")
    own, foreign = _dispatch(dist)
    gemm, elementwise = _rates()
    rates = _gather(dist, (gemm, elementwise, _adamw()))
    sharing = _sharing(dist, world)
    sync = _sync_cost(dist)
    measured = {g: _all_reduce_lines(dist, g) for g in sorted({2, world})}
    lines = tuple((g, *wall) for g, (wall, _) in measured.items())
    cpu_lines = tuple((g, *cpu) for g, (_, cpu) in measured.items())
    p2p = _p2p_line(dist)
    kernels = _gather(dist, measure_kernels(list(shapes)))
    table = tuple((key, statistics.median(k[i][1] for k in kernels)) for i, (key, _) in enumerate(kernels[0]))
    return HostProfile(
        processes=world, cores_factor=sharing, dispatch_s=own, foreign_dispatch_s=foreign,
        gemm_flops=statistics.median(r[0] for r in rates), elementwise_bw=statistics.median(r[1] for r in rates),
        sync_s=sync, collectives=lines, collective_cpu=cpu_lines, p2p=p2p, kernels=table,
        optimizer_s_per_param=statistics.median(r[2] for r in rates),
    )


# ----------------------------------------------------------------------------- torch kernels at a plan's shapes


KernelTable = tuple[tuple[tuple[int, ...], float], ...]


def measure_kernels(shapes: list[BlockShape | HeadShape], repeats: int = 5) -> KernelTable:
    """CPU seconds of plain torch forward + backward of each block or head shape (one thread): the kernels a
    rank runs under a plan, without sbpflow's dispatch (the floor prices that)."""
    out = []
    for shape in dict.fromkeys(shapes):
        fn = _block_step(shape) if isinstance(shape, BlockShape) else _head_step(shape)
        out.append((shape.key, _cpu_per_call(fn, repeats)))
    return tuple(out)


def _block_step(shape: BlockShape) -> Callable[[], None]:
    """A pre-LN block on one rank's shard: column-parallel q, k, v and MLP up, row-parallel projections."""
    import torch.nn.functional as F  # noqa: N812

    n, h, a, d, f, s = shape.tokens, shape.hidden, shape.heads, shape.head_dim, shape.ffn, shape.seq
    b = n // s
    w = {name: torch.randn(*dims, requires_grad=True) * 0.02 for name, dims in
         (("q", (a * d, h)), ("k", (a * d, h)), ("v", (a * d, h)), ("o", (h, a * d)), ("fc", (f, h)), ("pr", (h, f)))}
    w = {k: v.detach().requires_grad_() for k, v in w.items()}
    gamma, beta = torch.ones(h, requires_grad=True), torch.zeros(h, requires_grad=True)
    x = torch.randn(b, s, h, requires_grad=True)

    def step() -> None:
        y = F.layer_norm(x, (h,), gamma, beta)
        q, k, v = (F.linear(y, w[i]).reshape(b, s, a, d).transpose(1, 2) for i in "qkv")
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, a * d)
        z = x + F.linear(att, w["o"])
        out = z + F.linear(F.gelu(F.linear(F.layer_norm(z, (h,), gamma, beta), w["fc"])), w["pr"])
        out.sum().backward()

    return step


def _head_step(shape: HeadShape) -> Callable[[], None]:
    """The output layer on one rank's vocabulary shard and the cross-entropy over it."""
    import torch.nn.functional as F  # noqa: N812

    x = torch.randn(shape.tokens, shape.hidden, requires_grad=True)
    w = (torch.randn(shape.vocab, shape.hidden) * 0.02).requires_grad_()
    target = torch.randint(0, shape.vocab, (shape.tokens,))

    def step() -> None:
        F.cross_entropy(F.linear(x, w), target).backward()

    return step
