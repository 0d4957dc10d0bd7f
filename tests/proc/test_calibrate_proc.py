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
