"""Pipeline schedules as action lists: their shapes, the checks before running, the dry run and its bubble."""

from __future__ import annotations

import dataclasses

import pytest

from sbpflow.graph.schedule import (
    Action,
    ScheduleError,
    bubble,
    bubble_theory,
    check,
    grid,
    make,
    zero_bubble_theory,
)


def _compute(schedule, stage):  # type: ignore[no-untyped-def]
    return [str(a) for a in schedule.actions[stage] if a.kind in ("F", "B")]


def test_one_f_one_b_lists_warm_up_then_alternate() -> None:
    s = make("1f1b", stages=4, micro_batches=6)
    assert _compute(s, 0) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert _compute(s, 3) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    assert s.bounds == (4, 3, 2, 1)


def test_gpipe_lists_all_forwards_then_all_backwards() -> None:
    s = make("gpipe", stages=2, micro_batches=3)
    assert _compute(s, 1) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert s.bounds == (3, 3)


def test_messages_surround_compute() -> None:
    s = make("1f1b", stages=3, micro_batches=2)
    middle = [str(a) for a in s.actions[1]][:4]
    assert middle == ["recv_F0<-0", "F0", "send_F0->2", "recv_F1<-0"]
    assert Action("send_B", 1, 0) in s.actions[1]


def test_dry_run_grid_of_one_f_one_b() -> None:
    s = make("1f1b", stages=2, micro_batches=3)
    assert grid(s, check(s)).splitlines() == [
        "step     0   1   2   3   4   5   6   7",
        "stage 0  F0  F1  .   B0  F2  B1  .   B2",
        "stage 1  .   F0  B0  F1  B1  F2  B2  .",
    ]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (8, 16), (4, 2)])
def test_dry_run_bubble_equals_theory(name: str, p: int, m: int) -> None:
    """With unit F and B the idle share is exactly (p - 1) / (m + p - 1)."""
    assert bubble(check(make(name, p, m))) == pytest.approx(bubble_theory(p, m))


def test_one_f_one_b_never_holds_more_than_its_bound() -> None:
    """The dry run refuses an F beyond the bound, so a finished 1F1B run respects p - s; one slot fewer stalls."""
    s = make("1f1b", stages=4, micro_batches=8)
    check(s)
    tight = dataclasses.replace(s, bounds=(3, 3, 2, 1))
    with pytest.raises(ScheduleError, match=r"stage 0: waits at F3 \(its activation registers hold 3"):
        check(tight)


def test_a_missing_send_is_reported_with_the_grid() -> None:
    s = make("1f1b", stages=2, micro_batches=2)
    lost = tuple(a for a in s.actions[1] if str(a) != "send_B1->0")
    broken = dataclasses.replace(s, actions=(s.actions[0], lost))
    with pytest.raises(ScheduleError) as info:
        check(broken)
    text = str(info.value)
    assert "stage 0: waits at recv_B1<-1" in text
    assert "stage 1  .   F0  B0  F1  B1" in text


def test_counts_and_order_are_checked() -> None:
    s = make("gpipe", stages=2, micro_batches=2)
    twice = dataclasses.replace(s, actions=(s.actions[0] + (Action("F", 1),), s.actions[1]))
    with pytest.raises(ScheduleError, match=r"stage 0 must run F once for each of the 2 micro-batches, but its "
                                            r"list has F for micro-batches \[0, 1, 1\]"):
        check(twice)
    swapped = (Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1))
    with pytest.raises(ScheduleError, match="stage 1 runs B0 before F0"):
        check(dataclasses.replace(s, actions=(s.actions[0], swapped)))


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ScheduleError, match="pipeline schedule must be one of"):
        make("round_robin", 2, 4)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 16), (4, 4), (4, 8), (4, 16), (8, 4), (8, 8), (8, 16), (4, 2)])
def test_zero_bubble_runs_f_b_w_within_one_f_one_b_peak(p: int, m: int) -> None:
    """Every micro-batch's F, B and W once, in that order; at most min(p, m) held (1F1B's stage-0 peak); with
    F = B = W its idle share is ZB-H1's: (p - 1) / (3m + p - 1), a third of 1F1B's idle time (for m < p the
    first micro-batch's trip there and back bounds the step: 2m + 2p - 1 units)."""
    s = make("zero_bubble", p, m)
    assert s.splits_backward and s.bounds == (min(p, m),) * p
    cells = check(s)
    assert sum(1 for row in cells for c in row if c.startswith("W")) == p * m
    assert bubble(cells) == pytest.approx(zero_bubble_theory(p, m))
    if m >= p:
        assert zero_bubble_theory(p, m) == pytest.approx((p - 1) / (3 * m + p - 1))


def test_zero_bubble_defers_more_weight_gradients_on_later_stages() -> None:
    """ZB-H1: stage s runs W k - s after B k; the last stage sends its input gradients back first."""
    s = make("zero_bubble", 4, 8)
    assert _compute_w(s, 0)[:6] == ["F0", "F1", "F2", "F3", "B0", "W0"]
    assert _compute_w(s, 3)[:10] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0", "F4"]
    assert _compute_w(s, 3)[-5:] == ["B7", "W4", "W5", "W6", "W7"]


def _compute_w(schedule, stage):  # type: ignore[no-untyped-def]
    return [str(a) for a in schedule.actions[stage] if a.kind in ("F", "B", "W")]


def test_interleaved_follows_megatrons_order() -> None:
    """p = 2, v = 2, m = 4: placement 0 warms up with 2 (p - 1) + (v - 1) p = 4 forwards, chunk 0 for
    micro-batches 0-1, chunk 1 for the same, then one forward and one backward in turn (backwards from the
    last chunk); its four virtual stages hold 4, 3, 2, 1 micro-batches."""
    s = make("interleaved_1f1b", 2, 4, virtual=2)
    assert _compute_w(s, 0) == ["F0", "F1", "F0.1", "F1.1", "F2", "B0.1", "F3", "B1.1", "F2.1", "B0", "F3.1",
                                "B1", "B2.1", "B3.1", "B2", "B3"]
    assert s.bounds == (4, 3, 2, 1) and s.virtual_stages == 4
    assert Action("send_F", 0, 0, chunk=0) in s.actions[1]  # virtual stage 1 (placement 1) sends to 2 (placement 0)
    assert grid(s, check(s)).splitlines()[1].startswith("placement 0  F0.0  F1.0  F0.1  F1.1  F2.0  B0.1")


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (4, 16, 2), (2, 8, 4),
                                           (8, 8, 2), (8, 16, 2)])
def test_interleaved_bubble_and_memory(p: int, m: int, v: int) -> None:
    """Unit F and B per virtual stage: idle share (p - 1) / (v m + p - 1); rank r holds at most Megatron's
    warm-up plus one, 2 (p - r - 1) + (v - 1) p + 1, micro-batch chunks at once (all of them if fewer)."""
    s = make("interleaved_1f1b", p, m, virtual=v)
    assert bubble(check(s)) == pytest.approx(bubble_theory(p, m, v))
    for r in range(p):
        held, peak = [0] * v, 0
        for a in s.actions[r]:
            held[a.chunk] += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, sum(held))
        assert peak == min(v * m, 2 * (p - r - 1) + (v - 1) * p + 1)


def test_interleaved_dry_run_refuses_a_stage_one_slot_short() -> None:
    """Virtual stage 0 needs all 4 slots along Megatron's order; with 3 the dry run stops and shows where."""
    s = make("interleaved_1f1b", 2, 4, virtual=2)
    tight = dataclasses.replace(s, bounds=(3, *s.bounds[1:]))
    with pytest.raises(ScheduleError, match=r"placement 0: waits at F3 \(its activation registers hold 3") as info:
        check(tight)
    assert "placement 1  .     F0.0  F1.0  F0.1  B0.1" in str(info.value)


def test_interleaved_needs_whole_groups_and_other_schedules_one_stage_per_placement() -> None:
    with pytest.raises(ScheduleError, match="micro_batches must be a multiple of 4, but got 6"):
        make("interleaved_1f1b", 4, 6, virtual=2)
    with pytest.raises(ScheduleError, match="only interleaved_1f1b runs several stages per placement"):
        make("1f1b", 2, 4, virtual=2)
    assert _compute(make("interleaved_1f1b", 4, 6), 0) == _compute(make("1f1b", 4, 6), 0)


def test_w_before_its_b_is_refused() -> None:
    s = make("zero_bubble", 2, 2)
    last = list(s.actions[1])
    w0 = last.index(Action("W", 0))
    last.insert(0, last.pop(w0))
    with pytest.raises(ScheduleError, match="stage 1 runs W0 before B0"):
        check(dataclasses.replace(s, actions=(s.actions[0], tuple(last))))


def test_one_stage_runs_each_micro_batch_forward_then_backward_and_bad_counts_are_refused() -> None:
    s = make("1f1b", stages=1, micro_batches=3)  # a placement with no pipeline: the degenerate schedule
    assert _compute(s, 0) == ["F0", "B0", "F1", "B1", "F2", "B2"] and s.bounds == (1,)
    for p, m, v in [(0, 2, 1), (2, 0, 1), (2, 2, 0)]:
        with pytest.raises(ScheduleError, match="stages >= 1, micro_batches >= 1 and virtual >= 1"):
            make("1f1b", p, m, v)
