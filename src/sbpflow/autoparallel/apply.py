"""Auto-parallel for any model: plan its traced training step, then lay the model out by that plan.

``nn.Graph``'s ``config.enable_auto_parallel`` (and ``config.set_plan``) and ``sbpflow.auto_parallel`` take one
path: the step is traced on metadata and searched (:func:`plan_model`, ``graph_plan.plan_graph``), the model is
laid out by ``sbpflow.parallelize(model, **plan.parallelize_kwargs())`` (:func:`lay_out`), and a graph also
takes the plan's micro-batches, ZeRO stage, schedule and recompute (:func:`configure_graph`). The planner reads
the program, not a model class: a shipped model is planned as a user's own is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..creation import tensor as make_tensor
from ..errors import PlanError
from ..nn.container import ModuleList
from ..nn.module import Module
from ..nn.parallelize import Strategy, block_starts, parallelize
from ..tensor import Tensor, shards_from_full
from .graph_plan import Plan, plan_graph
from .graph_search import Knobs
from .host import HostPrediction, HostProfile, host_search
from .profiles import DeviceProfile
from .transformer import TransformerSpec


def plan_graph_inputs(graph: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``nn.Graph`` with ``config.enable_auto_parallel`` or ``config.set_plan``: at the first call, plans the graph's
    step (or takes the plan set), lays its one model out by the plan (:func:`lay_out`) and configures the graph
    (:func:`configure_graph`); then lays each call's local inputs (tensors or NumPy arrays) out as the plan's."""
    args = tuple(_local_tensor(a) if isinstance(a, np.ndarray) else a for a in args)
    strategy = graph.__dict__.get("_auto_strategy")
    if strategy is None:
        strategy = _plan_and_lay_out(graph, args)
    return _lay_out_inputs(strategy, args)


def _local_tensor(array: np.ndarray) -> Tensor:
    """A NumPy batch as a local tensor (integers as int64, as token ids and class labels are)."""
    return make_tensor(array.astype(np.int64) if array.dtype.kind in "iu" else array)


def _plan_and_lay_out(graph: Any, args: tuple[Any, ...]) -> Strategy:
    """Plans (or takes ``config.plan``), then lays the graph's one model out by the plan; returns its strategy.
    Every check runs before the model moves: a call that raises leaves graph and model as they were."""
    model = _one_model(graph, args)
    plan = graph.config.plan
    if plan is None:
        devices, profile, memory = graph.config.auto_parallel
        plan = plan_model(graph, args, devices, profile, memory_per_device=memory)
    _named_blocks(graph, plan.recomputed_blocks())  # (checked before the model moves)
    before = dict(model.named_parameters())
    strategy = lay_out(model, plan)
    _take_stacked_experts(graph, model, before)
    configure_graph(graph, plan)
    object.__setattr__(graph, "auto_plan", plan)
    object.__setattr__(graph, "_auto_strategy", strategy)
    return strategy


def plan_model(graph: Any, args: tuple[Any, ...], devices: int, profile: str | DeviceProfile = "cpu",
               memory_per_device: float | None = None, only: Callable[[Knobs], bool] | None = None) -> Plan:
    """The plan of the training step ``graph`` (an ``nn.Graph`` holding one model that sits on one device or was
    built under ``meta_init()``) on the plain local inputs ``args``; the model is left as it was."""
    model = _one_model(graph, args)
    with _layout_kept(graph, model):
        return plan_step(graph, args, devices, profile, memory_per_device=memory_per_device, only=only)


def lay_out(model: Module, plan: Plan, device: str = "cpu") -> Strategy:
    """Lays ``model`` out by ``plan`` with ``sbpflow.parallelize`` (stage starts moved to whole blocks)."""
    kwargs = plan.parallelize_kwargs()
    if kwargs["stages"] is not None:
        kwargs["stages"] = _whole_blocks(model, kwargs["stages"])
    return parallelize(model, **kwargs, device=device)


def _one_model(graph: Any, args: tuple[Any, ...]) -> Module:
    """The one model ``graph`` holds, checked to sit on one device, with ``args`` the plain local batch."""
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
    return model


def _take_stacked_experts(graph: Any, model: Module, before: dict[str, Any]) -> None:
    """``parallelize(expert=data)`` stacks each MoE's experts into new (E, ...) parameters (``prefix.w1`` for the
    ``prefix.{e}.w1.weight``): the graph's optimizers, made before the plan laid the model out, take them in place
    of the experts' own."""
    stacked = {}
    for name, p in model.named_parameters():
        if name not in before:
            prefix, _, weight = name.rpartition(".")
            stacked.update({id(before[f"{prefix}.{e}.{weight}.weight"]): p for e in range(p.shape[0])})
    if not stacked:
        return
    for entry in graph._optimizers:
        for group in entry.optimizer.param_groups:
            params = [stacked.get(id(p), p) for p in group["params"]]
            group["params"] = list({id(p): p for p in params}.values())  # one stacked weight per E experts


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
              memory_per_device: float | None = None, only: Callable[[Knobs], bool] | None = None) -> Plan:
    """Plans any ``nn.Graph``'s step from its traced graph for ``args``' metadata (what
    ``config.enable_auto_parallel(devices=, profile=, memory_per_device=)`` does at the first call, before it lays
    the model out with ``plan.parallelize_kwargs()`` and :func:`configure_graph`); ``only`` keeps the plans it
    accepts. Tracing a graph of a local model places it on this process's rank, as a call with local inputs
    does (:func:`plan_model` undoes that)."""
    return plan_graph(graph.trace(*args), devices, profile, memory_per_device=memory_per_device, only=only,
                      precision="traced")  # the plan runs this very step: price its own bytes


def configure_graph(graph: Any, plan: Plan) -> None:
    """Sets an ``nn.Graph``'s config to a graph plan's knobs: micro-batches, ZeRO stage, pipeline schedule, and
    activation checkpointing of the repeated blocks that the plan fully recomputes (all, or per block), and the SBP
    selection's activation cap at the traced layouts' (what the plan priced). (The layout itself is
    ``sbpflow.parallelize(model, **plan.parallelize_kwargs())``.) Selective recompute has no graph setting yet (the
    planner offers it to what-ifs only): such a plan runs with every activation kept.

    >>> from types import SimpleNamespace
    >>> calls = []
    >>> config = SimpleNamespace(set_gradient_accumulation_steps=lambda m: calls.append(("micro", m)),
    ...                          enable_zero=lambda stage: calls.append(("zero", stage)),
    ...                          set_pipeline_schedule=lambda s: calls.append(("schedule", s)), activation_cap="auto")
    >>> configure_graph(SimpleNamespace(config=config, _modules={}), Plan.example())
    >>> calls, config.activation_cap
    ([('micro', 1)], 'traced')
    """
    config = graph.config
    config.set_gradient_accumulation_steps(plan.micro_batches)
    if config.activation_cap == "auto":  # the plan priced what the laid-out (traced) layouts keep: no more
        config.activation_cap = "traced"
    if plan.knobs.zero:
        config.enable_zero(stage=plan.knobs.zero)
    if plan.knobs.pp > 1:
        config.set_pipeline_schedule(plan.knobs.schedule)
    for module in _named_blocks(graph, plan.recomputed_blocks()):
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


def auto_parallel_host(model: Module, spec: TransformerSpec, host: HostProfile, batch: int,
                       device: str = "cpu") -> HostAutoPlan:
    """Plans the eager training of a transformer of sizes ``spec`` (``model``'s) on the processes of one host
    (``host`` from ``calibrate_host``) with the host model, and lays ``model`` out by the fastest plan with
    ``sbpflow.parallelize``: its repeated-block list cut into the plan's blocks per stage.

    >>> import sbpflow
    >>> from sbpflow import nn
    >>> from sbpflow.autoparallel.host import HostProfile
    >>> host = HostProfile(processes=2, cores_factor=((1, 1.0), (2, 2.0)), dispatch_s=4e-5,
    ...                    foreign_dispatch_s=1e-5, gemm_flops=1e11, elementwise_bw=1e10,
    ...                    collectives=((2, 5e-4, 1e-9),), p2p=(5e-4, 1e-9))
    >>> model = nn.Sequential(nn.Embedding(32, 16), nn.ModuleList([nn.Linear(16, 16) for _ in range(2)]))
    >>> spec = TransformerSpec(layers=2, hidden=16, heads=2, seq=8, vocab=32)
    >>> auto = auto_parallel_host(model, spec, host, batch=4)
    >>> auto.strategy.world_size, [p.plan.pp for p in auto.ranking][:1]   # two cores: the stages share nothing
    (2, [2])
    """
    ranking = host_search(spec, host, batch)
    best = ranking[0]
    starts = block_starts(model, best.stage_layers) if best.plan.pp > 1 else None
    strategy = parallelize(model, data=best.plan.dp, tensor=best.plan.tp, pipeline=best.plan.pp, stages=starts,
                           device=device)
    return HostAutoPlan(spec, ranking, strategy)
