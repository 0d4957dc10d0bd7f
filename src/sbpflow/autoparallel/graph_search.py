"""The plan search on a traced graph: mesh (tp × pp × dp × cp), stage cuts, micro-batches, schedule, ZeRO, recompute.

The cost model is the sizes planner's (``predict``), applied per segment of the graph (``graph_model``):

* a segment's forward is the sum of its ops' roofline times on their per-rank shares, stretched when more
  devices compute at once than the cores they share (``DeviceProfile.stretch``: a CPU host's processes), and
  each blocking collective or stage hand-off waits for peers those cores are not running
  (``DeviceProfile.sync_wait``);
  forward + backward is three forwards; recompute reruns the segment's forward ("full") or the ops that make
  its wide values ("selective"); its tensor-parallel all-reduces are priced by α-β (again forward under "full");
* ZeRO-2/3 traffic per micro-batch and the gradient sync and optimizer step at the end are ``predict``'s
  functions of the parameters a stage holds;
* a stage's time is the sum of its segments plus its sends (the one activation crossing each cut);
  1F1B takes ``m · max t_i + (Σ t_i - max t_i) / v``; zero-bubble (ZB-H1, Qi et al. ICLR'24) fills two thirds
  of the bubble with weight-gradient work, so it pays a third of 1F1B's;
* memory per rank: model state under ZeRO (``cost.model_state_bytes``), plus the activations kept by the
  micro-batches in flight (1F1B: ``min(p - i, m)`` on stage ``i``), plus the working set of the largest
  segment under full recompute or of ZeRO-3's gathered weights;
* context parallel (``cp``, for steps whose attention is ``scaled_dot_product_attention``): a rank computes and
  keeps a cp-th of each sample's tokens (zigzag: equal causal work) and pays the ring's K/V hops, unoverlapped.

Stage cuts: for a given slowest-stage time, a greedy pass packs segments into stages in order under the time
and each stage's memory limit; a bisection finds the smallest time the greedy pass meets. Candidates are
costed in the order of a lower bound until the bound exceeds the ``keep``-th best (branch and bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

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

    def __str__(self) -> str:
        sched = "" if self.pp == 1 else f" {self.schedule}" + (f" x{self.virtual}" if self.virtual > 1 else "")
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (f"tp{self.tp} pp{self.pp} dp{self.dp}{cp} micro-batch {self.micro_batch} zero{self.zero} "
                f"recompute={self.recompute}{sched}")

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
        kv = model.kv_bytes if model.kv_bytes is not None else np.zeros(len(model.flops))
        self.kv_bytes = np.array([float(kv[s.lo:s.hi].sum()) for s in segs])
        self.kv_count = np.array([float((kv[s.lo:s.hi] > 0).sum()) for s in segs])
        # ZeRO gathers and scatters per module holding a block (FSDP's unit): the first segment of each pays α
        parents = [s.first_module.rpartition(".")[0] for s in segs]
        self.unit_start = np.array([float(i == 0 or parents[i] != parents[i - 1]) for i in range(len(segs))])

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
    blocks = model.block
    rerun = {"none": np.zeros_like(forward), "selective": wide, "full": forward}[k.recompute] * blocks
    group = tuple(range(k.tp))
    all_reduce = partial(_coll, "all_reduce", group, cluster=cluster)
    tp = _priced(all_reduce, ctx.comm_bytes * scale, ctx.comm_count) + wait * ctx.comm_count * (k.tp > 1)
    if k.recompute == "full":  # the forward all-reduces again
        tp += blocks * (_priced(all_reduce, ctx.comm_fwd_bytes * scale, ctx.comm_fwd_count)
                        + wait * ctx.comm_fwd_count * (k.tp > 1))
    params = ctx.whole_params + ctx.split_params / k.tp
    zero = _priced(partial(_zero_per_micro_batch, cluster, plan), params, ctx.unit_start)
    zero += wait * ZERO_COLLECTIVES[k.zero][0] * ctx.unit_start * (k.dp > 1)
    whole = (ctx.kept[:, 0] + ctx.kept[:, 1] / k.tp) * scale
    dropped = (ctx.wide[:, 0] + ctx.wide[:, 1] / k.tp) * scale
    inputs = np.concatenate([[0.0], ctx.out_bytes[:-1]]) * scale
    kept = np.where(blocks, {"none": whole, "selective": whole - dropped, "full": inputs}[k.recompute], whole)
    working = float(whole[blocks].max(initial=0.0)) if k.recompute == "full" else 0.0
    if k.zero == 3:
        working += 2 * 2 * float(params.max())  # the largest segment's weights gathered, fp16, twice in flight
    handoff = wait if k.pp > 1 else 0.0  # the receiving stage must get a core to go on, as a collective's peers
    send = _priced(lambda b: _p2p_time(plan, b, cluster), ctx.out_bytes * scale) + handoff * (ctx.out_bytes > 0)
    parts = {"compute": 3 * forward, "recompute": rerun, "tp_comm": tp, "dp_comm": zero}
    if k.cp > 1:
        parts["cp_comm"] = _ring(ctx, k, scale)
    return _Costs(sum(parts.values()), parts, params, kept, working, send)


def _ring(ctx: _Context, k: Knobs, scale: float) -> np.ndarray:
    """Seconds per micro-batch of ring attention's hops (``ops.ring_attention``), priced as not overlapped: a
    rank's K/V block goes c - 1 hops forward; K, V, dK, dV c - 1 hops backward and dK, dV one more."""
    c = k.cp
    block = ctx.kv_bytes * scale / k.tp  # heads split by tp
    hops = (c - 1) + 2 * (c - 1) + 1
    pair = (0, k.tp)  # ring neighbours on a (data, context, tensor) mesh: tensor-parallel ranks innermost
    return ctx.kv_count * hops * _priced(partial(_coll, "send_recv", pair, cluster=ctx.cluster),
                                         block / np.maximum(ctx.kv_count, 1.0))


def _active(ctx: _Context, k: Knobs) -> int:
    """Devices computing at once: every tensor- and data-parallel rank of as many stages as there are
    micro-batches in flight (one micro-batch runs its stages one after another)."""
    m = ctx.batch // (k.dp * k.micro_batch)
    return k.tp * k.dp * k.cp * min(k.pp, m)


def _in_flight(k: Knobs, stage: int, m: int) -> float:
    return in_flight(k.pp, k.virtual, stage, m)


def _stage_memory(ctx: _Context, k: Knobs, c: _Costs, stage: int, segs: list[int], m: int) -> dict[str, float]:
    memory = _model_state(ctx.model, _unique_params(ctx.model, k, segs), k)
    memory["activations"] = _in_flight(k, stage, m) * float(c.kept[segs].sum()) + c.working
    return memory


def _model_state(model: GraphModel, params: float, k: Knobs) -> dict[str, float]:
    """Model state bytes of a rank holding ``params`` parameters. Priced as the traced step holds them, also the
    copies sbpflow's runtime makes under data parallelism, at most: the gradients flattened into their buckets
    and, under ZeRO 1/2, the updated weights gathered whole (an upper bound: buckets may be smaller)."""
    memory = model_state_bytes(params, k.dp, k.zero, model.state_bytes)
    if model.traced and k.dp > 1:
        weight, grad, _ = model.state_bytes
        memory["buffers"] = params * (grad + (weight if k.zero in (1, 2) else 0.0))
    return memory


def _unique_params(model: GraphModel, k: Knobs, segs: list[int]) -> float:
    """Parameters one rank holds for these segments, a tied weight once."""
    seen: dict[int, float] = {}
    for i in segs:
        seen.update({v: n / k.tp if split else n for v, (n, split) in model.segments[i].params.items()})
    return sum(seen.values())


def _cut(ctx: _Context, k: Knobs, c: _Costs, m: int) -> tuple[int, ...] | None:
    """Where each of the ``pp · v`` chunks starts: the smallest slowest-chunk time that a greedy packing under
    every stage's memory meets (bisection); None when no packing fits."""
    n, chunks = len(c.time), k.pp * k.virtual
    if n < chunks:
        return None
    usable = ctx.cluster.profile.usable_memory
    state = sum(_model_state(ctx.model, 1.0, k).values())

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
                if t > limit or state * params * k.virtual + flight * kept + c.working > usable:
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
    hardware = model_flops + _rerun_flops(ctx.model, k.recompute, ctx.batch)
    return GraphPrediction(k, ctx.batch, tuple(cuts), step, breakdown, memory,
                           ctx.cluster.profile.usable_memory, hardware / step / devices / 1e12,
                           model_flops / step / devices / 1e12)


def _rerun_flops(model: GraphModel, recompute: str, batch: int) -> float:
    """FLOPs that recomputation adds to a step of ``batch`` samples: the forward again, or its wide ops'."""
    in_block = np.zeros(len(model.flops), dtype=bool)
    for s, rep in zip(model.segments, model.block, strict=True):
        in_block[s.lo:s.hi] = rep
    rerun = {"none": np.zeros_like(in_block), "selective": model.wide_op & in_block, "full": in_block}[recompute]
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
    params = float((ctx.whole_params + ctx.split_params / k.tp).sum()) / k.pp
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
                    for zero in (0, 1, 2, 3) if dp > 1 and cp == 1 else (0,):
                        for recompute in RECOMPUTE:
                            for schedule, virtual in _schedules(pp, m, n):
                                out.append(Knobs(tp, pp, dp, mb, zero, recompute, schedule, virtual, cp))
    return out


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
                 only: list[Knobs] | None = None) -> GraphSearch:
    """The fastest plan that fits, with ``keep - 1`` runners-up; ``only`` restricts the candidates."""
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
    if not good:
        too_big += [predict(ctx, k) for k in _smallest_memory(plans, too_big)]
        raise PlanError(_nothing_fits(model, cluster, batch, min(too_big, key=lambda p: p.memory_per_device)))
    faster = sorted((p for p in too_big if p.step_time < good[0].step_time), key=lambda p: p.step_time)
    return GraphSearch(good[0], good[1:keep], faster[:3], len(plans), costed, time.perf_counter() - start)


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
