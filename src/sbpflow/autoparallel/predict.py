"""The step time and memory of one 3-D parallel plan (tensor × pipeline × data) of a transformer.

Ranks are laid out as Megatron and ``nn.parallelize.stage_placements`` do: tensor-parallel ranks innermost, then
data-parallel replicas, then pipeline stages, so rank = (stage · dp + replica) · tp + shard. A group whose
ranks span nodes pays the inter-node link (the boxing :class:`~sbpflow.boxing.plan.CostModel`).

Inside a block, the SBP signature of every op on the tensor-parallel group is the block ILP's choice
(``block_sbp.solve_block``) for this plan's micro-batch, degree and recompute, under the memory the plan leaves
for it (``block_budget``): compute from the chosen signatures' local shapes, tensor-parallel communication from
the collectives those signatures issue (``block_sbp.block_collectives``), parameters and activations per rank
from the same choice. A plan with ``layout="megatron"`` uses Megatron-LM's choice instead (what
``sbpflow.parallelize`` lays out from column/row Linear pairs, so what ``auto_parallel_host`` predicts).

Per micro-batch, stage ``i`` costs ``t_i`` = its blocks' forward and backward (+ recomputation) + their
tensor-parallel collectives (forward, their duals backward, the forward ones again when full recompute reruns
the forward) + its point-to-point sends (activations forward, gradients backward; across nodes each tensor-parallel rank
sends 1/t and the receivers all-gather over NVLink: Narayanan et al. 2021 §4.1's scatter/gather)
+ ZeRO-2/3's per-micro-batch traffic. Under 1F1B with ``m`` micro-batches the pipeline takes

    Σ t_i + (m - 1) · max t_i                   (Alpa, Zheng et al. OSDI'22, eq. 2)

i.e. ``m`` times the slowest stage plus the bubble ``Σ t_i - max t_i`` ((p-1)/m of the work for equal
stages). Then each stage synchronises its gradients across replicas (not overlapped, as in Megatron-LM 2021)
and steps its optimizer; the slowest of those ends the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from ..boxing.plan import CostModel
from ..errors import PlanError
from .block_sbp import MEGATRON_CHOICES, BlockBudget, BlockPlan, block_collectives, cached_solve, evaluate_block
from .cost import collective_time, model_state_bytes
from .profiles import DeviceProfile
from .transformer import ACT_BYTES, RECOMPUTE, TransformerSpec, embedding_cost, head_activation_bytes, head_cost

ADAM_BYTES_PER_PARAM = 2 + 3 * 2 * 4 + 2  # read the fp16 gradient; read+write fp32 master, m, v; write fp16 weight
TIME_KEYS = ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer")
LAYOUTS = ("ilp", "megatron")  # a block's SBPs: the ILP's choice, or Megatron-LM's


@dataclass(frozen=True)
class Cluster:
    """``devices`` accelerators of one profile, ``gpus_per_node`` to a node."""

    devices: int
    profile: DeviceProfile
    gpus_per_node: int

    @cached_property
    def cost_model(self) -> CostModel:
        return self.profile.cost_model(self.gpus_per_node)


@dataclass(frozen=True)
class ParallelPlan:
    """The degrees and knobs of one plan: ``tp · pp · dp`` devices, ``batch / (dp · micro_batch)`` micro-batches."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    zero: int = 0
    recompute: str = "full"
    layout: str = "ilp"
    virtual: int = 1  # model chunks per stage: > 1 is Megatron's interleaved 1F1B

    def __str__(self) -> str:
        return (f"tp{self.tp} pp{self.pp} dp{self.dp} micro-batch {self.micro_batch} zero{self.zero} "
                f"recompute={self.recompute}" + ("" if self.layout == "ilp" else f" layout={self.layout}")
                + (f" interleaved x{self.virtual}" if self.virtual > 1 else ""))


@dataclass(frozen=True)
class StageCost:
    """One stage's seconds per micro-batch, by component."""

    layers: int
    compute: float
    recompute: float
    tp_comm: float
    pp_comm: float
    dp_comm: float  # ZeRO-2/3 traffic repeated every micro-batch

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp_comm + self.pp_comm + self.dp_comm


@dataclass(frozen=True)
class Prediction:
    """What a plan is predicted to cost: step seconds by component, bytes per device by component."""

    plan: ParallelPlan
    batch: int
    stage_layers: tuple[int, ...]
    step_time: float
    breakdown: dict[str, float]  # seconds, summing to step_time
    memory: dict[str, float]  # bytes on the fullest device
    usable_memory: float
    tflops_per_device: float  # hardware: the FLOPs the plan executes (recompute included) / time / devices
    model_tflops_per_device: float  # forward and backward alone / time / devices
    mfu: float  # model FLOPs / time / (devices · peak)
    notes: tuple[str, ...] = field(default=())
    block: BlockPlan | None = None  # the SBPs inside every block that this prediction priced

    @property
    def memory_per_device(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_per_device <= self.usable_memory


# ----------------------------------------------------------------------------- per-plan costs


@dataclass(frozen=True)
class PlanCosts:
    """Everything about one plan that does not depend on where the stage cuts fall."""

    spec: TransformerSpec
    cluster: Cluster
    plan: ParallelPlan
    micro_batches: int
    block: BlockPlan  # the SBP choice inside every block, and its costs
    layer_params: float  # parameters of one block on one rank
    layer_compute: float  # forward + backward of one block
    layer_recompute: float
    layer_tp: float
    layer_zero: float  # ZeRO-2/3 per micro-batch, one block
    p2p: float  # one activation (or gradient) send between neighbouring stages
    embedding: float
    head: float

    def stage_cost(self, stage: int, layers: int) -> StageCost:
        first, last = stage == 0, stage == self.plan.pp - 1
        # each of the v chunks receives and sends; only the model's first input and last output stay put
        sends = 2 * self.plan.virtual - first - last
        extra = (self.embedding if first else 0.0) + (self.head if last else 0.0)
        return StageCost(layers, layers * self.layer_compute + extra, layers * self.layer_recompute,
                         layers * self.layer_tp, sends * self.p2p, layers * self.layer_zero)

    def stage_params(self, stage: int, layers: int) -> float:
        """Parameters one rank of the stage holds (tied embedding: a copy on the first and the last stage)."""
        return layers * self.layer_params + fixed_params(self.spec, self.plan, stage)

    def stage_memory(self, stage: int, layers: int) -> dict[str, float]:
        """Bytes on one rank of ``stage``: model state under ZeRO, plus activations of the micro-batches in
        flight (1F1B: stage ``i`` of ``p`` holds ``min(p - i, m)``, Narayanan et al. 2021 §2.2.1)."""
        plan, spec = self.plan, self.spec
        memory = model_state_bytes(self.stage_params(stage, layers), plan.dp, plan.zero)
        flight = in_flight(plan.pp, plan.virtual, stage, self.micro_batches)
        # the block being rebuilt for backward (and ZeRO-3's gathered weights): ``block.working``
        head = head_activation_bytes(spec, plan.micro_batch, plan.tp) if stage == plan.pp - 1 else 0.0
        memory["activations"] = flight * layers * self.block.kept + self.block.working + head
        return memory

    def sync_time(self, stage: int, layers: int) -> tuple[float, float]:
        """(gradient synchronisation, optimizer step) seconds of one stage at the end of the step."""
        plan, cluster = self.plan, self.cluster
        return _grad_sync(plan, cluster, self.stage_params(stage, layers)), _optimizer(
            plan, cluster, self.stage_params(stage, layers))


def fixed_params(spec: TransformerSpec, plan: ParallelPlan, stage: int) -> float:
    """Parameters one rank of ``stage`` holds besides its blocks: the vocab-parallel token embedding (and learned
    positions) on the first stage, the final norm and the output layer on the last (a tied one is the embedding
    again when pp > 1)."""
    vocab_shard = spec.padded_vocab(plan.tp) * spec.hidden / plan.tp
    params = 0.0
    if stage == 0:
        params += vocab_shard + (spec.seq * spec.hidden if spec.position == "learned" else 0)
    if stage == plan.pp - 1:
        params += spec.norm_params + (vocab_shard if plan.pp > 1 or not spec.tied else 0)
    return params


def _grad_sync(plan: ParallelPlan, cluster: Cluster, params: float) -> float:
    """Seconds to synchronise the fp16 gradients of ``params`` parameters across replicas at the step's end."""
    grad_bytes = 2 * params
    dp_group = dp_ranks(plan)
    if plan.zero == 0:
        return _coll("all_reduce", dp_group, grad_bytes, cluster)
    if plan.zero == 1:  # sbpflow's stage 1 all-reduces the gradients (B), then all-gathers the updated slices
        return _coll("all_reduce", dp_group, grad_bytes, cluster) + _coll("all_gather", dp_group, grad_bytes, cluster)
    if plan.zero == 2:  # gradients were reduce-scattered per micro-batch
        return _coll("all_gather", dp_group, grad_bytes, cluster)
    return 0.0  # ZeRO-3 gathers weights when it needs them


def _optimizer(plan: ParallelPlan, cluster: Cluster, params: float) -> float:
    owned = params / (plan.dp if plan.zero >= 1 else 1)
    return owned * ADAM_BYTES_PER_PARAM / cluster.profile.memory_throughput


def plan_costs(spec: TransformerSpec, cluster: Cluster, plan: ParallelPlan, batch: int,
               bound: bool = False) -> PlanCosts:
    """The per-block and per-send costs of ``plan`` (checks that it is a plan of this model and cluster).

    ``bound``: costs no choice inside a block can beat, for the search's lower bound: the block ILP's fastest
    choice with no memory limit, and the fewest parameters any choice holds per rank."""
    check_plan(spec, cluster, plan, batch)
    profile = cluster.profile
    block = _bound_block(spec, cluster, plan) if bound else plan_block(spec, cluster, plan, batch)
    params = min_block_params(spec, plan.tp) if bound else block.params
    act = ACT_BYTES * plan.micro_batch * spec.seq * spec.hidden  # one block's input or output
    return PlanCosts(
        spec=spec, cluster=cluster, plan=plan, micro_batches=batch // (plan.dp * plan.micro_batch),
        block=block, layer_params=params, layer_compute=3 * block.forward_s, layer_recompute=block.recompute_s,
        layer_tp=block_tp_time(spec, cluster, plan, block.choices) + block.weight_sync_s,
        layer_zero=_zero_per_micro_batch(cluster, plan, params),
        p2p=_p2p_time(plan, act, cluster),
        embedding=embedding_cost(spec, plan.micro_batch, profile),
        head=head_cost(spec, plan.micro_batch, plan.tp, profile),
    )


def block_budget(spec: TransformerSpec, cluster: Cluster, plan: ParallelPlan, batch: int
                 ) -> tuple[BlockBudget, float]:
    """What the block ILP charges a choice under ``plan``, and the memory it may take: the first stage (the most
    micro-batches in flight under 1F1B, the embedding) holding ⌈l/p⌉ blocks, with the device's usable memory
    less that stage's other parameters' state (under the plan's ZeRO stage) and, with one stage, the head's
    logits. A parameter held costs its share of the step's gradient sync and optimizer step (spread over the
    ``m + p - 1`` micro-batch slots of the pipeline) and ZeRO-2/3's traffic every micro-batch, linearised at
    Megatron's parameters per rank."""
    m = batch // (plan.dp * plan.micro_batch)
    blocks = math.ceil(spec.layers / plan.pp)
    state = sum(model_state_bytes(1.0, plan.dp, plan.zero).values())
    reference = blocks * spec.layer_params / plan.tp
    step = (_grad_sync(plan, cluster, reference) + _optimizer(plan, cluster, reference)) / (m + plan.pp - 1)
    per_micro_batch = blocks * _zero_per_micro_batch(cluster, plan, spec.layer_params / plan.tp)
    budget = BlockBudget(state_bytes=state, blocks=blocks, copies=float(min(plan.pp, m)),
                         gathered_bytes=2 * ACT_BYTES if plan.zero == 3 else 0.0,
                         param_seconds=(step + per_micro_batch) / reference)
    head = head_activation_bytes(spec, plan.micro_batch, plan.tp) if plan.pp == 1 else 0.0
    limit = cluster.profile.usable_memory - state * fixed_params(spec, plan, 0) - head
    return budget, limit


def plan_block(spec: TransformerSpec, cluster: Cluster, plan: ParallelPlan, batch: int) -> BlockPlan:
    """The SBPs inside every block that ``plan`` is predicted with: the block ILP's choice under
    :func:`block_budget` (cached across plans), or Megatron's when the plan's layout is ``megatron`` or when no
    choice fits (the plan then does not fit either, and is reported so)."""
    budget, limit = block_budget(spec, cluster, plan, batch)
    rpn = cluster.gpus_per_node
    if plan.layout == "ilp" and plan.tp > 1:
        found = cached_solve(spec, plan.micro_batch, plan.tp, cluster.profile, limit, plan.recompute, budget, rpn)
        if found is not None:
            return found
    return evaluate_block(spec, plan.micro_batch, plan.tp, cluster.profile, MEGATRON_CHOICES, plan.recompute,
                          budget, rpn)


def _bound_block(spec: TransformerSpec, cluster: Cluster, plan: ParallelPlan) -> BlockPlan:
    if plan.layout == "ilp" and plan.tp > 1:
        found = cached_solve(spec, plan.micro_batch, plan.tp, cluster.profile, None, plan.recompute,
                             ranks_per_node=cluster.gpus_per_node)
        if found is not None:
            return found
    return evaluate_block(spec, plan.micro_batch, plan.tp, cluster.profile, MEGATRON_CHOICES, plan.recompute,
                          ranks_per_node=cluster.gpus_per_node)


def min_block_params(spec: TransformerSpec, tp: int) -> float:
    """The fewest parameters of one block a rank can hold: every linear layer's weight split, norms whole
    (Megatron's choice; a GPT's: 12h²/t, the column layers' biases 7h/t, the rest 6h)."""
    h, up = spec.hidden, 2 if spec.gated else 1
    weights = h * spec.qkv_width + h * h + (up + 1) * h * spec.ffn
    column_biases, row_biases = (spec.qkv_width + up * spec.ffn, 2 * h) if spec.bias else (0, 0)
    return (weights + column_biases) / tp + row_biases + 2 * spec.norm_params


def block_tp_time(spec: TransformerSpec, cluster: Cluster, plan: ParallelPlan,
                  choices: tuple[tuple[str, str], ...] = MEGATRON_CHOICES) -> float:
    """One block's tensor-parallel collectives per micro-batch under the SBP ``choices``: each transition forward
    and its dual backward (``block_sbp.block_collectives``), and the forward ones again when full recompute reruns
    the forward. (The ``tokens`` layers' weight-gradient all-reduces are ``BlockPlan.weight_sync_s``.)"""
    kinds = block_collectives(choices, plan.tp, spec)
    tokens, group = plan.micro_batch * spec.seq, tuple(range(plan.tp))
    times = [_coll(kind, group, ACT_BYTES * tokens * width * spec.hidden, cluster) for kind, width in kinds]
    forward = sum(times[0::2])  # (forward, backward) pairs
    return sum(times) + (forward if plan.recompute == "full" else 0.0)


def check_plan(spec: TransformerSpec, cluster: Cluster, plan: ParallelPlan, batch: int) -> None:
    """A plan is valid when its degrees multiply to the device count, tensor parallelism keeps whole heads,
    every stage gets a block, and the batch splits evenly into replicas and micro-batches."""
    if plan.tp * plan.pp * plan.dp != cluster.devices:
        raise PlanError(f"tp · pp · dp must equal the {cluster.devices} devices, but {plan} has "
                        f"{plan.tp * plan.pp * plan.dp}")
    if spec.heads % plan.tp or spec.kv % plan.tp:
        raise PlanError(f"tensor parallelism splits whole attention heads, so tp must divide the {spec.heads} heads "
                        f"and {spec.kv} key/value heads, but got tp={plan.tp}")
    if plan.pp > spec.layers:
        raise PlanError(f"every pipeline stage needs a block, but pp={plan.pp} > layers={spec.layers}")
    if plan.micro_batch < 1 or batch % (plan.dp * plan.micro_batch):
        raise PlanError(f"the batch ({batch}) must split into dp={plan.dp} replicas of micro-batches of "
                        f"{plan.micro_batch}")
    if plan.recompute not in RECOMPUTE:
        raise PlanError(f"recompute must be one of {RECOMPUTE}, but got {plan.recompute!r}")
    if plan.zero not in (0, 1, 2, 3):
        raise PlanError(f"ZeRO stage must be 0, 1, 2 or 3, but got {plan.zero!r}")
    if plan.layout not in LAYOUTS:
        raise PlanError(f"a plan's block layout must be one of {LAYOUTS}, but got {plan.layout!r}")
    if plan.virtual < 1 or (plan.virtual > 1 and (plan.pp == 1 or spec.layers < plan.pp * plan.virtual)):
        raise PlanError(f"an interleaved pipeline gives each of the pp={plan.pp} stages {plan.virtual} chunks of at "
                        f"least one block, so it needs pp > 1 and pp · virtual <= {spec.layers} (the layers)")
    micro_batches = batch // (plan.dp * plan.micro_batch)
    if plan.virtual > 1 and micro_batches % plan.pp:
        raise PlanError(f"an interleaved pipeline runs micro-batches in groups of pp={plan.pp}, but the plan has "
                        f"{micro_batches}")


def dp_ranks(plan: ParallelPlan) -> tuple[int, ...]:
    """Stage 0's replicas of tensor shard 0: every tp-th rank."""
    return tuple(replica * plan.tp for replica in range(plan.dp))


def _coll(kind: str, ranks: tuple[int, ...], nbytes: float, cluster: Cluster) -> float:
    return collective_time(kind, ranks, nbytes, cluster.cost_model, cluster.profile.device_type)


def _p2p_time(plan: ParallelPlan, nbytes: float, cluster: Cluster) -> float:
    """One send between neighbouring stages. Across nodes with tp > 1, each of the t ranks sends 1/t over its
    own NIC and the receivers all-gather the pieces over the node's links (Narayanan et al. 2021 §4.1)."""
    if plan.pp == 1:
        return 0.0
    pair = (0, plan.dp * plan.tp)
    inter = cluster.cost_model.link(cluster.profile.device_type, pair) != cluster.cost_model.link(
        cluster.profile.device_type, (0,))
    if inter and plan.tp > 1:
        return _coll("send_recv", pair, nbytes / plan.tp, cluster) + _coll(
            "all_gather", tuple(range(plan.tp)), nbytes, cluster)
    return _coll("send_recv", pair, nbytes, cluster)


def _zero_per_micro_batch(cluster: Cluster, plan: ParallelPlan, params: float) -> float:
    """ZeRO-2 reduce-scatters each micro-batch's gradients (they are never whole on a rank); ZeRO-3 also
    all-gathers the weights before forward and before backward. Per block of ``params`` parameters per rank,
    per micro-batch."""
    nbytes = 2 * params
    group = dp_ranks(plan)
    if plan.zero == 2:
        return _coll("reduce_scatter", group, nbytes, cluster)
    if plan.zero == 3:
        return _coll("reduce_scatter", group, nbytes, cluster) + 2 * _coll("all_gather", group, nbytes, cluster)
    return 0.0


# ----------------------------------------------------------------------------- from costs and cuts to a prediction


def in_flight(pp: int, virtual: int, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations ``stage`` holds at once under 1F1B: ``min(p - i, m)`` (Narayanan et al.
    2021 §2.2.1); interleaved, the first chunks run ahead (Korthikanti et al. 2023, §4.2.3)."""
    flight = float(min(pp - stage, micro_batches))
    if virtual > 1:
        flight *= 1 + (pp - 1) / (pp * virtual)
    return flight


def pipeline_breakdown(totals: list[float], parts: Callable[[int], dict[str, float]], end: tuple[float, float],
                       micro_batches: int, virtual: int, bubble_share: float = 1.0) -> dict[str, float]:
    """A pipelined step's seconds by component (``TIME_KEYS``), from each stage's seconds per micro-batch
    (``totals``; ``parts(i)``: stage ``i``'s by component, compute to dp_comm) and the (gradient sync, optimizer
    step) that ends the step (the slowest stage's): ``m`` times the slowest stage, the bubble (the other stages'
    time over the ``virtual`` chunks, ``bubble_share`` of it left by zero-bubble schedules), then ``end``.

    >>> parts = [{"compute": 1.0, "recompute": 0.0, "tp_comm": 0.0, "pp_comm": 0.5, "dp_comm": 0.0}] * 2
    >>> pipeline_breakdown([1.5, 1.5], parts.__getitem__, (0.1, 0.3), 4, 1)["bubble"]
    1.5
    """
    slow = max(range(len(totals)), key=lambda i: totals[i])
    m, p = micro_batches, parts(slow)
    out = {"compute": m * p["compute"], "recompute": m * p["recompute"], "tp_comm": m * p["tp_comm"],
           "pp_comm": m * p["pp_comm"], "dp_comm": m * p["dp_comm"] + end[0],
           "bubble": bubble_share * (sum(totals) - totals[slow]) / virtual, "optimizer": end[1]}
    for extra in ("cp_comm", "ep_comm"):  # context parallel's ring, expert parallel's exchange (the graph planner's)
        if extra in p:
            out[extra] = m * p[extra]
    return out


def _parts(stage: StageCost) -> dict[str, float]:
    return {"compute": stage.compute, "recompute": stage.recompute, "tp_comm": stage.tp_comm,
            "pp_comm": stage.pp_comm, "dp_comm": stage.dp_comm}



def predict_with_cuts(costs: PlanCosts, stage_layers: tuple[int, ...], batch: int) -> Prediction:
    """The step time and memory of ``costs``' plan with ``stage_layers`` blocks on each stage."""
    plan = costs.plan
    stages = [costs.stage_cost(i, k) for i, k in enumerate(stage_layers)]
    syncs = [costs.sync_time(i, k) for i, k in enumerate(stage_layers)]
    last = max(range(len(syncs)), key=lambda i: sum(syncs[i]))
    breakdown = pipeline_breakdown([s.total for s in stages], lambda i: _parts(stages[i]), syncs[last],
                                   costs.micro_batches, plan.virtual)
    memories = [costs.stage_memory(i, k) for i, k in enumerate(stage_layers)]
    memory = max(memories, key=lambda mem: sum(mem.values()))
    step = sum(breakdown.values())
    devices = costs.cluster.devices
    return Prediction(
        plan=plan, batch=batch, stage_layers=tuple(stage_layers), step_time=step, breakdown=breakdown,
        memory=memory, usable_memory=costs.cluster.profile.usable_memory,
        tflops_per_device=costs.spec.hardware_flops(batch, plan.recompute) / step / devices / 1e12,
        model_tflops_per_device=costs.spec.model_flops(batch) / step / devices / 1e12,
        mfu=costs.spec.model_flops(batch) / step / devices / costs.cluster.profile.peak_flops,
        block=costs.block,
    )


def even_cuts(layers: int, stages: int) -> tuple[int, ...]:
    """As even as possible, earlier stages taking the extra blocks (``nn.parallelize.split_blocks``).

    >>> even_cuts(10, 4)
    (3, 3, 2, 2)
    """
    base, extra = divmod(layers, stages)
    return tuple(base + (i < extra) for i in range(stages))


def lower_bound(costs: PlanCosts) -> float:
    """A step time no placement of the cuts can beat: Σ t_i does not depend on the cuts, max t_i is at least
    their mean and at least any stage's fixed part plus one block, and some stage holds ⌈l/p⌉ blocks to sync."""
    plan, layers = costs.plan, costs.spec.layers
    fixed = [costs.stage_cost(i, 0).total for i in range(plan.pp)]
    per_layer = costs.layer_compute + costs.layer_recompute + costs.layer_tp + costs.layer_zero
    total = sum(fixed) + layers * per_layer
    slowest = max(total / plan.pp, max(fixed) + per_layer)
    most = math.ceil(layers / plan.pp)
    sync = min(sum(costs.sync_time(i, most)) for i in {0, min(1, plan.pp - 1), plan.pp - 1})  # the kinds of stage
    # m · max + (Σ - max) / v grows with max: the bound of max bounds the step
    return costs.micro_batches * slowest + (total - slowest) / plan.virtual + sync
