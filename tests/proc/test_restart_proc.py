"""Automatic restart on real processes: ``sbpflow launch --max-restarts 1`` brings back a job that lost a rank,
and a script that restores with ``CheckpointManager`` ends with the losses and parameters of a run that was
never interrupted, bit for bit; a checkpoint written on 4 processes resumes on 2 and one written on 2 on 4;
``-n 2:4`` restarts a job that lost a rank on 2 processes, as a job relaunched on 2 from that checkpoint would.

A rank leaves by ``os._exit`` in the first attempt, at a step, on a rank and just before or after a save began,
all drawn from a seed: ``SBPFLOW_KILL_SEED`` when set (to replay a failure), else a fresh one, printed with
the draw and named in every assertion. A save begun just before the kill may be cut short, so the restart
resumes from the newest save begun or the one before it. Each launch runs tests/proc/resilient_train.py (a GPT
with dropout and AdamW) and is bounded by a timeout.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from procrun import REPO, run_command

SCRIPT = str(REPO / "tests" / "proc" / "resilient_train.py")
LAUNCH = [sys.executable, "-m", "sbpflow.cli", "launch"]
STEPS = 6
EVERY = 2  # resilient_train.py saves every 2 steps
TIMEOUT = 180.0
SEED = int(os.environ.get("SBPFLOW_KILL_SEED") or random.SystemRandom().randrange(1 << 32))


def _launch(out: Path, n: int | str, strategy: str, *extra: str,
            restarts: int = 0) -> list[tuple[int, int, int, float]]:
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


def draw_kill(seed: int, case: str, processes: int = 2) -> tuple[int, int, str]:
    """(steps done when the rank leaves, which rank, before or after that step's save), drawn from ``seed``."""
    rng = random.Random(f"{seed}:{case}")
    return rng.randint(1, STEPS - 1), rng.randrange(processes), rng.choice(["before-save", "after-save"])


def resumable_steps(kill_at: int, when: str) -> list[int]:
    """Where the restart may resume: the newest save begun before the kill, or (if that one was cut short) the
    one before it, which the start of the newest one waited for."""
    begun = max((s for s in range(0, kill_at + 1, EVERY) if s < kill_at or when == "after-save"), default=0)
    return [s for s in (begun - EVERY, begun) if s >= 0]


def first_attempt_logged(steps: list[int], kill_at: int) -> bool:
    """Rank 0 logged steps 0, 1, ... up to the last one every rank finished (``kill_at - 1``), or one fewer: the
    launcher may stop it before it logs the step that the rank which then left had finished too."""
    return steps == list(range(len(steps))) and len(steps) in (kill_at - 1, kill_at)


def test_resumable_steps_follow_the_saves() -> None:
    assert resumable_steps(4, "after-save") == [2, 4]
    assert resumable_steps(4, "before-save") == [0, 2]
    assert resumable_steps(5, "before-save") == [2, 4]
    assert resumable_steps(1, "after-save") == [0]
    assert first_attempt_logged([0, 1, 2, 3], 5) and first_attempt_logged([0, 1, 2, 3, 4], 5)
    assert not first_attempt_logged([0, 1, 2], 5) and not first_attempt_logged([0, 2, 3, 4], 5)


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_killed_and_restarted_equals_the_uninterrupted_run(tmp_path: Path, case: str) -> None:
    strategy, *extra = CASES[case]
    kill_at, kill_rank, when = draw_kill(SEED, case)
    drawn = f"SBPFLOW_KILL_SEED={SEED}: rank {kill_rank} leaves after {kill_at} steps, {when}"
    print(drawn)
    straight = _launch(tmp_path / "straight", 2, strategy, *extra)
    assert [s for _, _, s, _ in straight] == list(range(STEPS))
    killed = _launch(tmp_path / "killed", 2, strategy, *extra, "--kill-at", str(kill_at), "--kill-rank",
                     str(kill_rank), "--kill-when", when, restarts=1)
    first = [s for a, _, s, _ in killed if a == 0]
    second = [s for a, _, s, _ in killed if a == 1]
    assert first_attempt_logged(first, kill_at), (drawn, killed)
    assert second and second[0] in resumable_steps(kill_at, when) and second[0] <= len(first), (drawn, killed)
    assert second == list(range(second[0], STEPS)), (drawn, killed)
    want = {s: loss for _, _, s, loss in straight}
    for _, _, s, loss in killed:
        assert loss == want[s], (drawn, case, s, loss, want[s])  # both attempts, bit for bit
    for name, value in _params(tmp_path / "straight").items():
        np.testing.assert_array_equal(_params(tmp_path / "killed")[name], value, err_msg=f"{drawn}: {name}")


def test_elastic_n_restarts_a_failed_job_on_fewer_processes_by_resharding(tmp_path: Path) -> None:
    """``-n 2:4``: 4 processes until a rank leaves, then 2 from the newest checkpoint; the same numbers, bit for
    bit, as a job of 4 processes stopped at that checkpoint and launched again on 2."""
    kill_at, kill_rank, when = draw_kill(SEED, "elastic", processes=4)
    drawn = f"SBPFLOW_KILL_SEED={SEED}: rank {kill_rank} of 4 leaves after {kill_at} steps, {when}"
    print(drawn)
    elastic = _launch(tmp_path / "elastic", "2:4", "dp", "--kill-at", str(kill_at), "--kill-rank", str(kill_rank),
                      "--kill-when", when, restarts=1)
    first = [s for a, w, s, _ in elastic if a == 0 and w == 4]
    assert first_attempt_logged(first, kill_at) and len(first) == sum(a == 0 for a, *_ in elastic), (drawn, elastic)
    second = [(w, s, loss) for a, w, s, loss in elastic if a == 1]
    start = second[0][1]
    assert start in resumable_steps(kill_at, when) and start <= len(first), (drawn, elastic)
    assert [(w, s) for w, s, _ in second] == [(2, s) for s in range(start, STEPS)], (drawn, elastic)

    reference = tmp_path / "reference"
    if start:
        _launch(reference, 4, "dp", "--stop-at", str(start))  # writes the checkpoint of step `start` and ends
    on_two = [(w, s, loss) for _, w, s, loss in _launch(reference, 2, "dp") if w == 2]
    assert second == on_two, drawn
    for name, value in _params(reference).items():
        np.testing.assert_array_equal(_params(tmp_path / "elastic")[name], value, err_msg=f"{drawn}: {name}")


def test_n_takes_a_count_or_an_elastic_range() -> None:
    from sbpflow.cli import nproc_range

    assert (nproc_range("4"), nproc_range("2:4"), nproc_range("3:3")) == ((4, 4), (2, 4), (3, 3))
    for bad in ("0", "4:2", "two", "1:x"):
        with pytest.raises(SystemExit, match="sbpflow launch: -n"):
            nproc_range(bad)


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
    # `-n MIN:MAX` runs each attempt as a torchrun job of its own and says how many came before
    assert Config.from_env({"TORCHELASTIC_RESTART_COUNT": "0", "SBPFLOW_RESTART_BASE": "1"}).restart_count == 1
