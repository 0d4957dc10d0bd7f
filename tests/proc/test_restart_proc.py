"""Automatic restart on real processes: ``sbpflow launch --max-restarts 1`` brings back a job that lost a rank,
and a script that restores with ``CheckpointManager`` ends with the losses and parameters of a run that was
never interrupted, bit for bit; a checkpoint written on 4 processes resumes on 2 and one written on 2 on 4.

Rank 1 leaves by ``os._exit`` just after the save of step 4 began (first attempt only), so that save may be
cut short: the restart resumes from step 4 or, if its files were not all written, from step 2. Each launch
runs tests/proc/resilient_train.py (a GPT with dropout and AdamW) and is bounded by a timeout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from procrun import REPO, run_command

SCRIPT = str(REPO / "tests" / "proc" / "resilient_train.py")
LAUNCH = [sys.executable, "-m", "sbpflow.cli", "launch"]
STEPS = 6
TIMEOUT = 180.0


def _launch(out: Path, n: int, strategy: str, *extra: str, restarts: int = 0) -> list[tuple[int, int, int, float]]:
    out.mkdir(parents=True, exist_ok=True)
    result = run_command(LAUNCH + ["-n", str(n), "--max-restarts", str(restarts), SCRIPT, strategy, str(out),
                                   "--steps", str(STEPS), *extra], timeout=TIMEOUT)
    assert result.returncode == 0, result.report()
    return _log(out)


def _log(out: Path) -> list[tuple[int, int, int, float]]:
    """(attempt, world size, step, loss) for every step rank 0 logged."""
    rows = [line.split() for line in (out / "losses.txt").read_text().splitlines()]
    return [(int(a), int(w), int(s), float(loss)) for a, w, s, loss in rows]


def _params(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "params.npz") as f:
        return {k: f[k] for k in f.files}


CASES = {"eager dp2": ("dp=2",), "graph tp2": ("tp=2", "--graph"),
         "pipeline pp2 x 2 micro-batches": ("pp=2", "--graph", "--micro-batches", "2")}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_killed_and_restarted_equals_the_uninterrupted_run(tmp_path: Path, case: str) -> None:
    strategy, *extra = CASES[case]
    straight = _launch(tmp_path / "straight", 2, strategy, *extra)
    assert [s for _, _, s, _ in straight] == list(range(STEPS))
    killed = _launch(tmp_path / "killed", 2, strategy, *extra, "--kill-at", "4", restarts=1)
    first = [s for a, _, s, _ in killed if a == 0]
    second = [s for a, _, s, _ in killed if a == 1]
    assert first == [0, 1, 2, 3], killed  # rank 1 left after step 4's save began
    assert second in ([2, 3, 4, 5], [4, 5]), killed  # resumed from the newest complete checkpoint
    want = {s: loss for _, _, s, loss in straight}
    for _, _, s, loss in killed:
        assert loss == want[s], (case, s, loss, want[s])  # both attempts, bit for bit
    for name, value in _params(tmp_path / "straight").items():
        np.testing.assert_array_equal(_params(tmp_path / "killed")[name], value, err_msg=name)


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4)])
def test_a_checkpoint_resumes_on_another_number_of_processes(tmp_path: Path, before: int, after: int) -> None:
    run = tmp_path / "run"
    _launch(run, before, f"dp={before}", "--stop-at", "2")
    log = _launch(run, after, f"dp={after}")
    assert [(w, s) for _, w, s, _ in log] == [(before, 0), (before, 1)] + [(after, s) for s in range(2, STEPS)]
    straight = _launch(tmp_path / "straight", after, f"dp={after}")  # that world size all along
    for (_, _, s, loss), (_, _, s2, want) in zip(log[2:], straight[2:], strict=True):
        assert s == s2
        np.testing.assert_allclose(loss, want, rtol=1e-5)  # the first 2 steps summed in another order
    # Adam's m / sqrt(v) turns a rounding difference in a near-zero gradient into up to lr (1e-2) of a step:
    # parameters agree to a small fraction of the 4 steps' travel, not to rounding
    for name, value in _params(tmp_path / "straight").items():
        np.testing.assert_allclose(_params(run)[name], value, rtol=1e-3, atol=4e-4, err_msg=name)


def test_max_restarts_reaches_torchrun_and_the_attempt_is_read_from_its_environment() -> None:
    import argparse

    from sbpflow.cli import torchrun_argv
    from sbpflow.distributed import Config

    args = argparse.Namespace(nproc_per_node=2, nnodes=1, node_rank=0, master_addr=None, master_port=None,
                              max_restarts=3, script="t.py", script_args=[])
    assert torchrun_argv(args)[:6] == ["--nproc-per-node", "2", "--nnodes", "1", "--max-restarts", "3"]
    with pytest.raises(SystemExit, match="--max-restarts must be at least 0, but got -1"):
        torchrun_argv(argparse.Namespace(**(vars(args) | {"max_restarts": -1})))
    cfg = Config.from_env({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2",
                           "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (cfg.restart_count, cfg.agent_store) == (2, True)
    assert (Config.from_env({}).restart_count, Config.from_env({}).agent_store) == (0, False)
