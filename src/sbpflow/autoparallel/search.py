"""The plan search: tensor × pipeline × data degrees, micro-batch, ZeRO stage and recomputation together.

Every combination the flags leave open is a candidate. Each gets a cheap lower bound on its step time
(:func:`~sbpflow.autoparallel.predict.lower_bound`, no cuts needed, priced with the block ILP's fastest choice
without a memory limit, which a few solves cover for all candidates); candidates are then costed exactly, stage
cuts included (:func:`~sbpflow.autoparallel.stages.cut_stages`), in order of their bound, until the bound of
the next one exceeds the slowest of the ``keep`` best plans found. That is branch and bound: the result is
the same as costing every candidate (``exhaustive=True`` does, and the tests compare), in a fraction of the
time. Costing a candidate exactly solves its block ILP under its own memory budget (cached: candidates that
differ only where the budget does not see share a solve).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import PlanError
from .predict import Cluster, ParallelPlan, PlanCosts, Prediction, even_cuts, lower_bound, plan_costs, predict_with_cuts
from .stages import cut_stages
from .transformer import RECOMPUTE, TransformerSpec

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Fixed:
    """The parts of a plan the user fixed; None is searched."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    zero: int | None = None
    recompute: str | None = None
    micro_batches: int | None = None  # micro-batches per step (1: no pipelining of micro-batches, as eager runs)
    layout: str = "ilp"  # SBPs inside a block: the ILP's choice, or "megatron" (what parallelize applies)
    virtual: int | None = None  # model chunks per pipeline stage (interleaved 1F1B when > 1)

    def describe(self) -> str:
        """What was fixed, in words: ``with tp=8, pp=16 fixed`` (empty when nothing was)."""
        fields = ("tp", "pp", "dp", "micro_batch", "zero", "recompute", "micro_batches", "virtual")
        given = [f"{name.replace('_', '-')}={value}" for name in fields if (value := getattr(self, name)) is not None]
        return f"with {', '.join(given)} fixed" if given else "(nothing fixed)"


@dataclass
class SearchResult:
    """The best plan, the next best (``runners_up``), the fastest plans that did not fit, and the effort."""

    best: Prediction
    runners_up: list[Prediction]
    too_big: list[Prediction]
    candidates: int
    costed: int
    seconds: float
    exhaustive: bool = False
    fixed: Fixed = field(default_factory=Fixed)


def candidate_plans(spec: TransformerSpec, cluster: Cluster, batch: int, fixed: Fixed = Fixed()) -> list[ParallelPlan]:
    """Every valid plan agreeing with ``fixed``. Unfixed tensor parallelism stays inside a node (its
    all-reduces are on the critical path of every block); ZeRO stages are only distinct with dp > 1."""
    plans = []
    for tp in _choices(fixed.tp, _divisors(min(cluster.gpus_per_node, cluster.devices))):
        if spec.heads % tp or spec.kv % tp or cluster.devices % tp:
            continue
        for pp in _choices(fixed.pp, _divisors(cluster.devices // tp)):
            dp = cluster.devices // (tp * pp)
            if pp > spec.layers or tp * pp * dp != cluster.devices or fixed.dp not in (None, dp):
                continue
            for virtual in _choices(fixed.virtual, _chunks(spec.layers, pp)):
                if virtual == 1 or (pp > 1 and spec.layers >= pp * virtual):
                    plans += _knobs(tp, pp, dp, batch, fixed, virtual)
    return plans


def _chunks(layers: int, pp: int) -> tuple[int, ...]:
    """Interleaving degrees to try: 1, and 2, 3, 4, 6 or 8 chunks per stage of at least one block when pp > 1."""
    return (1,) if pp == 1 else tuple(v for v in (1, 2, 3, 4, 6, 8) if pp * v <= layers)


def _knobs(tp: int, pp: int, dp: int, batch: int, fixed: Fixed, virtual: int = 1) -> list[ParallelPlan]:
    plans = []
    sizes = MICRO_BATCHES if fixed.micro_batches is None else (batch // (dp * fixed.micro_batches),)
    for micro_batch in _choices(fixed.micro_batch, sizes):
        if micro_batch < 1 or batch % (dp * micro_batch):
            continue
        if fixed.micro_batches is not None and batch != dp * micro_batch * fixed.micro_batches:
            continue
        if virtual > 1 and (batch // (dp * micro_batch)) % pp:
            continue
        for zero in _choices(fixed.zero, (0, 1, 2, 3) if dp > 1 else (0,)):
            for recompute in _choices(fixed.recompute, RECOMPUTE):
                plans.append(ParallelPlan(tp, pp, dp, micro_batch, zero, recompute, fixed.layout, virtual))
    return plans


def _choices(value: object, default: tuple) -> tuple:
    return default if value is None else (value,)


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def cost(costs: PlanCosts, batch: int) -> Prediction:
    """The plan with its best cuts; with no cut in memory, even cuts (and ``fits`` False)."""
    cuts = cut_stages(costs) if costs.plan.virtual == 1 else None  # interleaved: blocks spread evenly
    return predict_with_cuts(costs, cuts or even_cuts(costs.spec.layers, costs.plan.pp), batch)


def search(spec: TransformerSpec, cluster: Cluster, batch: int, fixed: Fixed = Fixed(), keep: int = 5,
           exhaustive: bool = False) -> SearchResult:
    """The fastest plan that fits, with ``keep - 1`` runners-up.

    >>> from sbpflow.autoparallel import PROFILES
    >>> gpt = TransformerSpec(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
    >>> result = search(gpt, Cluster(8, PROFILES["a100-80gb"], 8), batch=16)
    >>> result.best.fits, result.best.plan.tp * result.best.plan.pp * result.best.plan.dp
    (True, 8)
    """
    start = time.perf_counter()
    plans = candidate_plans(spec, cluster, batch, fixed)
    if not plans:
        raise PlanError(f"no plan of {spec.describe()} on {cluster.devices} devices "
                        f"({cluster.gpus_per_node} per node) for a batch of {batch} {fixed.describe()}: a plan needs "
                        f"tp dividing the {spec.heads} heads, {spec.kv} key/value heads and the devices (searched "
                        f"within a node), pp dividing devices / tp and at most {spec.layers} (the layers), and the "
                        f"batch split into dp replicas of whole micro-batches")
    bounded = sorted(((lower_bound(plan_costs(spec, cluster, p, batch, bound=True)), i, p)
                      for i, p in enumerate(plans)), key=lambda x: x[:2])
    good: list[Prediction] = []
    too_big: list[Prediction] = []
    costed = 0
    for bound, _, plan in bounded:
        if not exhaustive and len(good) >= keep and bound > good[keep - 1].step_time:
            break
        prediction = cost(plan_costs(spec, cluster, plan, batch), batch)
        costed += 1
        (good if prediction.fits else too_big).append(prediction)
        good.sort(key=lambda p: p.step_time)
    if not good:
        smallest = min(too_big, key=lambda p: p.memory_per_device)
        where = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in smallest.memory.items())
        raise PlanError(f"no plan of {spec.describe()} on {cluster.devices} x {cluster.profile.name} fits in memory: "
                        f"the smallest, {smallest.plan}, needs {smallest.memory_per_device / 1e9:.1f} GB per device "
                        f"({where} GB), but {cluster.profile.usable_memory / 1e9:.1f} GB are usable")
    faster_too_big = sorted((p for p in too_big if p.step_time < good[0].step_time), key=lambda p: p.step_time)
    return SearchResult(good[0], good[1:keep], faster_too_big[:3], len(plans), costed,
                        time.perf_counter() - start, exhaustive, fixed)


def predict(spec: TransformerSpec, cluster: Cluster, plan: ParallelPlan, batch: int) -> Prediction:
    """One fully given plan, with its best cuts."""
    return cost(plan_costs(spec, cluster, plan, batch), batch)
