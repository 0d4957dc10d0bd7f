"""``sbpflow.nn.Graph``: a whole training (or inference) step compiled once, then run as a physical plan.

>>> import sbpflow
>>> from sbpflow import nn, sbp
>>> p = sbpflow.placement("cpu", [0, 1])
>>> model = nn.Linear(4, 2, placement=p, sbp=sbp.broadcast)
>>> opt = sbpflow.optim.SGD(model.parameters(), lr=0.1)
>>> class Step(nn.Graph):
...     def __init__(self):
...         super().__init__()
...         self.model = model
...         self.add_optimizer(opt)
...     def build(self, x):
...         loss = self.model(x).square().mean()
...         loss.backward()
...         return loss
>>> x = sbpflow.ones(8, 4, placement=p, sbp=sbp.split(0))
>>> loss = Step()(x)      # traces, compiles, runs
>>> loss.shape
torch.Size([])

The first call for a given input metadata (shape, dtype, placement, SBP) traces ``build()`` on lazy
tensors, selects SBPs for the whole graph, lowers it to a physical plan and verifies it; later calls
only run the plan. Parameters, buffers and optimizer state are the graph's variables: the very tensors
that ``model.state_dict()`` and the optimizer hold, updated in place after each successful step, so
eager and compiled steps can alternate on one model. A plan also assumes what the trace saw of the model and
optimizer (which tensors, ``requires_grad``, ``training``, hyperparameters but the lr): a call that finds any of it
changed compiles again, with a :class:`GraphRecompileWarning` naming the change, as torch.compile's guards do.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import amp
from .. import random as sbp_random
from .._layout import shard_box, shard_shape
from ..amp import GradScaler, trace_masked_updates
from ..autograd import enable_grad
from ..autoparallel.apply import plan_graph_inputs
from ..autoparallel.graph_plan import Plan
from ..comm import get_backend
from ..comm.base import TARGET_COST_FACTORS
from ..comm.simulated import SimulatedBackend
from ..creation import meta_tensor
from ..distributed import rank
from ..errors import SbpflowError
from ..graph.compile import CompileOptions, CompileReport, compile_graph, gc_paused
from ..graph.explain import explain, save_dot
from ..graph.ir import LNode, LogicalGraph
from ..graph.physical import PhysicalPlan
from ..graph.schedule import SCHEDULES
from ..graph.select import METHODS
from ..graph.trace import TraceError, Tracer, record_to_global, user_line
from ..meta import refuse
from ..optim.clip import clip_grad_norm_
from ..optim.zero import zero
from ..placement import Placement
from ..runtime import actors
from ..runtime.inorder import RANDOM_FEED, run_plan
from ..runtime.memory import dry_run
from ..sbp import Partial, Split, broadcast, format_nd
from ..tensor import Tensor
from ..utils.checkpoint import checkpoint
from .module import Module, relayout_

FOUND_INF = "amp.found_inf"  # the hidden output of a loss-scaled step: whether its gradients overflowed
SHOW: list[tuple[str, int | None]] = []  # set by `sbpflow graph`: (folder, rank) to describe every compile in


class GraphConfig:
    """Compile options of one :class:`Graph`."""

    def __init__(self) -> None:
        self.micro_batches = 1
        # False: micro-batches split the batch, and a step equals the full batch's for any loss (a sum loss sums,
        # a mean divides by the whole batch); True: gradients and scalar results are averaged over them (OneFlow)
        self.average_micro_batches = False
        self.executor = "actors"  # "actors" (the actor runtime) or "inorder" (the reference executor)
        self.threads: bool | None = None  # actor runtime: worker threads (None: under torch.distributed only)
        self.sbp_selection = "ilp"  # "ilp" (global, repeated layers tied), "ilp-unmerged" or "greedy" (eager's choice)
        # the activations the selection may keep for backward, bytes per rank (set_sbp_selection): "auto" is
        # "traced" under ZeRO 2 and 3 (whose sharded gradients or weights make replicated layouts cheap, so the
        # memory ZeRO was asked to save would go to activations), else None (ZeRO 1 shards only the update: its
        # forward and backward are the plain step's, and so is their choice)
        self.activation_cap: int | str | None = "auto"
        self.trace_path: str | None = None  # the actor runtime's timeline file (else SBPFLOW_TRACE, else none)
        # (devices, profile, memory_per_device): plan the model at the first call (enable_auto_parallel)
        self.auto_parallel: tuple[int, Any, float | None] | None = None
        self.plan: Any = None  # a graph plan (autoparallel.graph_plan.Plan) to lay the model out by (set_plan)
        self.pipeline_schedule = "1f1b"  # how stages on several placements take turns (graph.pipeline)
        self.zero_stage = 0  # ZeRO stage of the optimizers (enable_zero); 0: plain data parallel
        self.zero_options: dict[str, Any] = {}
        self.zero_prefetch = 1  # stage 3: how many units ahead a parameter gather may run (graph.prefetch)
        self.amp_dtype: torch.dtype | None = None  # the autocast dtype of build() (enable_amp); None: off
        self.grad_comm_dtype: torch.dtype | None = None  # the dtype gradients are reduced in; None: their own
        self.loss_scaler: Any = None  # an amp.GradScaler whose rules run inside the step (fp16); None: off
        self.fused_segments = True  # runs of plain compute nodes become one node of generated code (graph.fuse)
        self.segment_torch_compile = False  # and that code runs under torch.compile
        # the gradients one act of the schedule makes are summed by one accumulate node (graph.group); False: one
        # node per gradient (the numbers are the same)
        self.group_accumulates = True
        # a data-parallel gradient stays P(sum) over the micro-batches and is all-reduced once a step
        # (graph.late_reduce); False: once per micro-batch, as autograd's conversion reads
        self.reduce_after_accumulating = True
        # a multi-tensor optimizer update is cut by the gradient collective (bucket) each parameter waits for, so
        # early buckets' parameters update while the last bucket is on the wire (graph.update_split); False:
        # one update per parameter group (the numbers are the same)
        self.update_per_bucket = True
        # ZeRO-1/2: the updated shards are all-gathered in flat buckets, one collective per bucket
        # (graph.gather_bucket); False: one all-gather per parameter (the numbers are the same)
        self.gather_buckets = True

    def enable_zero(self, mode: bool | int = True, *, stage: int | None = None, prefetch: int = 1,
                    **options: Any) -> None:
        """Shards optimizer state (1), gradients (2) and parameters (3) on the data axis, as
        :func:`sbpflow.optim.zero` (``options``: ``axis``, ``min_shard_numel``, ``units``); the traced step then
        carries those SBPs as constraints (reduce-scatters and all-gathers instead of all-reduces). Stage 3
        gathers a unit's parameters up to ``prefetch`` units ahead of its use, so at most ``prefetch + 1``
        units (besides the model itself) hold gathered copies at once (:mod:`sbpflow.graph.prefetch`).

        OneFlow's spelling works too: ``enable_zero(True, stage=2)``, ``enable_zero(False)`` (off),
        ``shard_min_size=`` (``min_shard_numel``); ``enable_zero()`` alone is stage 1 here (OneFlow's: 2).

        >>> import sbpflow
        >>> config = sbpflow.nn.Graph().config
        >>> config.enable_zero(True, stage=2); config.zero_stage
        2
        >>> config.enable_zero(3); config.zero_stage
        3
        """
        if isinstance(mode, bool):
            stage = (1 if stage is None else stage) if mode else 0
        elif stage is not None:
            raise SbpflowError(f"enable_zero got the stage twice: {mode!r} and stage={stage!r}")
        else:
            stage = mode
        if "shard_min_size" in options:
            options["min_shard_numel"] = options.pop("shard_min_size")
        options.pop("shard_restore_level", None)  # OneFlow's restore of sharded parameters: sbpflow's is exact
        if stage not in (0, 1, 2, 3):
            raise SbpflowError(f"enable_zero(stage=...) must be 0, 1, 2 or 3, but got {stage!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise SbpflowError(f"enable_zero(prefetch=...) is a number of units >= 0, but got {prefetch!r}")
        self.zero_stage, self.zero_options, self.zero_prefetch = stage, options, prefetch

    def enable_amp(self, dtype: torch.dtype | bool = torch.bfloat16, *, grad_comm_dtype: torch.dtype | None = None,
                   loss_scaler: Any = "auto", mode: bool | None = None) -> None:
        """Traces build() under ``sbpflow.autocast(dtype)`` (casts become graph ops; master weights stay fp32);
        ``grad_comm_dtype=torch.bfloat16`` also reduces gradients in bf16 (half the bytes in the plan).

        ``loss_scaler``: an :class:`sbpflow.amp.GradScaler` run inside the step (``"auto"``: a default one for
        fp16, none for bf16; ``None``: none). Its scale multiplies the backward's starting gradient; the step
        divides the gradients by it, finds any inf/NaN (one reduction), keeps every parameter and optimizer
        state unchanged on overflow (``where``, no Python branch) and updates the scale, all as graph ops. The
        host reads the overflow flag after the run only to leave step counts unadvanced, as torch does;
        ``loss_scaler.get_scale()`` follows the graph's scale.

        OneFlow's ``enable_amp(True)`` (or ``mode=True``) is bf16 here, ``enable_amp(False)`` turns it off;
        OneFlow's default dtype is fp16: pass ``dtype=torch.float16`` for that."""
        if isinstance(dtype, bool) or mode is not None:
            if not (dtype if isinstance(dtype, bool) else mode):
                self.amp_dtype, self.grad_comm_dtype, self.loss_scaler = None, None, None
                return
            dtype = torch.bfloat16 if isinstance(dtype, bool) else dtype

        if dtype not in (torch.bfloat16, torch.float16):
            raise SbpflowError(f"enable_amp(dtype=...) takes torch.bfloat16 or torch.float16, but got {dtype}")
        if isinstance(loss_scaler, str) and loss_scaler == "auto":
            loss_scaler = GradScaler() if dtype == torch.float16 else None
        if loss_scaler is not None and not isinstance(loss_scaler, GradScaler):
            raise SbpflowError(f"enable_amp(loss_scaler=...) takes an sbpflow.amp.GradScaler, 'auto' or None, but got "
                               f"{loss_scaler!r}")
        self.amp_dtype, self.grad_comm_dtype = dtype, grad_comm_dtype
        self.loss_scaler = loss_scaler if loss_scaler is not None and loss_scaler.enabled else None

    def enable_fused_segments(self, enabled: bool = True, *, torch_compile: bool = False) -> None:
        """Makes each run of consecutive plain compute nodes between communication nodes one plan node whose
        kernel is straight-line Python generated from the run (:mod:`sbpflow.graph.fuse`): no per-node dispatch
        inside it, and its intermediates never reach the executor. ``torch_compile=True`` runs each segment's
        function under ``torch.compile(fn, dynamic=False)`` (compiled at the first step: slow to start).
        Numbers are those of the unfused plan (the same kernels in the same order) unless torch.compile fuses
        kernels. On by default. In a pipeline a run keeps to one stage and one part of the schedule (F, B, W).

        >>> import sbpflow
        >>> g = sbpflow.nn.Graph()
        >>> g.config.fused_segments, g.config.segment_torch_compile
        (True, False)
        >>> g.config.enable_fused_segments(False)  # one plan node per compute node
        >>> g.config.fused_segments
        False
        """
        if not isinstance(enabled, bool) or not isinstance(torch_compile, bool):
            raise SbpflowError(f"enable_fused_segments takes booleans, but got enabled={enabled!r}, "
                               f"torch_compile={torch_compile!r}")
        if torch_compile and not enabled:
            raise SbpflowError("enable_fused_segments(False, torch_compile=True): torch.compile applies to fused "
                               "segments, so it needs enabled=True")
        self.fused_segments, self.segment_torch_compile = enabled, torch_compile

    def set_gradient_accumulation_steps(self, steps: int, average: bool = False) -> None:
        """Splits dim 0 of every input into ``steps`` micro-batches; gradients accumulate over them.

        By default a step equals the full-batch step whatever the loss: a sum over the batch is summed over the
        micro-batches, a mean divides by the whole batch's size, and per-row outputs are concatenated
        (:mod:`sbpflow.graph.micro`; an op with no exact per-micro-batch form is refused by name). With
        ``average=True`` the loss's gradient and every scalar output are averaged over the micro-batches, as
        OneFlow's ``nn.Graph`` does (a sum loss then steps as ``loss / steps`` would on the full batch).
        """
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise SbpflowError(f"set_gradient_accumulation_steps needs an int >= 1, but got {steps!r}")
        if not isinstance(average, bool):
            raise SbpflowError(f"set_gradient_accumulation_steps(average=...) takes a bool, but got {average!r}")
        self.micro_batches, self.average_micro_batches = steps, average

    def set_pipeline_schedule(self, name: str) -> None:
        """``"1f1b"`` (default: stage s holds p - s micro-batches of activations), ``"gpipe"`` (every forward,
        then every backward: m), ``"zero_bubble"`` (ZB-H1: weight gradients split from the backward fill the
        bubble; p on every stage) or ``"interleaved_1f1b"`` (Megatron's: a model whose forward visits the p
        placements v times has v·p stages, stage k on placement k mod p; bubble (p - 1) / (v m + p - 1), m a
        multiple of p). Applies when the model's modules sit on several placements."""
        if name not in SCHEDULES:
            raise SbpflowError(f"pipeline schedule must be one of {SCHEDULES}, but got {name!r}")
        self.pipeline_schedule = name

    def set_executor(self, name: str, threads: bool | None = None) -> None:
        """"actors" (the actor runtime) or "inorder" (the reference executor). ``threads`` (actors only): True
        gives every lane a worker thread (and a CUDA stream of its own) also on virtual ranks; None, the
        default, uses threads under torch.distributed only."""
        if name not in ("actors", "inorder"):
            raise SbpflowError(f"Graph executor must be 'actors' or 'inorder', but got {name!r}")
        if threads is not None and name != "actors":
            raise SbpflowError(f"threads={threads} applies to the 'actors' executor, not {name!r}")
        self.executor = name
        self.threads = threads

    def enable_auto_parallel(self, devices: int, profile: Any = "cpu", memory_per_device: float | None = None) -> None:
        """At the first call, plan the graph's model for ``devices`` ranks from the step traced on the call's
        metadata (``autoparallel.apply.plan_step``), lay it out by the plan (``sbpflow.parallelize`` and this
        config's ZeRO stage, micro-batches, schedule and recompute), then compile and run; ``step.auto_plan`` is
        the plan. The model sits on one device (or was built under ``meta_init()``) and calls pass the plain local
        batch. ``profile``: a device profile name, file or object; ``memory_per_device``: the bytes each device
        may use (default: the profile's). Every model takes this path, the shipped ones included."""
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise SbpflowError(f"enable_auto_parallel needs devices >= 1, but got {devices!r}")
        if memory_per_device is not None and not memory_per_device > 0:
            raise SbpflowError(f"enable_auto_parallel needs memory_per_device > 0 bytes, but got {memory_per_device!r}")
        self.auto_parallel = (devices, profile, memory_per_device)

    def set_plan(self, plan: Any) -> None:
        """At the first call, lay the model out by ``plan`` (an ``autoparallel.graph_plan.Plan``, or the path of
        one that ``Plan.save`` or ``sbpflow plan --model ... --json`` wrote) without searching: the replay of
        ``step.auto_plan``."""
        self.plan = plan if isinstance(plan, Plan) else Plan.load(plan)

    def set_sbp_selection(self, name: str, *, activation_cap: int | str | None = "auto") -> None:
        """The SBP selection ``name`` (graph.select's methods), and a bound on the bytes per rank of the
        activations its layouts keep for backward: None, "traced" (no more than the traced layouts keep), a
        number of bytes, or "auto" ("traced" under ZeRO 2 and 3, else None).

        >>> import sbpflow
        >>> config = sbpflow.nn.Graph().config
        >>> config.set_sbp_selection("ilp", activation_cap="traced"); config.activation_cap
        'traced'
        """
        if name not in METHODS:
            raise SbpflowError(f"SBP selection must be one of {METHODS}, but got {name!r}")
        if not (activation_cap in (None, "auto", "traced") or (isinstance(activation_cap, int)
                                                               and not isinstance(activation_cap, bool)
                                                               and activation_cap >= 0)):
            raise SbpflowError(f"set_sbp_selection(activation_cap=...) must be None, 'auto', 'traced' or a number "
                               f"of bytes >= 0, but got {activation_cap!r}")
        self.sbp_selection, self.activation_cap = name, activation_cap


class ModuleConfig:
    """Per-module compile options, as ``module.config`` of a module a Graph holds (set before the first call).

    ``activation_checkpointing``: the module's forward is traced as a checkpointed segment: its ops are cloned
    into backward (recomputed there, same random keys) behind a control edge on the segment's incoming
    gradient, so the plan keeps only the module's inputs between forward and backward.
    """

    def __init__(self) -> None:
        self.activation_checkpointing = False
        self.stage_id: int | None = None
        self._module: Module | None = None

    @classmethod
    def of_module(cls, module: Module) -> ModuleConfig:
        """``module.to(nn.graph.GraphModule)`` (OneFlow's spelling): this module's config, made on first use."""
        if not isinstance(module.__dict__.get("config"), ModuleConfig):
            object.__setattr__(module, "config", cls())
        config: ModuleConfig = module.__dict__["config"]
        config._module = module
        return config

    def set_stage(self, stage_id: int, placement: Placement | None = None) -> None:
        """OneFlow's pipeline stage of the module. sbpflow's stages follow placements (a module's parameters'
        placement is its stage), so this lays the module's parameters out on ``placement`` (broadcast) where they
        are elsewhere, and keeps ``stage_id`` for reading."""
        self.stage_id = stage_id
        if placement is None or self._module is None:
            return
        for t in list(self._module.parameters()) + [b for b in self._module.buffers() if b is not None]:
            if not t.is_global or t.placement != placement:
                relayout_(t, placement, [broadcast] * placement.ndim)


GraphModule = ModuleConfig  # OneFlow's name, for module.to(nn.graph.GraphModule)


def _attach_module_configs(module: Module) -> None:
    """Gives every submodule without a ``config`` attribute of its own a :class:`ModuleConfig`."""
    for m in module.modules():
        if "config" not in m.__dict__:
            object.__setattr__(m, "config", ModuleConfig())


@contextmanager
def _checkpointed_modules(modules: Sequence[Module]) -> Iterator[None]:
    """While tracing, the forward of every module asking for activation checkpointing runs as a segment."""
    marked = [m for root in modules for m in root.modules()
              if isinstance(m.__dict__.get("config"), ModuleConfig) and m.config.activation_checkpointing]
    own = [m.__dict__.get("forward") for m in marked]  # a forward the instance set (parallelize's), kept
    for m in marked:
        forward = m.forward
        object.__setattr__(m, "forward", lambda *a, _f=forward, **k: checkpoint(_f, *a, **k))
    try:
        yield
    finally:
        for m, kept in zip(marked, own, strict=True):
            if kept is None:
                m.__dict__.pop("forward", None)
            else:
                object.__setattr__(m, "forward", kept)


@dataclass
class _OptimizerEntry:
    optimizer: Any
    lr_scheduler: Any = None
    clip_grad_max_norm: float | None = None
    clip_grad_norm_type: float = 2.0


@dataclass
class Compiled:
    """One compiled step: the plan and how to feed and read it."""

    logical: LogicalGraph
    plan: PhysicalPlan
    report: CompileReport
    inputs: list[str]
    outputs: list[tuple[str, Any]]  # (name, Buf of the packed result)
    output_tree: Any  # how outputs nest (None: one tensor; tuple length otherwise)
    variables: dict[str, Tensor]
    constants: dict[str, dict[int, torch.Tensor]]
    feeds: list[Callable[[], list[tuple[str, float]]]]
    random_keys: int
    executor: Any = None
    steps: int = field(default=0)
    scaler: Any = None  # the amp.GradScaler traced into the step (its overflow flag is output FOUND_INF)
    guard: tuple[Any, ...] = ()  # the model and optimizer state the plan assumed (_state_guard)
    guarded: list[Any] = field(default_factory=list)  # the objects whose ids the guard holds, kept alive
    input_sbps: list[Any] = field(default_factory=list)  # each tensor input's SBP in the plan (_trace_inputs)
    updated: list[list[Tensor]] = field(default_factory=list)  # per optimizer: the parameters the plan updates


class Graph:
    """Subclass, assign modules as attributes, call :meth:`add_optimizer`, define :meth:`build`."""

    config: GraphConfig
    _modules: dict[str, Module]
    _optimizers: list[_OptimizerEntry]
    _cache: dict[tuple[tuple[Any, ...], tuple[Any, ...]], Compiled]  # (input metadata, guard) -> plan
    _last: Compiled | None

    def __init__(self) -> None:
        object.__setattr__(self, "config", GraphConfig())
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_optimizers", [])
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "_last", None)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_modules" not in self.__dict__:
            raise SbpflowError(f"{type(self).__name__}: call super().__init__() before assigning attributes")
        if isinstance(value, Module):
            self._modules[name] = value
            _attach_module_configs(value)
        object.__setattr__(self, name, value)

    def add_optimizer(self, optimizer: Any, *, lr_sch: Any = None, clip_grad_max_norm: float | None = None,
                      clip_grad_norm_type: float = 2.0) -> None:
        """Adds ``optimizer`` (and its LR schedule, stepped after every compiled step) to the step."""
        self._optimizers.append(_OptimizerEntry(optimizer, lr_sch, clip_grad_max_norm, clip_grad_norm_type))

    def build(self, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no build()")

    # -- calling ----------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        if self.config.auto_parallel is not None or self.config.plan is not None:
            args = plan_graph_inputs(self, args)  # the planned model's global inputs
        if _all_local(args):  # OneFlow runs a graph of a local model on local tensors: one rank, this process's
            return _local_outputs(self(*self._on_this_rank(args)))
        inputs = _input_key(args)
        compiled = self._cache.get((inputs, self._guard()))
        if compiled is None:
            if self._cache:
                warnings.warn(f"{type(self).__name__}: compiling again {self._recompile_reason(inputs)}",
                              GraphRecompileWarning, stacklevel=2)
            with gc_paused():
                compiled = self._compile_and_cache(inputs, args)
            if SHOW:
                self._show(*SHOW[-1])
        object.__setattr__(self, "_last", compiled)
        return self._run(compiled, args)

    def _guard(self, notes: list[tuple[str, Any]] | None = None) -> tuple[Any, ...]:
        """What a compiled step assumed besides its inputs' metadata, as one flat tuple (a cache key)."""
        return _state_guard(self._modules, self._optimizers, notes)

    def _compile_and_cache(self, inputs: tuple[Any, ...], args: Sequence[Any]) -> Compiled:
        compiled = self._compile(args)
        notes: list[tuple[str, Any]] = []
        # taken after compiling, which makes optimizer state (init_state): the next call finds that state
        compiled.guard = self._guard(notes)
        compiled.guarded = [obj for _, obj in notes]  # its ids stay unique while the plan is cached
        self._cache[(inputs, compiled.guard)] = compiled
        object.__setattr__(self, "_last", compiled)
        return compiled

    def _recompile_reason(self, inputs: tuple[Any, ...]) -> str:
        """Why no cached plan fits: new input metadata, or the first model or optimizer change since the last one."""
        last = self._last
        if last is None or not any(key[0] == inputs for key in self._cache):
            return f"for new input metadata {_key_text(inputs)}"
        notes: list[tuple[str, Any]] = []
        now, was = self._guard(notes), last.guard
        changed = next((i for i, (a, b) in enumerate(zip(was, now, strict=False)) if a != b), min(len(was), len(now)))
        # the label of the entry as it is now (an added hook shifts the entries after it)
        what = notes[changed][0] if changed < len(notes) else "the model's structure changed"
        return f"because {what} since the last compiled step (its plan assumed it)"

    def _on_this_rank(self, args: Sequence[Any]) -> list[Any]:
        """Local inputs, and the local parameters and buffers of the graph's modules, laid out on a placement of
        this process's rank alone (broadcast): the graph then compiles as any other. The modules keep their
        tensors (same objects, now global on one rank: ``to_local()`` and ``numpy()`` read them as before)."""
        device = next(a for a in args if isinstance(a, Tensor)).device
        placement = Placement("cpu" if device.type == "meta" else device.type, [rank()])
        for module in self._modules.values():
            for t in list(module.parameters()) + [b for b in module.buffers() if b is not None]:
                if not t.is_global:
                    relayout_(t, placement, [broadcast])
                elif t.placement != placement:
                    raise SbpflowError(f"{type(self).__name__} got local inputs, but its module holds a global "
                                       f"tensor ({t._describe()}); a global model takes global tensors as inputs")
        return [_on(a, placement) if isinstance(a, Tensor) else a for a in args]

    def compile_only(self, *args: Any) -> Compiled:
        """Traces and compiles the step for ``args``' metadata (shape, dtype, placement, SBP), running nothing.

        The arguments may be meta tensors (:func:`sbpflow.meta_tensor`), and the graph's modules may be built
        under :func:`sbpflow.meta_init` (a model of any size, without memory for its weights): tracing reads
        metadata only. The result is cached as a call's would be: ``explain()``, ``plan`` and ``logical`` show
        it, and a later call with the same metadata on a model with real weights runs it without compiling.
        """
        if self.config.auto_parallel is not None or self.config.plan is not None:
            # plans (a model built under meta_init() too) and lays it out, as a call would
            args = plan_graph_inputs(self, args)
        inputs = _input_key(args)
        compiled = self._cache.get((inputs, self._guard()))
        if compiled is None:
            with gc_paused():
                compiled = self._compile_and_cache(inputs, args)
        object.__setattr__(self, "_last", compiled)
        return compiled

    def iterate(self, loader: Any, steps: int | None = None) -> Iterator[Any]:
        """Runs one step per batch of ``loader`` (a :class:`sbpflow.utils.data.DataLoader`) and yields each step's
        outputs: one epoch (from its first batch, or the rest of a restored loader's), or ``steps`` steps
        across epochs from the loader's position.

        The batches come from the loader's source actor, which loads the next ``prefetch`` batches while the
        current step computes; its spans are a lane of this graph's timeline (``SBPFLOW_TRACE``). A batch
        that is a tuple or list is passed as the step's arguments, a tensor as its one argument. The loader's
        ``state_dict()`` counts the steps run, so a checkpoint taken in the loop resumes at the next batch.
        A smaller last batch is new input metadata and compiles again: ``drop_last=True`` keeps one plan.

        >>> for loss in graph.iterate(loader, steps=100):  # doctest: +SKIP
        ...     print(loss.item())
        """
        batches = loader.batches(steps)
        try:
            for batch in batches:
                out = self(*batch) if isinstance(batch, (tuple, list)) else self(batch)
                executor = self._compiled().executor
                batches.source.timeline = executor.timeline if executor is not None else None
                yield out
        finally:
            batches.close()

    # -- compile ---------------------------------------------------------------------------------

    def trace(self, *args: Any) -> LogicalGraph:
        """The logical graph of the step for ``args``' metadata, traced and not compiled (no SBP selection, no
        lowering): what the auto-parallel planner reads. The model may be built under :func:`sbpflow.meta_init`;
        local inputs lay the graph's modules out on this process's rank, as a call does.

        >>> step.trace(ids, targets).format()  # doctest: +SKIP
        """
        tensors = [a for a in args if isinstance(a, Tensor)]
        if tensors and not any(a.is_global for a in tensors):
            args = tuple(self._on_this_rank(args))
        return self._trace(args)[0].graph

    def _trace(self, args: Sequence[Any]) -> tuple[Tracer, list[str], list[Any], Any, dict[str, Tensor], Any, Any,
                                                    list[list[Tensor]]]:
        """Runs ``build()`` on lazy tensors: (tracer, input names, input SBPs, output tree, variables, feeds,
        loss scaler, the parameters each optimizer updates)."""
        m = self.config.micro_batches
        self._apply_zero()
        for entry in self._optimizers:
            entry.optimizer.init_state()
        tracer = Tracer(m, target_factors(args), self.config.average_micro_batches)
        scaler = self._scaler_variables()
        variables = self._variables()
        saved = {name: (t._shards, t.grad, t._version) for name, t in variables.items()}
        draws = sbp_random.counter()
        tracer.push()
        try:
            for name, t in variables.items():
                tracer.add_variable(name, t)
                t._shards = None
                t.grad = None
            lazy_args, inputs, input_sbps, rows = _trace_inputs(tracer, args, m)
            tracer.loss_seed = scaler.loss_seed if scaler is not None else None
            with enable_grad(), self._amp(), _checkpointed_modules(list(self._modules.values())):
                result = self.build(*lazy_args)
            outputs, tree = _flatten_outputs(result)
            feeds, updated = self._trace_post(tracer, outputs, scaler, rows)
            _emit_assigns(tracer)
        finally:
            tracer.pop()
            sbp_random.set_counter(draws)
            for name, t in variables.items():
                t._shards, t.grad, t._version = saved[name]
                t._lazy = None
        return tracer, inputs, input_sbps, tree, variables, feeds, scaler, updated

    def _compile(self, args: Sequence[Any]) -> Compiled:
        start, cpu_start = time.perf_counter(), time.process_time()
        tracer, inputs, input_sbps, tree, variables, feeds, scaler, updated = self._trace(args)
        trace_s, trace_cpu = time.perf_counter() - start, time.process_time() - cpu_start
        options = CompileOptions(method=self.config.sbp_selection, schedule=self.config.pipeline_schedule,
                                 prefetch=self.config.zero_prefetch, fused_segments=self.config.fused_segments,
                                 torch_compile=self.config.segment_torch_compile,
                                 group=self.config.group_accumulates,
                                 late_reduce=self.config.reduce_after_accumulating,
                                 split_updates=self.config.update_per_bucket,
                                 gather_buckets=self.config.gather_buckets,
                                 activation_cap=self._activation_cap())
        plan, logical, report = compile_graph(tracer.graph, options, agree=_rank0_choice)
        with report.timing("memory plan"):
            plan.peak_bytes = _memory_plan(plan)
        report.times = {"trace": trace_s, **report.times}
        report.cpu_times = {"trace": trace_cpu, **report.cpu_times}
        out_bufs = [(n.name, plan.bufs[n.inputs[0]]) for n in plan.nodes if n.kind == "output" and n.name != FOUND_INF]
        constants = {f"const{vid}": shards for vid, shards in tracer.constants.items()}
        return Compiled(logical, plan, report, inputs, out_bufs, tree, variables, constants, feeds,
                        tracer.random_keys, scaler=scaler, input_sbps=input_sbps, updated=updated)

    def _activation_cap(self) -> int | str | None:
        cap = self.config.activation_cap
        if cap == "auto":
            return "traced" if self.config.zero_stage >= 2 else None
        return cap

    def _scaler_variables(self) -> Any:
        """The loss scaler (if any), its scale and tracker made graph variables on the first parameter's placement."""
        scaler = self.config.loss_scaler
        if scaler is None:
            return None
        params = [p for e in self._optimizers for p in e.optimizer._all_params() if p.is_global]
        if not params:
            raise SbpflowError("enable_amp(loss_scaler=...) scales the gradients of the graph's optimizers, but the "
                               "graph has no optimizer with global parameters (call add_optimizer)")
        scaler.graph_variables(params[0].placement)
        return scaler

    def _variables(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        seen: set[int] = set()
        for prefix, module in self._modules.items():
            for name, t in list(module.named_parameters()) + list(module.named_buffers()):
                if id(t) not in seen and t.is_global:
                    seen.add(id(t))
                    out[f"{prefix}.{name}"] = t
        scaler = self.config.loss_scaler
        for name, t in (scaler.graph_state() if scaler is not None else {}).items():
            seen.add(id(t))
            out[name] = t
        for k, entry in enumerate(self._optimizers):
            opt = entry.optimizer
            index = {id(p): i for i, p in enumerate(opt._all_params())}
            for p, state in opt.state.items():
                if id(p) not in index:  # a parameter taken out of the param groups: its state is no variable
                    continue
                for sname, value in state.items():
                    if isinstance(value, Tensor) and id(value) not in seen:
                        seen.add(id(value))
                        out[f"optim{k}.{index[id(p)]}.{sname}"] = value
        return out

    def _apply_zero(self) -> None:
        """Turns the optimizers into ZeRO ones once (a recompile finds them already sharded)."""
        stage = self.config.zero_stage
        if not stage:
            return
        modules = list(self._modules.values())
        if stage == 3 and len(modules) != 1:
            raise SbpflowError(f"enable_zero(3) gathers the parameters of the graph's module, so the graph needs "
                               f"exactly one module attribute, but it has {len(modules)}")
        for entry in self._optimizers:
            if entry.optimizer._zero is None:
                zero(entry.optimizer, stage, model=modules[0] if modules else None, **self.config.zero_options)

    def _amp(self) -> Any:
        from contextlib import ExitStack

        stack = ExitStack()
        if self.config.amp_dtype is not None:
            stack.enter_context(amp.autocast(self.config.amp_dtype))
        stack.enter_context(amp.gradient_communication(self.config.grad_comm_dtype))
        return stack

    def _trace_post(self, tracer: Tracer, outputs: list[Tensor], scaler: Any = None,
                    rows: Any = None) -> tuple[list[Callable[[], list[tuple[str, float]]]], list[list[Tensor]]]:
        """Outputs, gradient accumulation, loss-scale checks, clipping and optimizer updates (once per step, on
        the whole batch). Returns the feeds' makers and, per optimizer, the parameters it updates (those with a
        gradient: a frozen one is left alone, its step count too)."""
        for i, out in enumerate(outputs):
            if out._lazy is None:
                raise TraceError(f"build() must return tensors computed from its inputs, but output {i} is "
                                 f"{out._describe()}")
            how, _ = tracer.join_of(out, f"output {i} of build()")
            if how == "cat" and rows is not None:
                out = _rows_like_inputs(out, i, rows, tracer.graph.micro_batches)
            _micro_to_post(tracer, out, how, f"output{i}", output=True)
        tracer.phase = "post"
        per_entry = []
        for entry in self._optimizers:
            params = [p for g in entry.optimizer.param_groups for p in g["params"] if p.grad is not None]
            for p in params:
                assert p.grad is not None
                p.grad = _micro_to_post(tracer, p.grad, "sum", "grad")
            per_entry.append(params)
        found = _trace_unscale(tracer, scaler, [p for params in per_entry for p in params])
        before = {name: t._lazy.value.id for name, (t, _) in tracer.variables.items() if t._lazy is not None}
        feeds: list[Callable[[], list[tuple[str, float]]]] = []
        for k, (entry, params) in enumerate(zip(self._optimizers, per_entry, strict=True)):
            if entry.clip_grad_max_norm is not None:
                clip_grad_norm_(params, entry.clip_grad_max_norm, entry.clip_grad_norm_type)
            entry.optimizer.trace_step(f"optim{k}")
            feeds.append(_feed_fn(entry.optimizer, f"optim{k}"))
        if found is not None:
            changed = [(t, tracer.tensor_of(tracer.graph.values[before[name]]))
                       for name, (t, _) in tracer.variables.items()
                       if t._lazy is not None and name in before and t._lazy.value.id != before[name]]
            trace_masked_updates(found, changed)
            scaler.trace_update(found)
        return feeds, per_entry

    # -- run -------------------------------------------------------------------------------------

    def _run(self, compiled: Compiled, args: Sequence[Any]) -> Any:
        _refuse_meta(compiled, args)
        feeds = _input_feeds(compiled, args)
        for fn in compiled.feeds:
            feeds.update(fn())
        seed, base = sbp_random.advance(compiled.random_keys * compiled.plan.micro_batches)
        feeds[RANDOM_FEED] = (seed, base, compiled.random_keys)
        if compiled.scaler is not None:
            compiled.scaler.before_compiled_step()
        variables = {name: t._shards or {} for name, t in compiled.variables.items()}
        variables.update(compiled.constants)
        outputs = self._executor(compiled).run(feeds, variables) if self.config.executor == "actors" else \
            run_plan(compiled.plan, feeds, variables)
        for t in compiled.variables.values():
            t._version += 1
        skipped = compiled.scaler is not None and any(bool(v) for v in outputs.get(FOUND_INF, {}).values())
        if compiled.scaler is not None:
            compiled.scaler.after_compiled_step()
        for entry, updated in zip(self._optimizers, compiled.updated, strict=True):
            if not skipped:  # an overflowed step left parameters and state alone: step counts stay (as torch)
                entry.optimizer.after_compiled_step(updated)
            if entry.lr_scheduler is not None:
                entry.lr_scheduler.step()
        compiled.steps += 1
        return _wrap_outputs(compiled, outputs)

    def _executor(self, compiled: Compiled) -> Any:
        if compiled.executor is None:
            compiled.executor = actors.ActorRuntime(compiled.plan, trace=self.config.trace_path,
                                                    threads=self.config.threads)
        return compiled.executor

    # -- seeing the plan -------------------------------------------------------------------------

    def _compiled(self) -> Compiled:
        if self._last is None:
            raise SbpflowError(f"{type(self).__name__} has not been compiled yet: call it once first")
        return self._last

    @property
    def plan(self) -> PhysicalPlan:
        return self._compiled().plan

    @property
    def logical(self) -> LogicalGraph:
        return self._compiled().logical

    def explain(self, rank: int | None = None) -> str:
        """Each op's signature, every boxing node with bytes and time, and per-step totals (also printed)."""
        text = explain(self._compiled().logical, self._compiled().plan, self._compiled().report, rank)
        print(text)
        return text

    def save_dot(self, path: str, rank: int | None = None) -> list[str]:
        """Writes the logical graph and one rank's physical graph as Graphviz files (SVG too if dot exists)."""
        return save_dot(self._compiled().logical, self._compiled().plan, path, rank)

    def _show(self, folder: str, rank: int | None) -> None:
        import os

        name = f"{type(self).__name__}{len(self._cache)}"
        print(f"== {name}\n{self._compiled().logical.format()}\n")
        self.explain(rank)
        files = self.save_dot(os.path.join(folder, name), rank)
        print("wrote " + ", ".join(files))

    def __repr__(self) -> str:
        if self._last is None:
            return f"{type(self).__name__}(not compiled)"
        return f"{type(self).__name__}(\n{self._last.logical.format()}\n)"


class GraphRecompileWarning(UserWarning):
    """A graph met new input metadata, or a changed model or optimizer, and compiled again."""


# ----------------------------------------------------------------------------- helpers


def _on(t: Tensor, placement: Placement) -> Tensor:
    """A local input broadcast on ``placement`` (a meta one stays metadata)."""
    if t.is_meta:
        return meta_tensor(*t.shape, dtype=t.dtype, placement=placement, sbp=[broadcast])
    return t.to_global(placement, [broadcast])


def _all_local(args: Sequence[Any]) -> bool:
    tensors = [a for a in args if isinstance(a, Tensor)]
    return bool(tensors) and all(not a.is_global and not a.is_meta for a in tensors)


def _local_outputs(result: Any) -> Any:
    """A graph's outputs for local inputs: this rank's (whole) values as local tensors."""
    if isinstance(result, Tensor):
        return Tensor._from_local(result.to_local())
    if isinstance(result, (tuple, list)):
        return type(result)(_local_outputs(r) for r in result)
    return result


def _input_key(args: Sequence[Any]) -> tuple[Any, ...]:
    key: list[Any] = []
    for a in args:
        if isinstance(a, Tensor):
            if not a.is_global:
                raise SbpflowError(f"nn.Graph inputs are global tensors, but got {a._describe()}; "
                                   "convert it with .to_global(placement, sbp)")
            key.append((tuple(a.shape), a.dtype, a.placement, a.sbp))
        else:
            key.append(("py", a))
    return tuple(key)


def _key_text(key: tuple[Any, ...]) -> str:
    return ", ".join(f"{list(k[0])} {k[2]} {format_nd(k[3])}" if k[0] != "py" else repr(k[1]) for k in key)


_PLAIN = (bool, int, float, str, tuple, type(None))  # hyperparameter values compared by value in the guard


def _state_guard(modules: dict[str, Module], optimizers: list[_OptimizerEntry],
                 notes: list[tuple[str, Any]] | None = None) -> tuple[Any, ...]:
    """What a traced step bakes in besides its inputs, as a flat tuple: every module's identity, training mode and
    hooks, every parameter's identity and ``requires_grad``, every buffer's identity, each optimizer's param groups
    (parameter and state tensor identities, hyperparameters other than the per-step fed ones).

    torch.compile guards the same things. It runs every call, so it reads attributes and appends to one list
    (O(parameters), no names built); with ``notes`` it also records a label and the object of every entry, to
    say what changed and to keep the objects (their ids) alive while a plan is cached.
    """
    key: list[Any] = []
    for name, module in modules.items():
        _module_guard(module, name, key, notes)
    for k, entry in enumerate(optimizers):
        _optimizer_guard(entry.optimizer, f"optimizer {k}", key, notes)
    return tuple(key)


def _note(notes: list[tuple[str, Any]] | None, key: list[Any], label: str, obj: Any) -> None:
    """Labels the entries appended to ``key`` since the last note (the slow path: callers test ``notes`` first, so
    that the fast path builds no label)."""
    assert notes is not None
    notes.extend([(label, obj)] * (len(key) - len(notes)))


def _module_guard(m: Module, name: str, key: list[Any], notes: list[tuple[str, Any]] | None) -> None:
    append = key.append
    append(id(m))
    append(m.training)
    for p in m._parameters.values():  # (plain loops: faster here than map or comprehensions over 1-2 items)
        append(id(p))
        append(p is not None and p.requires_grad)
    for b in m._buffers.values():
        append(id(b))
    key.extend(m._pre_hooks)
    key.extend(m._forward_hooks)
    key.extend(m._backward_hooks)
    append(len(m._modules))  # the hooks' ids are never reused; the count separates modules' entries
    if notes is not None:  # labels in the order of the entries above
        notes.append((f"{name} is another module", m))
        notes.append((f"{name}.training changed", m))
        for pname, p in m._parameters.items():
            notes.append((f"{name}.{pname} is another tensor", p))
            notes.append((f"{name}.{pname}.requires_grad changed", p))
        notes.extend((f"{name}.{bname} is another tensor", b) for bname, b in m._buffers.items())
        _note(notes, key, f"{name}'s hooks or submodules changed", m)
    for child_name, child in m._modules.items():
        if child is not None:
            _module_guard(child, f"{name}.{child_name}" if notes is not None else name, key, notes)


def _optimizer_guard(opt: Any, name: str, key: list[Any], notes: list[tuple[str, Any]] | None) -> None:
    append = key.append
    append(id(opt))
    if notes is not None:
        _note(notes, key, f"{name} is another optimizer", opt)
    fed = opt.fed_hyperparameters
    states = opt.state._by_id
    for gi, group in enumerate(opt.param_groups):
        append(len(group))
        for hname, value in group.items():
            if hname == "params":
                append(len(value))
                if notes is not None:
                    _note(notes, key, f"{name}'s param group {gi} has other parameters", opt)
                for p in value:
                    append(id(p))
                    if notes is not None:
                        _note(notes, key, f"a parameter of {name}'s param group {gi} is another tensor", p)
                    entry = states.get(id(p))
                    if entry is not None:  # the state tensors' identity: load_state_dict makes new ones
                        _state_tensors_guard(entry[1], key, notes, f"{name}'s param group {gi}" if notes else "")
            elif hname not in fed:
                append(hname)
                append(value if isinstance(value, _PLAIN) else id(value))
                if notes is not None:
                    _note(notes, key, f"{name}'s param group {gi} {hname!r} changed", value)


def _state_tensors_guard(state: dict[str, Any], key: list[Any], notes: list[tuple[str, Any]] | None,
                         where: str) -> None:
    for sname, value in state.items():
        if isinstance(value, Tensor):
            key.append(id(value))
            if notes is not None:
                _note(notes, key, f"the optimizer state {sname!r} of a parameter of {where} is another tensor", value)


def target_factors(args: Sequence[Any]) -> tuple[Any, ...]:
    """The target cluster's collective cost factors (:data:`sbpflow.comm.base.TARGET_COST_FACTORS`: gloo composes
    reduce-scatter on CPU), whatever backend runs the plan."""
    return TARGET_COST_FACTORS


def _memory_plan(plan: PhysicalPlan) -> dict[int, int]:
    """Predicted peak bytes of every rank: the register protocol played without kernels (every rank, whatever
    this process owns), the same accounting the actor runtime reports after a real step. Ranks of one class
    (``plan.rank_classes``: the same nodes and bytes) peak alike, so one rank per class is played."""
    classes = plan.rank_classes()
    peaks = dry_run(plan, _Representatives(frozenset(classes))).peak_bytes
    return {r: peaks.get(rep, 0) for rep, members in classes.items() for r in members}


class _Representatives(SimulatedBackend):
    """The simulated backend, owning only the given ranks (for the memory plan's dry run)."""

    def __init__(self, ranks: frozenset[int]) -> None:
        super().__init__()
        self.ranks = ranks
        self._owned: dict[tuple[int, ...], list[int]] = {}  # nodes share few rank tuples (placements, unions)

    def owns(self, rank: int) -> bool:
        return rank in self.ranks

    def owned(self, ranks: Iterable[int]) -> list[int]:
        key = tuple(ranks)
        found = self._owned.get(key)
        if found is None:
            found = self._owned[key] = [r for r in key if r in self.ranks]
        return list(found)


def _rank0_choice(choice: Any) -> Any:
    """Every process adopts process 0's SBP choice (one broadcast at compile time): processes compile their plans
    independently and must run one plan, even where the solver breaks a tie differently on a busy machine."""
    if get_backend().name != "torch.distributed":
        return choice
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return choice
    box = [choice if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _trace_inputs(tracer: Tracer, args: Sequence[Any], m: int) -> tuple[list[Any], list[str], list[Any], Any]:
    """Lazy micro-batch inputs, their SBPs in the plan, and input 0's layout (placement, SBP; None with m = 1).

    Micro-batch k is chunk k of each shard's rows, so every input must cut dim 0 into the same blocks of rows (the
    same rows make micro-batch k in each): an input that does not (labels B beside data S(0)) gets the first
    input's splits of dim 0 on its own placement, converted at each call (a B input: a local slice)."""
    lazy: list[Any] = []
    names, sbps = [], []
    rows = None
    for i, a in enumerate(args):
        if not isinstance(a, Tensor):
            lazy.append(a)
            continue
        shape, sbp = tuple(a.shape), a.sbp
        if m > 1:
            if a.ndim == 0:
                raise SbpflowError(f"gradient accumulation over {m} micro-batches splits dim 0 of every input, but "
                                   f"input {i} is 0-d ({a._describe()})")
            if rows is None:
                rows = (a.placement, a.sbp)
            sbp = _same_rows(a, rows, m, what=f"input {i}")
            _check_micro_split(a, m, i, sbp)
            shape = (shape[0] // m, *shape[1:])
        name = f"input{i}"
        names.append(name)
        sbps.append(sbp)
        lazy.append(tracer.add_input(name, shape, a.dtype, a.placement, sbp))
    return lazy, names, sbps, rows


def _row_blocks(n: int, placement: Any, sbp: Any) -> tuple[tuple[int, int], ...]:
    """The distinct row ranges (dim 0, of ``n`` rows) of a layout's shards (a split of another dim keeps rows whole)."""
    dim0 = tuple(s if isinstance(s, Split) and s.dim == 0 else broadcast for s in sbp)
    return tuple(sorted({shard_box((n,), placement, dim0, r)[0] for r in placement.flat_ranks}))


def _same_rows(t: Tensor, rows: Any, m: int, what: str, n: int | None = None) -> Any:
    """An SBP for ``t`` on its placement whose shards hold the same blocks of rows as the first input's layout
    ``rows`` (for a tensor of ``n`` rows over the whole step): its own, else the first input's splits of dim 0
    with its own other axes; refused if there is none."""
    n = t.shape[0] if n is None else n
    want = _row_blocks(n, *rows)
    if _row_blocks(n, t.placement, t.sbp) == want:
        return t.sbp
    ref_placement, ref_sbp = rows
    if t.placement.hierarchy == ref_placement.hierarchy:
        candidate = tuple(Split(0) if isinstance(r, Split) and r.dim == 0 else
                          (broadcast if isinstance(s, (Split, Partial)) and getattr(s, "dim", None) == 0 else s)
                          for r, s in zip(ref_sbp, t.sbp, strict=True))
        if _row_blocks(n, t.placement, candidate) == want:
            return candidate
    raise SbpflowError(
        f"gradient accumulation over {m} micro-batches makes micro-batch k of chunk k of each shard's rows, so every "
        f"input and per-row output must hold the same blocks of rows as input 0 ({format_nd(ref_sbp)} on "
        f"{ref_placement}: rows {list(want)}), but {what} ({t._describe()}) has no SBP on its placement that does; "
        "give it input 0's split of dim 0")


def _rows_like_inputs(out: Tensor, i: int, rows: Any, m: int) -> Tensor:
    """A per-row output pinned (to_global) to a layout holding the inputs' blocks of rows, so that joining each
    rank's micro-batch pieces in order gives the batch's rows in order, whatever layout SBP selection picks."""
    sbp = _same_rows(out, rows, m, what=f"output {i} of build()", n=out.shape[0] * m)
    return record_to_global(out, out.placement, sbp)  # recorded even if unchanged: a constraint for selection


def _check_micro_split(a: Tensor, m: int, i: int, sbp: Any) -> None:
    for r in a.placement.flat_ranks:
        local = shard_shape(tuple(a.shape), a.placement, sbp, r)
        if local[0] % m:
            raise SbpflowError(
                f"gradient accumulation over {m} micro-batches cuts every rank's shard of input {i} along dim 0, "
                f"but rank {r} holds {local[0]} rows of the input with {a._describe()}; use a batch whose "
                f"per-rank rows divide by {m}")


def _micro_to_post(tracer: Tracer, t: Tensor, how: str, name: str, output: bool = False) -> Tensor:
    assert t._lazy is not None
    v = t._lazy.value
    shape = v.shape if how != "cat" else (v.shape[0] * tracer.graph.micro_batches, *v.shape[1:])
    out = tracer.new_value(shape, v.dtype, v.placement, v.sbp)
    kind = "pack" if output else "accumulate"
    saved = tracer.phase
    tracer.phase = "post"
    tracer.add_node(LNode(0, kind, how, (v.id,), (out.id,), fixed=True))
    if output:
        tracer.add_node(LNode(0, "output", name, (out.id,), in_sbps=(v.sbp,), fixed=True))
    tracer.phase = saved
    return tracer.tensor_of(out)


def _trace_unscale(tracer: Tracer, scaler: Any, params: list[Tensor]) -> Tensor | None:
    """Loss scaling: the accumulated gradients divided by the scale; returns the overflow flag (also a hidden
    output, FOUND_INF), or None without a scaler."""
    if scaler is None:
        return None
    grads = [p.grad for p in params if p.grad is not None]
    found, unscaled = scaler.trace_unscale(grads)
    for p, g in zip([p for p in params if p.grad is not None], unscaled, strict=True):
        p.grad = g
    assert found._lazy is not None
    tracer.add_node(LNode(0, "output", FOUND_INF, (found._lazy.value.id,), in_sbps=(found.sbp,), fixed=True))
    return found


def _emit_assigns(tracer: Tracer) -> None:
    for name, (t, initial) in tracer.variables.items():
        assert t._lazy is not None
        v = t._lazy.value
        if v.id == initial:
            continue
        phase = tracer.graph.nodes[v.producer].phase if v.producer >= 0 else "post"
        if phase == "micro" and tracer.graph.micro_batches > 1:
            raise TraceError(
                f"{user_line()}: build() updates {name} ({t._describe()}) in the forward pass (such as BatchNorm "
                "running statistics), which gradient accumulation cannot compile yet: it would need the value of "
                "the previous micro-batch; use micro_batches=1 or eval-mode statistics")
        tracer.phase = phase
        tracer.add_node(LNode(0, "assign", name, (v.id,), in_sbps=(t.sbp,), fixed=True))


def _flatten_outputs(result: Any) -> tuple[list[Tensor], Any]:
    if isinstance(result, Tensor):
        return [result], None
    if isinstance(result, (tuple, list)) and all(isinstance(r, Tensor) for r in result):
        return list(result), len(result)
    if result is None:
        return [], 0
    raise SbpflowError(f"build() must return a tensor, a tuple of tensors or None, but returned {type(result)}")


def _feed_fn(optimizer: Any, prefix: str) -> Callable[[], list[tuple[str, float]]]:
    def feeds() -> list[tuple[str, float]]:
        return [f for gi, g in enumerate(optimizer.param_groups) for f in optimizer.step_feeds(f"{prefix}.{gi}", g)]

    return feeds


def _refuse_meta(compiled: Compiled, args: Sequence[Any]) -> None:
    """A step cannot run on meta tensors (sbpflow.meta_init): the first one, input or variable, is named."""
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and a.is_meta:
            refuse(a, f"running the compiled step on input {i}")
    for name, t in compiled.variables.items():
        if t.is_meta:
            refuse(t, f"running the compiled step on variable {name!r}")


def _input_feeds(compiled: Compiled, args: Sequence[Any]) -> dict[str, Any]:
    feeds: dict[str, Any] = {}
    tensors = [a for a in args if isinstance(a, Tensor)]
    for k, (name, t) in enumerate(zip(compiled.inputs, tensors, strict=True)):
        if k < len(compiled.input_sbps) and compiled.input_sbps[k] != t.sbp:  # the rows of input 0's shards
            t = t.to_global(placement=t.placement, sbp=compiled.input_sbps[k])
        feeds[name] = t._shards or {}
    return feeds


def _wrap_outputs(compiled: Compiled, outputs: dict[str, dict[int, torch.Tensor]]) -> Any:
    results = []
    for name, buf in compiled.outputs:
        results.append(Tensor._from_shards(buf.shape, buf.dtype, buf.layout.placement, buf.layout.sbp,
                                           outputs.get(name, {})))
    if compiled.output_tree is None:
        return results[0]
    if compiled.output_tree == 0:
        return None
    return tuple(results)
