"""Device profiles: what one accelerator and its links can do, from public specs or measured here.

A profile is pure data. Peaks come from vendor datasheets; the efficiencies ``η`` say what fraction of a
peak real kernels sustain, and are the numbers ``sbpflow calibrate`` (or a user's own measurements) replace.

Public specs used (dense, no sparsity; per GPU; one direction of a link):

    profile     bf16 peak      HBM          memory   NVLink (per direction)   inter-node NIC per GPU
    a100-40gb   312 TFLOP/s    1555 GB/s    40 GB    300 GB/s (NVLink 3)      25 GB/s (HDR 200 Gb/s)
    a100-80gb   312 TFLOP/s    2039 GB/s    80 GB    300 GB/s (NVLink 3)      25 GB/s (HDR 200 Gb/s)
    h100-80gb   989 TFLOP/s    3350 GB/s    80 GB    450 GB/s (NVLink 4)      50 GB/s (NDR 400 Gb/s)

The efficiencies are assumptions, not specs: 75% of peak for large GEMMs (cuBLAS reaches 70-80% on large
fp16 GEMMs), less for small ones by a tile model (:meth:`DeviceProfile.gemm_efficiency`: the best of three output tiles,
the last wave's idle SMs, and ``k / (k + 128)`` for each tile's fixed cost, which is what slows attention's
per-head products), 80% of HBM bandwidth for elementwise kernels, and 75% of NVLink / 80% of the NIC for NCCL's ring
collectives (nccl-tests' bus bandwidth on DGX A100). ``sbpflow plan --explain`` prints them next to every
prediction so that what a prediction rests on is visible.

>>> PROFILES["a100-80gb"].matmul_flops / 1e12
234.0
>>> round(PROFILES["a100-80gb"].gemm_efficiency(2048, 2048, 128, batch=96), 2)  # attention's Q·Kᵀ per head
0.5
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..boxing.plan import CostModel, LinkCost
from ..errors import SbpflowError
from ..graph.costs import MEM_SECONDS_PER_BYTE, SECONDS_PER_FLOP

GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """One device type of a cluster: compute, memory and the two link kinds, with their efficiencies."""

    name: str
    device_type: str  # "cuda" or "cpu": the boxing cost model's device type
    peak_flops: float  # dense half-precision FLOP/s (fp32 when calibrated on a CPU)
    mem_bandwidth: float  # bytes/s of device memory
    memory_bytes: float  # capacity of one device
    intra_bandwidth: float  # bytes/s one direction, within a node
    inter_bandwidth: float  # bytes/s one direction per device, across nodes
    intra_alpha: float = 5e-6  # seconds of latency per collective round within a node
    inter_alpha: float = 10e-6  # ... across nodes
    eta_matmul: float = 0.6  # sustained fraction of peak_flops for GEMMs
    eta_memory: float = 0.8  # sustained fraction of mem_bandwidth for elementwise kernels
    eta_intra: float = 0.75  # sustained fraction of intra_bandwidth for collectives
    eta_inter: float = 0.8  # sustained fraction of inter_bandwidth
    launch_s: float = 5e-6  # the floor of any kernel: launch and tail
    compute_units: int = 0  # streaming multiprocessors a GEMM's tiles are spread over; 0: no tile/wave model
    # output tiles (rows, columns, their rate relative to the largest) the GEMM library picks from: smaller tiles
    # waste less of a small product's last wave but load more bytes per FLOP
    gemm_tiles: tuple[tuple[int, int, float], ...] = ((256, 128, 1.0), (128, 128, 0.9), (128, 64, 0.8))
    gemm_k_half: float = 0.0  # inner dimension at which a GEMM sustains half its large-k rate (prologue, epilogue)
    gpus_per_node: int = 8
    reserved_bytes: float = 3 * GB  # CUDA context, allocator fragmentation, workspaces
    # CPU cores the devices share (a host's processes); 0: each device computes on its own (accelerators)
    cores: float = 0.0
    background: float = 0.0  # busy processes of other jobs on those cores, as calibration found them
    # seconds a blocking collective would wait for peers the shared cores never run; a collective waits this
    # times the share of time a process waits for a core (:meth:`sync_wait`); 0 on accelerators
    sync_s: float = 0.0
    source: str = "public specs"

    @property
    def matmul_flops(self) -> float:
        """Sustained GEMM FLOP/s."""
        return self.peak_flops * self.eta_matmul

    def gemm_efficiency(self, m: Any, n: Any, k: Any, batch: Any = 1.0) -> Any:
        """The fraction of ``matmul_flops`` that ``batch`` (m, k) x (k, n) products sustain, with the tile that
        suits them best (as cuBLAS's heuristics pick one): the filled share of the output tiles, of the last
        wave of tiles over the compute units, and ``k / (k + k_half)`` for each tile's fixed cost. 1.0 for a
        profile without a tile model (CPUs, calibrated hosts). Numbers or NumPy arrays of them."""
        if self.compute_units <= 0:
            return np.ones_like(np.asarray(m, dtype=float)) if isinstance(m, np.ndarray) else 1.0
        m, n, k, batch = (np.maximum(np.asarray(a, dtype=float), 1.0) for a in (m, n, k, batch))
        best = np.zeros(np.broadcast(m, n, k, batch).shape)
        for tm, tn, rate in self.gemm_tiles:
            rows, cols = np.ceil(m / tm), np.ceil(n / tn)
            tiles = rows * cols * np.ceil(batch)
            fill = (m * n) / (rows * tm * cols * tn)
            waves = tiles / (np.ceil(tiles / self.compute_units) * self.compute_units)
            best = np.maximum(best, rate * fill * waves)
        out = best * k / (k + self.gemm_k_half)
        return out if out.ndim else float(out)

    def stretch(self, active: int) -> float:
        """Wall seconds per second of compute (on a free core) when ``active`` devices compute at once: the
        cores are shared fairly by them and the ``background`` processes of other jobs, ``(active +
        background) / cores`` when that is over 1.

        >>> host = replace(PROFILES["a100-80gb"], cores=2.0)
        >>> host.stretch(1), host.stretch(4), PROFILES["a100-80gb"].stretch(4)
        (1.0, 2.0, 1.0)
        >>> replace(host, background=1.0).stretch(2)
        1.5
        """
        if self.cores <= 0:
            return 1.0
        return max(1.0, (active + self.background) / self.cores)

    def sync_wait(self, active: int) -> float:
        """Seconds a blocking collective waits beyond its α-β time when ``active`` devices compute at once: its
        peers may be the processes the shared cores are not running, ``sync_s · (1 - 1 / stretch)``.

        >>> host = replace(PROFILES["a100-80gb"], cores=2.0, sync_s=4e-3)
        >>> host.sync_wait(2), host.sync_wait(4)
        (0.0, 0.002)
        """
        return self.sync_s * (1 - 1 / self.stretch(active))

    @property
    def memory_throughput(self) -> float:
        """Sustained bytes/s of elementwise kernels."""
        return self.mem_bandwidth * self.eta_memory

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes - self.reserved_bytes

    def cost_model(self, ranks_per_node: int | None = None) -> CostModel:
        """The boxing planner's α-β model for this profile (β includes the link efficiency)."""
        intra = LinkCost(self.intra_alpha, 1 / (self.intra_bandwidth * self.eta_intra))
        inter = LinkCost(self.inter_alpha, 1 / (self.inter_bandwidth * self.eta_inter))
        links = ((self.device_type, "intra"), intra), ((self.device_type, "inter"), inter)
        return CostModel(links=tuple(sorted(links)), ranks_per_node=ranks_per_node or self.gpus_per_node)


def _datasheet(name: str, peak_tflops: float, hbm_gbs: float, memory_gb: float, nvlink_gbs: float,
               nic_gbs: float, sms: int) -> DeviceProfile:
    return DeviceProfile(name=name, device_type="cuda", peak_flops=peak_tflops * 1e12, mem_bandwidth=hbm_gbs * GB,
                         memory_bytes=memory_gb * GB, intra_bandwidth=nvlink_gbs * GB, inter_bandwidth=nic_gbs * GB,
                         eta_matmul=0.75, compute_units=sms, gemm_k_half=128.0)


PROFILES: dict[str, DeviceProfile] = {
    "a100-40gb": _datasheet("a100-40gb", 312, 1555, 40, 300, 25, 108),
    "a100-80gb": _datasheet("a100-80gb", 312, 2039, 80, 300, 25, 108),
    "h100-80gb": _datasheet("h100-80gb", 989, 3350, 80, 450, 50, 132),
}


def _framework_cpu() -> DeviceProfile:
    """A CPU host as the rest of sbpflow already prices it: the boxing planner's default ``cpu`` links and SBP
    selection's compute rates (one profile for eager dispatch, graph selection and planning), on the cores this
    process may run on (its devices are this host's processes, one torch thread each; other jobs on the host
    are not counted: ``sbpflow calibrate`` measures them)."""

    links = dict(CostModel().links)
    intra, inter = links[("cpu", "intra")], links[("cpu", "inter")]
    return DeviceProfile(name="cpu", device_type="cpu", peak_flops=1 / SECONDS_PER_FLOP,
                         mem_bandwidth=1 / MEM_SECONDS_PER_BYTE, memory_bytes=16 * GB, intra_bandwidth=1 / intra.beta,
                         inter_bandwidth=1 / inter.beta, intra_alpha=intra.alpha, inter_alpha=inter.alpha,
                         eta_matmul=1.0, eta_memory=1.0, eta_intra=1.0, eta_inter=1.0, launch_s=20e-6,
                         reserved_bytes=0.0, cores=float(host_cores()),
                         source="sbpflow's default CPU costs (boxing.plan, graph.select)")


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def get_profile(name_or_path: str | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name (``a100-80gb``), or one that ``sbpflow calibrate`` wrote (a JSON path)."""
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    key = name_or_path.lower()
    if key in PROFILES:
        return PROFILES[key]
    if key == "cpu":
        return _framework_cpu()
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return load_profile(path)
    raise SbpflowError(f"a device is a built-in profile ({', '.join(PROFILES)}, cpu) or a profile file written by "
                       f"`sbpflow calibrate`, but got {name_or_path!r}")


def save_profile(profile: DeviceProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(profile), indent=2) + "\n")


def load_profile(path: str | Path) -> DeviceProfile:
    """Reads a profile file; unknown keys are an error (a typo would silently keep a default)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SbpflowError(f"a profile file is JSON written by `sbpflow calibrate`, but {path} could not be read: "
                           f"{e}") from e
    known = {f.name for f in fields(DeviceProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SbpflowError(f"profile {path} has keys that DeviceProfile does not know: {unknown}")
    if "gemm_tiles" in data:  # JSON has no tuples
        data["gemm_tiles"] = tuple(tuple(t) for t in data["gemm_tiles"])
    return DeviceProfile(**data)


def with_efficiency(profile: DeviceProfile, **etas: float) -> DeviceProfile:
    """A copy with some ``eta_*`` replaced (what calibration against a timeline updates)."""
    unknown = sorted(name for name in etas if not name.startswith("eta_") or not hasattr(profile, name))
    if unknown:
        raise SbpflowError(f"only a profile's eta_* efficiencies can be updated, but got {unknown}")
    return replace(profile, **etas)  # type: ignore[arg-type]
