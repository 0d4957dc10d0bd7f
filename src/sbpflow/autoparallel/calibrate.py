"""``sbpflow calibrate``: measure this machine into a :class:`DeviceProfile`.

What is measured, and what it becomes in the profile:

    matmul           fp32 GEMMs of growing size; the best FLOP/s       -> peak_flops (eta_matmul 1)
    memcpy           a large tensor copy, bytes read + written / s    -> mem_bandwidth
    elementwise      out = a + b over a large tensor, bytes / s       -> eta_memory = elementwise / memcpy
    launch floor     the same add on one element                      -> launch_s
    gloo α-β         all_reduce between local processes at sizes      -> intra_alpha, intra_bandwidth
                     from 4 B to MBs, least squares on the ring model

The inter-node link cannot be measured on one machine; the profile repeats the intra-node one and says so in
its ``source``.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..errors import SbpflowError
from .profiles import DeviceProfile


@dataclass(frozen=True)
class Measurements:
    """Raw results: throughputs, and the all-reduce times the α-β fit used."""

    matmul_flops: dict[int, float]  # matrix size -> FLOP/s
    memcpy_bandwidth: float
    elementwise_bandwidth: float
    launch_s: float
    processes: int
    all_reduce_s: dict[int, float]  # bytes -> seconds
    alpha: float
    beta: float


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs after one warm-up: the machine's capability, not its noise."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul(sizes: tuple[int, ...], repeats: int) -> dict[int, float]:
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out[n] = 2.0 * n**3 / _best_time(partial(torch.mm, a, b), repeats)
    return out


def measure_memory(numel: int, repeats: int) -> tuple[float, float, float]:
    """(memcpy bytes/s, elementwise bytes/s, launch floor s)."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    copy = 2 * 4 * numel / _best_time(lambda: c.copy_(a), repeats)
    add = 3 * 4 * numel / _best_time(lambda: torch.add(a, b, out=c), repeats)
    x, y = torch.ones(1), torch.ones(1)
    launch = _best_time(lambda: torch.add(x, y), repeats * 20)
    return copy, add, launch


def fit_alpha_beta(times: dict[int, float], processes: int) -> tuple[float, float]:
    """α and β of the ring all-reduce model ``2(p-1)α + 2(p-1)/p · n β``, by least squares, both >= 0.

    >>> t = {n: 2 * 1e-5 + 1 * n * 1e-9 for n in (4, 4096, 1 << 20)}   # p = 2: 2α + n β
    >>> [round(v, 12) for v in fit_alpha_beta(t, 2)]
    [1e-05, 1e-09]
    """
    if len(times) < 2:
        raise SbpflowError(f"an α-β fit needs all-reduce times at two sizes at least, but got {sorted(times)}")
    p = processes
    sizes = np.array(sorted(times), dtype=float)
    design = np.stack([np.full_like(sizes, 2 * (p - 1)), 2 * (p - 1) / p * sizes], axis=1)
    observed = np.array([times[int(n)] for n in sizes])
    # relative residuals: small messages (latency) matter as much as large ones (bandwidth)
    weights = 1 / observed
    solution, *_ = np.linalg.lstsq(design * weights[:, None], observed * weights, rcond=None)
    alpha, beta = (max(float(v), 0.0) for v in solution)
    return alpha, beta or 1e-12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _all_reduce_worker(rank: int, world: int, port: int, sizes: tuple[int, ...], repeats: int, out: str) -> None:
    """One gloo process: time all_reduce at each size (the slowest rank's view, after a barrier)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        times = {}
        for nbytes in sizes:
            t = torch.zeros(max(nbytes // 4, 1))
            dist.barrier()
            times[nbytes] = _best_time(partial(dist.all_reduce, t), repeats)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def measure_gloo(processes: int, sizes: tuple[int, ...], repeats: int) -> dict[int, float]:
    """All-reduce seconds per message size between ``processes`` local gloo processes."""
    import torch.multiprocessing as mp

    if processes < 2:
        raise SbpflowError(f"measuring gloo's α-β needs at least 2 processes, but got {processes}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.start_processes(_all_reduce_worker, args=(processes, _free_port(), sizes, repeats, out),
                           nprocs=processes, start_method="spawn", join=True)
        return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}


def calibrate(name: str = "local-cpu", processes: int = 2, quick: bool = False) -> tuple[DeviceProfile, Measurements]:
    """Measures this machine (about 10 s with ``quick``) and returns its profile with the raw measurements."""
    repeats = 3 if quick else 10
    matmul = measure_matmul((256, 512) if quick else (256, 512, 1024, 2048), repeats)
    copy, add, launch = measure_memory(1 << (22 if quick else 25), repeats)
    sizes = (4, 4096, 65536, 1 << 20) if quick else (4, 1024, 16384, 262144, 1 << 20, 1 << 23)
    times = measure_gloo(processes, sizes, repeats)
    alpha, beta = fit_alpha_beta(times, processes)
    found = Measurements(matmul, copy, add, launch, processes, times, alpha, beta)
    return _profile(name, found), found


def _profile(name: str, m: Measurements) -> DeviceProfile:
    bandwidth = 1 / m.beta
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 16e9
    return DeviceProfile(
        name=name, device_type="cpu", peak_flops=max(m.matmul_flops.values()), mem_bandwidth=m.memcpy_bandwidth,
        memory_bytes=float(total_memory), intra_bandwidth=bandwidth, inter_bandwidth=bandwidth,
        intra_alpha=m.alpha, inter_alpha=m.alpha, eta_matmul=1.0, eta_memory=min(m.elementwise_bandwidth /
                                                                               m.memcpy_bandwidth, 1.0),
        eta_intra=1.0, eta_inter=1.0, launch_s=m.launch_s, gpus_per_node=m.processes, reserved_bytes=0.0,
        source=f"sbpflow calibrate on {platform.node()}, {time.strftime('%Y-%m-%d')}; inter-node link not "
               "measured (copied from intra-node)",
    )


def describe(m: Measurements) -> str:
    """What was measured, as a small table."""
    lines = ["matmul (fp32):"] + [f"  {n:5d}^3  {f / 1e9:8.1f} GFLOP/s" for n, f in m.matmul_flops.items()]
    lines += [f"memcpy       {m.memcpy_bandwidth / 1e9:8.2f} GB/s (read + write)",
              f"elementwise  {m.elementwise_bandwidth / 1e9:8.2f} GB/s (a + b -> c)",
              f"launch floor {m.launch_s * 1e6:8.2f} us",
              f"gloo all_reduce on {m.processes} processes:"]
    lines += [f"  {n:9d} B  {t * 1e6:10.1f} us" for n, t in m.all_reduce_s.items()]
    lines.append(f"fit: alpha {m.alpha * 1e6:.1f} us, beta {m.beta * 1e9:.3f} ns/B ({1 / m.beta / 1e9:.2f} GB/s)")
    return "\n".join(lines)
