"""SBPs inside one transformer block on its tensor-parallel group: an ILP (HiGHS) with a memory limit.

All blocks have the same shapes, so one block is solved (about 40 binaries) and its choice holds for every
layer::

    x ─ ln1 ─ qkv ─ attention ─ proj ─ add ─ ln2 ─ fc1 ─ gelu ─ fc2 ─ add ─> next block
    └──────────────────────────────────┘  └────────────────────────────┘

Each linear picks ``replicate``, ``column``, ``row`` or ``tokens``; transitions cost the boxing planner's time
(twice: backward runs the dual collective), ops their roofline kernels, memory is :class:`BlockBudget`. When
memory is short or the group fast, the answer is Megatron's (column, heads, row; sequence-parallel norms), which
reproduces Korthikanti et al.'s activation counts; the tests check the ILP against enumerating every assignment.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import torch

from ..boxing.plan import CostModel, Layout, LinkCost, target_factors, transition_time
from ..errors import PlanError
from ..placement import Placement
from ..sbp import Broadcast, Partial, SbpParallel, Split, broadcast, partial_sum, split
from .cost import collective_time, matmul_flops, roofline
from .profiles import DeviceProfile
from .transformer import ACT_BYTES, TransformerSpec
from .units import seconds, size

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


# bytes a block keeps for backward per token, per unit of hidden, at each op's output (Korthikanti et al. 2023,
# Table 2): LayerNorm inputs (the stream, add1's output), linear inputs, Q, K, V, GeLU's input, and 1-byte dropout
# masks after the projections (add1, add2). Attention also keeps 5·a·s bytes per token: softmax output (2),
# dropout mask (1), dropout output (2). Megatron's choice gives s·b·h·(10 + 24/t) + 5·a·s²·b/t.
KEPT = {"x": 2, "ln1": 2, "qkv": 6, "attention": 2, "proj": 0, "add1": 3, "ln2": 2, "fc1": 8, "gelu": 8, "fc2": 0,
        "add2": 1}
RECOMPUTE_KINDS = ("none", "selective", "full")


@lru_cache(maxsize=64)
def op_shapes(spec: TransformerSpec) -> tuple[tuple[float, tuple[float, float] | None, float], ...]:
    """Per op of ``OPS``, for ``spec``'s sizes: (output width, weight (in, out), kept bytes per token), in units of
    h. A GPT's are the table's; grouped-query attention narrows qkv, a SwiGLU MLP has gate and up side by side."""
    h = spec.hidden
    qkv, ffn = spec.qkv_width / h, spec.ffn / h
    inner = (2 if spec.gated else 1) * ffn  # fc1's output: the MLP's input to its activation
    width = {"qkv": qkv, "fc1": inner, "gelu": ffn}
    weight = {"qkv": (1.0, qkv), "fc1": (1.0, inner), "fc2": (ffn, 1.0)}
    kept = {**KEPT, "qkv": ACT_BYTES * qkv, "fc1": ACT_BYTES * inner, "gelu": ACT_BYTES * ffn}
    return tuple((width.get(name, float(w)), weight.get(name, None if wt is None else (float(wt[0]), float(wt[1]))),
                  float(kept[name])) for name, _, _, w, wt in OPS)


@dataclass(frozen=True)
class BlockBudget:
    """What a block's choice costs beyond one micro-batch's seconds, on the stage the plan's memory binds on.

    ``state_bytes``: bytes per parameter held (weights, gradients and optimizer state under the plan's ZeRO stage;
    16 without ZeRO). ``blocks``: blocks on the stage. ``copies``: micro-batches whose kept activations a rank holds
    at once (1F1B: min(p, m) on the first stage). ``gathered_bytes``: bytes per parameter ZeRO-3 gathers for the
    block being run. ``param_seconds``: seconds per parameter held, per micro-batch (the step's gradient sync and
    optimizer amortised over the micro-batches, ZeRO's per-micro-batch traffic).
    The memory the ILP bounds is ``blocks · (state_bytes · params + copies · kept) + working``, per rank.
    """

    state_bytes: float = PARAM_BYTES
    blocks: int = 1
    copies: float = 1.0
    gathered_bytes: float = 0.0
    param_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.copies < 1:
            raise PlanError(f"a block budget needs blocks >= 1 and copies >= 1, but got blocks={self.blocks}, "
                            f"copies={self.copies}")
        for name in ("state_bytes", "gathered_bytes", "param_seconds"):
            if getattr(self, name) < 0:
                raise PlanError(f"BlockBudget.{name} must be >= 0, but got {getattr(self, name)}")


@dataclass(frozen=True)
class BlockPlan:
    """The chosen signature per op and what they cost one rank per micro-batch: ``seconds`` (compute, recompute
    and communication), ``comm_seconds`` (the transitions between ops and ``tokens`` layers' weight-gradient
    all-reduces), ``forward_s`` (the ops' forward kernels), ``attention_s`` (the core attention's forward: what
    selective recompute reruns); and per rank: ``params`` held, ``kept`` bytes per micro-batch in flight,
    ``working`` bytes of the block being rebuilt, ``memory`` as the budget counts it."""

    choices: tuple[tuple[str, str], ...]
    seconds: float
    comm_seconds: float
    memory: float
    solve_s: float
    method: str
    forward_s: float = 0.0
    attention_s: float = 0.0
    weight_sync_s: float = 0.0
    params: float = 0.0
    kept: float = 0.0
    working: float = 0.0
    recompute: str = "none"

    @property
    def recompute_s(self) -> float:
        """Forward seconds recomputation adds per micro-batch."""
        return {"none": 0.0, "selective": self.attention_s, "full": self.forward_s}[self.recompute]

    def __str__(self) -> str:
        ops = ", ".join(f"{op} {choice}" for op, choice in self.choices if op != "x")
        return (f"stream {dict(self.choices)['x']}; {ops}: {seconds(self.seconds)} per block "
                f"({seconds(self.comm_seconds)} communication), {size(self.memory)} per rank")


@dataclass(frozen=True)
class _Problem:
    forward: tuple[tuple[float, ...], ...]  # [op][choice] forward seconds
    weight_sync: tuple[tuple[float, ...], ...]  # [op][choice] seconds of a weight-gradient all-reduce
    params: tuple[tuple[float, ...], ...]  # [op][choice] parameters held per rank
    kept: tuple[tuple[float, ...], ...]  # [op][choice] bytes kept per micro-batch under the recompute
    working: tuple[tuple[float, ...], ...]  # [op][choice] bytes rebuilt for backward (+ ZeRO-3's gathered)
    edges: tuple[tuple[int, int, int, np.ndarray], ...]  # (producer, consumer, input position, cost[a][b])
    recompute: str
    budget: BlockBudget

    def op_cost(self, op: int, k: int) -> float:
        """Objective seconds of ``op``'s choice ``k``: forward + backward (twice forward) + what recompute reruns,
        its weight-gradient all-reduce, and the budget's price of the parameters it holds."""
        passes = 4 if self.recompute == "full" else 3
        rerun = self.recompute == "selective" and OPS[op][1] == "attention"
        return ((passes + rerun) * self.forward[op][k] + self.weight_sync[op][k]
                + self.budget.param_seconds * self.params[op][k])

    def op_memory(self, op: int, k: int) -> float:
        b = self.budget
        return b.blocks * (b.state_bytes * self.params[op][k] + b.copies * self.kept[op][k]) + self.working[op][k]


def _choices(op: int) -> tuple[Choice, ...]:
    return CHOICES[OPS[op][1]]


def _problem(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile, recompute: str,
             budget: BlockBudget, ranks_per_node: int) -> _Problem:
    if recompute not in RECOMPUTE_KINDS:
        raise PlanError(f"recompute must be one of {RECOMPUTE_KINDS}, but got {recompute!r}")
    key = _model_key(profile)
    tables: dict[str, list[tuple[float, ...]]] = {k: [] for k in ("forward", "sync", "params", "kept", "working")}
    for i in range(len(OPS)):
        rows = [_op_terms(i, c, micro_batch, spec, tp, profile, recompute, key, ranks_per_node) for c in _choices(i)]
        for name, column in zip(tables, zip(*rows, strict=True), strict=True):
            tables[name].append(tuple(column))
    working = tuple(tuple(w + budget.gathered_bytes * p for w, p in zip(ws, ps, strict=True))
                    for ws, ps in zip(tables["working"], tables["params"], strict=True))
    passes = 3 if recompute == "full" else 2  # full recompute reruns each forward transition
    tokens, h = micro_batch * spec.seq, spec.hidden
    edges = []
    for consumer, (_, _, producers, _, _) in enumerate(OPS):
        for position, producer in enumerate(producers):
            edges.append((producer, consumer, position, _edge_costs(
                producer, consumer, position, tokens, h, tp, key, ranks_per_node, passes, spec)))
    producer, consumer = CLOSING_EDGE
    edges.append((producer, consumer, -1, _edge_costs(producer, consumer, -1, tokens, h, tp, key, ranks_per_node,
                                                      passes, spec)))
    return _Problem(tuple(tables["forward"]), tuple(tables["sync"]), tuple(tables["params"]), tuple(tables["kept"]),
                    working, tuple(edges), recompute, budget)


def _op_terms(op: int, c: Choice, micro_batch: int, spec: TransformerSpec, tp: int, profile: DeviceProfile,
              recompute: str, key: tuple[float, float, float, float], ranks_per_node: int
              ) -> tuple[float, float, float, float, float]:
    """(forward seconds, weight-gradient all-reduce seconds, parameters, kept bytes, working bytes) of one op's
    choice on one rank, from its local shapes."""
    name, kind, producers, _, _ = OPS[op]
    width, weight, kept_units = op_shapes(spec)[op]
    tokens, h = micro_batch * spec.seq, spec.hidden
    share = tp if c.split_work else 1
    sync, params = 0.0, 0.0
    if weight is not None:
        k, m = round(weight[0] * h), round(weight[1] * h)
        forward = _linear_seconds(c, tokens, k, m, tp, profile)
        if c.reduce_weight_grad and tp > 1:
            model = _model_from_key(key, ranks_per_node)
            sync = collective_time("all_reduce", range(tp), ACT_BYTES * k * m, model, "cpu")
        column = c.split_weight and isinstance(c.out, Split)  # Megatron splits a column layer's bias too
        params = k * m / (tp if c.split_weight else 1) + (m / (tp if column else 1) if spec.bias else 0.0)
    elif kind == "attention":
        units = micro_batch * spec.heads / share
        forward = (_flash_seconds if spec.attention == "flash" else _attention_seconds)(
            units, spec.seq, h // spec.heads, profile)
    else:
        params = float(spec.norm_params) if kind == "norm" else 0.0  # whole in every choice
        read = op_shapes(spec)[producers[0]][0] if producers else width
        forward = 0.0 if kind == "stream" else roofline(0.0, _elementwise_bytes(kind, tokens, h, read, width) / share,
                                                        profile, matmul=False)
    out_share = tp if isinstance(c.out, Split) else 1
    # unfused attention keeps the softmax output, its dropout mask and output (5 bytes a score); flash attention
    # keeps only a row's log-sum-exp (fp32) and rebuilds the scores in backward
    per_token = 5.0 * spec.seq if spec.attention == "unfused" else 4.0
    scores = per_token * spec.heads * tokens if kind == "attention" else 0.0
    whole = (kept_units * tokens * h + scores) / out_share
    kept = {"none": whole, "selective": whole - scores / out_share, "full": whole if kind == "stream" else 0.0}
    return forward, sync, params, kept[recompute], whole - kept[recompute]


def _linear_seconds(c: Choice, tokens: int, k: int, m: int, tp: int, profile: DeviceProfile) -> float:
    """One GEMM of (tokens, k) by (k, m) on the local shapes: the input, weight and output each split or whole."""
    share = tp if c.split_work else 1
    x = tokens * k / (1 if isinstance(c.ins[0], Broadcast) else tp)
    w = k * m / (tp if c.split_weight else 1)
    y = tokens * m / (tp if isinstance(c.out, Split) else 1)  # a partial sum is whole on every rank
    # the local GEMM: a column layer splits its output features, a row layer its inner dim, "tokens" its rows
    rows = tokens / tp if c.name == "tokens" else tokens
    cols = m / tp if c.split_weight and isinstance(c.out, Split) else m
    inner = k / tp if c.split_weight and isinstance(c.out, Partial) else k
    return roofline(matmul_flops(tokens, m, k) / share, ACT_BYTES * (x + w + y), profile, gemm=(rows, cols, inner, 1))


def _attention_seconds(units: float, s: int, d: int, profile: DeviceProfile) -> float:
    """The core attention of ``units`` (sequence, head) pairs: scores Q·Kᵀ, fused scale-mask-softmax, dropout,
    probabilities · V."""
    scores = units * s * s
    return (roofline(matmul_flops(s, s, d, 1) * units, ACT_BYTES * units * (2 * s * d + s * s), profile,
                     gemm=(s, s, d, units))
            + roofline(matmul_flops(s, d, s, 1) * units, ACT_BYTES * units * (s * s + 2 * s * d), profile,
                       gemm=(s, d, s, units))
            + roofline(0.0, 2 * ACT_BYTES * scores, profile, matmul=False)
            + roofline(0.0, 2 * ACT_BYTES * scores + scores, profile, matmul=False))


def _flash_seconds(units: float, s: int, d: int, profile: DeviceProfile) -> float:
    """The core attention as one fused kernel (FlashAttention): both products at GEMM speed, and only Q, K, V and
    the output through memory."""
    return roofline(matmul_flops(s, s, d, 1) * units * 2, ACT_BYTES * units * 4 * s * d, profile,
                    gemm=(s, d, s, units))  # per query tile: scores (k = d) then output (n = d), fused


def _elementwise_bytes(kind: str, tokens: int, h: int, read: float, width: float) -> float:
    """Bytes read and written by a whole elementwise kernel: a norm or an activation reads its input (SwiGLU: gate
    and up) and writes its output; a residual add also reads the bias and writes a 1-byte dropout mask."""
    if kind == "add":
        return 3 * ACT_BYTES * tokens * h + tokens * h
    return ACT_BYTES * tokens * (read + width) * h


def _edge_costs(producer: int, consumer: int, position: int, tokens: int, h: int, tp: int,
                key: tuple[float, float, float, float], ranks_per_node: int, passes: int,
                spec: TransformerSpec) -> np.ndarray:
    shape = (tokens, round(op_shapes(spec)[producer][0] * h))
    srcs = [c.out for c in _choices(producer)]
    dsts = [c.out if position < 0 else c.ins[position] for c in _choices(consumer)]
    return np.array([[passes * _transition(shape, a, b, tp, key, ranks_per_node) for b in dsts] for a in srcs])


def _transition(shape: tuple[int, int], a: SbpParallel, b: SbpParallel, tp: int,
                key: tuple[float, float, float, float], ranks_per_node: int) -> float:
    if a == b or tp == 1:
        return 0.0
    if isinstance(b, Partial):
        return float("inf")  # nothing consumes partial values but through a reduction
    return _transition_cached(shape, a, b, tp, key, ranks_per_node)


@lru_cache(maxsize=4096)
def _transition_cached(shape: tuple[int, int], a: SbpParallel, b: SbpParallel, tp: int,
                       key: tuple[float, float, float, float], ranks_per_node: int) -> float:
    placement = Placement("cpu", list(range(tp)))
    model = _model_from_key(key, ranks_per_node)
    with target_factors(()):
        return transition_time(shape, torch.float16, Layout(placement, (a,)), Layout(placement, (b,)), model)


def _model_key(profile: DeviceProfile) -> tuple[float, float, float, float]:
    return (profile.intra_alpha, profile.intra_bandwidth * profile.eta_intra, profile.inter_alpha,
            profile.inter_bandwidth * profile.eta_inter)


def _model_from_key(key: tuple[float, float, float, float], ranks_per_node: int) -> CostModel:
    """The boxing model of the tensor-parallel group, priced as the profile's links (on ``cpu`` placements: the
    planner runs where no accelerator exists); a group wider than ``ranks_per_node`` pays the inter-node link."""
    links = ((("cpu", "intra"), LinkCost(key[0], 1 / key[1])), (("cpu", "inter"), LinkCost(key[2], 1 / key[3])))
    return CostModel(links=links, ranks_per_node=max(ranks_per_node, 1))


# ----------------------------------------------------------------------------- solving


def solve_block(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile,
                memory_limit: float | None = None, recompute: str = "none", budget: BlockBudget = BlockBudget(),
                ranks_per_node: int | None = None) -> BlockPlan:
    """The fastest SBP assignment of one block on ``tp`` ranks whose bytes per rank (as ``budget`` counts them)
    stay under ``memory_limit``.

    One-hot binaries pick each op's signature; each producer -> consumer edge has continuous variables
    ``e[a, b] >= x[producer, a] + x[consumer, b] - 1`` whose cost is the transition's, which is exact for
    one-hot choices and nonnegative costs. On one rank every choice costs the same: Megatron's names are kept.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    start = time.perf_counter()
    rpn = ranks_per_node or tp
    problem = _problem(spec, micro_batch, tp, profile, recompute, budget, rpn)
    if tp == 1:
        plan = _plan(problem, _picks(MEGATRON_CHOICES), time.perf_counter() - start, "one rank")
        if memory_limit is not None and plan.memory > memory_limit:
            raise _no_fit(problem, spec, micro_batch, 1, recompute, memory_limit)
        return plan
    offsets = np.cumsum([0] + [len(c) for c in problem.forward])
    n_choice = int(offsets[-1])
    cost = [problem.op_cost(op, k) for op in range(len(OPS)) for k in range(len(problem.forward[op]))]
    rows, lo, hi = [], [], []
    for op in range(len(OPS)):  # one signature per op
        rows.append({int(offsets[op]) + k: 1.0 for k in range(len(problem.forward[op]))})
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
        rows.append({int(offsets[op]) + k: problem.op_memory(op, k) for op in range(len(OPS))
                     for k in range(len(problem.forward[op]))})
        lo.append(-np.inf)
        hi.append(memory_limit)
    matrix = np.zeros((len(rows), len(cost)))
    for r, row in enumerate(rows):
        for col, value in row.items():
            matrix[r, col] = value
    integrality = np.zeros(len(cost))
    integrality[:n_choice] = 1
    result = milp(np.array(cost), integrality=integrality, bounds=Bounds(0, np.where(integrality > 0, 1, np.inf)),
                  constraints=LinearConstraint(matrix, np.array(lo), np.array(hi)), options={"mip_rel_gap": 1e-9})
    if result.x is None:
        raise _no_fit(problem, spec, micro_batch, tp, recompute, memory_limit)
    picks = tuple(int(np.argmax(result.x[offsets[op]:offsets[op + 1]])) for op in range(len(OPS)))
    return _plan(problem, picks, time.perf_counter() - start, "ilp")


def enumerate_block(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile,
                    memory_limit: float | None = None, recompute: str = "none", budget: BlockBudget = BlockBudget(),
                    ranks_per_node: int | None = None) -> BlockPlan:
    """The same optimum by trying every assignment (the check of :func:`solve_block`; thousands of them)."""
    start = time.perf_counter()
    problem = _problem(spec, micro_batch, tp, profile, recompute, budget, ranks_per_node or tp)
    best: tuple[float, tuple[int, ...]] | None = None
    for picks in itertools.product(*(range(len(row)) for row in problem.forward)):
        if memory_limit is not None and _memory(problem, picks) > memory_limit:
            continue
        total = _objective(problem, picks)
        if best is None or total < best[0]:
            best = (total, picks)
    if best is None or not np.isfinite(best[0]):
        raise _no_fit(problem, spec, micro_batch, tp, recompute, memory_limit)
    return _plan(problem, best[1], time.perf_counter() - start, "enumeration")


def _no_fit(problem: _Problem, spec: TransformerSpec, micro_batch: int, tp: int, recompute: str,
            memory_limit: float | None) -> PlanError:
    """The error of a block with no assignment under ``memory_limit``: what was asked, in words, and the least
    any assignment needs (each op at its smallest choice: a bound, as some pairs of choices do not connect)."""
    least = sum(min(problem.op_memory(op, k) for k in range(len(row))) for op, row in enumerate(problem.forward))
    limit = "no memory limit" if memory_limit is None else f"{memory_limit / 2**20:.2f} MiB per rank"
    return PlanError(f"no SBP assignment of a block of {spec.describe()} (micro-batch {micro_batch}, recompute "
                     f"{recompute}) on {tp} rank{'s' if tp > 1 else ''} fits in {limit}: the smallest needs at "
                     f"least {least / 2**20:.2f} MiB per rank (parameters and optimizer state of "
                     f"{problem.budget.blocks} block{'s' if problem.budget.blocks > 1 else ''}, and activations)")


def evaluate_block(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile,
                   choices: tuple[tuple[str, str], ...], recompute: str = "none",
                   budget: BlockBudget = BlockBudget(), ranks_per_node: int | None = None) -> BlockPlan:
    """What a given assignment (``BlockPlan.choices``, such as :data:`MEGATRON_CHOICES`) costs, by the same
    model the ILP minimises."""
    start = time.perf_counter()
    problem = _problem(spec, micro_batch, tp, profile, recompute, budget, ranks_per_node or tp)
    return _plan(problem, _picks(choices), time.perf_counter() - start, "given")


@lru_cache(maxsize=8192)
def _cached(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile, recompute: str,
            budget: BlockBudget, memory_limit: float | None, ranks_per_node: int) -> BlockPlan | None:
    try:
        return solve_block(spec, micro_batch, tp, profile, memory_limit, recompute, budget, ranks_per_node)
    except PlanError:
        return None


def cached_solve(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile,
                 memory_limit: float | None = None, recompute: str = "none", budget: BlockBudget = BlockBudget(),
                 ranks_per_node: int | None = None) -> BlockPlan | None:
    """:func:`solve_block`, cached across the plan search's candidates (None when nothing fits). The memory limit
    is rounded down to 1/512 of its power of two and the budget's prices to three significant digits, so plans
    whose limits differ by a few bytes share one solve, and a choice within the rounded limit fits the exact one.
    ``cached_solve.cache_info()`` counts hits and misses."""
    limit = None if memory_limit is None else _round_down(memory_limit)
    rounded = replace(budget, param_seconds=_significant(budget.param_seconds), copies=float(budget.copies))
    return _cached(spec, micro_batch, tp, profile, recompute, rounded, limit, ranks_per_node or tp)


cached_solve.cache_info = _cached.cache_info  # type: ignore[attr-defined]
cached_solve.cache_clear = _cached.cache_clear  # type: ignore[attr-defined]


def _round_down(value: float) -> float:
    """``value`` down to a multiple of 1/512 of its power of two (within 0.4%).

    >>> _round_down(1000.7), _round_down(3e9), _round_down(-5.0)
    (1000.0, 2998927360.0, -5.0)
    """
    if value <= 0:
        return value
    quantum = 2.0 ** (math.floor(math.log2(value)) - 9)
    return math.floor(value / quantum) * quantum


def _significant(value: float) -> float:
    return float(f"{value:.3g}")


def _picks(choices: tuple[tuple[str, str], ...]) -> tuple[int, ...]:
    picked = dict(choices)
    missing = [op[0] for op in OPS if op[0] not in picked]
    if missing:
        raise PlanError(f"a block's choices name every op of {[op[0] for op in OPS]}, but miss {missing}")
    return tuple(_choices(op).index(_pick(_choices(op), picked[OPS[op][0]])) for op in range(len(OPS)))


def _comm(problem: _Problem, picks: tuple[int, ...]) -> float:
    edges = sum(table[picks[u], picks[v]] for u, v, _, table in problem.edges)
    return float(edges) + sum(problem.weight_sync[op][k] for op, k in enumerate(picks))


def _objective(problem: _Problem, picks: tuple[int, ...]) -> float:
    edges = sum(table[picks[u], picks[v]] for u, v, _, table in problem.edges)
    return float(edges) + sum(problem.op_cost(op, k) for op, k in enumerate(picks))


def _memory(problem: _Problem, picks: tuple[int, ...]) -> float:
    return sum(problem.op_memory(op, k) for op, k in enumerate(picks))


def _plan(problem: _Problem, picks: tuple[int, ...], solve_s: float, method: str) -> BlockPlan:
    param_cost = problem.budget.param_seconds * sum(problem.params[op][k] for op, k in enumerate(picks))
    choices = tuple((OPS[op][0], _choices(op)[k].name) for op, k in enumerate(picks))

    def total(table: tuple[tuple[float, ...], ...]) -> float:
        return float(sum(table[op][k] for op, k in enumerate(picks)))

    attention = next(i for i, op in enumerate(OPS) if op[1] == "attention")
    return BlockPlan(choices, _objective(problem, picks) - param_cost, _comm(problem, picks), _memory(problem, picks),
                     solve_s, method, forward_s=total(problem.forward),
                     attention_s=problem.forward[attention][picks[attention]], weight_sync_s=total(problem.weight_sync),
                     params=total(problem.params), kept=total(problem.kept), working=total(problem.working),
                     recompute=problem.recompute)


def megatron(plan: BlockPlan) -> bool:
    """Whether ``plan`` is Megatron-LM's tensor parallelism (column, heads, row; column, S(1), row)."""
    wanted = {"qkv": "column", "attention": "S(1)", "proj": "row", "fc1": "column", "gelu": "S(1)", "fc2": "row"}
    return all(dict(plan.choices)[op] == c for op, c in wanted.items())


# ----------------------------------------------------------------------------- the collectives a choice issues


def block_collectives(choices: tuple[tuple[str, str], ...] | None, tp: int,
                      spec: TransformerSpec | None = None) -> list[tuple[str, float]]:
    """(kind, width in units of h) of the collectives one block issues per micro-batch, forward and backward,
    for the SBP selection's ``choices`` (``block_sbp.BlockPlan.choices``; None: Megatron's), at ``spec``'s widths
    (None: a GPT's).

    Each edge of the block whose producer's SBP differs from what its consumer takes is one transition forward
    and its dual backward (all-gather <-> reduce-scatter; an all-reduce's dual is the all-reduce of the
    column-parallel input's partial gradient, Megatron's f/g pair).
    """
    if tp == 1:
        return []
    if choices is None:
        choices = MEGATRON_CHOICES
    picked = dict(choices)
    widths = [w for w, _, _ in op_shapes(spec)] if spec is not None else [float(op[3]) for op in OPS]
    out: list[tuple[str, float]] = []
    edges = [(p, c, pos) for c, op in enumerate(OPS) for pos, p in enumerate(op[2])] + [(*CLOSING_EDGE, -1)]
    for producer, consumer, position in edges:
        src = _pick(_choices(producer), picked[OPS[producer][0]]).out
        chosen = _pick(_choices(consumer), picked[OPS[consumer][0]])
        dst = chosen.out if position < 0 else chosen.ins[position]
        for kind in _transition_kinds(src, dst):
            out.append((kind, widths[producer]))
            out.append((_DUAL.get(kind, kind), widths[producer]))
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
    if src == dst or isinstance(dst, Partial):
        return []
    if isinstance(src, Partial):
        return ["all_reduce"] if isinstance(dst, Broadcast) else ["reduce_scatter"]
    if isinstance(src, Split):
        return ["all_gather"] if isinstance(dst, Broadcast) else ["all_to_all"]
    return []  # B -> S: each rank slices its part
