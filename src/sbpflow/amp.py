"""Mixed precision: ``sbpflow.autocast`` casts op inputs by a per-op policy; ``GradScaler`` scales fp16 losses.

This is the supported way to use mixed precision: ``torch.autocast`` does not see sbpflow ops (they would
keep fp32 under it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .autograd import no_grad
from .creation import full
from .errors import SbpflowError
from .ops import functional as F
from .ops.dispatch import INPUT_HOOKS
from .ops.functional import cast, clone
from .sbp import broadcast
from .tensor import Tensor

# Under autocast every op looks up its name before it dispatches: LOWER casts floating inputs to the low dtype
# (the compute-heavy ops), FP32 casts them to fp32 (so sums and the loss keep fp32 accuracy), and any other op
# runs in its inputs' dtypes (mixed inputs promote, as in torch).
LOWER = frozenset({"matmul", "matmul_nd", "linear", "conv2d", "scaled_dot_product_attention"})
FP32 = frozenset({"sum", "mean", "cumsum", "softmax", "log_softmax", "layer_norm", "rms_norm", "exp", "log",
                  "pow", "rsqrt"})
LOW_DTYPES = (torch.bfloat16, torch.float16)


class _State(threading.local):
    dtype: torch.dtype | None = None  # the low dtype while an autocast block is on
    grad_comm: torch.dtype | None = None  # the dtype gradients are reduced in (gradient_communication)


_state = _State()


@contextmanager
def autocast(dtype: torch.dtype = torch.bfloat16, enabled: bool = True) -> Iterator[None]:
    """Runs the ops of the block under the mixed-precision policy for ``dtype`` (bf16 or fp16); nests, and
    ``enabled=False`` turns it off inside an outer block.

    Casts are ordinary sbpflow ``cast`` ops recorded by autograd, so a parameter stays fp32 (the master
    weight), its low-precision copy is made per use, and its gradient arrives in fp32. As in torch, backward
    runs with the dtypes forward chose, not under the policy.

    >>> import sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.randn(4, 4))
    >>> with autocast(dtype=torch.bfloat16):
    ...     y = sbpflow.randn(2, 4) @ w
    ...     s = y.sum()
    >>> y.dtype, s.dtype, w.dtype
    (torch.bfloat16, torch.float32, torch.float32)
    >>> s.backward()
    >>> w.grad.dtype
    torch.float32
    """
    if enabled and dtype not in LOW_DTYPES:
        raise SbpflowError(f"sbpflow.autocast(dtype=...) takes torch.bfloat16 or torch.float16, but got {dtype}")
    previous = _state.dtype
    _state.dtype = dtype if enabled else None
    INPUT_HOOKS.stack.append(cast_inputs)
    try:
        yield
    finally:
        INPUT_HOOKS.stack.pop()
        _state.dtype = previous


def active_dtype() -> torch.dtype | None:
    """The low dtype of the innermost autocast block, or None outside one (or inside ``enabled=False``)."""
    return _state.dtype


@contextmanager
def suspended() -> Iterator[None]:
    """No autocast inside (backward: gradients follow the dtypes forward chose)."""
    previous = _state.dtype
    _state.dtype = None
    try:
        yield
    finally:
        _state.dtype = previous


@contextmanager
def gradient_communication(dtype: torch.dtype | None) -> Iterator[None]:
    """Backward passes inside the block reduce fp32 gradients in ``dtype`` (bf16 halves the bytes of every
    gradient all-reduce or reduce-scatter); the reduced gradient is cast back to fp32 for the optimizer.
    ``None`` keeps the gradients' own dtype. Summing in bf16 rounds more: this trades accuracy for bandwidth.

    >>> import torch, sbpflow
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> w = sbpflow.ones(4, placement=p, sbp=sbpflow.sbp.broadcast, requires_grad=True)
    >>> x = sbpflow.ones(2, 4, placement=p, sbp=sbpflow.sbp.split(0))
    >>> with gradient_communication(torch.bfloat16), sbpflow.comm.record() as log:
    ...     (x * w).sum().backward()
    >>> [(e.kind, e.bytes) for e in log.events], w.grad.dtype  # ring bytes of 4 bf16 values (fp32: 32)
    ([('all_reduce', 16)], torch.float32)
    """
    if dtype is not None and dtype not in LOW_DTYPES:
        raise SbpflowError(f"gradient_communication(dtype=...) takes torch.bfloat16, torch.float16 or None, but got "
                           f"{dtype}")
    previous = _state.grad_comm
    _state.grad_comm = dtype
    try:
        yield
    finally:
        _state.grad_comm = previous


def grad_comm_dtype() -> torch.dtype | None:
    return _state.grad_comm


def cast_inputs(op_name: str, args: Sequence[Any]) -> Sequence[Any]:
    """``args`` with floating tensors cast as the policy says for ``op_name`` (the same args if it says nothing)."""
    low = _state.dtype
    if low is None:  # inside autocast(enabled=False), or suspended()
        return args
    target = low if op_name in LOWER else torch.float32 if op_name in FP32 else None
    if target is None:
        return args
    if not any(isinstance(a, Tensor) and a.dtype.is_floating_point and a.dtype != target for a in args):
        return args
    with suspended():  # the casts themselves dispatch as ops
        return tuple(cast(a, target) if isinstance(a, Tensor) and a.dtype.is_floating_point and a.dtype != target
                     else a for a in args)


class GradScaler:
    """Dynamic loss scaling for fp16, as ``torch.amp.GradScaler``: multiply the loss by ``scale``, divide the
    gradients back before the step, skip steps whose gradients hold an inf or NaN and halve the scale then,
    double it after ``growth_interval`` clean steps.

    >>> import sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.ones(2))
    >>> opt, scaler = sbpflow.optim.SGD([w], lr=0.5), sbpflow.amp.GradScaler(init_scale=8.0)
    >>> scaler.scale((w * 2).sum()).backward()
    >>> w.grad.tolist()
    [16.0, 16.0]
    >>> scaler.step(opt); scaler.update()
    >>> w.tolist(), scaler.get_scale()
    ([0.0, 0.0], 8.0)
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval > 0):
            raise SbpflowError(f"GradScaler needs growth_factor > 1, 0 < backoff_factor < 1 and growth_interval > 0, "
                               f"but got {growth_factor}, {backoff_factor}, {growth_interval}")
        self.enabled = enabled
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._growth_tracker = 0
        self._found_inf: dict[int, bool] = {}  # id(optimizer) -> whether its unscaled gradients hold inf/NaN
        self._graph: _GraphScale | None = None  # nn.Graph: the scale and tracker as graph variables

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale(self, loss: Any) -> Any:
        """``loss * scale`` (the loss itself when disabled)."""
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer: Any) -> None:
        """Divides ``optimizer``'s gradients by the scale in place and records whether any is not finite.

        Call it before clipping; :meth:`step` calls it if you did not. Once per optimizer per step."""
        if not self.enabled:
            return
        if id(optimizer) in self._found_inf:
            raise SbpflowError("GradScaler.unscale_() was already called for this optimizer since the last update()")
        optimizer.check_grads()  # a step that would refuse them refuses before they are divided
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self._found_inf[id(optimizer)] = not _all_finite(grads)
        inv = 1.0 / self._scale
        for grad in grads:
            shards = list(grad.local_tensors().values())
            if shards:
                torch._foreach_mul_(shards, inv)

    def step(self, optimizer: Any) -> None:
        """``optimizer.step()`` unless the unscaled gradients hold an inf or NaN (then the step is skipped)."""
        if not self.enabled:
            optimizer.step()
            return
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        if not self._found_inf[id(optimizer)]:
            optimizer.step()

    def update(self) -> None:
        """Backs the scale off after an overflow, grows it after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if any(self._found_inf.values()):
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf.clear()

    # -- nn.Graph (config.enable_amp(torch.float16)): the same rules as graph ops -------------------------------

    def graph_variables(self, placement: Any) -> dict[str, Any]:
        """The scale and growth tracker as broadcast 0-d fp32 tensors on ``placement``: variables of a compiled
        step, which updates them in place; they are made once and refreshed from this scaler before each run."""
        if self._graph is None or self._graph.scale.placement != placement:
            def scalar() -> Any:
                return full((), fill_value=0.0, placement=placement, sbp=(broadcast,) * placement.ndim)

            self._graph = _GraphScale(scalar(), scalar())
        return self.graph_state()

    def graph_state(self) -> dict[str, Any]:
        """The graph variables made by :meth:`graph_variables` by name (none before)."""
        if self._graph is None:
            return {}
        return {"amp.scale": self._graph.scale, "amp.growth_tracker": self._graph.tracker}

    def before_compiled_step(self) -> None:
        """Writes this scaler's scale and tracker into the graph's variables (a loaded state dict takes effect)."""
        assert self._graph is not None
        for t, value in ((self._graph.scale, self._scale), (self._graph.tracker, self._growth_tracker)):
            for shard in (t._shards or {}).values():
                shard.fill_(float(value))

    def after_compiled_step(self) -> None:
        """Reads back the scale and tracker the step updated (``get_scale()`` then says what torch's would)."""
        assert self._graph is not None
        shards = self._graph.scale._shards or {}
        if shards:  # a process holding no rank of the scaler's placement keeps its last values
            self._scale = float(next(iter(shards.values())))
            self._growth_tracker = int(next(iter((self._graph.tracker._shards or {}).values())))

    def loss_seed(self, seed: Any) -> Any:
        """Traced: the backward's implicit gradient ``seed`` times the scale (``scale(loss).backward()``)."""
        assert self._graph is not None
        scale = self._graph.scale
        if scale.placement != seed.placement:
            scale = scale.to_global(seed.placement, (_broadcast(),) * seed.placement.ndim)
        return seed * scale

    def trace_unscale(self, grads: list[Any]) -> tuple[Any, list[Any]]:
        """Traced: ``(found, unscaled)``: whether any of ``grads`` is not finite (a 0-d bool: one sum of non-finite
        counts over every gradient, so at most one reduction across ranks) and the gradients divided by the scale."""
        import torch as _torch

        assert self._graph is not None
        scale = self._graph.scale
        inv = 1.0 / scale
        count: Any = None
        out = []
        for g in grads:
            out.append(g * (inv if inv.placement == g.placement else inv.to_global(g.placement, _b(g))))
            bad = F.sum(F.cast(F.logical_not(F.isfinite(g)), _torch.float32))
            if bad.placement != scale.placement:
                bad = bad.to_global(scale.placement, _b(scale))
            count = bad if count is None else count + bad
        if count is None:
            return scale * 0 > 0, out
        return count > 0, out

    def trace_update(self, found: Any) -> None:
        """Traced: :meth:`update` as graph ops on the scale and tracker variables (torch's
        ``_amp_update_scale_``: back off on ``found``, grow after ``growth_interval`` clean steps if finite)."""
        assert self._graph is not None
        scale, tracker = self._graph.scale, self._graph.tracker
        zero = tracker * 0
        successful = tracker + 1
        grow = successful >= self.growth_interval
        grown = scale * self.growth_factor
        grown = F.where(F.isfinite(grown), grown, scale)
        new_scale = F.where(found, scale * self.backoff_factor, F.where(grow, grown, scale))
        new_tracker = F.where(found, zero, F.where(grow, zero, successful))
        scale._assign(new_scale)
        tracker._assign(new_tracker)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self._growth_tracker = state["growth_interval"], state["_growth_tracker"]


def master_weights(optimizer: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """Low-precision parameters with fp32 master weights, as the ZeRO paper counts mixed precision; returns
    ``optimizer``.

    Every fp32 parameter of ``optimizer`` becomes ``dtype`` in place (2 bytes; its gradients then are too, and
    are reduced in ``dtype``), and the optimizer keeps an fp32 copy as state ``"master"`` in its state layout
    (so ZeRO shards it with the moments). A step updates the master from the gradient cast to fp32 and writes
    it back cast to ``dtype``. Per data-parallel rank with Adam: 2Ψ parameters + 2Ψ gradients + 12Ψ state, so
    ZeRO stage 1 holds 4Ψ + 12Ψ/N and stage 2 2Ψ + 14Ψ/N. Run the forward under :func:`autocast` (``dtype``).
    Eager steps only (a compiled step refuses it).

    >>> import torch, sbpflow
    >>> w = sbpflow.nn.Parameter(sbpflow.ones(2))
    >>> opt = master_weights(sbpflow.optim.SGD([w], lr=1e-3))
    >>> w.dtype, opt.state[w]["master"].dtype
    (torch.bfloat16, torch.float32)
    >>> (w.float() * 1.0).sum().backward(); opt.step()
    >>> opt.state[w]["master"].tolist(), w.tolist()  # the master moves by 1e-3; bf16 cannot show it
    ([0.9990000128746033, 0.9990000128746033], [1.0, 1.0])
    """
    if dtype not in LOW_DTYPES:
        raise SbpflowError(f"master_weights(dtype=...) takes torch.bfloat16 or torch.float16, but got {dtype}")
    with no_grad():
        for p in optimizer._all_params():
            if p.dtype != torch.float32:
                continue
            state = optimizer.state[p]
            if not state:
                optimizer._init_scalars(state)
            layout = optimizer._state_layout(p)
            moved = p.detach() if layout is p else p.detach().to_global(layout.placement, layout.sbp)
            state["master"] = clone(moved)  # its own storage (a ZeRO slice may be a view of the parameter's)
            p._take_storage(cast(p.detach(), dtype))
            p.grad = None
            p._version += 1
    return optimizer


def trace_masked_updates(found: Any, updates: list[tuple[Any, Any]]) -> None:
    """Traced: each ``(variable, value before the optimizer)`` keeps its old value where ``found`` (a skipped
    step), as ``where(found, old, new)``; no Python branch on data."""
    on: dict[Any, Any] = {found.placement: found}  # the flag sent once to each placement (pipeline stages)
    for t, old in updates:
        if t.placement not in on:
            on[t.placement] = found.to_global(t.placement, _b(t))
        t._assign(F.where(on[t.placement], old, t))


class _GraphScale:
    """The graph variables of a :class:`GradScaler`: scale and growth tracker (0-d fp32, broadcast)."""

    def __init__(self, scale: Any, tracker: Any) -> None:
        self.scale = scale
        self.tracker = tracker


def _broadcast() -> Any:
    return broadcast


def _b(t: Any) -> tuple[Any, ...]:
    return (_broadcast(),) * t.placement.ndim


def _all_finite(grads: list[Any]) -> bool:
    """Whether every gradient is finite, the same answer on every process (one sbpflow reduction per gradient)."""
    ok = True
    with no_grad():
        for g in grads:
            ok = bool(F.isfinite(g).all().item()) and ok
    return ok
