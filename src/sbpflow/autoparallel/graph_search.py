"""The plan search on a traced graph: mesh (tp × pp × dp × cp, ep in dp), cuts, micro-batches, schedule, ZeRO, recompute

The cost model is the sizes planner's (``predict``), applied per segment of the graph (``graph_model``):

* a segment's forward is the sum of its ops' roofline times on their per-rank shares, stretched when more
  devices compute at once than the cores they share (``DeviceProfile.stretch``: a CPU host's processes), and
  each blocking collective or stage hand-off waits for peers those cores are not running
  (``DeviceProfile.sync_wait``);
  forward + backward is three forwards; recompute reruns the segment's forward ("full") or the ops that make
  its wide values ("selective"); its tensor-parallel all-reduces are priced by α-β (again forward under "full");
  each repeated block (``GraphModel.block_starts``) takes its own recompute choice (``Knobs.block_recompute``);
* ZeRO-2/3 traffic per micro-batch and the gradient sync and optimizer step at the end are ``predict``'s
  functions of the parameters a stage holds;
* a stage's time is the sum of its segments plus its sends (the one activation crossing each cut);
  1F1B takes ``m · max t_i + (Σ t_i - max t_i) / v``; zero-bubble (ZB-H1, Qi et al. ICLR'24) fills two thirds
  of the bubble with weight-gradient work, so it pays a third of 1F1B's;
* memory per rank: model state under ZeRO (``cost.model_state_bytes``), plus the activations kept by the
  micro-batches in flight (1F1B: ``min(p - i, m)`` on stage ``i``), plus the working set of the largest
  block under full recompute (which keeps only its input, as a module's activation checkpointing does) or of
  ZeRO-3's gathered weights; under a memory cap, a plan that keeps every activation and does not fit is tried
  again with its first blocks fully recomputed, as few as fit (:func:`_mixed_recompute`); for a plan of the
  traced step itself, also its inputs, backward's working set and ZeRO-1/2's update phase (``_transient``,
  ``_update_phase``), so the prediction bounds the compiled step's peak;
* context parallel (``cp``, for steps whose attention is ``scaled_dot_product_attention``): a rank computes and
  keeps a cp-th of each sample's tokens (zigzag: equal causal work) and pays the ring's K/V hops, unoverlapped;
* expert parallel (``ep``, for steps with routed experts, ``graph_model.Experts``): the experts are cut into ep
  groups over the data axis, so a rank holds ``1/ep`` of their parameters, gradients and optimizer state (ZeRO
  shards those over the group's ``dp/ep`` data ranks); as
  ``sbpflow.parallelize(expert=)`` runs them, with ``ep == dp`` (stacked experts) a rank computes its experts on
  the rows routed to them only (``k/E`` of its share of the dense experts' work and activations), with fewer
  groups on every token of its group's data ranks (``dp/ep`` times that share); each token's k routed rows go to
  their experts and back, forward and backward, priced as all-to-alls over the ep group (``ep_comm``).

Stage cuts: for a given slowest-stage time, a greedy pass packs segments into stages in order under the time
and each stage's memory limit; a bisection finds the smallest time the greedy pass meets. Candidates are
costed in the order of a lower bound until the bound exceeds the ``keep``-th best (branch and bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from ..errors import PlanError
from .cost import model_state_bytes
from .graph_model import GraphModel, segment_times
from .predict import (
    Cluster,
    ParallelPlan,
    _coll,
    _grad_sync,
    _optimizer,
    _p2p_time,
    _zero_per_micro_batch,
    in_flight,
    pipeline_breakdown,
)
from .transformer import RECOMPUTE

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")  # nn.Graph's pipeline schedule names
VIRTUAL = (2, 3, 4, 6, 8)  # model chunks per stage tried for interleaved 1F1B
ZERO_BUBBLE_SHARE = 1 / 3  # of 1F1B's bubble that zero-bubble (ZB-H1) leaves
WORKING_OPS = 3.0  # backward's working set, in the largest op's bytes (its inputs and outputs): see _transient
# blocking collectives over the data-parallel group by ZeRO stage: (per module and micro-batch, at the step's
# end), as ``predict``'s _zero_per_micro_batch and _grad_sync issue them
ZERO_COLLECTIVES = {0: (0, 1), 1: (0, 2), 2: (1, 1), 3: (3, 0)}


@dataclass(frozen=True)
class Knobs:
    """One plan's choices: ``tp · pp · dp`` devices, micro-batches of ``micro_batch`` samples per replica."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    zero: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual: int = 1  # chunks per stage (interleaved 1F1B)
    cp: int = 1  # context parallel: each sequence split zigzag over cp ranks (attention as a ring)
    ep: int = 1  # expert parallel: routed experts cut into ep groups over the data axis
    block_recompute: tuple[str, ...] = ()  # per repeated block, in order, its recompute; () all ``recompute``

    def __str__(self) -> str:
        sched = "" if self.pp == 1 else f" {self.schedule}" + (f" x{self.virtual}" if self.virtual > 1 else "")
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        cp += f" ep{self.ep}" if self.ep > 1 else ""
        return (f"tp{self.tp} pp{self.pp} dp{self.dp}{cp} micro-batch {self.micro_batch} zero{self.zero} "
                f"recompute={self._recompute()}{sched}")

    def _recompute(self) -> str:
        """``full``, or per block in runs: ``full x2 + none x6``."""
        if not self.block_recompute:
            return self.recompute
        runs: list[list[Any]] = []
        for mode in self.block_recompute:
            if runs and runs[-1][0] == mode:
                runs[-1][1] += 1
            else:
                runs.append([mode, 1])
        return " + ".join(f"{mode} x{n}" for mode, n in runs)

    def parallel_plan(self) -> ParallelPlan:
        """The sizes planner's description of the same plan (its helpers price dp groups and sends from it): the
        gradients are reduced over the data and context ranks alike."""
        return ParallelPlan(self.tp, self.pp, self.dp * self.cp, self.micro_batch, self.zero, self.recompute,
                            virtual=self.virtual)


@dataclass(frozen=True)
class GraphPrediction:
    """A plan's predicted step (seconds by component) and memory (bytes on the fullest device by component)."""

    knobs: Knobs
    batch: int
    cuts: tuple[int, ...]  # segment index where each stage (chunk) starts
    step_time: float
    breakdown: dict[str, float]
    memory: dict[str, float]
    usable_memory: float
    tflops_per_device: float  # hardware: FLOPs executed, recompute included
    model_tflops_per_device: float  # forward and backward alone

    @property
    def memory_per_device(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_per_device <= self.usable_memory


@dataclass
class GraphSearch:
    """The best plan, the runners-up, the fastest plans that did not fit, and the effort."""

    best: GraphPrediction
    runners_up: list[GraphPrediction]
    too_big: list[GraphPrediction]
    candidates: int
    costed: int
    seconds: float


@dataclass
class _Costs:
    """Per segment, for one plan, per micro-batch: seconds and bytes (see the module docstring)."""

    time: np.ndarray  # compute + recompute + tp + zero traffic
    parts: dict[str, np.ndarray]  # the same by component
    params: np.ndarray  # parameters one rank holds
    kept: np.ndarray  # activation bytes kept per micro-batch in flight
    working: float  # bytes of the largest rebuilt segment or gathered weights
    send: np.ndarray  # seconds to send the activation crossing each segment's end
    op_bytes: np.ndarray  # bytes of the largest op's inputs and outputs, per rank and micro-batch
    inputs: float  # bytes of the step's inputs a rank holds for the whole step


class _Context:
    """The model's per-segment arrays, and its per-op times cached by (micro-batch, tp)."""

    def __init__(self, model: GraphModel, cluster: Cluster, batch: int) -> None:
        self.model, self.cluster, self.batch = model, cluster, batch
        self.times: dict[tuple[float, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        segs = model.segments
        self.comm_bytes = np.array([sum(b for b, _ in s.tp_comm) for s in segs])
        self.comm_count = np.array([float(len(s.tp_comm)) for s in segs])
        self.comm_fwd_bytes = np.array([sum(b for b, fwd in s.tp_comm if fwd) for s in segs])
        self.comm_fwd_count = np.array([float(sum(fwd for _, fwd in s.tp_comm)) for s in segs])
        self.whole_params = np.array([float(sum(n for n, split in s.params.values() if not split)) for s in segs])
        self.split_params = np.array([float(sum(n for n, split in s.params.values() if split)) for s in segs])
        self.kept = np.array([s.kept for s in segs])
        self.wide = np.array([s.wide for s in segs])
        self.out_bytes = np.array([s.out_bytes for s in segs])
        self._experts(model)
        kv = model.kv_bytes if model.kv_bytes is not None else np.zeros(len(model.flops))
        self.kv_bytes = np.array([float(kv[s.lo:s.hi].sum()) for s in segs])
        self.kv_count = np.array([float((kv[s.lo:s.hi] > 0).sum()) for s in segs])
        starts = model.block_starts()
        self.block_of = np.full(len(segs), -1)  # per segment: the repeated block it belongs to, -1 outside them
        for b, (lo, hi) in enumerate(zip(starts, [*starts[1:], len(segs)][:len(starts)], strict=True)):
            self.block_of[lo:hi] = np.where(model.block[lo:hi], b, -1)
        self.block_first = np.array([b >= 0 and (i == 0 or self.block_of[i - 1] != b)
                                     for i, b in enumerate(self.block_of)])
        # ZeRO gathers and scatters per module holding a block (FSDP's unit): the first segment of each pays α
        parents = [s.first_module.rpartition(".")[0] for s in segs]
        self.unit_start = np.array([float(i == 0 or parents[i] != parents[i - 1]) for i in range(len(segs))])

    def _experts(self, model: GraphModel) -> None:
        """Per segment: the experts' parameters (whole, split by tp), the bytes their ops keep, and the rows routed."""
        n, experts = len(model.segments), model.experts
        self.expert_whole, self.expert_split, self.expert_kept = np.zeros(n), np.zeros(n), np.zeros((n, 2))
        self.routed = np.zeros(n)
        if experts is None:
            return
        for i, s in enumerate(model.segments):
            self.expert_whole[i] = sum(e for v, (e, split) in s.params.items() if v in experts.params and not split)
            self.expert_split[i] = sum(e for v, (e, split) in s.params.items() if v in experts.params and split)
            self.routed[i] = float(experts.routed_bytes[s.lo:s.hi].sum())
        self.expert_kept = experts.kept

    def expert_times(self, micro_batch: int, tp: int) -> np.ndarray:
        """Per segment, the forward seconds of its expert ops alone."""
        key = (-float(micro_batch), tp)  # (negative: apart from segment_times' keys)
        if key not in self.times:
            only = self.model.experts.op if self.model.experts is not None else np.zeros(len(self.model.flops), bool)
            self.times[key] = segment_times(self.model, micro_batch, tp, self.cluster.profile, only=only)
        return self.times[key][0]

    def segment_times(self, micro_batch: int, tp: int, cp: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-rank forward times; under context parallelism a rank holds ``1/cp`` of each sample's tokens
        (zigzag: the same causal attention work on every rank)."""
        key = (micro_batch / cp, tp)
        if key not in self.times:
            self.times[key] = segment_times(self.model, micro_batch / cp, tp, self.cluster.profile)
        return self.times[key]


def _affine(f: Callable[[float], float]) -> tuple[float, float]:
    """(a, b) with ``f(x) = a + b·x`` for x > 0: an α-β time of x bytes (0 bytes cost nothing)."""
    one, two = f(1.0), f(2.0)
    return one - (two - one), two - one


def _priced(f: Callable[[float], float], volumes: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """``f`` of each volume, summed over ``counts`` transfers sharing it (vectorised through :func:`_affine`)."""
    a, b = _affine(f)
    counts = (volumes > 0).astype(float) if counts is None else counts
    return counts * a + b * volumes


def _costs(ctx: _Context, k: Knobs) -> _Costs:
    model, cluster, plan = ctx.model, ctx.cluster, k.parallel_plan()
    forward, wide, _ = ctx.segment_times(k.micro_batch, k.tp, k.cp)
    active = _active(ctx, k)
    stretch, wait = cluster.profile.stretch(active), cluster.profile.sync_wait(active)
    forward, wide = forward * stretch, wide * stretch
    scale = k.micro_batch / model.batch / k.cp  # a rank's share of a micro-batch's activations
    spans = _expert_span(ctx, k) - 1.0  # expert work beyond (or, routed rows only, below) a rank's dense share
    if spans:
        forward = forward + spans * ctx.expert_times(k.micro_batch, k.tp) * stretch
    mode = _modes(ctx, k)
    full, selective = mode == RECOMPUTE.index("full"), mode == RECOMPUTE.index("selective")
    rerun = np.where(full, forward, np.where(selective, wide, 0.0))
    group = tuple(range(k.tp))
    all_reduce = partial(_coll, "all_reduce", group, cluster=cluster)
    tp = _priced(all_reduce, ctx.comm_bytes * scale, ctx.comm_count) + wait * ctx.comm_count * (k.tp > 1)
    if full.any():  # the forward all-reduces again
        tp += full * (_priced(all_reduce, ctx.comm_fwd_bytes * scale, ctx.comm_fwd_count)
                      + wait * ctx.comm_fwd_count * (k.tp > 1))
    params = ctx.whole_params + ctx.split_params / k.tp
    params -= (ctx.expert_whole + ctx.expert_split / k.tp) * (1 - 1 / k.ep)
    zero = _priced(partial(_zero_per_micro_batch, cluster, plan), params, ctx.unit_start)
    zero += wait * ZERO_COLLECTIVES[k.zero][0] * ctx.unit_start * (k.dp > 1)
    whole = (ctx.kept[:, 0] + ctx.kept[:, 1] / k.tp + spans * (ctx.expert_kept[:, 0] + ctx.expert_kept[:, 1] / k.tp)
             ) * scale
    dropped = (ctx.wide[:, 0] + ctx.wide[:, 1] / k.tp) * scale
    inputs = np.concatenate([[0.0], ctx.out_bytes[:-1]]) * scale
    # a fully recomputed block keeps its input alone, and rebuilds its activations one block at a time
    kept = np.where(full, np.where(ctx.block_first, inputs, 0.0), np.where(selective, whole - dropped, whole))
    rebuilt = np.bincount(ctx.block_of[full], weights=whole[full]) if full.any() else np.zeros(1)
    working = float(rebuilt.max())
    if k.zero == 3:
        working += 2 * 2 * float(params.max())  # the largest segment's weights gathered, fp16, twice in flight
    handoff = wait if k.pp > 1 else 0.0  # the receiving stage must get a core to go on, as a collective's peers
    send = _priced(lambda b: _p2p_time(plan, b, cluster), ctx.out_bytes * scale) + handoff * (ctx.out_bytes > 0)
    per_op = model.nbytes * np.where(model.batched, scale, 1.0) / np.where(model.split, k.tp, 1)
    op_bytes = np.maximum.reduceat(per_op, np.array([s.lo for s in model.segments]))
    step_inputs = model.input_bytes * ctx.batch / (k.dp * k.cp * model.batch)  # every micro-batch's, fed at once
    parts: dict[str, np.ndarray] = {"compute": 3 * forward, "recompute": rerun, "tp_comm": tp, "dp_comm": zero}
    if k.cp > 1:
        parts["cp_comm"] = _ring(ctx, k, scale, wait)
    if k.ep > 1:
        parts["ep_comm"] = _exchange(ctx, k, scale, full, wait)
    return _Costs(np.sum(list(parts.values()), axis=0), parts, params, kept, working, send, op_bytes, step_inputs)


def _ring(ctx: _Context, k: Knobs, scale: float, wait: float) -> np.ndarray:
    """Seconds per micro-batch of ring attention's hops (``ops.ring_attention``), priced as not overlapped: a
    rank's K/V block goes c - 1 hops forward; K, V, dK, dV c - 1 hops backward and dK, dV one more. Each hop
    also ``wait``s for a neighbour that shared cores are not running."""
    c = k.cp
    block = ctx.kv_bytes * scale / k.tp  # heads split by tp
    hops = (c - 1) + 2 * (c - 1) + 1
    pair = (0, k.tp)  # ring neighbours on a (data, context, tensor) mesh: tensor-parallel ranks innermost
    return ctx.kv_count * hops * (_priced(partial(_coll, "send_recv", pair, cluster=ctx.cluster),
                                          block / np.maximum(ctx.kv_count, 1.0)) + wait)


def _modes(ctx: _Context, k: Knobs) -> np.ndarray:
    """Per segment, its recompute as an index into ``RECOMPUTE``: its block's choice, "none" outside blocks."""
    if k.block_recompute:
        if len(k.block_recompute) != ctx.block_first.sum():
            raise PlanError(f"a plan recomputes per repeated block, one choice each, but the traced step has "
                            f"{int(ctx.block_first.sum())} blocks and the plan {len(k.block_recompute)} choices")
        codes = np.array([RECOMPUTE.index(m) for m in k.block_recompute])
    else:
        codes = np.full(max(int(ctx.block_first.sum()), 1), RECOMPUTE.index(k.recompute))
    return np.where(ctx.block_of >= 0, codes[np.maximum(ctx.block_of, 0)], 0)


def _expert_span(ctx: _Context, k: Knobs) -> float:
    """A rank's expert work over its share of the dense experts' (every expert on its own tokens), as
    ``sbpflow.parallelize(expert=)`` runs them: with one group per data rank (``ep == dp``) the experts are
    stacked and a rank runs its experts on the rows routed to them only, ``k/E`` of its dense share (routing
    even); with fewer groups each rank of a group runs the group's ``E/ep`` experts on every token of the group's
    ``dp/ep`` data ranks."""
    if k.ep == 1:
        return 1.0
    assert ctx.model.experts is not None  # (candidates offer ep > 1 only to steps with routed experts)
    return ctx.model.experts.routed_share if k.ep == k.dp else k.dp / k.ep


def _exchange(ctx: _Context, k: Knobs, scale: float, full: np.ndarray, wait: float) -> np.ndarray:
    """Seconds per micro-batch of the token exchange: a rank's routed rows (k per token) go to their experts and
    come back (two all-to-alls over the ep group), in forward and again in backward; once more forward under full
    recompute. Each all-to-all blocks: it also ``wait``s for peers that shared cores are not running."""
    stride = k.dp // k.ep * k.tp * k.cp  # a rank's peers in the other groups: parallelize's groups are data rows
    group = tuple(range(0, k.ep * stride, stride))
    rows = ctx.routed * scale * k.ep  # the group's rows: an all-to-all's volume
    passes = 4 + 2 * full
    return passes * (_priced(partial(_coll, "all_to_all", group, cluster=ctx.cluster), rows) + wait * (rows > 0))


def _active(ctx: _Context, k: Knobs) -> int:
    """Devices computing at once: every tensor- and data-parallel rank of as many stages as there are
    micro-batches in flight (one micro-batch runs its stages one after another)."""
    m = ctx.batch // (k.dp * k.micro_batch)
    return k.tp * k.dp * k.cp * min(k.pp, m)


def _in_flight(k: Knobs, stage: int, m: int) -> float:
    return in_flight(k.pp, k.virtual, stage, m)


def _stage_memory(ctx: _Context, k: Knobs, c: _Costs, stage: int, segs: list[int], m: int) -> dict[str, float]:
    params = _unique_params(ctx.model, k, segs)
    experts = _unique_params(ctx.model, k, segs, experts_only=True) if k.ep > 1 else 0.0
    memory = _model_state(ctx.model, params, k, experts)
    memory["activations"] = _in_flight(k, stage, m) * float(c.kept[segs].sum()) + c.working
    memory.update(_transient(ctx.model, c, segs))
    if ctx.model.traced and k.dp > 1 and k.zero in (1, 2):
        memory.update(_update_phase(ctx.model, params, k, memory))
    return memory


def _update_phase(model: GraphModel, params: float, k: Knobs, memory: dict[str, float]) -> dict[str, float]:
    """ZeRO 1/2 on sbpflow's runtime peaks in one of two phases: backward (the gradients, their bucket, the
    activations and working set) or the update (the updated shards all-gathered into a flat bucket and copied out
    of it, with the update's new weight and state shards, once the gradients are gone). ``buffers`` becomes the
    gradient bucket, and ``update`` what the update phase holds beyond backward's peak."""
    weight, grad, state = model.state_bytes
    buffers = params * grad
    backward = memory["gradients"] + buffers + memory["activations"] + memory.get("working", 0.0)
    update = 2 * params * weight + params * (weight + state) / k.dp
    return {"buffers": buffers, "update": max(0.0, update - backward)}


def _transient(model: GraphModel, c: _Costs, segs: list[int]) -> dict[str, float]:
    """Bytes besides state and kept activations, priced for plans that run the traced step on sbpflow's runtime:
    the step's inputs, and backward's working set: a fused backward segment holds the gradients of its ops'
    inputs and its intermediates at once, ``WORKING_OPS`` times the largest op's inputs and outputs."""
    if not model.traced:
        return {}
    return {"inputs": c.inputs, "working": WORKING_OPS * float(c.op_bytes[segs].max(initial=0.0))}


def _model_state(model: GraphModel, params: float, k: Knobs, experts: float = 0.0) -> dict[str, float]:
    """Model state bytes of a rank holding ``params`` parameters, ``experts`` of them an ep group's (ZeRO shards
    those over the group's ``dp/ep`` data ranks). Priced as the traced step holds them, also the copies sbpflow's
    runtime makes under data parallelism, at most: the gradients flattened into their buckets and, under ZeRO 1/2,
    the updated weights gathered whole (an upper bound: buckets may be smaller)."""
    memory = model_state_bytes(params - experts, k.dp, k.zero, model.state_bytes)
    if experts:
        for name, nbytes in model_state_bytes(experts, k.dp // k.ep, k.zero, model.state_bytes).items():
            memory[name] += nbytes
    if model.traced and k.dp > 1:
        weight, grad, _ = model.state_bytes
        memory["buffers"] = params * (grad + (weight if k.zero in (1, 2) else 0.0))
    return memory


def _unique_params(model: GraphModel, k: Knobs, segs: list[int], experts_only: bool = False) -> float:
    """Parameters one rank holds for these segments (or of them, the experts'), a tied weight once."""
    seen: dict[int, float] = {}
    experts = model.experts.params if model.experts is not None else frozenset()
    for i in segs:
        seen.update({v: (n / k.tp if split else n) / (k.ep if v in experts else 1)
                     for v, (n, split) in model.segments[i].params.items() if v in experts or not experts_only})
    return sum(seen.values())


def _cut(ctx: _Context, k: Knobs, c: _Costs, m: int) -> tuple[int, ...] | None:
    """Where each of the ``pp · v`` chunks starts: the smallest slowest-chunk time that a greedy packing under
    every stage's memory meets (bisection); None when no packing fits."""
    n, chunks = len(c.time), k.pp * k.virtual
    if n < chunks:
        return None
    usable = ctx.cluster.profile.usable_memory
    # bytes per parameter, an expert's where they differ (ZeRO shards those over fewer ranks): at most
    state = sum(_model_state(ctx.model, 1.0, k, experts=1.0 if k.ep > 1 else 0.0).values())
    if ctx.model.traced and k.dp > 1 and k.zero in (1, 2):  # the update phase's bytes per parameter, if more
        weight, _, optimizer = ctx.model.state_bytes  # (_update_phase: weights, state shards, gather bucket,
        state = max(state, 3 * weight + optimizer / k.dp + (weight + optimizer) / k.dp)  # copies, new shards)
    transient = sum(_transient(ctx.model, c, list(range(n))).values())  # the largest op's, wherever it falls

    def pack(limit: float) -> tuple[int, ...] | None:
        """Each chunk takes segments from where the last ended up to the latest end at which it (its segments,
        receiving its input and sending its output) stays under ``limit`` and its stage's memory."""
        starts, lo = [], 0
        for chunk in range(chunks):
            if lo >= n:
                return None
            last = chunk == chunks - 1
            flight = _in_flight(k, chunk % k.pp, m) * k.virtual
            t = float(c.send[lo - 1]) if lo else 0.0
            params = kept = 0.0
            end = None
            for e in range(lo + 1, n - (chunks - chunk - 1) + 1):  # the chunk is segments lo .. e - 1
                t, params, kept = t + c.time[e - 1], params + c.params[e - 1], kept + c.kept[e - 1]
                if t > limit or state * params * k.virtual + flight * kept + c.working + transient > usable:
                    break
                if (not last and t + c.send[e - 1] <= limit) or e == n:
                    end = e
            if end is None:
                return None
            starts.append(lo)
            lo = end
        return tuple(starts) if lo == n else None

    lo, hi = float(c.time.max()), float(c.time.sum() + c.send.sum()) * 1.0001
    best = pack(hi)
    if best is None:
        return None
    for _ in range(30):
        mid = (lo + hi) / 2
        found = pack(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
        if hi - lo < 1e-4 * hi:
            break
    return best


def _even(n: int, chunks: int) -> tuple[int, ...]:
    base, extra = divmod(n, chunks)
    return tuple(i * base + min(i, extra) for i in range(chunks))


def predict(ctx: _Context, k: Knobs, cuts: tuple[int, ...] | None = None) -> GraphPrediction:
    """The step time and memory of ``k`` with its best cuts (or ``cuts``; even ones when nothing fits)."""
    m = ctx.batch // (k.dp * k.micro_batch)
    c = _costs(ctx, k)
    n, chunks = len(c.time), k.pp * k.virtual
    cuts = cuts or _cut(ctx, k, c, m) or _even(n, chunks)
    bounds = list(cuts) + [n]
    segs = [list(range(bounds[i], bounds[i + 1])) for i in range(chunks)]
    chunk_time = []
    for i, s in enumerate(segs):  # each chunk receives from the one before and sends to the one after
        receive = float(c.send[bounds[i] - 1]) if i > 0 else 0.0
        send = float(c.send[s[-1]]) if i < chunks - 1 else 0.0
        chunk_time.append(float(c.time[s].sum()) + receive + send)
    stage_segs = [[j for i in range(k.virtual) for j in segs[i * k.pp + st]] for st in range(k.pp)]
    stage_time = [sum(chunk_time[i * k.pp + st] for i in range(k.virtual)) for st in range(k.pp)]
    plan = k.parallel_plan()
    stretch = ctx.cluster.profile.stretch(ctx.cluster.devices)  # every rank steps its optimizer at once
    # the gradient sync's collectives wait for replicas still in backward, as those between ops do
    wait = ctx.cluster.profile.sync_wait(_active(ctx, k)) * ZERO_COLLECTIVES[k.zero][1] * (k.dp * k.cp > 1)
    syncs = [(_grad_sync(plan, ctx.cluster, _unique_params(ctx.model, k, s)) + wait,
              stretch * _optimizer(plan, ctx.cluster, _unique_params(ctx.model, k, s))) for s in stage_segs]
    last = max(range(k.pp), key=lambda st: sum(syncs[st]))
    share = ZERO_BUBBLE_SHARE if k.schedule == "zero_bubble" and m >= k.pp else 1.0

    def parts(st: int) -> dict[str, float]:
        """Stage ``st``'s seconds per micro-batch by component; its sends are the rest of its time."""
        own = {name: float(v[stage_segs[st]].sum()) for name, v in c.parts.items()}
        return {**own, "pp_comm": stage_time[st] - sum(own.values())}

    breakdown = pipeline_breakdown(stage_time, parts, syncs[last], m, k.virtual, share)
    memories = [_stage_memory(ctx, k, c, st, stage_segs[st], m) for st in range(k.pp)]
    memory = max(memories, key=lambda mem: sum(mem.values()))
    step = sum(breakdown.values())
    devices = ctx.cluster.devices
    model_flops = ctx.model.model_flops(ctx.batch)
    hardware = model_flops + _rerun_flops(ctx.model, _modes(ctx, k), ctx.batch)
    return GraphPrediction(k, ctx.batch, tuple(cuts), step, breakdown, memory,
                           ctx.cluster.profile.usable_memory, hardware / step / devices / 1e12,
                           model_flops / step / devices / 1e12)


def _rerun_flops(model: GraphModel, modes: np.ndarray, batch: int) -> float:
    """FLOPs that recomputation adds to a step of ``batch`` samples: per segment (``modes``, as :func:`_modes`)
    the forward again, or its wide ops'."""
    mode = np.zeros(len(model.flops), dtype=int)
    for s, m in zip(model.segments, modes, strict=True):
        mode[s.lo:s.hi] = m
    rerun = (mode == RECOMPUTE.index("full")) | ((mode == RECOMPUTE.index("selective")) & model.wide_op)
    scale = np.where(model.batched, batch / model.batch, 1.0)
    return float((model.flops * scale * rerun).sum())


def _bound(ctx: _Context, k: Knobs) -> float:
    """A step time no cut can beat: the slowest stage takes at least its share of the work and the largest
    segment, and some stage holds at least ``1/pp`` of the parameters to sync."""
    m = ctx.batch // (k.dp * k.micro_batch)
    c = _costs(ctx, k)
    total = float(c.time.sum())
    slowest = max(total / k.pp, float(c.time.max()))
    share = ZERO_BUBBLE_SHARE if k.schedule == "zero_bubble" and m >= k.pp else 1.0
    plan = k.parallel_plan()
    params = float(c.params.sum()) / k.pp
    sync = _grad_sync(plan, ctx.cluster, params) + _optimizer(plan, ctx.cluster, params)
    return m * slowest + share * (total - slowest) / k.virtual + sync


def _state_bound(ctx: _Context, k: Knobs) -> float:
    """Bytes of model state some rank holds at least: its stage's share of the parameters (1/pp of them)."""
    split = ctx.whole_params + ctx.split_params / k.tp - (ctx.expert_whole + ctx.expert_split / k.tp) * (1 - 1 / k.ep)
    params = float(split.sum()) / k.pp
    return sum(_model_state(ctx.model, params, k).values())


def candidates(model: GraphModel, cluster: Cluster, batch: int) -> list[Knobs]:
    """Every plan of the graph: tp inside a node dividing the graph's tensor-parallel sizes, pp up to the
    number of segments, whole micro-batches per replica, ZeRO 1-3 only with dp > 1, and the schedules."""
    out = []
    n = len(model.segments)
    for tp in (d for d in _divisors(min(cluster.gpus_per_node, cluster.devices)) if model.tp_allowed(d)):
        for cp in (d for d in _divisors(cluster.devices // tp) if _cp_allowed(model, d)):
            for pp in (d for d in _divisors(cluster.devices // (tp * cp)) if d <= n):
                dp = cluster.devices // (tp * cp * pp)
                for mb in (b for b in MICRO_BATCHES if batch % (dp * b) == 0):
                    m = batch // (dp * mb)
                    for ep in _ep_degrees(model, dp, cp):
                        for zero in (0, 1, 2, 3) if dp > 1 and cp == 1 else (0,):
                            for recompute in _recomputes(model):
                                for schedule, virtual in _schedules(pp, m, n):
                                    out.append(Knobs(tp, pp, dp, mb, zero, recompute, schedule, virtual, cp, ep))
    return out


def _recomputes(model: GraphModel) -> tuple[str, ...]:
    """The recompute choices: all for a what-if; none and full for plans that run the traced step, as nn.Graph
    recomputes only by activation checkpointing of whole modules (selective recompute has no graph setting)."""
    return ("none", "full") if model.traced else RECOMPUTE


def _ep_degrees(model: GraphModel, dp: int, cp: int) -> list[int]:
    """Expert-parallel degrees: 1, and with routed experts every divisor of dp that divides the experts (without
    context parallelism: ``sbpflow.parallelize`` cuts expert groups on a (data, tensor) mesh)."""
    if model.experts is None or cp > 1:
        return [1]
    return [d for d in _divisors(dp) if model.experts.count % d == 0]


def _cp_allowed(model: GraphModel, cp: int) -> bool:
    """Context parallelism splits a step with attention whose sequence takes 2·cp zigzag chunks (no ZeRO with it:
    ``sbpflow.parallelize`` keeps parameters whole on the context axis)."""
    return cp == 1 or (model.seq_len > 0 and model.seq_len % (2 * cp) == 0)


def _schedules(pp: int, m: int, segments: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zero_bubble", 1)]
    return out + [("interleaved_1f1b", v) for v in VIRTUAL if m % pp == 0 and pp * v <= segments]


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def search_graph(model: GraphModel, cluster: Cluster, batch: int, keep: int = 5,
                 only: list[Knobs] | None = None, accept: Callable[[Knobs], bool] | None = None) -> GraphSearch:
    """The fastest plan that fits, with ``keep - 1`` runners-up; ``only`` restricts the candidates, and the plans
    recomputing some blocks derived from them (:func:`_mixed_recompute`) are tried only where ``accept`` takes
    them (always without ``only``, never with ``only`` alone)."""
    start = time.perf_counter()
    ctx = _Context(model, cluster, batch)
    plans = only if only is not None else candidates(model, cluster, batch)
    if not plans:
        raise PlanError(f"no plan of the traced step ({len(model.segments)} stage-cut segments, tensor-parallel "
                        f"sizes {list(model.tp_dims)}) on {cluster.devices} devices for a batch of {batch}: the "
                        f"batch must split into whole micro-batches on every data-parallel replica")
    order = sorted(((_bound(ctx, k), i, k) for i, k in enumerate(plans)), key=lambda x: x[:2])
    good: list[GraphPrediction] = []
    too_big: list[GraphPrediction] = []
    costed = 0
    usable = cluster.profile.usable_memory
    for bound, _, k in order:
        if len(good) >= keep and bound > good[keep - 1].step_time:
            break
        if _state_bound(ctx, k) > usable:
            continue  # its model state alone cannot fit, wherever the cuts fall
        found = predict(ctx, k)
        costed += 1
        (good if found.fits else too_big).append(found)
        good.sort(key=lambda p: p.step_time)
    for over in sorted((p for p in too_big if p.knobs.recompute == "none"), key=lambda p: p.step_time):
        if len(good) >= keep and over.step_time > good[keep - 1].step_time:
            break  # recomputing some blocks only adds time
        if only is not None and accept is None:
            break
        mixed = _mixed_recompute(ctx, over.knobs)
        costed += len(mixed)
        good.extend(p for p in mixed if p.fits and (accept is None or accept(p.knobs)))
        good.sort(key=lambda p: p.step_time)
    if not good:
        too_big += [predict(ctx, k) for k in _smallest_memory(plans, too_big)]
        raise PlanError(_nothing_fits(model, cluster, batch, min(too_big, key=lambda p: p.memory_per_device)))
    faster = sorted((p for p in too_big if p.step_time < good[0].step_time), key=lambda p: p.step_time)
    return GraphSearch(good[0], good[1:keep], faster[:3], len(plans), costed, time.perf_counter() - start)


def _mixed_recompute(ctx: _Context, k: Knobs) -> list[GraphPrediction]:
    """Plans of ``k`` (which keeps every activation) with its first ``j`` repeated blocks fully recomputed and the
    rest kept (or, for a what-if, which need not run the traced step, recomputed selectively): per choice of the
    rest, the smallest ``j`` that fits (bisection: memory falls as ``j`` grows), and the plan at ``j`` when none
    does. Early blocks first: under 1F1B the first stages hold the most micro-batches in flight."""
    blocks = int(ctx.block_first.sum())
    out = []
    for rest in _recomputes(ctx.model)[:-1]:  # (not full: that is the uniform plan)
        def at(j: int, rest: str = rest) -> GraphPrediction:
            modes = ("full",) * j + (rest,) * (blocks - j)
            return predict(ctx, replace(k, recompute="full", block_recompute=modes))

        lo, hi = 1, blocks - 1
        if hi < lo:
            break
        best = at(hi)
        out.append(best)
        while best.fits and lo < hi:
            mid = (lo + hi) // 2
            found = at(mid)
            out.append(found)
            if found.fits:
                best, hi = found, mid
            else:
                lo = mid + 1
    return out


def _smallest_memory(plans: list[Knobs], done: list[GraphPrediction]) -> list[Knobs]:
    """The plans that hold the least per device, so the error names the true minimum: every parameter sharded
    over all devices (ZeRO-3, or no data parallelism), the smallest micro-batch, full recompute."""
    seen = {p.knobs for p in done}
    smallest = min((k.micro_batch for k in plans), default=1)
    return [k for k in plans if k not in seen and (k.zero == 3 or k.dp == 1) and k.micro_batch == smallest
            and k.recompute == "full"] or [k for k in plans if k not in seen][:20]


def _nothing_fits(model: GraphModel, cluster: Cluster, batch: int, smallest: GraphPrediction) -> str:
    where = ", ".join(f"{name} {_size(v)}" for name, v in smallest.memory.items())
    return (f"no plan of the traced step ({_count(model.param_count)} parameters, batch {batch}) fits "
            f"{cluster.devices} devices with {_size(cluster.profile.usable_memory)} usable each: the smallest plan "
            f"({smallest.knobs}) needs {_size(smallest.memory_per_device)} per device ({where}); a device with "
            f"at least {_size(smallest.memory_per_device * 1.005)} usable would fit it")


def _count(n: float) -> str:
    """A count in words: ``175B``, ``265k``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _size(nbytes: float) -> str:
    """Bytes in words: ``1.23 GB``, ``45.6 MB``, ``7.8 kB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} bytes"
