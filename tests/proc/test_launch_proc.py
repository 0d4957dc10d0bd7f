"""``sbpflow launch``: the same script prints the same numbers on virtual ranks and on processes;
a failing rank ends the job with a summary that names it."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import pytest
from procrun import REPO, run_command

from sbpflow.cli import torchrun_argv
from sbpflow.distributed import Config
from sbpflow.errors import SbpflowError

EXAMPLE = str(REPO / "examples" / "matmul_dp.py")
LAUNCH = [sys.executable, "-m", "sbpflow.cli", "launch"]


def test_example_prints_the_same_numbers_on_virtual_ranks_and_on_processes() -> None:
    plain = run_command([sys.executable, EXAMPLE, "--ranks", "3"], timeout=60)
    launched = run_command(LAUNCH + ["-n", "3", EXAMPLE, "--ranks", "3"], timeout=90)
    assert plain.returncode == 0, plain.report()
    assert launched.returncode == 0, launched.report()
    assert launched.stdout == plain.stdout  # print0: one copy, from rank 0
    lines = plain.stdout.splitlines()
    assert len(lines) == 7 and lines[0].startswith("step 0: loss ")
    losses = [float(line.split()[3]) for line in lines[:5]]
    assert losses == sorted(losses, reverse=True)


FAILING = textwrap.dedent("""
    import os, sys, time
    import sbpflow
    from sbpflow import sbp

    p = sbpflow.placement("cpu", [0, 1])
    x = sbpflow.randn(6, 4, placement=p, sbp=sbp.split(0))
    x.numpy()                                   # both ranks are up and connected
    if sbpflow.rank() == 1:
        if sys.argv[1] == "raise":
            raise ValueError("rank 1 fails on purpose")
        sys.exit(3)
    print("rank 0 got", x.sum().item())         # waits for rank 1 in an all-reduce
""")


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_rank_ends_the_launched_job_with_a_summary(tmp_path: Path, how: str) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    result = run_command(LAUNCH + ["-n", "2", str(script), how], timeout=60)
    assert result.returncode == 1, result.report()
    assert result.elapsed < 30, result.report()
    code = 1 if how == "raise" else 3
    assert f"first failure: rank 1 (exit code {code})" in result.stderr, result.report()
    assert "rank 0 got" not in result.stdout
    if how == "raise":
        assert "sbpflow: rank 1 failed with ValueError: rank 1 fails on purpose" in result.stderr, result.report()


def test_torchrun_arguments() -> None:
    def args(**kw: object) -> argparse.Namespace:
        base = dict(nproc_per_node=4, nnodes=1, node_rank=0, master_addr=None, master_port=None, script="t.py",
                    script_args=["--x", "1"])
        return argparse.Namespace(**(base | kw))

    assert torchrun_argv(args())[-4:] == ["--standalone", "t.py", "--x", "1"]
    multi = torchrun_argv(args(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=4000))
    assert multi == ["--nproc-per-node", "4", "--nnodes", "2", "--max-restarts", "0", "--node-rank", "1",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:4000", "--rdzv-id", "sbpflow", "t.py",
                     "--x", "1"]
    with pytest.raises(SystemExit, match="needs --master-addr"):
        torchrun_argv(args(nnodes=2))


def test_config_reads_torchrun_and_sbpflow_variables() -> None:
    plain = Config.from_env({})
    assert (plain.launched, plain.rank, plain.world_size, plain.timeout, plain.debug) == (False, 0, 1, 300.0, False)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
           "SBPFLOW_TIMEOUT": "7.5", "SBPFLOW_DEBUG": "1"}
    cfg = Config.from_env(env)
    assert (cfg.launched, cfg.rank, cfg.world_size, cfg.local_rank, cfg.master_addr, cfg.master_port) == (
        True, 3, 4, 1, "h", 1234)
    assert (cfg.timeout, cfg.debug) == (7.5, True)
    with pytest.raises(SbpflowError, match="SBPFLOW_TIMEOUT must be a positive number of seconds, but it is '0'"):
        Config.from_env({"SBPFLOW_TIMEOUT": "0"})
    with pytest.raises(SbpflowError, match="RANK must be an integer, but it is 'x'"):
        Config.from_env({"RANK": "x", "WORLD_SIZE": "2"})
