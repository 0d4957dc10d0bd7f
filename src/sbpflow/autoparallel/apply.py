"""``sbpflow.auto_parallel``: plan a GPT for the devices at hand and lay it out by that plan.

The plan comes from the same search as ``sbpflow plan``, restricted to what the model's
:func:`~sbpflow.models.gpt.parallelize` realises: tensor, pipeline and data degrees and uneven stage cuts.
sbpflow's GPT keeps whole optimizer state on every replica and stores all activations, so ZeRO stays 0 and
recompute "none"; its blocks are laid out Megatron-style, so the search prices them with Megatron-LM's SBPs
(``layout="megatron"``), not the block ILP's choice, and the plan predicted is the plan run.
Eager training runs a step as one micro-batch (stages do not overlap), which is the
default; ``micro_batches=None`` lets the search choose, for ``nn.Graph`` with
``config.set_gradient_accumulation_steps(auto.micro_batches)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import PlanError
from ..nn.container import ModuleList
from ..nn.parallelize import parallelize
from ..tensor import Tensor, shards_from_full
from .explain import explain
from .graph_plan import Plan, plan_graph
from .host import HostPrediction, HostProfile, host_search
from .predict import Cluster, Prediction
from .profiles import DeviceProfile, get_profile
from .search import Fixed, SearchResult, search
from .transformer import TransformerSpec

Strategy = Any  # what a model's `lay_out` returns: sbpflow.models.gpt.Strategy for the GPT


@runtime_checkable
class Plannable(Protocol):
    """A model the planner lays out (sbpflow.models.gpt.GPT is one): the planner reaches models only through this.

    ``strategy`` is the layout applied (None before); its ``shard_inputs(ids, targets)`` places a step's inputs.
    """

    strategy: Any

    def planner_sizes(self) -> dict[str, int]:
        """The model's sizes as TransformerSpec's fields: layers, hidden, heads, seq, vocab."""
        ...

    def lay_out(self, data: int, tensor: int, pipeline: Sequence[int], device: str) -> Any:
        """Places the parameters for the plan's degrees (``pipeline``: blocks per stage); returns the strategy."""
        ...


@dataclass
class AutoPlan:
    """The search's outcome and the strategy it was applied as."""

    spec: TransformerSpec
    cluster: Cluster
    result: SearchResult
    strategy: Strategy

    @property
    def prediction(self) -> Prediction:
        return self.result.best

    @property
    def micro_batches(self) -> int:
        plan = self.prediction.plan
        return self.prediction.batch // (plan.dp * plan.micro_batch)

    def explain(self) -> str:
        return explain(self.spec, self.cluster, self.prediction, self.result)


def gpt_spec(model: object) -> TransformerSpec:
    """The planner's description of a :class:`Plannable` model, such as an ``sbpflow.models.gpt.GPT``."""
    sizes: dict[str, Any] = dict(_plannable(model).planner_sizes())
    return TransformerSpec(**sizes)


def _plannable(model: object) -> Plannable:
    if not isinstance(model, Plannable):
        raise PlanError(f"auto_parallel plans models that implement autoparallel.apply.Plannable (such as "
                        f"sbpflow.models.gpt.GPT), but got {type(model).__name__}")
    return model


def auto_parallel(model: object, devices: int, batch: int, device: str = "cpu",
                  profile: str | DeviceProfile = "cpu", gpus_per_node: int | None = None,
                  micro_batches: int | None = 1) -> AutoPlan:
    """Searches the fastest plan of ``model`` on ``devices`` ranks for a global ``batch`` and applies it.

    >>> import sbpflow
    >>> from sbpflow.models.gpt import GPT, GPTConfig
    >>> sbpflow.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    >>> auto = sbpflow.auto_parallel(model, devices=2, batch=4)
    >>> auto.strategy.world_size, model.strategy is auto.strategy
    (2, True)
    """
    spec = gpt_spec(model)
    found = get_profile(profile)
    cluster = Cluster(devices, found, gpus_per_node or devices)
    # parallelize lays every block out Megatron-style (models.gpt.BLOCK_PLAN: column/row styles, the residual
    # stream B on the tensor axis); the block ILP's other choices (sequence-parallel stream, replicated or
    # token-split layers) have no parallelize style, so plans that are applied are predicted with that layout.
    fixed = Fixed(zero=0, recompute="none", micro_batches=micro_batches, layout="megatron", virtual=1)
    result = search(spec, cluster, batch, fixed)
    plan = result.best.plan
    strategy = _plannable(model).lay_out(data=plan.dp, tensor=plan.tp, pipeline=result.best.stage_layers,
                                         device=device)
    return AutoPlan(spec, cluster, result, strategy)


def plan_graph_inputs(graph: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``nn.Graph`` with ``config.enable_auto_parallel`` or ``config.set_plan``: at the first call, plans the graph's
    model (or takes the plan set) and lays it out; then lays each call's local inputs out as the plan's.

    A graph whose one model is a :class:`Plannable` (the GPT) and that was given neither a plan nor a memory cap
    is planned by the sizes planner, as ``sbpflow.auto_parallel`` does; every other graph by its traced step
    (:func:`plan_step`), laid out by ``sbpflow.parallelize(model, **plan.parallelize_kwargs())`` and
    :func:`configure_graph`."""
    config = graph.config
    if config.plan is None and config.auto_parallel[2] is None and _plannable_model(graph) is not None:
        return _gpt_inputs(graph, args)
    strategy = graph.__dict__.get("_auto_strategy")
    if strategy is None:
        strategy = _plan_and_lay_out(graph, args)
    return _lay_out_inputs(strategy, args)


def _gpt_inputs(graph: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    model = _graph_gpt(graph)
    if model.strategy is None:
        devices, profile, _ = graph.config.auto_parallel
        auto = auto_parallel(model, devices, batch=int(args[0].shape[0]), profile=profile, micro_batches=None)
        graph.config.set_gradient_accumulation_steps(auto.micro_batches)
        object.__setattr__(graph, "auto_plan", auto)
    if not 1 <= len(args) <= 2:
        raise PlanError(f"an auto-parallel GPT step takes ids (and targets), but got {len(args)} arguments")
    ids, targets = model.strategy.shard_inputs(*args)  # type: ignore[union-attr]
    return (ids,) if targets is None else (ids, targets)


def _plannable_model(graph: Any) -> Any:
    found = [m for m in graph._modules.values() if isinstance(m, Plannable)]
    return found[0] if len(found) == 1 and len(graph._modules) == 1 else None


def _graph_gpt(graph: Any) -> Any:
    found = [m for m in graph._modules.values() if isinstance(m, Plannable)]
    if len(found) != 1:
        raise PlanError(f"enable_auto_parallel plans the one model a graph holds that implements "
                        f"autoparallel.apply.Plannable (such as sbpflow.models.gpt.GPT), but "
                        f"{type(graph).__name__} holds {len(found)}")
    return found[0]


def _plan_and_lay_out(graph: Any, args: tuple[Any, ...]) -> Any:
    """Plans (or takes ``config.plan``), then lays the graph's one model out by the plan; returns its strategy.
    Every check runs before the model moves: a call that raises leaves graph and model as they were."""
    name = type(graph).__name__
    if len(graph._modules) != 1:
        raise PlanError(f"auto-parallel lays out the one model a graph holds, but {name} holds "
                        f"{len(graph._modules)} modules ({', '.join(graph._modules) or 'none'})")
    (attribute, model), = graph._modules.items()
    tensors = [a for a in args if isinstance(a, Tensor)]
    if not tensors or any(a.is_global for a in tensors):
        got = ", ".join(a._describe() for a in tensors) or "no tensor argument"
        raise PlanError(f"auto-parallel {name} takes the plain local batch (the same on every process), which the "
                        f"plan lays out, but got {got}")
    placed = [n for n, t in _own_tensors(model) if t.is_global]
    if placed:
        raise PlanError(f"auto-parallel lays out a model that sits on one device, but {name}.{attribute} already "
                        f"holds global tensors ({', '.join(placed[:3])}{', ...' if len(placed) > 3 else ''})")
    plan = graph.config.plan
    if plan is None:
        devices, profile, memory = graph.config.auto_parallel
        with _layout_kept(graph, model):
            plan = plan_step(graph, args, devices, profile, memory_per_device=memory)
    kwargs = plan.parallelize_kwargs()
    if kwargs["stages"] is not None:
        kwargs["stages"] = _whole_blocks(model, kwargs["stages"])
    strategy = parallelize(model, **kwargs)
    configure_graph(graph, plan)
    object.__setattr__(graph, "auto_plan", plan)
    object.__setattr__(graph, "_auto_strategy", strategy)
    return strategy


def _whole_blocks(model: Any, starts: list[str]) -> list[str]:
    """Stage starts moved to the start of the block they fall in (the child of a ModuleList, else of the model
    that holds them): the planner may cut inside a block, between modules whose outputs the block's own forward
    adds (a residual), which pre-hooks on modules cannot move between stages. Starts that would meet are kept."""
    named = dict(model.named_modules())
    moved = []
    for start in starts:
        parts = start.split(".")
        block = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                      if isinstance(named.get(".".join(parts[:i - 1])), ModuleList)), parts[0])
        moved.append(block if block in named else start)
    return moved if len(set(moved)) == len(moved) else list(starts)


def _own_tensors(model: Any) -> list[tuple[str, Any]]:
    return [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if b is not None)]


@contextmanager
def _layout_kept(graph: Any, model: Any) -> Iterator[None]:
    """Tracing a graph of a local model lays its tensors out on this process's rank and makes optimizer state:
    both are undone on leaving, so the plan lays out the model (and the first step makes state) as it was."""
    tensors = [t for _, t in _own_tensors(model)]
    fields = ("_shape", "_dtype", "_placement", "_sbp", "_shards", "_local")
    saved = [({f: getattr(t, f) for f in fields}, t.grad, t._version) for t in tensors]
    states = [(opt.state, {i: set(s) for i, (_, s) in opt.state._by_id.items()})
              for opt in (e.optimizer for e in graph._optimizers)]
    try:
        yield
    finally:
        for t, (layout, grad, version) in zip(tensors, saved, strict=True):
            for f, value in layout.items():
                object.__setattr__(t, f, value)
            if getattr(t, "_boxed", None) is not None:
                t._boxed = {}
            t.grad, t._version = grad, version
        for by_param, had in states:
            for i in list(by_param._by_id):
                if i not in had:
                    del by_param._by_id[i]
                else:
                    for key in set(by_param._by_id[i][1]) - had[i]:
                        del by_param._by_id[i][1][key]


def _lay_out_inputs(strategy: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Local tensor inputs as the parallelized model's pre-hook lays them out: the first on the first stage, the
    others on the last, split on the batch over the data axis."""
    out, first = [], True
    for a in args:
        if isinstance(a, Tensor) and not a.is_global:
            placement = strategy.stages[0] if first else strategy.stages[-1]
            if a.is_meta:  # compile_only of a model built under meta_init()
                a = Tensor._meta(tuple(a.shape), a.dtype, placement, strategy.input_sbp)
                out.append(a)
                first = False
                continue
            value = a.to_local()
            a = Tensor._from_shards(tuple(value.shape), value.dtype, placement, strategy.input_sbp,
                                    shards_from_full(value, placement, strategy.input_sbp))
        first = first and not isinstance(a, Tensor)
        out.append(a)
    return tuple(out)


def plan_step(graph: Any, args: tuple[Any, ...], devices: int, profile: str | DeviceProfile = "cpu",
              memory_per_device: float | None = None) -> Plan:
    """Plans any ``nn.Graph``'s step from its traced graph for ``args``' metadata (what
    ``config.enable_auto_parallel(devices=, profile=, memory_per_device=)`` does at the first call, before it lays
    the model out with ``plan.parallelize_kwargs()`` and :func:`configure_graph`). Tracing a graph of a local
    model places it on this process's rank, as a call with local inputs does."""
    return plan_graph(graph.trace(*args), devices, profile, memory_per_device=memory_per_device)


def configure_graph(graph: Any, plan: Plan) -> None:
    """Sets an ``nn.Graph``'s config to a graph plan's knobs: micro-batches, ZeRO stage, pipeline schedule, and
    activation checkpointing of the repeated blocks under full recompute. (The layout itself is
    ``sbpflow.parallelize(model, **plan.parallelize_kwargs())``.) Selective recompute has no graph setting yet:
    such a plan runs with every activation kept, which its memory prediction over-estimates nothing of.

    >>> from types import SimpleNamespace
    >>> calls = []
    >>> config = SimpleNamespace(set_gradient_accumulation_steps=lambda m: calls.append(("micro", m)),
    ...                          enable_zero=lambda stage: calls.append(("zero", stage)),
    ...                          set_pipeline_schedule=lambda s: calls.append(("schedule", s)))
    >>> configure_graph(SimpleNamespace(config=config, _modules={}), Plan.example())
    >>> calls
    [('micro', 1)]
    """
    config = graph.config
    config.set_gradient_accumulation_steps(plan.micro_batches)
    if plan.knobs.zero:
        config.enable_zero(stage=plan.knobs.zero)
    if plan.knobs.pp > 1:
        config.set_pipeline_schedule(plan.knobs.schedule)
    if plan.knobs.recompute == "full":
        for module in _named_blocks(graph, plan.blocks):
            module.config.activation_checkpointing = True


def _named_blocks(graph: Any, names: list[str]) -> list[Any]:
    """The graph's modules called ``names`` (relative to the one model a graph holds, or with its attribute)."""
    found = []
    for attribute, root in graph._modules.items():
        named = dict(root.named_modules())
        for name in names:
            module = named.get(name) or named.get(name.removeprefix(attribute + "."))
            if module is None:
                raise PlanError(f"the plan recomputes block {name!r}, but {type(graph).__name__}.{attribute} has no "
                                f"such module")
            found.append(module)
    return found


@dataclass
class HostAutoPlan:
    """The host search's ranking (fastest first) and the strategy the best plan was applied as."""

    spec: TransformerSpec
    ranking: list[HostPrediction]
    strategy: Strategy

    @property
    def prediction(self) -> HostPrediction:
        return self.ranking[0]

    def explain(self, runners_up: int = 4) -> str:
        """The chosen plan's predicted step by component, then the next plans and the components they lose on."""
        best = self.prediction
        lines = [f"chosen: {_host_name(best)}: {best.step_time * 1e3:.1f} ms per step ("
                 + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in best.breakdown.items() if v) + " ms)"]
        for other in self.ranking[1:runners_up + 1]:
            worse = sorted(((other.breakdown[k] - best.breakdown.get(k, 0.0), k) for k in other.breakdown),
                           reverse=True)[:2]
            lines.append(f"  {_host_name(other)}: {other.step_time * 1e3:.1f} ms, loses on "
                         + ", ".join(f"{k} +{d * 1e3:.1f} ms" for d, k in worse if d > 0))
        return "\n".join(lines)


def _host_name(p: HostPrediction) -> str:
    return f"tp{p.plan.tp} pp{p.plan.pp} dp{p.plan.dp} stages {list(p.stage_layers)}"


def auto_parallel_host(model: object, host: HostProfile, batch: int, device: str = "cpu") -> HostAutoPlan:
    """Plans ``model``'s eager training on the processes of one host (``host`` from ``calibrate_host``) with the
    host model, and applies the fastest plan.

    >>> import sbpflow
    >>> from sbpflow.autoparallel.host import HostProfile
    >>> from sbpflow.models.gpt import GPT, GPTConfig
    >>> host = HostProfile(processes=2, cores_factor=((1, 1.0), (2, 2.0)), dispatch_s=4e-5,
    ...                    foreign_dispatch_s=1e-5, gemm_flops=1e11, elementwise_bw=1e10,
    ...                    collectives=((2, 5e-4, 1e-9),), p2p=(5e-4, 1e-9))
    >>> sbpflow.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    >>> auto = auto_parallel_host(model, host, batch=4)
    >>> auto.strategy.world_size, [p.plan.pp for p in auto.ranking][:1]   # two cores: the stages share nothing
    (2, [2])
    """
    spec = gpt_spec(model)
    ranking = host_search(spec, host, batch)
    best = ranking[0]
    strategy = _plannable(model).lay_out(data=best.plan.dp, tensor=best.plan.tp, pipeline=best.stage_layers,
                                         device=device)
    return HostAutoPlan(spec, ranking, strategy)
