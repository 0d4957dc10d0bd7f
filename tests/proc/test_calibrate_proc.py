"""``sbpflow calibrate --quick`` on this machine: real gloo processes, a profile file that ``sbpflow plan`` reads."""

from __future__ import annotations

import json
import sys

from procrun import run_command

from sbpflow.autoparallel import load_profile

CLI = [sys.executable, "-m", "sbpflow.cli"]


def test_calibrate_writes_a_profile_that_plan_uses(tmp_path) -> None:
    path = tmp_path / "here.json"
    done = run_command(CLI + ["calibrate", "--quick", "-o", str(path)], timeout=120)
    assert done.returncode == 0, done.report()
    assert "gloo all_reduce on 2 processes" in done.stdout and "fit: alpha" in done.stdout
    profile = load_profile(path)
    assert profile.device_type == "cpu" and profile.gpus_per_node == 2
    assert 1e8 < profile.peak_flops < 1e14  # a CPU core or two, fp32
    assert 1e7 < profile.intra_bandwidth < 1e12 and 0 <= profile.intra_alpha < 1e-2
    plan = run_command(CLI + ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab",
                              "96", "--batch", "8", "--devices", "2", "--device", str(path), "--json"], timeout=60)
    assert plan.returncode == 0, plan.report()
    assert json.loads(plan.stdout)["cluster"]["device"] == "local-cpu"


def _calibrate_host_job() -> dict:
    import torch

    import sbpflow
    from sbpflow.autoparallel import ParallelPlan, TransformerSpec
    from sbpflow.autoparallel.calibrate_host import calibrate_host
    from sbpflow.autoparallel.host import plan_shapes, predict_host

    torch.set_num_threads(1)
    sbpflow.distributed.init()
    spec = TransformerSpec(layers=2, hidden=32, heads=2, seq=8, vocab=64)
    plans = [(ParallelPlan(1, 1, 2, 2, 0, "none"), (2,)), (ParallelPlan(2, 1, 1, 4, 0, "none"), (2,))]
    shapes = plan_shapes(spec, plans, 4)
    host = calibrate_host(shapes)
    return {"profile": host, "keys": [s.key for s in shapes],
            "steps": [predict_host(spec, p, cuts, 4, host).step_time for p, cuts in plans]}


def test_calibrate_host_measures_every_primitive_on_two_processes() -> None:
    from procrun import run_ranks

    results = run_ranks(_calibrate_host_job, 2, timeout=120)
    host = results[0]["profile"]
    assert results[1]["profile"] == host  # every process gets rank-agreed numbers
    assert host.processes == 2
    assert [k for k, _ in host.cores_factor] == [1, 2] and all(f >= 1 for _, f in host.cores_factor)
    assert host.sync_s >= 0
    assert [g for g, _, _ in host.collectives] == [2] and [g for g, _, _ in host.collective_cpu] == [2]
    assert [key for key, _ in host.kernels] == results[0]["keys"]  # the shapes asked for, each timed
    assert all(s > 0 for _, s in host.kernels) and host.optimizer_s_per_param > 0
    assert 0 < host.foreign_dispatch_s and 0 < host.dispatch_s
    assert all(t > 0 for t in results[0]["steps"])


def _calibrate_job() -> dict:
    import torch

    import sbpflow
    from sbpflow.autoparallel import get_profile
    from sbpflow.autoparallel.calibrate import calibrate_job

    torch.set_num_threads(1)
    sbpflow.distributed.init()
    profile, measured = calibrate_job(get_profile("cpu"), quick=True)
    return {"profile": profile, "measured": measured}


def test_calibrate_job_measures_links_and_cores_inside_a_running_job() -> None:
    from procrun import run_ranks

    from sbpflow.autoparallel import get_profile

    results = run_ranks(_calibrate_job, 2, timeout=120)
    profile, measured = results[0]["profile"], results[0]["measured"]
    assert results[1]["profile"].cores == profile.cores  # every process gets the same numbers
    assert 0 < profile.cores <= 2 and profile.gpus_per_node == 2
    # a collective in a step costs at least what it cost after compute: its α-β and its wait on shared cores
    assert 2 * profile.intra_alpha + profile.sync_wait(2) >= measured.collective_s * 0.999
    base = get_profile("cpu")
    assert (profile.peak_flops, profile.launch_s) == (base.peak_flops, base.launch_s)  # compute rates kept
