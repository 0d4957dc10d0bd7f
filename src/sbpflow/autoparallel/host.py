"""Eager training steps on host processes that share CPU cores (the 4-gloo-process validation).

On an accelerator a step is bounded by kernels and links (``predict.py``); eager training on CPU processes by
per-op dispatch, cores shared between processes and the waits that sharing causes. This model prices those from
the plan's metadata and a calibrated :class:`HostProfile` (``calibrate_host.py``)::

    step  = Σ_stages (f(k_s) · cpu_s + blocking_s · sync) + Σ_collectives (a_g + b_g · n)
    cpu_s = dispatch_own · d + dispatch_foreign · d' + FLOPs / R_gemm + bytes / R_mem

``f(k)`` stretches CPU seconds when ``k`` processes share fewer cores; ``sync`` is what a blocking collective
waits for the process the sharing left behind; eager stages run one after another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import PlanError, SbpflowError
from .block_sbp import block_collectives
from .predict import ParallelPlan
from .stages import all_cuts
from .transformer import TransformerSpec

FP32 = 4
FIRST_BUCKET_BYTES = 1 << 20  # autograd.FIRST_BUCKET_MB
BUCKET_BYTES = 25 << 20  # autograd.DEFAULT_BUCKET_MB

# Ops sbpflow's GPT dispatches per training step (forward, backward kernels, loss; counted by
# tests/sim/test_host_model.py on a real step): each block, and the rest (embeddings, final LayerNorm, tied
# head, cross-entropy). Counted on one rank, where each linear's gradient is one op (linear_backward) and
# attention's head reshapes are fused (reshape_permute, permute_reshape).
DISPATCH_PER_BLOCK = 34
DISPATCH_FIXED = 31  # 34 until elementwise backward stopped computing gradients that no input needs
ADAMW_BYTES_PER_PARAM = FP32 * 7  # read p, g, m, v; write p, m, v (fp32 foreach kernels)


@dataclass(frozen=True)
class HostProfile:
    """What one host gives a job of ``processes`` processes, measured by ``calibrate_host``.

    ``cores_factor``: (active processes, wall seconds per CPU second of each). ``collectives``: (group size,
    a seconds, b seconds per byte) of one all-reduce of an n-byte tensor, ``a + b·n``; gloo builds
    reduce-scatter from an all-reduce and an all-gather costs about one. ``p2p``: (a, b) of one send/receive.
    """

    processes: int
    cores_factor: tuple[tuple[int, float], ...]
    dispatch_s: float
    foreign_dispatch_s: float
    gemm_flops: float
    elementwise_bw: float
    collectives: tuple[tuple[int, float, float], ...]
    p2p: tuple[float, float]
    collective_cpu: tuple[tuple[int, float, float], ...] = ()  # (group, a, b): the caller's CPU in a collective
    kernels: tuple[tuple[tuple[int, ...], float], ...] = ()  # (BlockShape or HeadShape key, CPU s fwd + bwd)
    optimizer_s_per_param: float = 0.0  # AdamW's step; 0: its bytes at elementwise_bw
    sync_s: float = 0.0  # a blocking collective's wait for the process the sharing left behind
    source: str = "calibrate_host"

    def __post_init__(self) -> None:
        for name in ("dispatch_s", "foreign_dispatch_s", "gemm_flops", "elementwise_bw"):
            if not getattr(self, name) > 0:
                raise SbpflowError(f"HostProfile.{name} must be positive, but got {getattr(self, name)!r}")
        active = sorted(k for k, _ in self.cores_factor)
        if not active or active[0] < 1 or active[-1] < self.processes:
            raise SbpflowError(f"HostProfile.cores_factor needs factors for 1..{self.processes} active processes, "
                               f"but got them for {active}")

    def factor(self, active: int) -> float:
        """Wall seconds per CPU second when ``active`` processes run at once (the nearest measured count at or
        above ``active``)."""
        table = dict(self.cores_factor)
        return table[min(k for k in table if k >= active)]

    def kernel_seconds(self, shape: tuple[int, ...], flops: float, nbytes: float) -> float:
        """CPU seconds of the torch kernels of a block or head of ``shape``, forward and backward: measured at
        that shape when the profile has it, else GEMM FLOPs and elementwise bytes at the profile's rates."""
        table = dict(self.kernels)
        if shape in table:
            return table[shape]
        return flops / self.gemm_flops + nbytes / self.elementwise_bw

    def collective(self, kind: str, group: int, nbytes: float, cpu: bool = False) -> float:
        """Wall seconds of one collective on ``group`` ranks of a logical ``nbytes`` tensor (``cpu``: the CPU
        seconds the calling thread spends in it; none for a send, whose copies are small)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        if kind == "send_recv":
            a, b = (0.0, 0.0) if cpu else self.p2p
            return a + b * nbytes
        table = {g: (a, b) for g, a, b in (self.collective_cpu if cpu else self.collectives)}
        if cpu and not table:
            return 0.0
        if group not in table:
            raise SbpflowError(f"the host profile has all-reduce costs for groups of {sorted(table)}, not {group}")
        a, b = table[group]
        return a + b * nbytes


@dataclass(frozen=True)
class Comm:
    """``count`` collectives of one kind on groups of ``group`` ranks, each of a logical ``nbytes`` tensor."""

    kind: str
    group: int
    nbytes: float
    count: int
    part: str  # tp_comm, dp_comm, pp_comm, loss_comm


@dataclass(frozen=True)
class BlockShape:
    """One rank's share of a block: tokens, hidden, local heads of ``head_dim``, local MLP width."""

    tokens: int
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    seq: int

    @property
    def key(self) -> tuple[int, ...]:
        return (0, self.tokens, self.hidden, self.heads, self.head_dim, self.ffn, self.seq)

    @property
    def flops(self) -> float:
        """GEMM FLOPs forward and backward (twice forward): q, k, v, projection, MLP, scores and context."""
        n, h = self.tokens, self.hidden
        width = self.heads * self.head_dim
        forward = 2 * n * h * (4 * width + 2 * self.ffn) + 4 * n * self.seq * width
        return 3.0 * forward

    @property
    def nbytes(self) -> float:
        """Elementwise bytes forward and backward (twice forward), fp32: LayerNorms and residual adds on the
        whole width, GeLU on the local MLP width, softmax on the local scores."""
        n, h = self.tokens, self.hidden
        forward = FP32 * (2 * 2 * n * h + 2 * 3 * n * h + 2 * n * self.ffn
                          + 3 * (n // self.seq) * self.heads * self.seq * self.seq)
        return 3.0 * forward


@dataclass(frozen=True)
class HeadShape:
    """The last stage's output layer on one rank: tokens, hidden, local vocabulary."""

    tokens: int
    hidden: int
    vocab: int

    @property
    def key(self) -> tuple[int, ...]:
        return (1, self.tokens, self.hidden, self.vocab)

    @property
    def flops(self) -> float:
        return 3 * 2.0 * self.tokens * self.hidden * self.vocab

    @property
    def nbytes(self) -> float:
        return 3 * 3.0 * FP32 * self.tokens * self.vocab


@dataclass(frozen=True)
class StageWork:
    """One rank of a stage: its ops, FLOPs and bytes per step, and the collectives it takes part in."""

    dispatch_own: int
    dispatch_foreign: int
    layers: int
    block: BlockShape
    head: HeadShape | None  # on the last stage
    optimizer_bytes: float
    comms: tuple[Comm, ...]

    @property
    def collective_count(self) -> int:
        return sum(c.count for c in self.comms)


@dataclass(frozen=True)
class HostPrediction:
    plan: ParallelPlan
    stage_layers: tuple[int, ...]
    step_time: float
    breakdown: dict[str, float]  # seconds, summing to step_time
    cpu_per_rank: tuple[float, ...]  # CPU seconds of one rank of each stage, its collectives' included
    collectives: int  # on the busiest rank
    stages: tuple[StageWork, ...] = field(repr=False, default=())


# ----------------------------------------------------------------------------- one stage's work


def stage_work(spec: TransformerSpec, plan: ParallelPlan, stage_layers: tuple[int, ...], stage: int, batch: int,
               choices: tuple[tuple[str, str], ...] | None = None) -> StageWork:
    """The work of one rank of ``stage`` in an eager step of ``batch`` sequences (one micro-batch)."""
    tp, dp, pp = plan.tp, plan.dp, plan.pp
    if len(stage_layers) != pp or sum(stage_layers) != spec.layers or min(stage_layers) < 1:
        raise PlanError(f"stage cuts must give each of the {pp} stages at least one of the {spec.layers} blocks, "
                        f"but got {stage_layers}")
    if batch % dp:
        raise PlanError(f"the batch ({batch}) must split into dp={dp} replicas")
    layers = stage_layers[stage]
    first, last = stage == 0, stage == pp - 1
    b, s, h, v, a = batch // dp, spec.seq, spec.hidden, spec.vocab, spec.heads
    tokens = b * s
    own = layers * DISPATCH_PER_BLOCK + (DISPATCH_FIXED if first and last else
                                         _fixed_share(first, last))
    foreign = DISPATCH_PER_BLOCK * spec.layers + DISPATCH_FIXED - own
    block = BlockShape(tokens, h, a // tp, h // a, 4 * h // tp, s)
    head = HeadShape(tokens, h, v // tp) if last else None
    params = _stage_params(spec, plan, stage, layers)
    comms = _stage_comms(spec, plan, stage, layers, batch, choices)
    return StageWork(own, foreign, layers, block, head, params * ADAMW_BYTES_PER_PARAM, tuple(comms))


def _fixed_share(first: bool, last: bool) -> int:
    """The fixed dispatches split between the first stage (embeddings: 8) and the last (the rest)."""
    embedding = 8
    return embedding if first else (DISPATCH_FIXED - embedding if last else 0)


def _stage_params(spec: TransformerSpec, plan: ParallelPlan, stage: int, layers: int) -> float:
    """Parameters one rank of ``stage`` updates (the tied embedding on both ends when pp > 1)."""
    h, tp = spec.hidden, plan.tp
    params = layers * spec.layer_params / tp
    if stage == 0:
        params += spec.vocab * h / tp + spec.seq * h
    if stage == plan.pp - 1:
        params += 2 * h + (spec.vocab * h / tp if plan.pp > 1 else 0)
    return params


def _stage_comms(spec: TransformerSpec, plan: ParallelPlan, stage: int, layers: int, batch: int,
                 choices: tuple[tuple[str, str], ...] | None) -> list[Comm]:
    tp, dp, pp = plan.tp, plan.dp, plan.pp
    first, last = stage == 0, stage == pp - 1
    h, tokens = spec.hidden, batch // dp * spec.seq
    comms: list[Comm] = []
    per_block: dict[tuple[str, float], int] = {}
    for kind, width in block_collectives(choices, tp, spec):
        per_block[(kind, width)] = per_block.get((kind, width), 0) + 1
    for (kind, width), n in per_block.items():
        comms.append(Comm(kind, tp, FP32 * tokens * width * h, n * layers, "tp_comm"))
    if tp > 1 and first:  # vocab-parallel embedding: its partial output all-reduced
        comms.append(Comm("all_reduce", tp, FP32 * tokens * h, 1, "tp_comm"))
    if tp > 1 and last:  # the head's input gradient; the loss's max and sum (forward), its gradient's sum
        comms.append(Comm("all_reduce", tp, FP32 * tokens * h, 1, "tp_comm"))
        comms.append(Comm("all_reduce", tp, FP32 * tokens, 3, "loss_comm"))
    if dp > 1 and last:  # the loss's token count over replicas
        comms.append(Comm("all_reduce", dp, 2 * FP32, 1, "loss_comm"))
    if last:  # reading the loss's value: its partial sums over each mesh axis
        comms += [Comm("all_reduce", g, FP32, 1, "loss_comm") for g in (dp, tp) if g > 1]
    if pp > 1:  # ... and from the last stage to every process
        comms.append(Comm("send_recv", 2, FP32, 1, "pp_comm"))
    comms += _dp_sync(spec, plan, stage, layers)
    if pp > 1:
        act = FP32 * tokens * h / tp
        sends = (not first) + (not last)  # activations in and out, forward; their gradients, backward
        comms.append(Comm("send_recv", 2, act, 2 * sends, "pp_comm"))
        if first or last:  # the tied embedding to the head and its gradient back
            comms.append(Comm("send_recv", 2, FP32 * spec.vocab * h / tp, 2, "pp_comm"))
    return comms


def _dp_sync(spec: TransformerSpec, plan: ParallelPlan, stage: int, layers: int) -> list[Comm]:
    """Gradient all-reduces over replicas: every leaf's per-rank shard, whole or split on the tensor axis, goes
    in flat buckets (the first closes past 1 MiB, the others past 25 MiB)."""
    tp, dp, pp = plan.tp, plan.dp, plan.pp
    if dp == 1:
        return []
    h = spec.hidden
    first, last = stage == 0, stage == pp - 1
    whole: float = layers * (4 * h + 2 * h)  # LayerNorms, c_proj biases
    split = layers * (spec.layer_params - 6 * h) / tp  # a rank's shards of the tensor-split weights
    if first:
        whole += spec.seq * h
        split += spec.vocab * h / tp
    if last:
        whole += 2 * h
    comms = []
    if whole + split:
        buckets = _buckets(FP32 * (whole + split))
        comms.append(Comm("all_reduce", dp, FP32 * (whole + split) / buckets, buckets, "dp_comm"))
    if pp > 1 and first:  # the head's share of the tied embedding's gradient, once it came back
        comms.append(Comm("all_reduce", dp, FP32 * spec.vocab * h / tp, 1, "dp_comm"))
    return comms


def _buckets(nbytes: float) -> int:
    """Flat buckets of ``nbytes`` of gradients.

    >>> _buckets(1000), _buckets(2 << 20), _buckets(30 << 20)
    (1, 2, 3)
    """
    if nbytes <= FIRST_BUCKET_BYTES:
        return 1
    return 1 + math.ceil((nbytes - FIRST_BUCKET_BYTES) / BUCKET_BYTES)


# ----------------------------------------------------------------------------- the step


def cpu_seconds(work: StageWork, host: HostProfile) -> float:
    """CPU seconds of one rank outside collectives: dispatch floors, torch kernels and AdamW."""
    return (work.dispatch_own * host.dispatch_s + work.dispatch_foreign * host.foreign_dispatch_s
            + kernel_seconds(work, host))


def collective_cpu_seconds(work: StageWork, host: HostProfile) -> float:
    """CPU seconds the rank's thread spends inside its collectives (copies, reductions, sbpflow's boxing)."""
    return sum(c.count * host.collective(c.kind, c.group, c.nbytes, cpu=True) for c in work.comms)


def kernel_seconds(work: StageWork, host: HostProfile) -> float:
    """The torch kernels of one rank's blocks, head and AdamW step."""
    blocks = work.layers * host.kernel_seconds(work.block.key, work.block.flops, work.block.nbytes)
    head = 0.0 if work.head is None else host.kernel_seconds(work.head.key, work.head.flops, work.head.nbytes)
    if host.optimizer_s_per_param > 0:
        optimizer = work.optimizer_bytes / ADAMW_BYTES_PER_PARAM * host.optimizer_s_per_param
    else:
        optimizer = work.optimizer_bytes / host.elementwise_bw
    return blocks + head + optimizer


def blocking(work: StageWork) -> float:
    """Collectives that stop a rank between stretches of compute: tensor-parallel and the loss's, and the
    receiving side of each transfer between stages (half the stage's sends and receives; a transfer is
    counted on both of its stages). Gradient buckets overlap backward."""
    tp_and_loss = sum(c.count for c in work.comms if c.part in ("tp_comm", "loss_comm"))
    return tp_and_loss + sum(c.count for c in work.comms if c.part == "pp_comm") / 2


def comm_seconds(work: StageWork, host: HostProfile) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in work.comms:
        out[c.part] = out.get(c.part, 0.0) + c.count * host.collective(c.kind, c.group, c.nbytes)
    return out


def predict_host(spec: TransformerSpec, plan: ParallelPlan, stage_layers: tuple[int, ...], batch: int,
                 host: HostProfile, choices: tuple[tuple[str, str], ...] | None = None) -> HostPrediction:
    """The eager step of ``plan`` on ``host``: stages one after another, each stretched by the processes it
    runs at once; collectives added on the critical path (each stage's own, and the sends between them)."""
    if plan.tp * plan.pp * plan.dp != host.processes:
        raise PlanError(f"tp · pp · dp must equal the host's {host.processes} processes, but {plan} has "
                        f"{plan.tp * plan.pp * plan.dp}")
    works = tuple(stage_work(spec, plan, stage_layers, s, batch, choices) for s in range(plan.pp))
    cpus = tuple(cpu_seconds(w, host) for w in works)
    active = plan.tp * plan.dp if plan.pp > 1 else host.processes
    breakdown = {"dispatch": 0.0, "compute": 0.0, "sharing": 0.0, "sync": 0.0, "tp_comm": 0.0, "dp_comm": 0.0,
                 "pp_comm": 0.0, "loss_comm": 0.0}
    for w, cpu in zip(works, cpus, strict=True):
        dispatch = w.dispatch_own * host.dispatch_s
        if plan.pp == 1:  # one stage: foreign ops are none
            dispatch += w.dispatch_foreign * host.foreign_dispatch_s
        breakdown["dispatch"] += dispatch
        own_cpu = cpu - (0.0 if plan.pp == 1 else w.dispatch_foreign * host.foreign_dispatch_s)
        factor = host.factor(active)
        breakdown["compute"] += own_cpu - dispatch
        breakdown["sharing"] += (factor - 1) * own_cpu
        breakdown["sync"] += blocking(w) * host.sync_s
        for part, seconds in comm_seconds(w, host).items():
            if part == "pp_comm":
                seconds /= 2  # a send and its receive are one transfer on the critical path
            breakdown[part] += seconds
    cpu_per_rank = tuple(c + collective_cpu_seconds(w, host) for w, c in zip(works, cpus, strict=True))
    return HostPrediction(plan, tuple(stage_layers), sum(breakdown.values()), breakdown, cpu_per_rank,
                          max(w.collective_count for w in works), works)


# ----------------------------------------------------------------------------- the search on a host


def host_plans(spec: TransformerSpec, processes: int, batch: int) -> list[tuple[ParallelPlan, tuple[int, ...]]]:
    """Every plan sbpflow's eager GPT can run on ``processes`` processes: tp dividing heads and vocabulary,
    dp dividing the batch, and every stage cut (one micro-batch: ZeRO 0, no recompute)."""
    out = []
    for tp in range(1, processes + 1):
        if processes % tp or spec.heads % tp or spec.vocab % tp:
            continue
        for pp in range(1, processes // tp + 1):
            dp = processes // (tp * pp)
            if tp * pp * dp != processes or pp > spec.layers or batch % dp:
                continue
            for cuts in all_cuts(spec.layers, pp):
                out.append((ParallelPlan(tp, pp, dp, batch // dp, 0, "none"), cuts))
    return out


def plan_shapes(spec: TransformerSpec, plans: list[tuple[ParallelPlan, tuple[int, ...]]],
                batch: int) -> list[BlockShape | HeadShape]:
    """The block and head shapes these plans give their ranks (what ``calibrate_host`` times)."""
    shapes: list[BlockShape | HeadShape] = []
    for plan, cuts in plans:
        last = stage_work(spec, plan, cuts, plan.pp - 1, batch)
        shapes.append(last.block)
        if last.head is not None:
            shapes.append(last.head)
    return list(dict.fromkeys(shapes))


def host_search(spec: TransformerSpec, host: HostProfile | Sequence[HostProfile], batch: int) -> list[HostPrediction]:
    """Every host plan, fastest first. Given several calibrations of a host whose load changes (other jobs), a
    plan's prediction is its median one over them (the middle one; the upper middle for an even count)."""
    hosts = [host] if isinstance(host, HostProfile) else list(host)
    if not hosts or any(h.processes != hosts[0].processes for h in hosts):
        raise PlanError(f"host_search needs one or more profiles of one process count, but got "
                        f"{[h.processes for h in hosts]}")
    ranked = []
    # choices=None: Megatron's block layout, the one sbpflow.parallelize applies (auto_parallel_host), so the
    # ranking prices the layout that runs; the block ILP's other choices have no parallelize style.
    for plan, cuts in host_plans(spec, hosts[0].processes, batch):
        predictions = sorted((predict_host(spec, plan, cuts, batch, h) for h in hosts), key=lambda p: p.step_time)
        ranked.append(predictions[len(predictions) // 2])
    return sorted(ranked, key=lambda p: p.step_time)
