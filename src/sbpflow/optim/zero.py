"""ZeRO stages 1, 2 and 3 as SBP choices on the data-parallel mesh axis.

Plain data parallelism keeps parameters, gradients and optimizer state ``B`` on the data axis; each stage
splits one kind more there, and boxing supplies the collectives (the stages: :func:`zero`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .._layout import shard_shape
from ..autograd import is_grad_enabled, no_grad
from ..errors import SbpflowError
from ..graph import trace
from ..graph.ir import Gather
from ..nn.container import ModuleList, Sequential
from ..nn.module import Module, relayout_
from ..sbp import NdSbp, Split, broadcast
from ..tensor import Tensor
from .optimizer import Optimizer

# Tensors whose smallest piece would be under this many elements (biases, norm scales) stay B: a collective per
# tiny tensor costs more latency than the memory it saves.
DEFAULT_MIN_SHARD_NUMEL = 64
GATHERED = "zero3 gathered parameters"  # the plan.watch set of nn.Graph's stage-3 gathered copies


def zero_sbp(p: Tensor, axis: int = 0, min_shard_numel: int = DEFAULT_MIN_SHARD_NUMEL) -> NdSbp:
    """``p``'s SBP with ``B`` on mesh axis ``axis`` replaced by a split, or unchanged if ``p`` stays whole there.

    >>> import sbpflow
    >>> p = sbpflow.zeros(5, 3, placement=sbpflow.placement("cpu", [0, 1]), sbp=sbpflow.sbp.broadcast)
    >>> zero_sbp(p, min_shard_numel=1), zero_sbp(p, min_shard_numel=100)
    ((Split(dim=0),), (Broadcast(),))
    """
    if not p.is_global:
        return ()
    sbp, placement = p.sbp, p.placement
    n = placement.hierarchy[axis]
    if n == 1 or sbp[axis] != broadcast:
        return sbp
    local = shard_shape(tuple(p.shape), placement, sbp, placement.flat_ranks[0])  # this rank's box on the other axes
    # the first dim long enough for every rank to get a piece (uneven pieces as torch.tensor_split)
    for dim, length in enumerate(local):
        if length < n:
            continue
        smallest = (length // n) * _numel(local) // length
        if smallest >= min_shard_numel:
            return sbp[:axis] + (Split(dim),) + sbp[axis + 1:]
        break  # a later dim gives pieces of the same size
    return sbp


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class ZeroPlan:
    """What :func:`zero` decided: the stage, the data axis and each parameter's sharded SBP.

    ``gathered_bytes`` is the bytes of stage-3 gathered copies held right now (on the first owned rank), and
    ``peak_gathered_bytes`` its high-water mark: the window of whole parameters stage 3 keeps alive.
    """

    stage: int
    axis: int
    sharded: dict[int, NdSbp] = field(default_factory=dict)  # id(param) -> its SBP with the data axis split
    gathered_bytes: int = 0
    peak_gathered_bytes: int = 0

    def state_sbp(self, p: Tensor) -> NdSbp | None:
        return self.sharded.get(id(p), p.sbp if p.is_global else None)


def zero(optimizer: Optimizer, stage: int, *, model: Module | None = None, axis: int = 0,
         min_shard_numel: int = DEFAULT_MIN_SHARD_NUMEL, units: list[Module] | None = None) -> Optimizer:
    """Turns ``optimizer`` (and for stage 3 ``model``) into ZeRO stage ``stage`` on mesh axis ``axis``; returns it.

    Call it after placing the model and before the first step. Stage 3 needs ``model`` (its parameters are
    re-laid out in place, and its ``units`` get the gather hooks).

    * stage 1: optimizer state ``S(d)``; the step slices the ``B`` gradient, updates the slice and all-gathers
      it into the ``B`` parameter.
    * stage 2: the gradient too (``Tensor._grad_sbp``): backward boxes it ``P -> S(d)``, one reduce-scatter in
      place of DDP's all-reduce.
    * stage 3: the parameter too, at rest. Each unit (by default the model and every layer of a ModuleList)
      gathers its parameters when its forward starts and frees them when it ends, gathers again when backward
      reaches its outputs, and frees that copy once its gradient is reduce-scattered: only running units hold
      whole parameters. nn.Graph's prefetch pass (:mod:`sbpflow.graph.prefetch`) runs the next units' gathers
      ahead within that window.

    Memory per data-parallel rank (fp32 Adam, Ψ parameters, N ranks): plain ``16Ψ``, stage 1 ``8Ψ + 8Ψ/N``,
    stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``. On an n-D mesh only mesh axis ``axis`` changes.

    >>> import sbpflow
    >>> from sbpflow import nn, sbp
    >>> p2 = sbpflow.placement("cpu", [0, 1])
    >>> lin = nn.Linear(4, 8).to_global(p2, sbp.broadcast)
    >>> opt = zero(sbpflow.optim.AdamW(lin.parameters()), stage=3, model=lin, min_shard_numel=4)
    >>> lin.weight.sbp, lin.bias.sbp
    ((Split(dim=0),), (Split(dim=0),))
    >>> lin(sbpflow.randn(6, 4, placement=p2, sbp=sbp.split(0))).sum().backward()
    >>> lin.weight.grad.sbp
    (Split(dim=0),)
    >>> opt.step()
    """
    _check_stage(stage, model)
    plan = ZeroPlan(stage, axis)
    for p in optimizer._all_params():
        if p.is_global:
            _check_axis(p, axis)
            target = zero_sbp(p, axis, min_shard_numel)
            if target != p.sbp:
                plan.sharded[id(p)] = target
    optimizer._zero = plan
    if stage >= 2:
        for p in optimizer._all_params():
            p._grad_sbp = plan.sharded.get(id(p))
    if stage == 3:
        assert model is not None
        _shard_parameters(optimizer, plan)
        _install_units(model, units if units is not None else default_units(model), plan)
    _relayout_state(optimizer)
    return optimizer


def _check_stage(stage: int, model: Module | None) -> None:
    if stage not in (1, 2, 3):
        raise SbpflowError(f"sbpflow.optim.zero(stage=...) must be 1, 2 or 3, but got {stage!r}")
    if stage == 3 and model is None:
        raise SbpflowError("sbpflow.optim.zero(stage=3) gathers parameters around each module's forward, so it "
                           "needs model=: the module whose parameters the optimizer updates")


def _check_axis(p: Tensor, axis: int) -> None:
    if not 0 <= axis < p.placement.ndim:
        raise SbpflowError(f"sbpflow.optim.zero(axis={axis}) names no mesh axis of the parameter with "
                           f"{p._describe()} ({p.placement.ndim} axes)")


def _shard_parameters(optimizer: Optimizer, plan: ZeroPlan) -> None:
    """Stage 3: every sharded parameter (and any gradient it has) moves to its ``S`` layout, in place."""
    for p in optimizer._all_params():
        target = plan.sharded.get(id(p))
        if target is not None:
            relayout_(p, p.placement, target)
            p._grad_sbp = None  # the leaf's own SBP is now the gradient's


def _relayout_state(optimizer: Optimizer) -> None:
    """State created before :func:`zero` moves to the new state layout (a fresh optimizer has none)."""
    with no_grad():
        for p, state in optimizer.state.items():
            target = optimizer.state_sbp(p)
            for name, value in state.items():
                if isinstance(value, Tensor) and value.is_global and value.sbp != target:
                    state[name] = value.to_global(p.placement, target)


# -- stage 3: units gather, free and gather again ---------------------------------------------------------


def default_units(model: Module) -> list[Module]:
    """The model itself and every item of a ``ModuleList`` or ``Sequential`` (the repeated layers), as FSDP
    is usually wrapped: each block holds its own parameters whole only while it runs."""
    units = [model]
    for m in model.modules():
        if isinstance(m, (ModuleList, Sequential)):
            units += [child for child in m.children() if child not in units]
    return units


@dataclass
class _Slot:
    """One sharded parameter of a unit: the module attribute it is read through."""

    module: Module
    name: str
    param: Tensor
    gathered_sbp: NdSbp


def _install_units(model: Module, units: list[Module], plan: ZeroPlan) -> None:
    owner = _unit_of_params(model, units)
    slots: dict[int, list[_Slot]] = {id(u): [] for u in units}
    for module, name, p in _direct_params(model):
        unit = owner.get(id(p))
        if unit is not None and id(p) in plan.sharded:
            gathered = p.sbp[:plan.axis] + (broadcast,) + p.sbp[plan.axis + 1:]
            slots[id(unit)].append(_Slot(module, name, p, gathered))
    for index, unit in enumerate(units):
        if slots[id(unit)]:
            nested = any(other is not unit and other in units for other in unit.modules())
            _Unit(unit, slots[id(unit)], plan, index, nested).install()


def _direct_params(model: Module) -> Iterator[tuple[Module, str, Tensor]]:
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                yield module, name, p


def _unit_of_params(model: Module, units: list[Module]) -> dict[int, Module]:
    """id(param) -> the innermost unit holding it (a parameter reachable from several is gathered by the first)."""
    unit_ids = {id(u) for u in units}
    owner: dict[int, Module] = {}

    def walk(module: Module, unit: Module | None) -> None:
        unit = module if id(module) in unit_ids else unit
        for p in module._parameters.values():
            if p is not None and unit is not None:
                owner.setdefault(id(p), unit)
        for child in module.children():
            walk(child, unit)

    walk(model, None)
    return owner


class _Unit:
    """The hooks of one stage-3 unit. A forward call gathers, the unit's output hook gathers again in backward."""

    def __init__(self, module: Module, slots: list[_Slot], plan: ZeroPlan, index: int = 0,
                 nested: bool = False) -> None:
        self.module = module
        self.slots = slots
        self.plan = plan
        self.index = index  # the unit's place in the list of units (nn.Graph's prefetch pass orders by trace)
        self.nested = nested  # it contains other units (gathered around them, outside the prefetch window)

    def install(self) -> None:
        self.module.register_forward_pre_hook(self._before_forward)
        self.module.register_forward_hook(self._after_forward)

    def _before_forward(self, module: Module, args: tuple[Any, ...]) -> None:
        traced = []
        for slot in self.slots:
            gathered = slot.param.to_global(slot.param.placement, slot.gathered_sbp)  # S -> B: all-gather
            if gathered._lazy is None:  # nn.Graph traces: the compiled plan owns the memory
                self.plan.gathered_bytes += _first_shard_bytes(gathered)
            else:
                traced.append(gathered._lazy.value.id)
            object.__setattr__(slot.module, slot.name, gathered)  # shadows the parameter during forward
        self.plan.peak_gathered_bytes = max(self.plan.peak_gathered_bytes, self.plan.gathered_bytes)
        if traced:
            self._record_gather(tuple(traced), backward=False)

    def _record_gather(self, values: tuple[int, ...], backward: bool) -> None:
        """nn.Graph: the gathered values, for the prefetch pass and the runtime's count of gathered bytes."""
        tracer = trace.tracing()
        assert tracer is not None
        tracer.graph.gathers.append(Gather(self.index, backward, values, self.nested))
        tracer.graph.watch.setdefault(GATHERED, []).extend(values)

    def _after_forward(self, module: Module, args: tuple[Any, ...], output: Any) -> None:
        gathered = [slot.module.__dict__.pop(slot.name) for slot in self.slots]
        if any(g._lazy is not None for g in gathered):
            self._after_traced_forward(gathered, output)
            return
        for g in gathered:
            self.plan.gathered_bytes -= _first_shard_bytes(g)
        if not is_grad_enabled() or not any(g.requires_grad for g in gathered) or _checkpointed(output):
            return  # no backward will read them (a checkpointed unit recomputes from the shards): dropped, freed
        copies = [_GatheredCopy(slot, g, self.plan) for slot, g in zip(self.slots, gathered, strict=True)]
        for copy in copies:
            copy.free()
            copy.tensor.register_hook(copy.after_grad)
        def refill_all(grad: Tensor) -> None:
            for copy in copies:
                copy.refill()

        regather = _Once(refill_all)
        for out in _tensors(output):
            if out.requires_grad:
                out.register_hook(regather)


    def _after_traced_forward(self, gathered: list[Tensor], output: Any) -> None:
        """nn.Graph: when backward reaches the unit's output, the traced gathers are recorded again, behind a
        control edge on that gradient, and the gathered tensors autograd saved are rebound to the new values;
        so the forward copies die after their last forward use, as the eager storage is freed."""
        if not is_grad_enabled() or not any(g.requires_grad for g in gathered):
            return

        def regather(grad: Tensor) -> None:
            tracer = trace.tracing()
            assert tracer is not None and grad._lazy is not None
            values = []
            for slot, g in zip(self.slots, gathered, strict=True):
                with no_grad():
                    fresh = slot.param.detach().to_global(slot.param.placement, slot.gathered_sbp)
                tracer.graph.nodes[-1].control = (grad._lazy.value.id,)  # the to_global just recorded
                assert fresh._lazy is not None
                g._lazy = fresh._lazy
                values.append(fresh._lazy.value.id)
            self._record_gather(tuple(values), backward=True)

        hook = _Once(regather)
        for out in _tensors(output):
            if out.requires_grad:
                out.register_hook(hook)


class _Once:
    """A gradient hook that runs its action the first time any of the tensors it is registered on gets one."""

    def __init__(self, action: Callable[[Tensor], None]) -> None:
        self.action = action
        self.done = False

    def __call__(self, grad: Tensor) -> None:
        if not self.done:
            self.done = True
            self.action(grad)


class _GatheredCopy:
    """A gathered parameter that autograd saved: its storage is emptied after forward and refilled in backward.

    Ops saved this tensor (or views of it) for their gradients, so the tensor must stay; its storage does not.
    Resizing the untyped storage to zero frees the memory for every view at once, as FSDP does.
    """

    def __init__(self, slot: _Slot, tensor: Tensor, plan: ZeroPlan) -> None:
        self.slot = slot
        self.tensor = tensor
        self.plan = plan
        self.nbytes = {r: t.untyped_storage().nbytes() for r, t in tensor.local_tensors().items()}

    def free(self) -> None:
        self.tensor._boxed = None  # boxed copies of the gathered value would outlive the free
        for t in self.tensor.local_tensors().values():
            t.untyped_storage().resize_(0)

    def refill(self) -> None:
        """Gathers the (unchanged) shards again, into the same storage the saved views point at."""
        with no_grad():
            fresh = self.slot.param.detach().to_global(self.slot.param.placement, self.slot.gathered_sbp)
        for r, t in self.tensor.local_tensors().items():
            t.untyped_storage().resize_(self.nbytes[r])
            t.copy_(fresh.local_tensors()[r])
        self.plan.gathered_bytes += _first_shard_bytes(self.tensor)
        self.plan.peak_gathered_bytes = max(self.plan.peak_gathered_bytes, self.plan.gathered_bytes)

    def after_grad(self, grad: Tensor) -> None:
        """Every consumer's backward has run: the copy is no longer needed."""
        if self.tensor.local_tensors() and next(iter(self.tensor.local_tensors().values())).untyped_storage().nbytes():
            self.plan.gathered_bytes -= _first_shard_bytes(self.tensor)
            self.free()


def _checkpointed(output: Any) -> bool:
    """Whether every differentiable output comes straight from an activation-checkpoint node, whose backward
    recomputes the unit's forward (reading the parameters afresh) instead of using the gathered copies."""
    outs = [o for o in _tensors(output) if o.requires_grad]
    return bool(outs) and all(o.grad_fn is not None and o.grad_fn.op.name == "checkpoint" for o in outs)


def _first_shard_bytes(t: Tensor) -> int:
    shards = t.local_tensors()
    if not shards:
        return 0
    first = shards[min(shards)]
    return first.numel() * first.element_size()


def _tensors(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [o for o in output if isinstance(o, Tensor)]
    if isinstance(output, dict):
        return [o for o in output.values() if isinstance(o, Tensor)]
    return []


def memory_per_rank(optimizer: Optimizer, rank: int | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state tensors held by ``rank`` (the first owned rank if None).

    >>> import sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.zeros(4))
    >>> memory_per_rank(sbpflow.optim.SGD([w], lr=0.1))
    {'params': 16, 'grads': 0, 'state': 0}
    """
    out = {"params": 0, "grads": 0, "state": 0}
    for p in optimizer._all_params():
        out["params"] += _bytes_on(p, rank)
        if p.grad is not None:
            out["grads"] += _bytes_on(p.grad, rank)
        if p in optimizer.state:
            out["state"] += sum(_bytes_on(v, rank) for v in optimizer.state[p].values() if isinstance(v, Tensor))
    return out


def _bytes_on(t: Tensor, rank: int | None) -> int:
    shards = t.local_tensors()
    if not shards:
        return 0
    shard = shards.get(rank if rank is not None else min(shards))
    return 0 if shard is None else shard.numel() * shard.element_size()
