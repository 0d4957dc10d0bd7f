"""SBPs inside a transformer block on its tensor-parallel group: an ILP (HiGHS) with a memory limit.

Every block of a GPT has the same shapes, so the choice is made once for one block and holds for all of
them: a 96-layer model costs one block's variables (about 40 binaries), not 96 times that. The block, on a
1-D mesh of ``t`` ranks, as logical 2-D tensors of ``N = b·s`` tokens:

    x ─ ln1 ─ qkv ─ attention ─ proj ─ add ─ ln2 ─ fc1 ─ gelu ─ fc2 ─ add ─> (the next block's x)
    └──────────────────────────────────┘  └────────────────────────────┘

Each linear layer picks ``replicate`` (x B, W B -> B), ``column`` (x B, W S(1) -> S(1)), ``row``
(x S(1), W S(0) -> P(sum)) or ``tokens`` (x S(0), W B -> S(0), its weight gradient all-reduced); attention
and GeLU keep B, S(0) or S(1) (heads); LayerNorm B or S(0); residual adds take two equal SBPs. Between a
producer and a consumer the boxing planner's ``transition_time`` prices the change, counted twice (the
backward pass runs the dual transition: all-gather <-> reduce-scatter, all-reduce <-> nothing and back).
Ops cost their roofline forward + backward time on their local shapes. Memory per rank: weights under
mixed-precision Adam (16 bytes per parameter, split or whole) and the activations kept for backward.

Megatron-LM's choice (column, heads, row, column, S(1), row) is what the ILP finds when memory is short
or the group is fast; the tests check the ILP against enumerating every assignment.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..boxing.plan import CostModel, Layout, LinkCost, target_factors, transition_time
from ..errors import PlanError
from ..sbp import Broadcast, Partial, SbpParallel, broadcast, partial_sum, split
from .cost import collective_time, matmul_flops, roofline
from .profiles import DeviceProfile
from .transformer import ACT_BYTES, TransformerSpec

B, S0, S1, P = broadcast, split(0), split(1), partial_sum
PARAM_BYTES = 16  # mixed-precision Adam: fp16 weight and gradient, fp32 master, momentum, variance


@dataclass(frozen=True)
class Choice:
    """One signature of one op: input SBPs, output SBP, and whether it splits the weight and the work."""

    name: str
    ins: tuple[SbpParallel, ...]
    out: SbpParallel
    split_weight: bool = False
    split_work: bool = True
    reduce_weight_grad: bool = False


LINEAR = (Choice("replicate", (B,), B, split_work=False), Choice("column", (B,), S1, split_weight=True),
          Choice("row", (S1,), P, split_weight=True), Choice("tokens", (S0,), S0, reduce_weight_grad=True))
NORM = (Choice("B", (B,), B, split_work=False), Choice("S(0)", (S0,), S0))
POINTWISE = NORM + (Choice("S(1)", (S1,), S1),)
ADD = (Choice("B", (B, B), B, split_work=False), Choice("S(0)", (S0, S0), S0), Choice("S(1)", (S1, S1), S1))
STREAM = (Choice("B", (), B, split_work=False), Choice("S(0)", (), S0))

# name, kind, inputs (producer op indices), output width in units of h, weight (in, out) in units of h
OPS = (
    ("x", "stream", (), 1, None), ("ln1", "norm", (0,), 1, None), ("qkv", "linear", (1,), 3, (1, 3)),
    ("attention", "attention", (2,), 1, None), ("proj", "linear", (3,), 1, (1, 1)), ("add1", "add", (0, 4), 1, None),
    ("ln2", "norm", (5,), 1, None), ("fc1", "linear", (6,), 4, (1, 4)), ("gelu", "pointwise", (7,), 4, None),
    ("fc2", "linear", (8,), 1, (4, 1)), ("add2", "add", (5, 9), 1, None),
)
CHOICES = {"stream": STREAM, "norm": NORM, "linear": LINEAR, "attention": POINTWISE, "pointwise": POINTWISE,
           "add": ADD}
CLOSING_EDGE = (10, 0)  # the block's output is the next block's input


@dataclass(frozen=True)
class BlockPlan:
    """The chosen signature per op, the block's seconds (compute + communication) and bytes per rank."""

    choices: tuple[tuple[str, str], ...]
    seconds: float
    comm_seconds: float
    memory: float
    solve_s: float
    method: str

    def __str__(self) -> str:
        ops = ", ".join(f"{op} {choice}" for op, choice in self.choices if op != "x")
        from .explain import seconds, size

        return (f"stream {dict(self.choices)['x']}; {ops}: {seconds(self.seconds)} per block "
                f"({seconds(self.comm_seconds)} communication), {size(self.memory)} per rank")


@dataclass(frozen=True)
class _Problem:
    op_cost: tuple[tuple[float, ...], ...]  # [op][choice] seconds
    op_memory: tuple[tuple[float, ...], ...]  # [op][choice] bytes
    edges: tuple[tuple[int, int, int, np.ndarray], ...]  # (producer, consumer, input position, cost[a][b])


def _choices(op: int) -> tuple[Choice, ...]:
    return CHOICES[OPS[op][1]]


def _problem(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile) -> _Problem:
    tokens, h = micro_batch * spec.seq, spec.hidden
    op_cost, op_memory = [], []
    for i, (_, kind, _, width, weight) in enumerate(OPS):
        op_cost.append(tuple(_op_seconds(kind, c, tokens, h, width, weight, spec, tp, profile) for c in _choices(i)))
        op_memory.append(tuple(_op_bytes(c, tokens, h, width, weight, tp) for c in _choices(i)))
    edges = []
    for consumer, (_, _, producers, _, _) in enumerate(OPS):
        for position, producer in enumerate(producers):
            edges.append((producer, consumer, position, _edge_costs(producer, consumer, position, tokens, h, tp,
                                                                    profile)))
    producer, consumer = CLOSING_EDGE
    edges.append((producer, consumer, -1, _edge_costs(producer, consumer, -1, tokens, h, tp, profile)))
    return _Problem(tuple(op_cost), tuple(op_memory), tuple(edges))


def _op_seconds(kind: str, c: Choice, tokens: int, h: int, width: int, weight: tuple[int, int] | None,
                spec: TransformerSpec, tp: int, profile: DeviceProfile) -> float:
    """Forward + backward (twice forward) roofline seconds on one rank, plus a ``tokens`` weight all-reduce."""
    share = tp if c.split_work else 1
    if kind == "stream":
        return 0.0
    if weight is not None:
        k, m = weight[0] * h, weight[1] * h
        nbytes = ACT_BYTES * (tokens * k + k * m + tokens * m)
        seconds = 3 * roofline(matmul_flops(tokens, m, k) / share, nbytes / share, profile)
        if c.reduce_weight_grad:
            seconds += collective_time("all_reduce", range(tp), ACT_BYTES * k * m, _model(profile, tp), "cpu")
        return seconds
    if kind == "attention":  # scores and context: 4·N·s·h FLOPs
        return 3 * roofline(4.0 * tokens * spec.seq * h / share, 4 * ACT_BYTES * tokens * h / share, profile)
    return 3 * roofline(0.0, 2 * ACT_BYTES * tokens * width * h / share, profile, matmul=False)


def _op_bytes(c: Choice, tokens: int, h: int, width: int, weight: tuple[int, int] | None, tp: int) -> float:
    params = 0 if weight is None else weight[0] * weight[1] * h * h
    kept = ACT_BYTES * tokens * width * h / (1 if isinstance(c.out, Broadcast) else tp)
    return PARAM_BYTES * params / (tp if c.split_weight else 1) + kept


def _edge_costs(producer: int, consumer: int, position: int, tokens: int, h: int, tp: int,
                profile: DeviceProfile) -> np.ndarray:
    shape = (tokens, OPS[producer][3] * h)
    srcs = [c.out for c in _choices(producer)]
    dsts = [c.out if position < 0 else c.ins[position] for c in _choices(consumer)]
    return np.array([[2 * _transition(shape, a, b, tp, profile) for b in dsts] for a in srcs])


def _transition(shape: tuple[int, int], a: SbpParallel, b: SbpParallel, tp: int, profile: DeviceProfile) -> float:
    if a == b or tp == 1:
        return 0.0
    if isinstance(b, Partial):
        return float("inf")  # nothing consumes partial values but through a reduction
    return _transition_cached(shape, a, b, tp, _model_key(profile))


@lru_cache(maxsize=4096)
def _transition_cached(shape: tuple[int, int], a: SbpParallel, b: SbpParallel, tp: int,
                       key: tuple[float, float, float, float]) -> float:
    from ..placement import Placement

    placement = Placement("cpu", list(range(tp)))
    model = _model_from_key(key, tp)
    with target_factors(()):
        return transition_time(shape, torch.float16, Layout(placement, (a,)), Layout(placement, (b,)), model)


def _model_key(profile: DeviceProfile) -> tuple[float, float, float, float]:
    return (profile.intra_alpha, profile.intra_bandwidth * profile.eta_intra, profile.inter_alpha,
            profile.inter_bandwidth * profile.eta_inter)


def _model_from_key(key: tuple[float, float, float, float], tp: int) -> CostModel:
    """The boxing model of a tensor-parallel group inside one node, priced as the profile's links (on ``cpu``
    placements: the planner runs where no accelerator exists)."""
    links = ((("cpu", "intra"), LinkCost(key[0], 1 / key[1])), (("cpu", "inter"), LinkCost(key[2], 1 / key[3])))
    return CostModel(links=links, ranks_per_node=max(tp, 1))


def _model(profile: DeviceProfile, tp: int) -> CostModel:
    return _model_from_key(_model_key(profile), tp)


# ----------------------------------------------------------------------------- solving


def solve_block(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile,
                memory_limit: float | None = None) -> BlockPlan:
    """The fastest SBP assignment of one block on ``tp`` ranks whose bytes per rank stay under ``memory_limit``.

    One-hot binaries pick each op's signature; each producer -> consumer edge has continuous variables
    ``e[a, b] >= x[producer, a] + x[consumer, b] - 1`` whose cost is the transition's, which is exact for
    one-hot choices and nonnegative costs.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    start = time.perf_counter()
    problem = _problem(spec, micro_batch, tp, profile)
    offsets = np.cumsum([0] + [len(c) for c in problem.op_cost])
    n_choice = int(offsets[-1])
    cost = [v for row in problem.op_cost for v in row]
    rows, lo, hi = [], [], []
    for op in range(len(OPS)):  # one signature per op
        rows.append({int(offsets[op]) + k: 1.0 for k in range(len(problem.op_cost[op]))})
        lo.append(1.0)
        hi.append(1.0)
    for producer, consumer, _, table in problem.edges:
        for a, b in itertools.product(range(table.shape[0]), range(table.shape[1])):
            if table[a, b] == 0:
                continue
            index = len(cost)
            blocked = not np.isfinite(table[a, b])
            cost.append(0.0 if blocked else float(table[a, b]))
            pair = {int(offsets[producer]) + a: 1.0, int(offsets[consumer]) + b: 1.0}
            rows.append({**pair, index: -1.0} if not blocked else pair)
            lo.append(-np.inf)
            hi.append(1.0)
    if memory_limit is not None:
        rows.append({int(offsets[op]) + k: m for op, row in enumerate(problem.op_memory) for k, m in enumerate(row)})
        lo.append(-np.inf)
        hi.append(memory_limit)
    matrix = np.zeros((len(rows), len(cost)))
    for r, row in enumerate(rows):
        for col, value in row.items():
            matrix[r, col] = value
    integrality = np.zeros(len(cost))
    integrality[:n_choice] = 1
    result = milp(np.array(cost), integrality=integrality, bounds=Bounds(0, np.where(integrality > 0, 1, np.inf)),
                  constraints=LinearConstraint(matrix, np.array(lo), np.array(hi)))
    if result.x is None:
        raise PlanError(f"no SBP assignment of a block fits in {memory_limit} bytes per rank on {tp} ranks")
    picks = tuple(int(np.argmax(result.x[offsets[op]:offsets[op + 1]])) for op in range(len(OPS)))
    return _plan(problem, picks, time.perf_counter() - start, "ilp")


def enumerate_block(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile,
                    memory_limit: float | None = None) -> BlockPlan:
    """The same optimum by trying every assignment (the check of :func:`solve_block`; thousands of them)."""
    start = time.perf_counter()
    problem = _problem(spec, micro_batch, tp, profile)
    best: tuple[float, tuple[int, ...]] | None = None
    for picks in itertools.product(*(range(len(row)) for row in problem.op_cost)):
        if memory_limit is not None and _memory(problem, picks) > memory_limit:
            continue
        total = _time(problem, picks)[0]
        if best is None or total < best[0]:
            best = (total, picks)
    if best is None or not np.isfinite(best[0]):
        raise PlanError(f"no SBP assignment of a block fits in {memory_limit} bytes per rank on {tp} ranks")
    return _plan(problem, best[1], time.perf_counter() - start, "enumeration")


def _time(problem: _Problem, picks: tuple[int, ...]) -> tuple[float, float]:
    comm = sum(table[picks[u], picks[v]] for u, v, _, table in problem.edges)
    return sum(problem.op_cost[op][k] for op, k in enumerate(picks)) + comm, comm


def _memory(problem: _Problem, picks: tuple[int, ...]) -> float:
    return sum(problem.op_memory[op][k] for op, k in enumerate(picks))


def _plan(problem: _Problem, picks: tuple[int, ...], solve_s: float, method: str) -> BlockPlan:
    total, comm = _time(problem, picks)
    choices = tuple((OPS[op][0], _choices(op)[k].name) for op, k in enumerate(picks))
    return BlockPlan(choices, total, comm, _memory(problem, picks), solve_s, method)


def megatron(plan: BlockPlan) -> bool:
    """Whether ``plan`` is Megatron-LM's tensor parallelism (column, heads, row; column, S(1), row)."""
    wanted = {"qkv": "column", "attention": "S(1)", "proj": "row", "fc1": "column", "gelu": "S(1)", "fc2": "row"}
    return all(dict(plan.choices)[op] == c for op, c in wanted.items())


# ----------------------------------------------------------------------------- the collectives a choice issues


def block_collectives(choices: tuple[tuple[str, str], ...] | None, tp: int) -> list[tuple[str, int]]:
    """(kind, width in units of h) of the collectives one block issues per micro-batch, forward and backward,
    for the SBP selection's ``choices`` (``block_sbp.BlockPlan.choices``; None: Megatron's).

    Each edge of the block whose producer's SBP differs from what its consumer takes is one transition forward
    and its dual backward (all-gather <-> reduce-scatter; an all-reduce's dual is the all-reduce of the
    column-parallel input's partial gradient, Megatron's f/g pair).
    """
    if tp == 1:
        return []
    if choices is None:
        choices = MEGATRON_CHOICES
    picked = dict(choices)
    out: list[tuple[str, int]] = []
    edges = [(p, c, pos) for c, op in enumerate(OPS) for pos, p in enumerate(op[2])] + [(*CLOSING_EDGE, -1)]
    for producer, consumer, position in edges:
        src = _pick(_choices(producer), picked[OPS[producer][0]]).out
        chosen = _pick(_choices(consumer), picked[OPS[consumer][0]])
        dst = chosen.out if position < 0 else chosen.ins[position]
        for kind in _transition_kinds(src, dst):
            out.append((kind, OPS[producer][3]))
            out.append((_DUAL.get(kind, kind), OPS[producer][3]))
    return out


MEGATRON_CHOICES = (("x", "B"), ("ln1", "B"), ("qkv", "column"), ("attention", "S(1)"), ("proj", "row"),
                    ("add1", "B"), ("ln2", "B"), ("fc1", "column"), ("gelu", "S(1)"), ("fc2", "row"), ("add2", "B"))
_DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}


def _pick(options: tuple[Choice, ...], name: str) -> Choice:
    for c in options:
        if c.name == name:
            return c
    raise PlanError(f"a block choice names one of {[c.name for c in options]}, but got {name!r}")


def _transition_kinds(src: SbpParallel, dst: SbpParallel) -> list[str]:
    """The collectives of one SBP change on a 1-D group, as the boxing table composes them for gloo."""
    from ..sbp import Split

    if src == dst or isinstance(dst, Partial):
        return []
    if isinstance(src, Partial):
        return ["all_reduce"] if isinstance(dst, Broadcast) else ["reduce_scatter"]
    if isinstance(src, Split):
        return ["all_gather"] if isinstance(dst, Broadcast) else ["all_to_all"]
    return []  # B -> S: each rank slices its part
