"""Pipeline schedules as per-stage action lists (F, B, W k), and the checks they pass before anything runs::

    schedule          stage s does                                          activations held on s
    gpipe             F 0..m-1, then B 0..m-1                               m
    1f1b              F 0..w-1 (w = min(p-s-1, m)), then F/B pairs, then Bs p - s
    zero_bubble       1f1b's F and B, W k-s right after B k, the last s+1   p (ZB-H1: 1F1B's peak,
                      W at the end (W fills the cool-down's bubbles)        on every stage)
    interleaved_1f1b  v virtual stages per placement (stage k on k mod p):  per virtual stage, from
                      Megatron's order, 2(p-s-1) + (v-1)p warm-up Fs        its rank's order

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

SCHEDULES = ("1f1b", "gpipe", "zero_bubble", "interleaved_1f1b")
COMPUTE = ("F", "B", "W")


class ScheduleError(SbpflowError, RuntimeError):
    """A pipeline schedule that is malformed or cannot finish; the message shows where."""


@dataclass(frozen=True)
class Action:
    """One entry of a rank's list: ``kind`` is F, B, W, send_F, recv_F, send_B or recv_B.

    F k is micro-batch k's forward on this stage; B k its backward (under zero_bubble input gradients only);
    W k zero_bubble's weight gradients, split from B at graph level; a send or recv moves the activation
    (after F, to stage s+1) or its gradient (after B, to stage s-1). Every rank of a stage (itself maybe a
    data x tensor mesh) runs its stage's list.

    ``chunk`` says which of the rank's virtual stages acts (interleaved 1F1B; 0 otherwise): on rank ``r`` of
    ``p``, chunk ``c`` is virtual stage ``c * p + r``."""

    kind: str
    micro: int
    peer: int | None = None  # the other rank of a send or recv
    chunk: int = 0

    def __str__(self) -> str:
        name = f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")
        if self.peer is None:
            return name
        arrow = "->" if self.kind.startswith("send") else "<-"
        return f"{name}{arrow}{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists and the activation bound each virtual stage's registers enforce.

    Ranks here are pipeline ranks (one per placement); under ``interleaved_1f1b`` each runs ``virtual``
    stages, and ``bounds`` has one entry per virtual stage ``k`` (on rank ``k mod p``)."""

    name: str
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]  # per rank
    bounds: tuple[int, ...]  # per virtual stage: micro-batches whose activations may be held at once
    virtual: int = 1  # stages per rank

    @property
    def stages(self) -> int:
        """Pipeline ranks (placements)."""
        return len(self.actions)

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.virtual

    @property
    def splits_backward(self) -> bool:
        """Whether B is input gradients only and W the weight gradients (zero_bubble)."""
        return any(a.kind == "W" for a in self.actions[0])

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of ``rank``'s ``chunk``."""
        return chunk * self.stages + rank

    def compute_order(self, rank: int) -> dict[tuple[str, int, int], int]:
        """(F, B or W, virtual stage, micro-batch) -> its index among the rank's compute actions: the runtime's
        priority."""
        order = [(a.kind, self.stage(rank, a.chunk), a.micro) for a in self.actions[rank] if a.kind in COMPUTE]
        return {key: i for i, key in enumerate(order)}


Order = list[tuple[str, int, int]]  # a rank's compute actions: (kind, micro-batch, chunk)


# ----------------------------------------------------------------------------- making schedules


def make(name: str, stages: int, micro_batches: int, virtual: int = 1) -> Schedule:
    """The named schedule for ``stages`` ranks, ``micro_batches`` micro-batches and ``virtual`` stages per rank
    (interleaved 1F1B only), sends and recvs included."""
    _check_make(name, stages, micro_batches, virtual)
    p, m, v = stages, micro_batches, virtual
    if name == "zero_bubble":
        orders = [_zero_bubble_order(p, m, s) for s in range(p)]
    elif name == "gpipe":
        orders = [_gpipe_order(m) for _ in range(p)]
    elif name == "interleaved_1f1b" and v > 1:
        orders = [_interleaved_order(p, v, m, r) for r in range(p)]
    else:
        orders = [_one_f_one_b_order(p, m, s) for s in range(p)]
    if name == "gpipe":
        bounds = (m,) * p
    elif name == "zero_bubble":
        bounds = (min(p, m),) * p
    else:
        bounds = _held_peaks(orders, p, v, frees="B")
    lists = tuple(tuple(with_messages(order, r, p, v)) for r, order in enumerate(orders))
    return Schedule(name, m, lists, bounds, v)


def _check_make(name: str, p: int, m: int, v: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"pipeline schedule must be one of {SCHEDULES}, but got {name!r}")
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"a schedule needs stages >= 1, micro_batches >= 1 and virtual >= 1, but got {p}, {m} "
                            f"and {v}")
    if v > 1 and name != "interleaved_1f1b":
        raise ScheduleError(f"only interleaved_1f1b runs several stages per placement, but schedule {name!r} got "
                            f"{v} stages on each of {p} placements; use config.set_pipeline_schedule("
                            f"'interleaved_1f1b') or one stage per placement")
    if v > 1 and m % p:
        raise ScheduleError(f"interleaved_1f1b takes micro-batches in groups of the {p} placements (Megatron's "
                            f"order), so micro_batches must be a multiple of {p}, but got {m}")


def _gpipe_order(m: int) -> Order:
    return [("F", k, 0) for k in range(m)] + [("B", k, 0) for k in range(m)]


def _one_f_one_b_order(p: int, m: int, s: int) -> Order:
    """Warm-up forwards (p - s - 1 of them), then one forward and one backward in turn, then the rest."""
    warm = min(p - s - 1, m)
    order = [("F", k, 0) for k in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k, 0), ("B", k, 0)]
    order += [("B", k, 0) for k in range(m - warm, m)]
    return order


def _interleaved_order(p: int, v: int, m: int, r: int) -> Order:
    """Megatron's interleaved 1F1B on rank ``r``: forwards go through the chunks in groups of ``p``
    micro-batches (chunk 0 for micro-batches 0..p-1, then chunk 1 for the same ones, ...), backwards through
    the chunks in reverse; ``2 (p - r - 1) + (v - 1) p`` warm-up forwards, then one forward and one
    backward in turn."""
    total = v * m

    def forward(i: int) -> tuple[str, int, int]:
        return ("F", (i // (p * v)) * p + i % p, (i // p) % v)

    def backward(i: int) -> tuple[str, int, int]:
        return ("B", (i // (p * v)) * p + i % p, v - 1 - (i // p) % v)

    warm = min(total, 2 * (p - r - 1) + (v - 1) * p)
    order = [forward(i) for i in range(warm)]
    for j in range(total - warm):
        order += [forward(warm + j), backward(j)]
    order += [backward(j) for j in range(total - warm, total)]
    return order


def _zero_bubble_order(p: int, m: int, s: int) -> Order:
    """ZB-H1: 1F1B's order of F and B, with the weight gradient W of micro-batch k - s right after B k and the
    last s + 1 of them after the last B. Later stages defer more W: their B goes back at once, which shortens
    the backward's critical path by a W per stage, and the deferred W fill the cool-down's bubble. A stage
    then holds at most p micro-batches until their W (1F1B's peak, that of its first stage)."""
    order: Order = []
    next_w = 0
    for kind, k, _ in _one_f_one_b_order(p, m, s):
        order.append((kind, k, 0))
        if kind == "B" and k >= s:
            order.append(("W", k - s, 0))
            next_w = k - s + 1
    return order + [("W", k, 0) for k in range(next_w, m)]


def _held_peaks(orders: Sequence[Order], p: int, v: int, frees: str) -> tuple[int, ...]:
    """Per virtual stage, the most micro-batches forwarded and not yet freed (by B, or W) along its rank's order:
    what its activation registers must hold (timing cannot change it: only the rank's own actions count)."""
    peaks = [0] * (p * v)
    for r, order in enumerate(orders):
        held = [0] * v
        for kind, _, chunk in order:
            held[chunk] += 1 if kind == "F" else -1 if kind == frees else 0
            peaks[chunk * p + r] = max(peaks[chunk * p + r], held[chunk])
    return tuple(peaks)


def with_messages(order: Sequence[tuple[str, int, int]], rank: int, stages: int, virtual: int = 1) -> list[Action]:
    """A rank's compute order with its receives before and sends after each F and B (virtual stage
    ``chunk * stages + rank`` sends to the next virtual stage and receives from the previous one)."""
    out: list[Action] = []
    last = stages * virtual - 1
    for kind, k, chunk in order:
        vs = chunk * stages + rank
        before, after = (vs - 1, vs + 1) if kind == "F" else (vs + 1, vs - 1)
        if kind in ("F", "B") and 0 <= before <= last:
            out.append(Action(f"recv_{kind}", k, before % stages, chunk))
        out.append(Action(kind, k, None, chunk))
        if kind in ("F", "B") and 0 <= after <= last:
            out.append(Action(f"send_{kind}", k, after % stages, chunk))
    return out


# ----------------------------------------------------------------------------- checking


def check(schedule: Schedule) -> list[list[str]]:
    """Validates ``schedule`` and returns its dry run: per rank, the compute action at each unit step.

    Every stage has each F and B once, F k before B k, and a dry run of all stages in unit steps (a message
    sent at step t is received at t+1) finishes, or a ScheduleError shows the rank x step grid up to where it
    stuck. With equal F and B times the bubble is (p - 1) / (m + p - 1) for GPipe and 1F1B, and
    (p - 1) / (v m + p - 1) interleaved (:func:`bubble_theory`)."""
    for r, actions in enumerate(schedule.actions):
        for chunk in range(schedule.virtual):
            mine = [a for a in actions if a.chunk == chunk]
            where = _where(schedule, r, chunk)
            _check_counts(where, mine, schedule.micro_batches, schedule.splits_backward)
            _check_order(where, mine)
    return simulate(schedule)


def _where(schedule: Schedule, rank: int, chunk: int) -> str:
    if schedule.virtual == 1:
        return f"stage {rank}"
    return f"virtual stage {schedule.stage(rank, chunk)} (chunk {chunk} of placement {rank})"


def _check_counts(where: str, actions: Sequence[Action], m: int, split: bool) -> None:
    for kind in COMPUTE if split else ("F", "B"):
        micros = sorted(a.micro for a in actions if a.kind == kind)
        if micros != list(range(m)):
            raise ScheduleError(f"{where} must run {kind} once for each of the {m} micro-batches, "
                                f"but its list has {kind} for micro-batches {micros}")


def _check_order(where: str, actions: Sequence[Action]) -> None:
    seen: set[tuple[str, int]] = set()
    for a in actions:
        before = {"B": "F", "W": "B"}.get(a.kind)
        if before is not None and (before, a.micro) not in seen:
            raise ScheduleError(f"{where} runs {a.kind}{a.micro} before {before}{a.micro}: F, then B, then W "
                                "for each micro-batch")
        seen.add((a.kind, a.micro))


def simulate(schedule: Schedule) -> list[list[str]]:
    """Plays every rank's list in unit steps; raises :class:`ScheduleError` (with the grid) if it cannot finish.

    Within a step a rank takes its receives (messages sent in earlier steps), at most one F, B or W, then its
    sends. An F beyond its virtual stage's activation bound, or a receive whose message never comes, stops it."""
    return _play(schedule)[0]


def action_steps(schedule: Schedule) -> dict[tuple[str, int, int], int]:
    """(kind, virtual stage, micro-batch) -> the unit step of the dry run where that compute action runs."""
    return _play(schedule)[1]


@dataclass
class _DryRun:
    """The state of :func:`_play`: each rank's next action, held micro-batches per virtual stage, messages."""

    heads: list[int]
    held: list[int]
    mailbox: set[tuple[int, str, int]] = field(default_factory=set)  # (to virtual stage, kind, micro)
    steps: dict[tuple[str, int, int], int] = field(default_factory=dict)


def _play(schedule: Schedule) -> tuple[list[list[str]], dict[tuple[str, int, int], int]]:
    p = schedule.stages
    state = _DryRun([0] * p, [0] * schedule.virtual_stages)
    cells: list[list[str]] = [[] for _ in range(p)]
    while any(state.heads[r] < len(schedule.actions[r]) for r in range(p)):
        arrived = set(state.mailbox)
        moved = False
        for r in range(p):
            cell, advanced = _play_step(schedule, r, state, arrived, len(cells[r]))
            cells[r].append(cell)
            moved = moved or advanced
        if not moved:
            raise ScheduleError(_stuck_message(schedule, state, cells))
    return cells, state.steps


def _play_step(schedule: Schedule, r: int, state: _DryRun, arrived: set[tuple[int, str, int]],
               step: int) -> tuple[str, bool]:
    """One unit step of rank ``r``; returns its grid cell and whether it moved."""
    actions = schedule.actions[r]
    cell, moved, computed = ".", False, False
    while state.heads[r] < len(actions):
        a = actions[state.heads[r]]
        vs = schedule.stage(r, a.chunk)
        if a.kind.startswith("recv"):
            key = (vs, a.kind[-1], a.micro)
            if key not in arrived:
                break
            arrived.discard(key)
            state.mailbox.discard(key)
        elif a.kind.startswith("send"):
            state.mailbox.add((vs + 1 if a.kind == "send_F" else vs - 1, a.kind[-1], a.micro))
        else:
            if computed or (a.kind == "F" and state.held[vs] >= schedule.bounds[vs]):
                break
            frees = "W" if schedule.splits_backward else "B"
            state.held[vs] += 1 if a.kind == "F" else -1 if a.kind == frees else 0
            state.steps[(a.kind, vs, a.micro)] = step
            cell, computed = _label(schedule, a), True
        state.heads[r] += 1
        moved = True
    return cell, moved


def _label(schedule: Schedule, a: Action) -> str:
    """A grid cell: F3, or F3.1 for chunk 1 of an interleaved schedule (every chunk shown there)."""
    return f"{a.kind}{a.micro}" + (f".{a.chunk}" if schedule.virtual > 1 else "")


def _stuck_message(schedule: Schedule, state: _DryRun, cells: list[list[str]]) -> str:
    lines = [f"pipeline schedule {schedule.name!r} cannot finish: no stage can move after step {len(cells[0]) - 1}"]
    for r, actions in enumerate(schedule.actions):
        label = "stage" if schedule.virtual == 1 else "placement"
        if state.heads[r] >= len(actions):
            lines.append(f"  {label} {r}: done")
            continue
        a = actions[state.heads[r]]
        vs = schedule.stage(r, a.chunk)
        why = (f"its activation registers hold {schedule.bounds[vs]} micro-batches, all in use" if a.kind == "F"
               else "the matching send never comes" if a.kind.startswith("recv") else "")
        lines.append(f"  {label} {r}: waits at {a}" + (f" ({why})" if why else ""))
    return "\n".join(lines) + "\n" + grid(schedule, cells)


# ----------------------------------------------------------------------------- reading a dry run


def grid(schedule: Schedule, cells: list[list[str]], ranks: Sequence[Sequence[int]] | None = None) -> str:
    """The rank x step grid of a dry run: one row per stage (with its ranks when given), '.' where idle.
    Under interleaved 1F1B a row is a placement and a cell ``F3.1`` is micro-batch 3 on its chunk 1."""
    steps = max((len(row) for row in cells), default=0)
    label = "stage" if schedule.virtual == 1 else "placement"
    labels = [f"{label} {s}" + (f" {list(ranks[s])}" if ranks else "") for s in range(len(cells))]
    width = max(len(text) for text in [*labels, "step"])
    cell = max([2, *(len(c) for row in cells for c in row), len(str(steps))]) + 2
    lines = ["step".ljust(width) + "  " + "".join(str(t).ljust(cell) for t in range(steps)).rstrip()]
    for text, row in zip(labels, cells, strict=True):
        lines.append(text.ljust(width) + "  " + "".join(c.ljust(cell) for c in row).rstrip())
    return "\n".join(lines)


def bubble(cells: list[list[str]]) -> float:
    """Idle share of a dry run's stage x step area (equal F and B times)."""
    area = sum(len(row) for row in cells)
    busy = sum(1 for row in cells for c in row if c != ".")
    return 1.0 - busy / area if area else 0.0


def bubble_theory(stages: int, micro_batches: int, virtual: int = 1) -> float:
    """(p - 1) / (v m + p - 1): the idle share of GPipe and 1F1B (v = 1) and of interleaved 1F1B with v stages
    per placement, with balanced stages and no communication time."""
    return (stages - 1) / (virtual * micro_batches + stages - 1)


def zero_bubble_theory(stages: int, micro_batches: int) -> float:
    """ZB-H1's idle share with F = B = W: a step of 3m + p - 1 units ((p - 1) (F + B - W) of bubble, a third
    of 1F1B's), or 2m + 2p - 1 when m < p (the first forward's trip to the last stage and back comes first)."""
    p, m = stages, micro_batches
    return 1.0 - 3 * m / max(3 * m + p - 1, 2 * m + 2 * p - 1)
