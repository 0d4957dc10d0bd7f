"""The optimizer base: param groups, and state kept in each parameter's layout and updated shard by shard.

Every update rule is elementwise, so a step runs ``torch._foreach_*`` kernels over the local shards of
parameters, gradients and state together, with no dispatch and no communication. Overriding
:meth:`Optimizer.state_sbp` shards the state (ZeRO-1) with no other change.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..autograd import enable_grad, no_grad
from ..autograd.engine import zero_grads
from ..creation import zeros
from ..errors import LocalGlobalError, SbpError, SbpflowError, ShapeError
from ..meta import meta_init
from ..ops.functional import cast
from ..sbp import NdSbp, Partial, format_nd
from ..tensor import Tensor, logical_value, shards_from_full


class ParamState(dict):  # type: ignore[type-arg]
    """The state of one parameter: names to sbpflow tensors (in the state layout) or Python numbers."""


class _StateByParam:
    """``optimizer.state[param]``, keyed by identity (Tensor ``==`` is elementwise, so no dict of tensors)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Tensor, ParamState]] = {}

    def __getitem__(self, p: Tensor) -> ParamState:
        entry = self._by_id.get(id(p))
        if entry is None:
            entry = (p, ParamState())
            self._by_id[id(p)] = entry
        return entry[1]

    def __contains__(self, p: object) -> bool:
        return id(p) in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def items(self) -> Iterator[tuple[Tensor, ParamState]]:
        return iter(self._by_id.values())

    def clear(self) -> None:
        self._by_id.clear()


@dataclass
class ShardBatch:
    """Local torch shards of the parameters one step updates, aligned by position.

    ``params[i]``, ``grads[i]`` and ``state[name][i]`` are the same rank's shard
    of the same parameter; ``owner[i]`` is the index of that parameter in
    ``tensors`` (so per-parameter scalars, such as Adam's step, expand to shards).
    """

    tensors: list[Tensor]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    owner: list[int]
    state: dict[str, list[torch.Tensor]]


class Optimizer:
    """Base class: holds ``param_groups`` (dicts with ``"params"`` plus hyperparameters) and ``state``.

    A parameter with a partial SBP has no per-shard value to update: stepping it raises an SbpError.

    >>> import sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.ones(3))
    >>> opt = sbpflow.optim.SGD([w], lr=0.5)
    >>> (w * w).sum().backward()
    >>> opt.step()
    >>> w.tolist()
    [0.0, 0.0, 0.0]
    """

    # the hyperparameters a compiled step reads before every run (step_feeds); a traced step bakes in the others,
    # so nn.Graph compiles again when one of those changes
    fed_hyperparameters: tuple[str, ...] = ("lr",)

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        self.defaults = defaults
        self.state = _StateByParam()
        self._zero: Any = None  # a ZeroPlan once sbpflow.optim.zero() has sharded this optimizer
        self.param_groups: list[dict[str, Any]] = []
        groups = list(params)
        if not groups:
            raise SbpflowError(f"{type(self).__name__} got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            self.add_param_group(g)

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Adds a group; missing hyperparameters come from the defaults."""
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in params:
            _check_param(p, type(self).__name__)
            if id(p) in seen:
                raise SbpflowError(f"{type(self).__name__}: a parameter ({p._describe()}) appears in two groups")
            seen.add(id(p))
        full = {**self.defaults, **group, "params": params}
        self.param_groups.append(full)

    # -- the layout hook -------------------------------------------------------------------------

    def state_sbp(self, param: Tensor) -> NdSbp | None:
        """The SBP of ``param``'s state tensors (its own SBP; ``None`` for a local parameter; ZeRO's shard after
        :func:`sbpflow.optim.zero`). Override for other layouts."""
        if self._zero is not None:
            return self._zero.state_sbp(param)  # type: ignore[no-any-return]
        return param.sbp if param.is_global else None

    # -- gradients -------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of every parameter of every group."""
        zero_grads((p for group in self.param_groups for p in group["params"]), set_to_none)

    # -- step ------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Updates every parameter that has a gradient; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        self.check_grads()  # every group before any parameter or state changes
        with no_grad():
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params:
                    self._step_params(group, params)
        return loss

    def check_grads(self) -> None:
        """Refuses a gradient that cannot update its parameter: of another shape, or local for a global parameter
        (or the other way round); and a partial parameter. :meth:`step` (and ``GradScaler.unscale_``) call it
        before changing anything."""
        who = f"{type(self).__name__}.step"
        for p in self._all_params():
            grad = p.grad
            if grad is None:
                continue
            if grad.is_global != p.is_global:
                raise LocalGlobalError(f"{who}: a gradient must be local or global as its parameter is, but the "
                                       f"parameter with {p._describe()} has a gradient with {grad._describe()}")
            if tuple(grad.shape) != tuple(p.shape):
                raise ShapeError(f"{who}: a gradient must have its parameter's shape, but the parameter with "
                                 f"{p._describe()} has a gradient with {grad._describe()}")
            if p.is_global:
                _check_not_partial(p, type(self).__name__)

    def _step_params(self, group: dict[str, Any], params: list[Tensor]) -> None:
        views = [self._update_view(p) for p in params]
        batch = self._batch(group, params, views)
        self._update(group, batch)
        for p, (view, _) in zip(params, views, strict=True):
            if view is not p:  # sharded state or a master weight: the updated value goes back into the parameter
                p._assign(_written_back(view, p))
            else:  # updated on its shards by the foreach kernels: say so, as torch's step does
                p._version += 1

    def _update_view(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """``(parameter, gradient)`` in the state layout: ``p`` itself unless :meth:`state_sbp` differs."""
        grad = p.grad
        assert grad is not None
        master = self._master_of(p)
        if master is not None:  # amp.master_weights: the fp32 copy is updated, from an fp32 gradient
            return master, _master_grad(grad, master)
        if not p.is_global:
            return p, grad
        _check_not_partial(p, type(self).__name__)
        target = self.state_sbp(p)
        if target is None or target is p._sbp or target == p.sbp:
            # (identity first: comparing placements and SBPs runs dataclass __eq__, per parameter per step)
            if (grad._placement is not p._placement and grad.placement != p.placement) or \
                    (grad._sbp is not p._sbp and grad.sbp != p.sbp):
                grad = grad.to_global(p.placement, p.sbp)
            return p, grad
        if any(isinstance(s, Partial) for s in target):
            raise SbpError(f"{type(self).__name__}.state_sbp must not be partial, but gave {format_nd(target)} "
                           f"for the parameter with {p._describe()}")
        # ZeRO-1: B -> S(d) takes a local slice of parameter and gradient (no comm); _write_back's S -> B is the
        # step's one all-gather
        return p.detach().to_global(p.placement, target), grad.to_global(p.placement, target)

    def _master_of(self, p: Tensor) -> Tensor | None:
        """``p``'s fp32 master weight (state ``"master"``, see :func:`sbpflow.amp.master_weights`), if it has one."""
        if p not in self.state:
            return None
        master = self.state[p].get("master")
        return master if isinstance(master, Tensor) else None

    def _batch(self, group: dict[str, Any], params: list[Tensor], views: list[tuple[Tensor, Tensor]]) -> ShardBatch:
        names = self._state_names(group)
        batch = ShardBatch(params, [], [], [], {name: [] for name in names})
        for i, (p, (view, grad)) in enumerate(zip(params, views, strict=True)):
            state = self.state[p]
            self._init_state(p, view, state, names)
            grad_shards = grad.local_tensors()
            for r, shard in view.local_tensors().items():
                batch.params.append(shard)
                batch.grads.append(grad_shards[r])
                batch.owner.append(i)
                for name in names:
                    batch.state[name].append(state[name].local_tensors()[r])
        return batch

    def _init_state(self, p: Tensor, view: Tensor, state: ParamState, names: list[str]) -> None:
        if not state:
            self._init_scalars(state)
        for name in names:
            if name not in state:
                state[name] = _zeros_like_view(view)

    # -- compiled steps (nn.Graph) ------------------------------------------------------------------

    def init_state(self) -> None:
        """Creates every parameter's state tensors now (zeros in the state layout), as a first step would.

        :meth:`state_dict` calls it, so that a fresh optimizer's state dict lists
        the tensors a checkpoint fills (``sbpflow.load``), in their layout.
        """
        for group in self.param_groups:
            names = self._state_names(group)
            for p in group["params"]:
                with meta_init(p.is_meta):  # a meta parameter's state is meta too (compile_only)
                    self._init_state(p, self._state_layout(p), self.state[p], names)

    def _state_layout(self, p: Tensor) -> Tensor:
        """A tensor in ``p``'s state layout (``p`` itself unless :meth:`state_sbp` differs) to shape new state on."""
        master = self._master_of(p)
        if master is not None:  # state lives like the fp32 master weight
            return master
        target = self.state_sbp(p)
        if not p.is_global or target is None or target == p.sbp:
            return p
        return zeros(tuple(p.shape), placement=p.placement, sbp=target, dtype=p.dtype)

    def trace_step(self, feed_prefix: str) -> list[tuple[str, float]]:
        """Traces this optimizer's update of every parameter with a (lazy) gradient into the graph being built.

        Parameters and state tensors are the graph's variables: each update op's results are written back
        with ``_assign``. Per-step numbers (lr, step counts) are fed each step: returns ``(feed name, value)``
        pairs the graph refreshes before every run by :meth:`step_feeds`.
        """
        feeds = []
        with no_grad():
            for gi, group in enumerate(self.param_groups):
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                if any(self._master_of(p) is not None for p in params):
                    raise SbpflowError(f"{type(self).__name__} with master weights (sbpflow.amp.master_weights) has "
                                       "no compiled (nn.Graph) update yet; use eager steps")
                grads = []
                for p in params:
                    _check_not_partial(p, type(self).__name__)
                    grad = p.grad
                    assert grad is not None
                    target = self.state_sbp(p) or p.sbp  # ZeRO: the gradient in the state layout
                    if (grad.placement, grad.sbp) != (p.placement, target):
                        grad = grad.to_global(p.placement, target)
                    grads.append(grad)
                self._trace_group(group, f"{feed_prefix}.{gi}", params, grads)
                feeds += self.step_feeds(f"{feed_prefix}.{gi}", group)
        return feeds

    def _trace_group(self, group: dict[str, Any], prefix: str, params: list[Tensor], grads: list[Tensor]) -> None:
        """Traces one group's update; by default one update op per parameter (see :meth:`_trace_update`)."""
        for p, grad in zip(params, grads, strict=True):
            self._trace_update(group, prefix, p, grad)

    def _param_view(self, p: Tensor) -> Tensor:
        """``p`` (detached) in the state layout: itself, or ZeRO's shard of it (a local slice of a B parameter)."""
        target = self.state_sbp(p)
        view = p.detach()
        return view if target is None or target == p.sbp else view.to_global(p.placement, target)

    def _write_back(self, p: Tensor, updated: Tensor) -> None:
        """Stores a traced update of :meth:`_param_view` into ``p`` (an all-gather when the state is sharded)."""
        p._assign(updated if updated.sbp == p.sbp else updated.to_global(p.placement, p.sbp))

    def step_feeds(self, prefix: str, group: dict[str, Any]) -> list[tuple[str, float]]:
        """The per-step scalars of one group for its next compiled step."""
        return [(f"{prefix}.lr", float(group["lr"]))]

    def after_compiled_step(self, updated: Collection[Tensor]) -> None:
        """Advances host-side scalar state (step counts) of the parameters a compiled step ``updated`` (those
        with a gradient when it was traced: a frozen one keeps its count, as in an eager step) once it has
        succeeded."""

    def _trace_update(self, group: dict[str, Any], prefix: str, p: Tensor, grad: Tensor) -> None:
        raise SbpflowError(f"{type(self).__name__} has no compiled (nn.Graph) update")

    # -- what subclasses define ------------------------------------------------------------------

    def _state_names(self, group: dict[str, Any]) -> list[str]:
        """Names of the tensor state this group's update needs (created as zeros in the state layout)."""
        return []

    def _init_scalars(self, state: ParamState) -> None:
        """Scalar state of a parameter seen for the first time (such as Adam's step)."""

    def _update(self, group: dict[str, Any], batch: ShardBatch) -> None:
        raise NotImplementedError

    # -- state dict ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {...}}, "param_groups": [...]}``, parameters numbered in group order (as torch).

        Every parameter is listed, a fresh optimizer's too (zeros, see :meth:`init_state`); the state tensors are
        the optimizer's own (shared storage), so ``sbpflow.load`` into them restores the optimizer in place.
        """
        self.init_state()
        index = {id(p): i for i, p in enumerate(self._all_params())}
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index and s}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads hyperparameters and state; tensors (sbpflow, torch or NumPy) are laid out like this optimizer's.
        Every value is checked and made first: a refused state dict changes nothing."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise SbpflowError(f"{type(self).__name__}.load_state_dict needs a dict with 'state' and 'param_groups' "
                               f"(an optimizer's state_dict()), but got {type(state_dict).__name__} "
                               f"{sorted(state_dict) if isinstance(state_dict, dict) else ''}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups, strict=True)
        ):
            raise SbpflowError(f"{type(self).__name__}.load_state_dict: the saved param groups do not match this "
                               "optimizer's (different number of groups or parameters per group)")
        loaded: list[tuple[Tensor, dict[str, Any]]] = []  # every value made (and checked) before any state changes
        for saved, own in zip(groups, self.param_groups, strict=True):
            for saved_index, p in zip(saved["params"], own["params"], strict=True):
                entry = state_dict["state"].get(saved_index)
                if entry:
                    dtype = _state_dtype(entry, p)
                    loaded.append((p, {k: self._load_value(k, v, p, dtype) for k, v in entry.items()}))
        self.state.clear()
        for saved, own in zip(groups, self.param_groups, strict=True):
            own.update({k: v for k, v in saved.items() if k != "params"})
        for p, values in loaded:
            self.state[p].update(values)

    def _load_value(self, name: str, value: Any, p: Tensor, dtype: torch.dtype | None = None) -> Any:
        if name == "step":
            return float(value.item() if hasattr(value, "item") else value)
        if value is None or isinstance(value, (int, float)):
            return value
        return _in_state_layout(value, p, self.state_sbp(p), dtype)

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(g.items()) if k != "params"]
        return "\n".join(lines) + "\n)"


def _check_param(p: Any, who: str) -> None:
    if not isinstance(p, Tensor):
        raise SbpflowError(f"{who} optimizes sbpflow Tensors, but got {type(p).__name__}")
    if not p.is_leaf:
        raise SbpflowError(f"{who} can only optimize leaf tensors, but got one with grad_fn ({p._describe()})")


def _check_not_partial(p: Tensor, who: str) -> None:
    if any(isinstance(s, Partial) for s in p.sbp):
        raise SbpError(
            f"{who} updates parameters shard by shard, which needs a split or broadcast SBP, but a parameter has "
            f"{p._describe()}; a partial value has no per-shard update (convert it with .to_global(sbp=...) first)"
        )


def _master_grad(grad: Tensor, master: Tensor) -> Tensor:
    """A low-precision gradient in its master weight's layout and dtype."""
    if grad.is_global and (grad.placement, grad.sbp) != (master.placement, master.sbp):
        grad = grad.to_global(master.placement, master.sbp)
    return cast(grad, master.dtype) if grad.dtype != master.dtype else grad


def _written_back(view: Tensor, p: Tensor) -> Tensor:
    """An updated view (a ZeRO slice, or a master weight) in ``p``'s dtype and layout: cast first, so the
    all-gather of a sharded update moves ``p``'s own (2-byte) dtype."""
    value = cast(view, p.dtype) if view.dtype != p.dtype else view
    if not p.is_global:
        return value
    return value if (value.placement, value.sbp) == (p.placement, p.sbp) else value.to_global(p.placement, p.sbp)


def _zeros_like_view(view: Tensor) -> Tensor:
    if not view.is_global:
        return zeros(tuple(view.shape), dtype=view.dtype)
    return zeros(tuple(view.shape), placement=view.placement, sbp=view.sbp, dtype=view.dtype)


def _state_dtype(entry: dict[str, Any], p: Tensor) -> torch.dtype:
    """The dtype of a parameter's state tensors: its master weight's (fp32 under amp.master_weights), else its own."""
    master = entry.get("master")
    return master.dtype if isinstance(master, (Tensor, torch.Tensor)) else p.dtype


def _in_state_layout(value: Any, p: Tensor, sbp: NdSbp | None, dtype: torch.dtype | None = None) -> Tensor:
    """A saved state tensor as a new tensor in ``p``'s state layout (its own memory), in ``dtype`` (``p``'s)."""
    dtype = dtype or p.dtype
    if isinstance(value, Tensor):
        if value.is_global and p.is_global:
            moved = value.detach().to_global(p.placement, sbp)
            return Tensor._from_shards(tuple(moved.shape), dtype, p.placement, moved.sbp,
                                       {r: t.to(dtype, copy=True) for r, t in moved.local_tensors().items()})
        value = logical_value(value)
    full = torch.as_tensor(value).detach().to(dtype)
    if tuple(full.shape) != tuple(p.shape):
        raise SbpflowError(f"optimizer state of shape {list(full.shape)} does not fit the parameter with "
                           f"{p._describe()}")
    if not p.is_global:
        return Tensor._from_local(full.clone())
    assert sbp is not None
    return Tensor._from_shards(tuple(full.shape), dtype, p.placement, sbp, shards_from_full(full, p.placement, sbp))
