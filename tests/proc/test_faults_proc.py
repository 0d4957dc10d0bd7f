"""Faults end a job, they never hang it: a failed rank, a rank that skips an op, ranks that disagree.

Each worker first warms up (a collective that creates the process groups and
connections), so the fault hits a running job, not its start-up.
"""

from __future__ import annotations

import time
from typing import Any

from procrun import spawn

import sbpflow
from sbpflow import sbp as S


def _warm_up() -> tuple[sbpflow.Tensor, sbpflow.Tensor]:
    p = sbpflow.placement("cpu", list(range(sbpflow.world_size())))
    x = sbpflow.randn(6, 4, placement=p, sbp=S.split(0))
    w = sbpflow.randn(4, 3, placement=p, sbp=S.split(0))
    x.numpy()
    return x, w


# -- (a) a rank raises: the others are in a collective with it ----------------------------------


def raise_on_rank(bad: int) -> Any:
    x, _ = _warm_up()
    if sbpflow.rank() == bad:
        raise RuntimeError(f"rank {bad} fails on purpose")
    return x.sum().numpy()  # an all-reduce that the failed rank never joins


def test_a_failed_rank_ends_every_process_and_is_named() -> None:
    # the default SBPFLOW_TIMEOUT (300 s) is far off: survivors must notice the closed connections
    job = spawn(raise_on_rank, 3, args=(1,), timeout=60)
    assert not job.timed_out, job.report()
    assert job.elapsed < 30, job.report()
    assert all(o.returncode not in (0, None) for o in job.ranks), job.report()
    assert job.ranks[1].error == "RuntimeError: rank 1 fails on purpose", job.report()
    assert "procrun: rank 1 failed with RuntimeError" in job.ranks[1].stderr
    for survivor in (0, 2):
        error = job.ranks[survivor].error or ""
        assert error.startswith("CommError: "), job.report()
        assert "all_reduce on ranks [0, 1, 2] failed on rank" in error, error
        assert "op 'sum'" in error or "boxing" in error, error
    assert "failed ranks: [0, 1, 2]" in job.report()


# -- (b) a rank skips an op: the others time out, naming what they waited in -----------------------


def skip_an_op(skipper: int) -> dict[str, Any]:
    x, w = _warm_up()
    if sbpflow.rank() == skipper:
        time.sleep(12)  # busy elsewhere: it never issues the matmul's all-gather
        return {"skipped": True}
    start = time.monotonic()
    try:
        x @ w  # w is S(0): dispatch all-gathers it (to B) inside op 'matmul'
    except sbpflow.CommError as e:
        return {"error": str(e), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def test_a_skipped_op_raises_comm_error_naming_the_op_after_the_timeout() -> None:
    job = spawn(skip_an_op, 2, args=(1,), env={"SBPFLOW_TIMEOUT": "10"}, timeout=60)
    assert not job.timed_out and not job.failed, job.report()
    waiting = job.ranks[0].result
    assert waiting["error"] is not None, job.report()
    assert 9 <= waiting["elapsed"] <= 15, waiting
    message = waiting["error"]
    assert "timed out after 10 s (SBPFLOW_TIMEOUT)" in message, message
    assert "op 'matmul'" in message and "boxing [4, 3]" in message and "all_gather axis 0" in message, message
    assert job.ranks[1].result == {"skipped": True}


# -- (c) SBPFLOW_DEBUG: ranks issue different collectives -------------------------------------------


def mismatched_collectives(odd: int) -> dict[str, Any]:
    x, w = _warm_up()
    start = time.monotonic()
    try:
        if sbpflow.rank() == odd:
            x @ w  # an all-gather of w, (4, 3) ...
        else:
            x.sum().numpy()  # ... while the others all-reduce a scalar: same group, different collectives
    except sbpflow.CommError as e:
        return {"error": str(e), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def test_debug_mode_reports_the_first_mismatch_with_both_sides() -> None:
    job = spawn(mismatched_collectives, 2, args=(1,), env={"SBPFLOW_DEBUG": "1", "SBPFLOW_TIMEOUT": "30"},
                timeout=60)
    assert not job.timed_out and not job.failed, job.report()
    for o in job.ranks:
        message, elapsed = o.result["error"], o.result["elapsed"]
        assert message is not None and elapsed < 10, job.report()  # found by the check, not by the timeout
        assert "ranks [0, 1] issue different collectives" in message, message
        assert "rank 0: all_reduce on ranks [0, 1]" in message, message
        assert "rank 1: all_gather on ranks [0, 1] with ((2, 3), (2, 3)), torch.float32" in message, message
        assert "in reading a logical value" in message and "in op 'matmul' > boxing [4, 3]" in message, message


def same_collectives_under_debug() -> Any:
    x, w = _warm_up()
    return [(x @ w).numpy(), x.sum().numpy()]


def test_debug_mode_passes_a_correct_program() -> None:
    job = spawn(same_collectives_under_debug, 2, env={"SBPFLOW_DEBUG": "1"}, timeout=60)
    assert not job.failed, job.report()
    (a0, s0), (a1, s1) = (o.result for o in job.ranks)
    assert (a0 == a1).all() and s0 == s1


# -- (d) SBPFLOW_DEBUG: replicas of a B tensor that differ across ranks --------------------------------


def diverging_replicas() -> dict[str, Any]:
    p = sbpflow.placement("cpu", list(range(sbpflow.world_size())))
    same = sbpflow.tensor([1.0, 2.0]).to_global(p, S.broadcast)  # equal everywhere: passes
    out: dict[str, Any] = {"same": same.numpy().tolist()}
    for name, build in [("to_global", lambda: sbpflow.tensor([float(sbpflow.rank())]).to_global(p, S.broadcast)),
                        ("tensor", lambda: sbpflow.tensor([float(sbpflow.rank())], placement=p, sbp=S.broadcast))]:
        try:
            build()
            out[name] = None
        except sbpflow.CommError as e:
            out[name] = str(e)
    return out


def test_debug_mode_reports_b_replicas_that_differ() -> None:
    job = spawn(diverging_replicas, 2, env={"SBPFLOW_DEBUG": "1", "SBPFLOW_TIMEOUT": "30"}, timeout=60)
    assert not job.timed_out and not job.failed, job.report()
    for o in job.ranks:
        assert o.result["same"] == [1.0, 2.0]
        for name, what in [("to_global", "to_global of a local tensor"), ("tensor", "sbpflow.tensor of shape [1]")]:
            message = o.result[name]
            assert message is not None, (name, job.report())
            assert f"{what}: ranks [0, 1] hold replicas of one value along mesh axis 0" in message, message
            assert "rank 0: [1] float32 sha1" in message and "rank 1: [1] float32 sha1" in message, message


def test_without_debug_the_replica_check_costs_nothing() -> None:
    job = spawn(diverging_replicas, 2, timeout=60)
    assert not job.failed, job.report()
    assert all(o.result["to_global"] is None and o.result["tensor"] is None for o in job.ranks)
