"""``sbpflow calibrate``: measure this machine into a :class:`DeviceProfile`.

What is measured, and what it becomes in the profile:

    matmul           fp32 GEMMs of growing size; the best FLOP/s       -> peak_flops (eta_matmul 1)
    memcpy           a large tensor copy, bytes read + written / s    -> mem_bandwidth
    elementwise      out = a + b over a large tensor, bytes / s       -> eta_memory = elementwise / memcpy
    launch floor     the same add on one element                      -> launch_s
    gloo α-β         all_reduce between local processes at sizes      -> intra_alpha, intra_bandwidth
                     from 4 B to MBs, least squares on the ring model
    sharing          k = 1..N processes run the same fixed work at     -> cores, background: the line
                     once: wall over the work's time on a free core       (k + background) / cores fitted
                     (other jobs, and the CPU a process loses to          to those stretches
                     switching, included)
    α in a step      a 4-byte all_reduce after 1 ms of compute on      -> sync_s: that beyond its α-β time,
                     every process, beyond the compute alone (waiting     over the share of time a process
                     for the process the shared cores left behind)        waits for a core (shared cores);
                                                                          else intra_alpha >= that / 2(p-1)

The inter-node link cannot be measured on one machine; the profile repeats the intra-node one and says so in
its ``source``. :func:`calibrate_job` measures the same inside a running job (every process calls it), for a
benchmark that predicts plans on the processes it then times.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import SbpflowError
from .profiles import DeviceProfile, host_cores

SIZES = (4, 1024, 16384, 262144, 1 << 20, 1 << 23)  # all_reduce message bytes of the α-β fit
SIZES_QUICK = (4, 4096, 65536, 1 << 20)
SHARING_NOISE = 0.1  # a stretch this close to 1 is a process alone on its core, timed with some noise


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
    # (k, wall seconds of fixed work per second it takes on a free core) with k processes running it at once
    sharing: tuple[tuple[int, float], ...] = ()
    collective_s: float = 0.0  # a small all-reduce between stretches of compute, beyond the compute alone


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
    """One gloo process: the job's measurements (:func:`measure_job`), written by rank 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        times, sharing, collective = measure_job(dist, sizes, repeats)
        if rank == 0:
            Path(out).write_text(json.dumps({"times": times, "sharing": sharing, "collective": collective}))
    finally:
        dist.destroy_process_group()


def measure_job(dist: Any, sizes: tuple[int, ...], repeats: int
                ) -> tuple[dict[int, float], tuple[tuple[int, float], ...], float]:
    """On every process of a running gloo job: (all_reduce seconds per message size, the slowest rank's view
    after a barrier; the stretch of fixed work with k = 1..N processes busy; a 4-byte all-reduce's cost after
    compute)."""
    times = {}
    for nbytes in sizes:
        t = torch.zeros(max(nbytes // 4, 1))
        dist.barrier()
        times[nbytes] = max(_gather(dist, _best_time(partial(dist.all_reduce, t), repeats)))
    return times, _sharing(dist), _collective_after_compute(dist)


def _gather(dist: Any, value: float) -> list[float]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def _busy(seconds: float) -> None:
    """``seconds`` of this thread's CPU in small GEMMs."""
    a = torch.randn(64, 64)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        torch.mm(a, a)


def _work(gemms: int) -> None:
    """A fixed piece of work: ``gemms`` small GEMMs."""
    a = torch.randn(64, 64)
    for _ in range(gemms):
        torch.mm(a, a)


def _sharing(dist: Any, gemms: int = 1200, repeats: int = 5) -> tuple[tuple[int, float], ...]:
    """(k, stretch) for k = 1..N: the wall seconds from a common start until ranks 0..k-1 have each run a fixed
    piece of work (about 20 ms on a free core), over that work's time on a free core (the fastest single run);
    the median of ``repeats`` rounds, each timing every k (the load of other jobs drifts). Fixed work rather than
    CPU seconds: on a shared host a process also spends more CPU on the same work (switches, caches); a common
    start, because a process the cores left waiting starts late."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spans: dict[int, list[float]] = {k: [] for k in range(1, world + 1)}
    fastest = float("inf")
    for _ in range(repeats):
        for k in spans:
            dist.barrier()
            start = time.time()  # one clock for the processes of a host
            if rank < k:
                begin = time.perf_counter()
                _work(gemms)
                fastest = min(fastest, time.perf_counter() - begin)
            ends: list[Any] = [None] * world
            dist.all_gather_object(ends, (start, time.time()))
            spans[k].append(max(end for _, end in ends[:k]) - min(begin for begin, _ in ends))
    free = min(_gather(dist, fastest))
    return tuple((k, max(1.0, statistics.median(t) / free)) for k, t in spans.items())


def fit_sharing(sharing: tuple[tuple[int, float], ...], most: float = float("inf")) -> tuple[float, float]:
    """(cores, background) of the stretches measured with k processes busy: the line ``(k + background) /
    cores`` (a fair share of the cores among k processes and the other jobs' busy ones) by least squares
    through the stretched points (over ``1 + SHARING_NOISE``: below them each process had a core), background
    >= 0 and cores at most ``most`` (the host's). When nothing was stretched, each busy process had a core:
    as many cores as the most processes measured, and no other jobs.

    >>> fit_sharing(((1, 1.5), (2, 2.0), (3, 2.5), (4, 3.0)))  # 2 cores, 2 busy processes of other jobs
    (2.0, 2.0)
    >>> fit_sharing(((1, 1.0), (2, 1.02), (3, 1.5), (4, 2.0)))  # 2 cores, nothing else running
    (2.0, 0.0)
    >>> fit_sharing(((1, 1.0), (2, 1.0)))
    (2.0, 0.0)
    >>> fit_sharing(((1, 1.3), (2, 1.5)), most=2)  # a shallow line: more other jobs on the host's 2 cores
    (2.0, 1.3)
    """
    stretched = [(float(n), float(f)) for n, f in sharing if f > 1 + SHARING_NOISE]
    if not stretched:
        return float(max((n for n, _ in sharing), default=0)), 0.0
    k, s = np.array(stretched).T
    slope, intercept = np.polyfit(k, s, 1) if len(k) > 1 else (s[0] / k[0], 0.0)
    if intercept < 0 or slope <= 0:  # no other jobs: the line through the origin
        slope, intercept = float(k @ s / (k @ k)), 0.0
    cores, background = 1 / slope, intercept / slope
    if cores > most:  # the host has no more: the rest of the stretch is other jobs
        cores, background = most, max(0.0, float(np.mean(s * most - k)))
    return round(float(cores), 6), round(float(background), 6)


def _collective_after_compute(dist: Any, work: float = 1e-3, n: int = 20, repeats: int = 5) -> float:
    """Seconds a blocking 4-byte all-reduce adds after ``work`` CPU seconds on every process: its latency and
    the wait for the process that the shared cores left behind (what a step's collectives between ops pay)."""
    flag = torch.zeros(1)

    def loop(reduce: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            _busy(work)
            if reduce:
                dist.all_reduce(flag)
        return (time.perf_counter() - start) / n

    samples = [loop(True) - loop(False) for _ in range(repeats)]
    return max(0.0, statistics.median(_gather(dist, statistics.median(samples))))


def measure_gloo(processes: int, sizes: tuple[int, ...], repeats: int
                 ) -> tuple[dict[int, float], tuple[tuple[int, float], ...], float]:
    """:func:`measure_job` on ``processes`` local gloo processes started for it."""
    import torch.multiprocessing as mp

    if processes < 2:
        raise SbpflowError(f"measuring gloo's α-β needs at least 2 processes, but got {processes}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.start_processes(_all_reduce_worker, args=(processes, _free_port(), sizes, repeats, out),
                           nprocs=processes, start_method="spawn", join=True)
        found = json.loads(Path(out).read_text())
        sharing = tuple((int(k), float(f)) for k, f in found["sharing"])
        return {int(k): v for k, v in found["times"].items()}, sharing, found["collective"]


def calibrate(name: str = "local-cpu", processes: int = 2, quick: bool = False) -> tuple[DeviceProfile, Measurements]:
    """Measures this machine (about 10 s with ``quick``) and returns its profile with the raw measurements."""
    repeats = 3 if quick else 10
    matmul = measure_matmul((256, 512) if quick else (256, 512, 1024, 2048), repeats)
    copy, add, launch = measure_memory(1 << (22 if quick else 25), repeats)
    times, sharing, collective = measure_gloo(processes, SIZES_QUICK if quick else SIZES, repeats)
    alpha, beta = fit_alpha_beta(times, processes)
    found = Measurements(matmul, copy, add, launch, processes, times, alpha, beta, sharing, collective)
    return _profile(name, found), found


def calibrate_job(base: DeviceProfile, name: str = "this-job", quick: bool = False
                  ) -> tuple[DeviceProfile, Measurements]:
    """``base`` (its compute rates and launch floor) with the links and the cores of the running job, measured
    on every process of it (each process calls this; all get the same profile): gloo's α-β on the job's
    group, the cores its processes share, and the cost of a collective between stretches of compute."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise SbpflowError("calibrate_job runs on every process of a torch.distributed job of 2 processes or more "
                           "(sbpflow launch -n N)")
    repeats = 3 if quick else 10
    processes = dist.get_world_size()
    times, sharing, collective = measure_job(dist, SIZES_QUICK if quick else SIZES, repeats)
    alpha, beta = fit_alpha_beta(times, processes)
    found = Measurements({}, base.mem_bandwidth, base.memory_throughput, base.launch_s, processes, times, alpha,
                         beta, sharing, collective)
    named = replace(base, name=name, gpus_per_node=processes, source=f"{base.source}; links and cores: "
                    f"calibrate_job on {processes} processes, {time.strftime('%Y-%m-%d %H:%M')}")
    return _with_links(named, found), found


def _with_links(profile: DeviceProfile, m: Measurements) -> DeviceProfile:
    """``profile`` with the measured links and shared cores. A collective after compute costs more than its α-β
    time: on shared cores, the wait for the peers they are not running (``sync_s``, scaled to the share of time
    a process waits for a core with every process busy); on cores of their own, at least a longer α."""
    bandwidth = 1 / m.beta
    cores, background = fit_sharing(m.sharing, host_cores())
    shared = replace(profile, cores=cores, background=background)
    waiting = 1 - 1 / shared.stretch(m.processes)
    alpha, sync = max(m.alpha, m.collective_s / (2 * (m.processes - 1))), 0.0
    if waiting > 0:
        alpha, sync = m.alpha, max(0.0, m.collective_s - 2 * (m.processes - 1) * m.alpha) / waiting
    return replace(shared, intra_bandwidth=bandwidth, inter_bandwidth=bandwidth, intra_alpha=alpha,
                   inter_alpha=alpha, eta_intra=1.0, eta_inter=1.0, sync_s=sync)


def _profile(name: str, m: Measurements) -> DeviceProfile:
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 16e9
    measured = DeviceProfile(
        name=name, device_type="cpu", peak_flops=max(m.matmul_flops.values()), mem_bandwidth=m.memcpy_bandwidth,
        memory_bytes=float(total_memory), intra_bandwidth=1 / m.beta, inter_bandwidth=1 / m.beta, eta_matmul=1.0,
        eta_memory=min(m.elementwise_bandwidth / m.memcpy_bandwidth, 1.0), launch_s=m.launch_s,
        gpus_per_node=m.processes, reserved_bytes=0.0,
        source=f"sbpflow calibrate on {platform.node()}, {time.strftime('%Y-%m-%d')}; inter-node link not "
               "measured (copied from intra-node)",
    )
    return _with_links(measured, m)


def describe(m: Measurements) -> str:
    """What was measured, as a small table."""
    lines = ["matmul (fp32):"] + [f"  {n:5d}^3  {f / 1e9:8.1f} GFLOP/s" for n, f in m.matmul_flops.items()]
    lines += [f"memcpy       {m.memcpy_bandwidth / 1e9:8.2f} GB/s (read + write)",
              f"elementwise  {m.elementwise_bandwidth / 1e9:8.2f} GB/s (a + b -> c)",
              f"launch floor {m.launch_s * 1e6:8.2f} us",
              f"gloo all_reduce on {m.processes} processes:"]
    lines += [f"  {n:9d} B  {t * 1e6:10.1f} us" for n, t in m.all_reduce_s.items()]
    lines.append(f"fit: alpha {m.alpha * 1e6:.1f} us, beta {m.beta * 1e9:.3f} ns/B ({1 / m.beta / 1e9:.2f} GB/s)")
    cores, background = fit_sharing(m.sharing, host_cores())
    stretches = ", ".join(f"{k} busy {f:.2f}x" for k, f in m.sharing)
    lines.append(f"fixed work with k processes busy: {stretches} ({cores:.2f} cores, {background:.2f} busy "
                 f"processes of other jobs); a 4-byte all_reduce after compute: {m.collective_s * 1e6:.0f} us")
    return "\n".join(lines)
