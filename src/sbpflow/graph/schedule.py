"""Pipeline schedules as per-stage action lists, and the checks they pass before anything runs.

A schedule says, for each of the ``p`` stages, the order of its actions over ``m`` micro-batches::

    F k        forward of micro-batch k on this stage
    B k        backward of micro-batch k (input and weight gradients; under zero_bubble input gradients only)
    W k        zero_bubble: the weight gradients of micro-batch k, split from B at graph level
    send/recv  the activation (after F, to stage s+1) or its gradient (after B, to stage s-1)

Every rank of a stage runs its stage's list (a stage may itself be a data x tensor mesh).

    schedule    stage s does                                              activations held on s
    gpipe       F 0..m-1, then B 0..m-1                                   m
    1f1b        F 0..w-1 (w = min(p-s-1, m)), then F/B pairs, then Bs     p - s
    zero_bubble each unit step: B if its gradient came, else F if a slot     p (ZB-H1: 1F1B's peak,
                is free, else a pending W (W fills the bubbles)            on every stage)

:func:`check` runs before a plan is used: every stage has each F and B once, F k before B k, and a
dry run of all stages in unit steps (each F or B takes one step; a message sent at step t can be
received at t+1) either finishes or raises :class:`ScheduleError` with the rank x step grid up to
where it stuck. The same dry run gives the bubble: with equal F and B times it is
(p - 1) / (m + p - 1) for both schedules (:func:`bubble_theory`).

>>> s = make("1f1b", stages=2, micro_batches=3)
>>> print(grid(s, check(s)))
step     0   1   2   3   4   5   6   7
stage 0  F0  F1  .   B0  F2  B1  .   B2
stage 1  .   F0  B0  F1  B1  F2  B2  .
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import SbpflowError

SCHEDULES = ("1f1b", "gpipe", "zero_bubble")
COMPUTE = ("F", "B", "W")


class ScheduleError(SbpflowError, RuntimeError):
    """A pipeline schedule that is malformed or cannot finish; the message shows where."""


@dataclass(frozen=True)
class Action:
    """One entry of a stage's list: ``kind`` is F, B, send_F, recv_F, send_B or recv_B."""

    kind: str
    micro: int
    peer: int | None = None  # the other stage of a send or recv

    def __str__(self) -> str:
        if self.peer is None:
            return f"{self.kind}{self.micro}"
        arrow = "->" if self.kind.startswith("send") else "<-"
        return f"{self.kind}{self.micro}{arrow}{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists and the activation bound each stage's registers enforce."""

    name: str
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]  # per stage
    bounds: tuple[int, ...]  # per stage: micro-batches whose activations may be held at once

    @property
    def stages(self) -> int:
        return len(self.actions)

    @property
    def splits_backward(self) -> bool:
        """Whether B is input gradients only and W the weight gradients (zero_bubble)."""
        return any(a.kind == "W" for a in self.actions[0])

    def compute_order(self, stage: int) -> dict[tuple[str, int], int]:
        """(F or B, micro-batch) -> its index among the stage's compute actions: the runtime's priority."""
        order = [(a.kind, a.micro) for a in self.actions[stage] if a.kind in COMPUTE]
        return {key: i for i, key in enumerate(order)}


# ----------------------------------------------------------------------------- making schedules


def make(name: str, stages: int, micro_batches: int) -> Schedule:
    """The named schedule for ``stages`` stages and ``micro_batches`` micro-batches, sends and recvs included."""
    if name not in SCHEDULES:
        raise ScheduleError(f"pipeline schedule must be one of {SCHEDULES}, but got {name!r}")
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"a schedule needs stages >= 1 and micro_batches >= 1, but got {stages} and "
                            f"{micro_batches}")
    p, m = stages, micro_batches
    if name == "zero_bubble":
        bounds = (min(p, m),) * p
        orders = _zero_bubble_orders(p, m, bounds[0])
    else:
        bounds = tuple(m if name == "gpipe" else min(p - s, m) for s in range(p))
        orders = [_gpipe_order(m) if name == "gpipe" else _one_f_one_b_order(p, m, s) for s in range(p)]
    lists = tuple(tuple(with_messages(order, s, p)) for s, order in enumerate(orders))
    return Schedule(name, m, lists, bounds)


def _gpipe_order(m: int) -> list[tuple[str, int]]:
    return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]


def _one_f_one_b_order(p: int, m: int, s: int) -> list[tuple[str, int]]:
    """Warm-up forwards (p - s - 1 of them), then one forward and one backward in turn, then the rest."""
    warm = min(p - s - 1, m)
    order = [("F", k) for k in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k), ("B", k)]
    order += [("B", k) for k in range(m - warm, m)]
    return order


def _zero_bubble_orders(p: int, m: int, bound: int) -> list[list[tuple[str, int]]]:
    """ZB-H1 by list scheduling in unit steps: a stage runs B when its gradient has come (the critical path),
    else F when a micro-batch has arrived and fewer than ``bound`` are held (held until W), else its oldest
    pending W, which fills what would be 1F1B's bubble."""
    stages = [_ZbStage() for _ in range(p)]
    while any(len(st.order) < 3 * m for st in stages):
        picks = [_zero_bubble_pick(stages, s, m, bound) for s in range(p)]  # all decide on the last step's state
        for st, action in zip(stages, picks, strict=True):
            if action is not None:
                st.apply(action)
    return [st.order for st in stages]


@dataclass
class _ZbStage:
    """One stage's progress while :func:`_zero_bubble_orders` builds its list."""

    order: list[tuple[str, int]] = field(default_factory=list)
    next_f: int = 0
    next_b: int = 0
    held: int = 0  # micro-batches forwarded whose W has not run
    pending_w: list[int] = field(default_factory=list)
    forwarded: set[int] = field(default_factory=set)
    backwarded: set[int] = field(default_factory=set)

    def apply(self, action: tuple[str, int]) -> None:
        kind, k = action
        self.order.append(action)
        if kind == "F":
            self.next_f, self.held = self.next_f + 1, self.held + 1
            self.forwarded.add(k)
        elif kind == "B":
            self.next_b += 1
            self.pending_w.append(k)
            self.backwarded.add(k)
        else:
            self.pending_w.pop(0)
            self.held -= 1


def _zero_bubble_pick(stages: list[_ZbStage], s: int, m: int, bound: int) -> tuple[str, int] | None:
    me, last = stages[s], s == len(stages) - 1
    k = me.next_b
    if k < m and k in (me.forwarded if last else stages[s + 1].backwarded):
        return ("B", k)
    k = me.next_f
    if k < m and me.held < bound and (s == 0 or k in stages[s - 1].forwarded):
        return ("F", k)
    return ("W", me.pending_w[0]) if me.pending_w else None


def with_messages(order: Sequence[tuple[str, int]], stage: int, stages: int) -> list[Action]:
    """A stage's compute order with its receives before and sends after each F and B."""
    out: list[Action] = []
    last = stages - 1
    for kind, k in order:
        if kind == "F" and stage > 0:
            out.append(Action("recv_F", k, stage - 1))
        if kind == "B" and stage < last:
            out.append(Action("recv_B", k, stage + 1))
        out.append(Action(kind, k))
        if kind == "F" and stage < last:
            out.append(Action("send_F", k, stage + 1))
        if kind == "B" and stage > 0:
            out.append(Action("send_B", k, stage - 1))
    return out


# ----------------------------------------------------------------------------- checking


def check(schedule: Schedule) -> list[list[str]]:
    """Validates ``schedule`` and returns its dry run: per stage, the compute action at each unit step."""
    for s, actions in enumerate(schedule.actions):
        _check_counts(s, actions, schedule.micro_batches, schedule.splits_backward)
        _check_order(s, actions)
    return simulate(schedule)


def _check_counts(stage: int, actions: Sequence[Action], m: int, split: bool) -> None:
    for kind in COMPUTE if split else ("F", "B"):
        micros = sorted(a.micro for a in actions if a.kind == kind)
        if micros != list(range(m)):
            raise ScheduleError(f"stage {stage} must run {kind} once for each of the {m} micro-batches, "
                                f"but its list has {kind} for micro-batches {micros}")


def _check_order(stage: int, actions: Sequence[Action]) -> None:
    seen: set[tuple[str, int]] = set()
    for a in actions:
        before = {"B": "F", "W": "B"}.get(a.kind)
        if before is not None and (before, a.micro) not in seen:
            raise ScheduleError(f"stage {stage} runs {a.kind}{a.micro} before {before}{a.micro}: F, then B, then W "
                                "for each micro-batch")
        seen.add((a.kind, a.micro))


def simulate(schedule: Schedule) -> list[list[str]]:
    """Plays every stage's list in unit steps; raises :class:`ScheduleError` (with the grid) if it cannot finish.

    Within a step a stage takes its receives (messages sent in earlier steps), at most one F or B, then its
    sends. An F beyond the stage's activation bound, or a receive whose message never comes, stops it."""
    p = schedule.stages
    heads = [0] * p
    held = [0] * p
    mailbox: set[tuple[int, str, int, int]] = set()  # (to stage, kind, micro, from stage), visible next step
    cells: list[list[str]] = [[] for _ in range(p)]
    while any(heads[s] < len(schedule.actions[s]) for s in range(p)):
        arrived = set(mailbox)
        moved = False
        for s in range(p):
            cell, advanced = _play_step(schedule, s, heads, held, arrived, mailbox)
            cells[s].append(cell)
            moved = moved or advanced
        if not moved:
            raise ScheduleError(_stuck_message(schedule, heads, held, cells))
    return cells


def _play_step(schedule: Schedule, s: int, heads: list[int], held: list[int],
               arrived: set[tuple[int, str, int, int]], mailbox: set[tuple[int, str, int, int]]) -> tuple[str, bool]:
    """One unit step of stage ``s``; returns its grid cell and whether it moved."""
    actions = schedule.actions[s]
    cell, moved, computed = ".", False, False
    while heads[s] < len(actions):
        a = actions[heads[s]]
        if a.kind.startswith("recv"):
            key = (s, a.kind[-1], a.micro, a.peer if a.peer is not None else -1)
            if key not in arrived:
                break
            arrived.discard(key)
            mailbox.discard(key)
        elif a.kind.startswith("send"):
            mailbox.add((a.peer if a.peer is not None else -1, a.kind[-1], a.micro, s))
        else:
            if computed or (a.kind == "F" and held[s] >= schedule.bounds[s]):
                break
            frees = "W" if schedule.splits_backward else "B"
            held[s] += 1 if a.kind == "F" else -1 if a.kind == frees else 0
            cell, computed = str(a), True
        heads[s] += 1
        moved = True
    return cell, moved


def _stuck_message(schedule: Schedule, heads: list[int], held: list[int], cells: list[list[str]]) -> str:
    lines = [f"pipeline schedule {schedule.name!r} cannot finish: no stage can move after step {len(cells[0]) - 1}"]
    for s, actions in enumerate(schedule.actions):
        if heads[s] >= len(actions):
            lines.append(f"  stage {s}: done")
            continue
        a = actions[heads[s]]
        why = (f"its activation registers hold {schedule.bounds[s]} micro-batches, all in use" if a.kind == "F"
               else "the matching send never comes" if a.kind.startswith("recv") else "")
        lines.append(f"  stage {s}: waits at {a}" + (f" ({why})" if why else ""))
    return "\n".join(lines) + "\n" + grid(schedule, cells)


# ----------------------------------------------------------------------------- reading a dry run


def grid(schedule: Schedule, cells: list[list[str]], ranks: Sequence[Sequence[int]] | None = None) -> str:
    """The rank x step grid of a dry run: one row per stage (with its ranks when given), '.' where idle."""
    steps = max((len(row) for row in cells), default=0)
    labels = [f"stage {s}" + (f" {list(ranks[s])}" if ranks else "") for s in range(len(cells))]
    width = max(len(label) for label in [*labels, "step"])
    cell = max([2, *(len(c) for row in cells for c in row), len(str(steps))]) + 2
    lines = ["step".ljust(width) + "  " + "".join(str(t).ljust(cell) for t in range(steps)).rstrip()]
    for label, row in zip(labels, cells, strict=True):
        lines.append(label.ljust(width) + "  " + "".join(c.ljust(cell) for c in row).rstrip())
    return "\n".join(lines)


def bubble(cells: list[list[str]]) -> float:
    """Idle share of a dry run's stage x step area (equal F and B times)."""
    area = sum(len(row) for row in cells)
    busy = sum(1 for row in cells for c in row if c != ".")
    return 1.0 - busy / area if area else 0.0


def bubble_theory(stages: int, micro_batches: int) -> float:
    """(p - 1) / (m + p - 1): the idle share of GPipe and 1F1B with balanced stages and no communication time."""
    return (stages - 1) / (micro_batches + stages - 1)
