"""Calibration's arithmetic without measuring: the α-β fit and the profile built from measurements."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sbpflow.autoparallel import Cluster, ParallelPlan, TransformerSpec, get_profile, predict
from sbpflow.autoparallel.calibrate import Measurements, _profile, fit_alpha_beta
from sbpflow.errors import SbpflowError


@pytest.mark.parametrize("processes", [2, 4])
def test_alpha_beta_fit_recovers_the_ring_model_under_noise(processes):
    alpha, beta = 50e-6, 1 / 2e9
    rng = np.random.default_rng(0)
    p = processes
    times = {n: (2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta) * (1 + 0.03 * rng.standard_normal())
             for n in (4, 1024, 16384, 262144, 1 << 20, 1 << 23)}
    fitted_alpha, fitted_beta = fit_alpha_beta(times, p)
    assert fitted_alpha == pytest.approx(alpha, rel=0.1)
    assert fitted_beta == pytest.approx(beta, rel=0.1)
    with pytest.raises(SbpflowError, match="two sizes"):
        fit_alpha_beta({4: 1e-4}, p)


def test_profile_from_measurements_predicts_with_them():
    m = Measurements(matmul_flops={256: 50e9, 512: 80e9}, memcpy_bandwidth=10e9, elementwise_bandwidth=8e9,
                     launch_s=2e-6, processes=2, all_reduce_s={4: 1e-4, 1 << 20: 1e-3}, alpha=40e-6, beta=1e-9)
    profile = _profile("here", m)
    assert profile.peak_flops == 80e9 and profile.eta_matmul == 1.0
    assert profile.eta_memory == pytest.approx(0.8) and profile.intra_bandwidth == pytest.approx(1e9)
    cluster = Cluster(2, profile, 2)
    spec = TransformerSpec(layers=2, hidden=64, heads=4, seq=32, vocab=96)
    # one rank's compute can only be as fast as the measured GEMM rate
    single = predict(spec, Cluster(1, profile, 1), ParallelPlan(1, 1, 1, 4, 0, "none"), 4)
    assert single.breakdown["compute"] >= 6 * 4 * 32 * (12 * 64 * 64 * 2 + 96 * 64) / 80e9
    # two ranks of data parallelism pay one gradient all-reduce at the fitted α-β
    dp = predict(spec, cluster, ParallelPlan(1, 1, 2, 2, 0, "none"), 4)
    grads = 2 * (spec.params + 0.0)
    assert dp.breakdown["dp_comm"] == pytest.approx(2 * 40e-6 + grads * 1e-9, rel=0.05)


def _synthetic_trace(path, alpha, beta, launch, bandwidth):
    """A timeline as the actor runtime writes it, with spans timed by a known α-β and memory bandwidth."""
    from sbpflow.runtime.trace import TraceWriter

    w = TraceWriter(path, pid=0)
    t = 1000.0
    mesh = "cpu/comm:cpu:[[0, 1, 2, 3], [4, 5, 6, 7]]:axis1"  # a group of 4 ranks
    for i, n in enumerate((64, 4096, 65536, 1 << 20, 1 << 22)):
        seconds = 6 * alpha + 1.5 * n * beta  # all_reduce of n bytes over 4 ranks
        w.span(mesh, f"#{i} boxing all_reduce for linear output 0 (1/1)", "boxing", micro=0, start=t,
               end=t + seconds, nbytes=n)
        gathered = 3 * alpha + 0.75 * n * beta  # all_gather to n bytes
        w.span(mesh, f"#{i + 10} boxing all_gather for matmul input 1 (1/1)", "boxing", micro=0, start=t,
               end=t + gathered, nbytes=n)
    for i, n in enumerate((256, 65536, 1 << 20, 1 << 23)):
        w.span("cpu/compute", f"#{i + 20} compute add", "add", micro=0, start=t, end=t + launch + 3 * n / bandwidth,
               nbytes=n)
        w.span("cpu/compute", f"#{i + 30} compute gelu", "gelu", micro=0, start=t,
               end=t + launch + 2 * n / bandwidth, nbytes=n)
    w.span("cpu/compute", "#40 compute linear", "linear", micro=0, start=t, end=t + 1.0, nbytes=64)  # not fitted
    w.flush()  # left open, as a running job leaves it


def test_calibration_from_a_trace_recovers_alpha_beta_and_memory_efficiency(tmp_path):
    from sbpflow.autoparallel.from_trace import calibrate_from_trace

    path = tmp_path / "rank0.json"
    _synthetic_trace(path, alpha=30e-6, beta=1 / 2e9, launch=10e-6, bandwidth=4e9)
    base = get_profile("cpu")
    result = calibrate_from_trace(replace(base, mem_bandwidth=8e9), [str(path)])
    after = result.after
    assert after.intra_alpha == pytest.approx(30e-6, rel=1e-3)
    assert after.intra_bandwidth * after.eta_intra == pytest.approx(2e9, rel=1e-3)
    assert after.eta_memory == pytest.approx(0.5, rel=1e-3) and after.launch_s == pytest.approx(10e-6, rel=1e-3)
    for kind, (before, now, count) in result.errors.items():
        assert count == (10 if kind == "collective" else 8)
        assert now < 1e-3 < before, kind
    assert "error before" in result.describe()


def test_calibration_from_a_trace_without_usable_spans_says_so(tmp_path):
    from sbpflow.autoparallel.from_trace import calibrate_from_trace
    from sbpflow.runtime.trace import TraceWriter

    w = TraceWriter(tmp_path / "t.json", pid=0)
    w.span("cpu/compute", "#1 compute linear", "linear", micro=0, start=1.0, end=2.0, nbytes=4)
    w.flush()
    w.close()
    with pytest.raises(SbpflowError, match="boxing collectives or elementwise"):
        calibrate_from_trace(get_profile("cpu"), [str(tmp_path / "t.json")])


def test_a_collective_inside_a_step_and_shared_cores_enter_the_profile():
    """The cores and the other jobs' busy processes are the line through the stretches of fixed work with k
    processes busy, and the profile stretches k devices' compute by it. What a small all-reduce costs after
    compute beyond its α-β time is the wait for a peer the shared cores are not running: the profile's
    collectives wait that long with every process busy, less with fewer; on cores of their own, it is α."""
    m = Measurements(matmul_flops={256: 50e9}, memcpy_bandwidth=10e9, elementwise_bandwidth=8e9, launch_s=2e-6,
                     processes=4, all_reduce_s={4: 1e-4, 1 << 20: 1e-3}, alpha=40e-6, beta=1e-9,
                     sharing=((1, 1.25), (2, 1.9), (3, 2.5), (4, 3.1)), collective_s=1.2e-3)
    profile = _profile("here", m)
    assert profile.intra_alpha == 40e-6 and profile.sync_wait(4) == pytest.approx(1.2e-3 - 6 * 40e-6)
    assert 0 < profile.sync_wait(1) < profile.sync_wait(2) < profile.sync_wait(4)
    assert profile.cores == pytest.approx(1.6, rel=0.05) and profile.background == pytest.approx(1.0, abs=0.1)
    assert [profile.stretch(k) for k in (1, 4)] == pytest.approx([1.25, 3.1], rel=0.05)
    alone = _profile("here", replace(m, sharing=((1, 1.0), (2, 1.05), (3, 1.5), (4, 2.0))))
    assert (alone.cores, alone.background, alone.stretch(2)) == (2.0, 0.0, 1.0)  # 2 processes, 2 free cores
    assert alone.sync_wait(2) == 0.0
    quiet = _profile("here", replace(m, sharing=((1, 1.0), (4, 1.02)), collective_s=1e-5))
    assert quiet.intra_alpha == 40e-6 and quiet.stretch(4) == 1.0  # 4 cores for 4 processes: nothing shared
    slow = _profile("here", replace(m, sharing=((1, 1.0), (4, 1.02))))
    assert slow.intra_alpha == pytest.approx(1.2e-3 / 6) and slow.sync_wait(4) == 0.0  # per ring round
