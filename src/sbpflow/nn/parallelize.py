"""``sbpflow.parallelize``: data x tensor x pipeline (x expert x context) parallelism for any model, from per-module
rules.

Each process holds ranks of ``pipeline`` stage placements, each a (data, tensor) mesh with the tensor-parallel
ranks innermost (as Megatron orders them), or (data, context, tensor) with ``context`` > 1. A parameter is B on
the data and context axes and gets its style's SBP on the tensor axis; the ops' signatures then insert every
collective. Context parallelism is only the inputs' layout: ids and targets (B, T, ...) are split zigzag on the
sequence (``Z(1)``, causal work balanced) over the context axis, every op runs on its rows, and attention
(``scaled_dot_product_attention``) runs as a ring. Three rules decide the layout:

    plan     module-name glob -> style ("colwise" | "rowwise" | "vocab" | "replicate" or nn.parallel's
             objects). Default: the model's ``parallel_plan`` attribute; else inferred from the module tree
             (below); tensor=1 keeps every parameter B.
    stages   the modules where pipeline stages start; default: the model's largest ModuleList of repeated
             blocks cut evenly (modules before it join the first stage, those after it the last). Modules
             take the stage of the last start at or before them in registration (pre-)order.
    expert   a module with ``num_experts`` and an ``experts`` ModuleList of that length has its experts cut
             into ``expert`` groups over the data axis; the router stays on every rank. With ``expert ==
             data`` an :class:`~sbpflow.nn.MoE`'s experts are stacked and split S(0) over the data axis
             (:func:`~sbpflow.nn.moe.split_experts`: tokens travel to their experts, only routed rows move;
             the stacked weights are new parameters, so make the optimizer after parallelize); with fewer
             groups (or another module) each expert moves to its group's data rows and gets every token of
             its group.

The inferred plan reads sibling Linears: the Linear ``R`` that most siblings feed (their output width is its
input width and their input width its output width) is row-parallel and those siblings are column-parallel:
q, k, v -> o and fc -> proj as Megatron splits them. Its parent's head counts (``n_head``, ``num_heads``,
``num_key_value_heads`` ...) must divide by ``tensor``, so each rank keeps whole heads.

Forward pre-hooks move activations between stages (a module whose parameters sit on one stage gets its global
inputs moved there) and lay out plain local inputs (the same on every process): the first tensor argument on
the first stage, every other one on the last, split on the batch over the data axis. Ops in a parent's forward
that meet tensors of several stages (a residual ``x = x + blk(x)`` added outside the block) run on the latest
of them: the model's forward runs inside ``ops.dispatch.stage_order`` (``virtual=1``).

>>> import sbpflow
>>> from sbpflow import nn
>>> sbpflow.manual_seed(0)
>>> mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
>>> strategy = sbpflow.parallelize(mlp, data=2, tensor=2)
>>> [sbpflow.sbp.format_nd(mlp[i].weight.sbp) for i in (0, 2)]
['(B, S(0))', '(B, S(1))']
>>> mlp(sbpflow.randn(4, 4)).sbp
(Split(dim=0), Partial(op='sum'))
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..creation import tensor as make_tensor
from ..errors import AutogradError, PlanError
from ..ops.dispatch import stage_order
from ..placement import Placement
from ..sbp import broadcast, format_nd, split, zigzag
from ..tensor import Tensor, shards_from_full
from .container import ModuleList
from .conv import Conv2d
from .layers import Embedding, Linear
from .module import Module, relayout_
from .moe import MoE, split_experts
from .parallel import ColwiseParallel, Replicate, RowwiseParallel, VocabParallelEmbedding, place_own_tensors

DATA_AXIS = 0  # each stage's mesh is (data, tensor), or (data, context, tensor): Strategy.tensor_axis

STYLES: dict[str, Any] = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
                          "vocab": VocabParallelEmbedding(), "replicate": Replicate()}
# Hugging Face's tp_plan words (``base_model_tp_plan``) that mean one of ours; "colwise_rep" gathers the
# output right away, which is a replicated layer's result.
HF_STYLES = {"local_colwise": "colwise", "local_rowwise": "rowwise", "embedding": "vocab",
             "colwise_rep": "replicate", "rowwise_rep": "rowwise", "local": "replicate", "gather": "replicate"}
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "heads", "num_attention_heads", "n_kv", "n_kv_heads",
              "num_key_value_heads")


# -- the strategy (pure data) ----------------------------------------------------------------------


@dataclass
class Strategy:
    """Where a parallelized model lives: one placement per pipeline stage, each a (data, tensor) mesh.

    ``params`` maps each parameter name to its stage, n-D SBP and logical shape; ``block_stage`` gives each
    block of the repeated-block list its stage. Inputs ``ids`` live on stage 0 and ``targets`` on the last
    stage, both split on the batch over the data axis.
    """

    data: int
    tensor: int
    pipeline: int
    device: str
    stages: tuple[Placement, ...]
    block_stage: tuple[int, ...]  # each block's placement (an index into ``stages``)
    virtual: int = 1  # virtual stages per placement (interleaved 1F1B): stage k sits on placement k mod p
    params: dict[str, tuple[int, tuple[Any, ...], tuple[int, ...]]] = field(default_factory=dict)
    expert: int = 1  # groups the experts are cut into over the data axis
    context: int = 1  # ranks a sequence is split over (a mesh axis between data and tensor when > 1)

    @property
    def tensor_axis(self) -> int:
        return 2 if self.context > 1 else 1

    @property
    def input_sbp(self) -> tuple[Any, ...]:
        """SBP of ids and targets: split on the batch over data (B if data is 1), zigzag on the sequence over
        context, broadcast over tensor."""
        context = (zigzag(1),) if self.context > 1 else ()
        return (split(0) if self.data > 1 else broadcast, *context, broadcast)

    @property
    def world_size(self) -> int:
        return self.data * self.context * self.tensor * self.pipeline

    @property
    def everywhere(self) -> Placement:
        """A 1-D placement of every rank of every stage (to read a value on every process)."""
        return Placement(self.device, list(range(self.world_size)))

    def shard_inputs(self, ids: Any, targets: Any = None) -> tuple[Tensor, Tensor | None]:
        """Lays logical ``ids`` (and ``targets``), arrays of shape (B, ...), out as this strategy's inputs."""
        ids_t = make_tensor(_as_array(ids), placement=self.stages[0], sbp=self.input_sbp)
        if targets is None:
            return ids_t, None
        return ids_t, make_tensor(_as_array(targets), placement=self.stages[-1], sbp=self.input_sbp)

    def describe(self) -> str:
        """A table: each stage's placement and blocks, then each parameter's logical shape, stage and SBP."""
        mesh = "(data, context, tensor)" if self.context > 1 else "(data, tensor)"
        context = f" x context={self.context}" if self.context > 1 else ""
        lines = [f"strategy: data={self.data}{context} x tensor={self.tensor} x pipeline="
                 f"{self.pipeline} ({self.world_size} {self.device} devices); each stage a {mesh} mesh"]
        for s, p in enumerate(self.stages):
            blocks = [str(i) for i, b in enumerate(self.block_stage) if b == s]
            lines.append(f"  stage {s}: {p}  blocks [{', '.join(blocks)}]")
        lines.append(f"  inputs: ids on stage 0, targets on stage {self.pipeline - 1}, sbp {format_nd(self.input_sbp)}")
        width = max([len(n) for n in self.params] + [9])
        lines.append(f"  {'parameter':<{width}}  {'shape':<10} stage  sbp {mesh}")
        for name, (stage, nd, shape) in self.params.items():
            lines.append(f"  {name:<{width}}  {str(list(shape)):<10} {stage:>5}  {format_nd(nd)}")
        return "\n".join(lines)


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, Tensor):
        return np.asarray(value.numpy())
    array = np.asarray(value)
    return array.astype(np.int64) if array.dtype.kind in "iu" else array


def stage_placements(data: int, tensor: int, pipeline: int, device: str = "cpu",
                     context: int = 1) -> tuple[Placement, ...]:
    """One (data, tensor) mesh per stage, (data, context, tensor) with ``context`` > 1; stage ``s`` holds the
    next ``data * context * tensor`` ranks.

    >>> [str(p) for p in stage_placements(2, 1, 2)]
    ['cpu:[[0], [1]]', 'cpu:[[2], [3]]']
    >>> str(stage_placements(1, 1, 1, context=2)[0])
    'cpu:[[[0], [1]]]'
    """
    per_stage = data * context * tensor
    meshes = np.arange(pipeline * per_stage).reshape(pipeline, data, context, tensor)
    return tuple(Placement(device, (mesh if context > 1 else mesh[:, 0]).tolist()) for mesh in meshes)


def split_blocks(n_layer: int, pipeline: int) -> tuple[int, ...]:
    """Stage of each block: contiguous runs, as even as possible (earlier stages take the extra ones).

    >>> split_blocks(5, 2)
    (0, 0, 0, 1, 1)
    """
    if pipeline > max(n_layer, 1):
        raise PlanError(f"pipeline={pipeline} needs at least that many blocks, but the model has {n_layer}")
    sizes = [len(part) for part in np.array_split(np.arange(n_layer), pipeline)]
    return tuple(s for s, n in enumerate(sizes) for _ in range(n))


def block_starts(model: Module, blocks_per_stage: Sequence[int]) -> list[str]:
    """The ``stages`` argument that gives stage ``s`` the next ``blocks_per_stage[s]`` of the model's repeated
    blocks (its largest ModuleList of same-class modules): uneven cuts, such as a planner's.

    >>> from sbpflow import nn
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(4)]))
    >>> block_starts(net, (1, 3))
    ['1.0', '1.1']
    """
    named = dict(model.named_modules())
    blocks = _block_names(named, _largest_block_list(named))
    sizes = list(blocks_per_stage)
    if not sizes or sum(sizes) != len(blocks) or min(sizes) < 1:
        raise PlanError(f"parallelize: blocks per stage must give every stage at least one block, {len(blocks)} in "
                        f"all (the repeated blocks of {type(model).__name__}), but got {sizes}")
    firsts = np.cumsum([0] + sizes[:-1])
    return [blocks[int(i)] for i in firsts]


# -- parallelize -----------------------------------------------------------------------------------


def parallelize(model: Module, data: int = 1, tensor: int = 1, pipeline: int = 1, virtual: int = 1,
                expert: int = 1, *, context: int = 1, plan: Mapping[str, Any] | None = None,
                stages: Sequence[str] | None = None, device: str = "cpu") -> Strategy:
    """Lays ``model``'s parameters out for data x tensor x pipeline (x expert x context) parallelism; returns the
    Strategy.

    Every check runs before any parameter moves, so a call that raises leaves the model as it was.
    ``virtual`` > 1 cuts ``virtual * pipeline`` stages, stage ``k`` on placement ``k mod pipeline``.
    ``context`` > 1 splits the inputs' sequence (dim 1) zigzag over that many ranks: context parallelism for a
    model whose attention is ``scaled_dot_product_attention``.

    >>> import sbpflow
    >>> from sbpflow import nn
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(4)]))
    >>> s = sbpflow.parallelize(net, pipeline=2, stages=["1.0", "1.2"])
    >>> [s.params[f"1.{i}.weight"][0] for i in range(4)], s.params["0.weight"][0]
    ([0, 0, 1, 1], 0)
    """
    _check_degrees(data, tensor, pipeline, virtual, expert, context)
    named = dict(model.named_modules())
    styles = _resolve_plan(model, named, plan, tensor)
    blocks = _largest_block_list(named)
    starts = list(stages) if stages is not None else _even_starts(named, blocks, pipeline * virtual)
    virtual_stage = _virtual_stages(named, starts, pipeline * virtual)
    placement_of = {name: k % pipeline for name, k in virtual_stage.items()}
    moes = _expert_modules(named, expert, data, styles)
    placements = stage_placements(data, tensor, pipeline, device, context)
    block_stage = tuple(placement_of[name] for name in _block_names(named, blocks))
    strategy = Strategy(data, tensor, pipeline, device, placements, block_stage, virtual, expert=expert,
                        context=context)
    # every check is done: from here on the model changes
    for name, module in named.items():
        place_own_tensors(module, styles.get(name, Replicate()), placements[placement_of[name]],
                          strategy.tensor_axis)
    for moe in moes:
        _split_experts(moe, expert, data)
    _install_hooks(model, named, strategy)
    for name, param in model.named_parameters():  # an expert (stacked, or on a sub-mesh) keeps its owner's stage
        strategy.params[name] = (placement_of[name.rpartition(".")[0]], param.sbp, tuple(param.shape))
    model.strategy = strategy
    return strategy


def _check_degrees(data: int, tensor: int, pipeline: int, virtual: int, expert: int, context: int) -> None:
    for what, n in (("data", data), ("tensor", tensor), ("pipeline", pipeline), ("virtual", virtual),
                    ("expert", expert), ("context", context)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise PlanError(f"parallelize needs {what} to be an int >= 1, but got {n!r}")
    if data % expert:
        raise PlanError(f"parallelize cuts the experts into groups over the data axis, so expert={expert} must "
                        f"divide data={data}")


# -- the plan --------------------------------------------------------------------------------------


def _resolve_plan(model: Module, named: Mapping[str, Module], plan: Mapping[str, Any] | None,
                  tensor: int) -> dict[str, Any]:
    """``{module name: style}`` for the tensor axis: the plan's (checked even when tensor is 1), else inferred."""
    if plan is None:
        plan = getattr(model, "parallel_plan", None)
    if plan is None:
        return _infer_plan(model, named, tensor) if tensor > 1 else {}
    if not isinstance(plan, Mapping):
        raise PlanError(f"parallelize: plan must map module-name patterns to styles, but got {plan!r}")
    chosen: dict[str, Any] = {}
    for pattern, style in plan.items():
        style = _style(pattern, style)
        hits = [name for name in named if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise PlanError(f"parallelize: plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                            f"its modules are {_some(named)}")
        for name in hits:
            _check_fits(named[name], name, style)
            chosen.setdefault(name, style)
    _check_heads(named, chosen, tensor)
    return chosen if tensor > 1 else {}


def _style(pattern: str, style: Any) -> Any:
    if isinstance(style, str):
        word = HF_STYLES.get(style, style)
        if word not in STYLES:
            raise PlanError(f"parallelize: the style for {pattern!r} must be one of {sorted(STYLES)} (or a "
                            f"Hugging Face tp_plan word {sorted(HF_STYLES)}), but got {style!r}")
        return STYLES[word]
    if not isinstance(style, (ColwiseParallel, RowwiseParallel, Replicate)):
        raise PlanError(f"parallelize: the style for {pattern!r} must be a name or ColwiseParallel(), "
                        f"RowwiseParallel(), VocabParallelEmbedding() or Replicate(), but got {style!r}")
    return style


def _check_fits(module: Module, name: str, style: Any) -> None:
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(module, (Linear, Conv2d, Embedding)):
        raise PlanError(f"parallelize: {type(style).__name__} applies to Linear, Conv2d and Embedding modules, but "
                        f"{name or 'the root module'} is a {type(module).__name__}")


def _check_heads(named: Mapping[str, Module], chosen: Mapping[str, Any], tensor: int) -> None:
    """A column-split projection keeps whole heads per rank only if ``tensor`` divides its parent's head counts."""
    for name, style in chosen.items():
        if not isinstance(style, ColwiseParallel) or not name:
            continue
        parent_name = name.rpartition(".")[0]
        parent = named[parent_name]
        for attr in HEAD_ATTRS:
            heads = parent.__dict__.get(attr)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads % tensor:
                raise PlanError(f"parallelize: tensor={tensor} must divide {parent_name or 'the root module'}."
                                f"{attr}={heads}, so that each rank of the column-split {name} keeps whole heads")


def _infer_plan(model: Module, named: Mapping[str, Module], tensor: int) -> dict[str, Any]:
    """Megatron pairs among sibling Linears (see the module docstring); a PlanError if there are none."""
    chosen: dict[str, Any] = {}
    for parent_name, parent in named.items():
        prefix = f"{parent_name}." if parent_name else ""
        linears = [(prefix + n, m) for n, m in parent._modules.items() if isinstance(m, Linear)]
        pair = _megatron_pair(linears)
        if pair is not None:
            columns, row = pair
            chosen.update({n: ColwiseParallel() for n in columns})
            chosen[row] = RowwiseParallel()
    if not chosen:
        raise PlanError(f"parallelize: tensor={tensor} needs a plan, but {type(model).__name__} has no "
                        f"parallel_plan and no module holds a pair of Linears to split Megatron-style (one whose "
                        f"output width is another's input width and back); pass plan={{pattern: 'colwise' | "
                        f"'rowwise' | 'vocab' | 'replicate'}} or tensor=1")
    _check_heads(named, chosen, tensor)
    return chosen


def _megatron_pair(linears: list[tuple[str, Any]]) -> tuple[list[str], str] | None:
    """(column-parallel names, the row-parallel name): the row is the Linear most siblings feed, the last on ties."""
    best: tuple[list[str], str] | None = None
    for row_name, row in linears:
        feeds = [n for n, m in linears if n != row_name and m.out_features == row.in_features
                 and m.in_features == row.out_features]
        if not feeds:
            continue
        columns = [n for n, m in linears if n != row_name and m.in_features == row.out_features]
        if best is None or len(columns) >= len(best[0]):
            best = (columns, row_name)
    return best


def _some(named: Mapping[str, Module], limit: int = 12) -> str:
    names = [n or "''" for n in named]
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


# -- stages ----------------------------------------------------------------------------------------


def _largest_block_list(named: Mapping[str, Module]) -> str | None:
    """The ModuleList of same-class modules holding the most parameters (the repeated blocks), or None."""
    best, best_size = None, -1
    for name, module in named.items():
        items = list(module._modules.values()) if isinstance(module, ModuleList) else []
        if not items or len({type(m) for m in items}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = name, size
    return best


def _block_names(named: Mapping[str, Module], blocks: str | None) -> list[str]:
    if blocks is None:
        return []
    prefix = f"{blocks}." if blocks else ""
    return [prefix + key for key in named[blocks]._modules]


def _even_starts(named: Mapping[str, Module], blocks: str | None, n_stages: int) -> list[str]:
    """The first block of each of ``n_stages`` even runs of the block list (else of the root's children)."""
    if n_stages == 1:
        return []
    if blocks is not None:
        units = _block_names(named, blocks)
    else:
        units = [n for n, m in named[""]._modules.items() if any(True for _ in m.parameters())]
    if n_stages > len(units):
        where = f"the {len(units)} blocks of {blocks}" if blocks else f"{len(units)} top-level modules with parameters"
        raise PlanError(f"parallelize: {n_stages} pipeline stages (pipeline x virtual) need a block each, but the "
                        f"model has {where}; pass stages=[module names] or fewer stages")
    owner = split_blocks(len(units), n_stages)
    return [units[owner.index(s)] for s in range(n_stages)]


def _virtual_stages(named: Mapping[str, Module], starts: list[str], n_stages: int) -> dict[str, int]:
    """Each module's virtual stage: the index of the last start at or before it in registration order."""
    if len(starts) != n_stages and not (n_stages == 1 and not starts):
        raise PlanError(f"parallelize: stages must name where each of the {n_stages} pipeline stages (pipeline x "
                        f"virtual) starts, but got {len(starts)}: {starts}")
    order = {name: i for i, name in enumerate(named)}
    missing = [s for s in starts if s not in order]
    if missing:
        raise PlanError(f"parallelize: stages names {missing}, which are not modules of the model; its modules are "
                        f"{_some(named)}")
    positions = [order[s] for s in starts]
    if positions != sorted(set(positions)):
        raise PlanError(f"parallelize: stages must be distinct modules in registration order, but got {starts}")
    at = {order[s]: k for k, s in enumerate(starts)}
    stage, out = 0, {}
    for i, name in enumerate(named):
        stage = at.get(i, stage)
        out[name] = stage
    return out


# -- experts ---------------------------------------------------------------------------------------


def _expert_modules(named: Mapping[str, Module], expert: int, data: int, styles: Mapping[str, Any]) -> list[Module]:
    """Modules that declare experts (``num_experts`` and an ``experts`` list of that length), checked."""
    if expert == 1:
        return []
    found = []
    for name, m in named.items():
        n, experts = m.__dict__.get("num_experts"), m._modules.get("experts")
        if isinstance(n, int) and isinstance(experts, ModuleList) and len(experts._modules) == n:
            if n % expert:
                raise PlanError(f"parallelize: expert={expert} must divide {name}.num_experts={n}")
            if _stacks(m, expert, data):
                _check_alike(name, n, styles)
            found.append(m)
    if not found:
        raise PlanError(f"parallelize: expert={expert} splits experts, but no module declares them (an int "
                        f"num_experts and an experts ModuleList of that length)")
    return found


def _stacks(moe: Module, groups: int, data: int) -> bool:
    """One expert group per data rank of an nn.MoE: its experts stack, split S(0) over the data axis."""
    return groups == data and isinstance(moe, MoE)


def _check_alike(name: str, n: int, styles: Mapping[str, Any]) -> None:
    """Stacked experts share one layout: the plan must give every expert's w1 (w2, w3) the same style."""
    for weight in ("w1", "w2", "w3"):
        chosen = {styles.get(f"{name}.experts.{e}.{weight}", Replicate()) for e in range(n)}
        if len(chosen) > 1:
            raise PlanError(f"parallelize: expert=data stacks the experts of {name}, so the plan must give every "
                            f"experts.*.{weight} one style, but it gives {sorted(map(repr, chosen))}")


def _split_experts(moe: Module, groups: int, data: int) -> None:
    """Stacked over the data axis when each data rank is one group (:func:`_stacks`); else expert ``e`` moves to
    the data rows of group ``e // (num_experts / groups)`` of its stage's mesh."""
    if _stacks(moe, groups, data):
        assert isinstance(moe, MoE) and isinstance(moe.experts, ModuleList)  # (for mypy: _expert_modules checked)
        split_experts(moe, moe.experts[0].w1.weight.placement, DATA_AXIS)
        return
    experts = list(moe._modules["experts"]._modules.values())
    per_group = len(experts) // groups
    for e, module in enumerate(experts):
        for p in module.parameters():
            mesh = p.placement
            ranks = np.asarray(mesh.flat_ranks).reshape(mesh.hierarchy)  # (data, tensor)
            rows = mesh.hierarchy[DATA_AXIS] // groups
            g = e // per_group
            relayout_(p, Placement(mesh.type, ranks[g * rows:(g + 1) * rows].tolist()), p.sbp)


# -- hooks: inputs and stage moves -----------------------------------------------------------------


def _install_hooks(model: Module, named: Mapping[str, Module], strategy: Strategy) -> None:
    for handle in model.__dict__.get("_parallelize_handles", ()):
        handle.remove()
    if getattr(model.__dict__.get("forward"), "_stage_order", False):
        del model.__dict__["forward"]  # laid out again: the last layout's stage order goes
    handles = [model.register_forward_pre_hook(_local_inputs(strategy), prepend=True)]
    if strategy.pipeline > 1:
        if strategy.virtual == 1:  # with virtual stages a placement is not one place in the order
            _forward_in_stage_order(model, strategy.stages)
        for module, target in _stage_units(named, strategy.stages):
            handles.append(module.register_forward_pre_hook(_to_stage(target)))
    object.__setattr__(model, "_parallelize_handles", handles)


def _forward_in_stage_order(model: Module, stages: Sequence[Placement]) -> None:
    """The model's forward runs inside ``stage_order(stages)``: an op there that meets tensors of several stages
    (a residual added in the parent's forward) runs on the latest of them; outside it such an op still raises."""
    forward = model.forward

    def staged(*args: Any, **kwargs: Any) -> Any:
        with stage_order(stages):
            return forward(*args, **kwargs)

    staged._stage_order = True  # type: ignore[attr-defined]
    object.__setattr__(model, "forward", staged)


def _stage_units(named: Mapping[str, Module], stages: Sequence[Placement]) -> list[tuple[Module, Placement]]:
    """The largest modules whose tensors all sit on one stage (their parent's spread over several)."""
    homes: dict[str, set[Placement]] = {}
    for name, module in named.items():
        tensors = [t for t in (*module.parameters(), *module.buffers()) if t is not None and t.is_global]
        homes[name] = {t.placement for t in tensors if t.placement in stages}
    units = []
    for name, module in named.items():
        if name and len(homes[name]) == 1 and len(homes[name.rpartition(".")[0]]) > 1:
            units.append((module, next(iter(homes[name]))))
    return units


def _to_stage(target: Placement) -> Callable[[Module, tuple[Any, ...]], tuple[Any, ...]]:
    """A pre-hook moving global tensor inputs to ``target`` (SBP kept); the gradient moves back."""

    def hook(module: Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.to_global(placement=target) if isinstance(a, Tensor) and a.is_global
                     and a.placement != target else a for a in args)

    return hook


def _local_inputs(strategy: Strategy) -> Callable[[Module, tuple[Any, ...]], tuple[Any, ...]]:
    """A pre-hook laying out local tensor inputs: the first on the first stage, the others on the last."""

    def lay_out(x: Tensor, placement: Placement) -> Tensor:
        if x.requires_grad:
            raise AutogradError(f"parallelize lays out local inputs by cutting them into shards, which would cut "
                                f"them from the graph, but an input ({x._describe()}) requires grad; pass a "
                                f"global tensor (strategy.shard_inputs) instead")
        value = x.to_local()
        if strategy.context > 1 and value.dim() < 2:
            raise PlanError(f"parallelize(context={strategy.context}) splits inputs on their sequence (dim 1), but "
                            f"an input has shape {list(value.shape)}; pass (batch, sequence, ...) inputs")
        return Tensor._from_shards(tuple(value.shape), value.dtype, placement, strategy.input_sbp,
                                   shards_from_full(value, placement, strategy.input_sbp))

    def hook(module: Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        out, first = [], True
        for a in args:
            if isinstance(a, Tensor) and not a.is_global:
                a = lay_out(a, strategy.stages[0] if first else strategy.stages[-1])
            first = first and not isinstance(a, Tensor)
            out.append(a)
        return tuple(out)

    return hook


__all__ = ["Strategy", "block_starts", "parallelize", "split_blocks", "stage_placements"]
