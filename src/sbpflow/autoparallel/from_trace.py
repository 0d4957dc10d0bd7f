"""On-the-fly calibration: a finished run's timeline updates a profile's α-β and memory efficiency.

The actor runtime's timeline (``SBPFLOW_TRACE`` / ``GraphConfig.trace_path``, one Chrome-trace file per
rank) has one span per act with its op, its duration and the bytes it wrote. Two kinds of spans carry what
the cost model predicts:

* boxing collectives (``#12 boxing all_reduce for ...``) on a comm lane named after its placement and mesh
  axis (``cpu/comm:cpu:[[0, 1], [2, 3]]:axis1``), which gives the group size ``p``. Their times fit
  ``rounds · α + volume · β`` by least squares (the rows of ``cost.collective_time``);
* elementwise kernels (``add``, ``mul``, ``gelu`` ...), whose bytes moved (inputs read + output written) fit
  ``launch + bytes / (bandwidth · η_memory)``.

GEMMs are left alone: a span records the bytes a matmul wrote, not its inner dimension, so its FLOPs are
unknown. The report gives each class's median relative prediction error with the old and the new profile.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import SbpflowError
from .profiles import DeviceProfile

_COLLECTIVE = re.compile(r"boxing (all_reduce|all_gather|reduce_scatter)\b")
_LANE = re.compile(r"comm:\w+:(\[.*\]):axis(\d+)$")
BINARY = ("add", "sub", "mul", "div", "where")  # read two inputs, write one output
UNARY = ("neg", "exp", "log", "gelu", "relu", "tanh", "sqrt", "rsqrt", "pow", "clamp", "cast", "abs")


@dataclass(frozen=True)
class Sample:
    """One span as the cost model sees it: ``time ≈ intercept_units · a + volume · b``."""

    kind: str  # "collective" or "elementwise"
    units: float  # rounds (collectives) or 1 (a kernel's launch)
    volume: float  # bytes on the wire per rank (collectives) or bytes through memory (kernels)
    seconds: float


def samples(paths: list[str]) -> list[Sample]:
    """The spans of the timeline files that the cost model can price."""
    out: list[Sample] = []
    for path in paths:
        out += _file_samples(path)
    if not out:
        raise SbpflowError(f"a calibration trace needs boxing collectives or elementwise kernels, but {paths} "
                           "have none (was SBPFLOW_TRACE set for a compiled nn.Graph step?)")
    return out


def _file_samples(path: str) -> list[Sample]:
    try:
        events = json.loads(_closed(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as problem:
        raise SbpflowError(f"a trace is the Chrome-trace JSON the actor runtime writes, but {path}: "
                           f"{problem}") from problem
    lanes = {(ev["pid"], ev["tid"]): ev["args"]["name"] for ev in events
             if ev.get("ph") == "M" and ev.get("name") == "thread_name"}
    out = []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("dur", 0) <= 0:
            continue
        sample = _sample(ev, lanes.get((ev["pid"], ev["tid"]), ""))
        if sample is not None:
            out.append(sample)
    return out


def _closed(text: str) -> str:
    """The runtime leaves the JSON array open while a job runs (Chrome reads it so); close it to parse."""
    text = text.rstrip().rstrip(",")
    return text if text.endswith("]") else text + "]"


def _sample(event: dict, lane: str) -> Sample | None:
    seconds = event["dur"] * 1e-6
    written = float(event["args"].get("bytes", 0))
    op = event.get("cat", "")
    match = _COLLECTIVE.search(event.get("name", ""))
    if match:
        p = _group_size(lane)
        if p is None or p < 2:
            return None
        return _collective(match.group(1), p, written, seconds)
    if op in BINARY:
        return Sample("elementwise", 1.0, 3 * written, seconds)
    if op in UNARY:
        return Sample("elementwise", 1.0, 2 * written, seconds)
    return None


def _group_size(lane: str) -> int | None:
    """The size of the mesh axis a comm lane runs on: ``...comm:cpu:[[0, 1], [2, 3]]:axis1`` -> 2."""
    match = _LANE.search(lane)
    if not match:
        return None
    shape = np.array(json.loads(match.group(1))).shape
    axis = int(match.group(2))
    return int(shape[axis]) if axis < len(shape) else None


def _collective(kind: str, p: int, written: float, seconds: float) -> Sample:
    """Rounds and per-rank wire bytes of a ring collective, from the bytes one rank wrote (its output)."""
    if kind == "all_reduce":  # output: the whole tensor n; 2(p-1) rounds, 2(p-1)/p n
        return Sample("collective", 2 * (p - 1), 2 * (p - 1) / p * written, seconds)
    if kind == "all_gather":  # output: the gathered n
        return Sample("collective", p - 1, (p - 1) / p * written, seconds)
    return Sample("collective", p - 1, (p - 1) * written, seconds)  # reduce_scatter: output n / p


def fit(rows: list[Sample]) -> tuple[float, float]:
    """(a, b) >= 0 minimising the relative error of ``units · a + volume · b`` against the measured seconds."""
    if len(rows) < 2:
        raise SbpflowError(f"a fit needs two spans at least, but got {len(rows)}")
    design = np.array([[r.units, r.volume] for r in rows])
    observed = np.array([r.seconds for r in rows])
    weights = 1 / observed
    solution, *_ = np.linalg.lstsq(design * weights[:, None], observed * weights, rcond=None)
    a, b = (max(float(v), 0.0) for v in solution)
    return a, b


def predicted(sample: Sample, profile: DeviceProfile) -> float:
    if sample.kind == "collective":
        return sample.units * profile.intra_alpha + sample.volume / (profile.intra_bandwidth * profile.eta_intra)
    return profile.launch_s + sample.volume / profile.memory_throughput


def error(rows: list[Sample], profile: DeviceProfile) -> float:
    """Median |predicted - measured| / measured."""
    return statistics.median(abs(predicted(r, profile) - r.seconds) / r.seconds for r in rows)


@dataclass(frozen=True)
class TraceCalibration:
    before: DeviceProfile
    after: DeviceProfile
    errors: dict[str, tuple[float, float, int]]  # class -> (before, after, spans)

    def describe(self) -> str:
        lines = [f"{'spans':<12} {'count':>6} {'error before':>13} {'error after':>12}"]
        for kind, (old, new, count) in self.errors.items():
            lines.append(f"{kind:<12} {count:6d} {old:13.1%} {new:12.1%}")
        a, b = self.before, self.after
        old_bw, new_bw = a.intra_bandwidth * a.eta_intra / 1e9, b.intra_bandwidth * b.eta_intra / 1e9
        lines.append(f"alpha {a.intra_alpha * 1e6:.1f} -> {b.intra_alpha * 1e6:.1f} us; bandwidth "
                     f"{old_bw:.2f} -> {new_bw:.2f} GB/s; "
                     f"eta_memory {a.eta_memory:.2f} -> {b.eta_memory:.2f}; launch {a.launch_s * 1e6:.1f} -> "
                     f"{b.launch_s * 1e6:.1f} us")
        return "\n".join(lines)


def calibrate_from_trace(profile: DeviceProfile, paths: list[str]) -> TraceCalibration:
    """``profile`` with α-β (intra-node: the trace's ranks share a machine) and η_memory refit from the spans;
    a class with fewer than two spans keeps its old values."""
    rows = samples(paths)
    by_kind = {kind: [r for r in rows if r.kind == kind] for kind in ("collective", "elementwise")}
    updated = profile
    if len(by_kind["collective"]) >= 2:
        alpha, beta = fit(by_kind["collective"])
        updated = replace(updated, intra_alpha=alpha, intra_bandwidth=1 / max(beta, 1e-15), eta_intra=1.0)
    if len(by_kind["elementwise"]) >= 2:
        launch, per_byte = fit(by_kind["elementwise"])
        eta = 1 / (max(per_byte, 1e-15) * profile.mem_bandwidth)
        updated = replace(updated, launch_s=launch, eta_memory=eta)
    errors = {kind: (error(found, profile), error(found, updated), len(found))
              for kind, found in by_kind.items() if found}
    return TraceCalibration(profile, updated, errors)
