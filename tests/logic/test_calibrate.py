"""Calibration's arithmetic without measuring: the α-β fit and the profile built from measurements."""

from __future__ import annotations

import numpy as np
import pytest

from sbpflow.autoparallel import Cluster, ParallelPlan, TransformerSpec, predict
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
