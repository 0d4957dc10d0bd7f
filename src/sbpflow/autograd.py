"""Reverse-mode autodiff over sbpflow ops.

Every op's gradient is written in sbpflow ops, so backward gets SBP inference
and boxing like forward: a partial gradient stays partial between ops and is
reduced only where a consumer, or a leaf's own SBP, needs otherwise. A leaf's
``.grad`` always has the leaf's placement and SBP, so a broadcast weight under
split data gets one all-reduce per backward (the DDP behaviour).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from .errors import AutogradError
from .sbp import broadcast, partial_sum

if TYPE_CHECKING:
    from .ops.registry import OpDef
    from .tensor import Tensor


class _Mode(threading.local):
    grad_enabled = True
    coalesce = False  # see coalesce_grad_reductions


_mode = _Mode()


def is_grad_enabled() -> bool:
    return _mode.grad_enabled


@contextmanager
def _set_grad(enabled: bool) -> Iterator[None]:
    previous = _mode.grad_enabled
    _mode.grad_enabled = enabled
    try:
        yield
    finally:
        _mode.grad_enabled = previous


class no_grad:
    """Context manager and decorator that turns off gradient recording."""

    def __enter__(self) -> None:
        self._previous = _mode.grad_enabled
        _mode.grad_enabled = False

    def __exit__(self, *exc: object) -> None:
        _mode.grad_enabled = self._previous

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with _set_grad(False):
                return fn(*args, **kwargs)

        wrapped.__name__ = getattr(fn, "__name__", "wrapped")
        wrapped.__doc__ = fn.__doc__
        return wrapped


class enable_grad(no_grad):
    def __enter__(self) -> None:
        self._previous = _mode.grad_enabled
        _mode.grad_enabled = True


@contextmanager
def coalesce_grad_reductions(enabled: bool = True) -> Iterator[None]:
    """Backward passes inside the block reduce the partial-sum gradients of broadcast leaves together: one flat
    all-reduce per (placement, dtype, SBP) at the end of backward instead of one per leaf, as DDP's buckets do.

    Values are the same (a sum of concatenated buffers is the concatenation of the sums); what changes is the
    number of collectives, whose fixed latency dominates with many small gradients.

    >>> import sbpflow
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> w1 = sbpflow.ones(3, placement=p, sbp=sbpflow.sbp.broadcast, requires_grad=True)
    >>> w2 = sbpflow.ones(2, placement=p, sbp=sbpflow.sbp.broadcast, requires_grad=True)
    >>> x = sbpflow.ones(4, 1, placement=p, sbp=sbpflow.sbp.split(0))
    >>> with sbpflow.comm.record() as log, coalesce_grad_reductions():
    ...     ((x * w1).sum() + (x * w2).sum()).backward()
    >>> log.counts(), w1.grad.numpy().tolist()
    ({'all_reduce': 1}, [4.0, 4.0, 4.0])
    """
    previous = _mode.coalesce
    _mode.coalesce = enabled
    try:
        yield
    finally:
        _mode.coalesce = previous


class Node:
    """One recorded op application: what backward needs to compute input gradients."""

    __slots__ = ("op", "inputs", "versions", "outputs", "out_refs", "out_meta", "args", "attrs", "needs", "freed",
                 "__weakref__")

    def __init__(self, op: OpDef, inputs: Sequence[Any], outputs: Sequence[Tensor], attrs: dict[str, Any],
                 save_outputs: bool) -> None:
        self.op = op
        self.args = tuple(inputs)  # tensors and scalars, in call order
        self.inputs = tuple(a for a in inputs if _is_tensor(a))
        self.versions = tuple(t._version for t in self.inputs)
        self.outputs = tuple(o.detach() for o in outputs) if save_outputs else ()
        self.out_refs = tuple(weakref.ref(o) for o in outputs)
        # with several outputs, one may be dropped before backward (max's indices): keep what its zeros need
        self.out_meta = (tuple((tuple(o.shape), o.dtype, o._placement, o._sbp) for o in outputs)
                         if len(outputs) > 1 else ())
        self.attrs = attrs
        self.needs = tuple(t.requires_grad for t in self.inputs)
        self.freed = False

    @property
    def name(self) -> str:
        return f"{self.op.name}_backward"


def _is_tensor(x: Any) -> bool:
    return isinstance(x, _tensor_class())


def _tensor_class() -> type:
    # tensor.py imports this module, so Tensor is looked up once, on first use, not per call
    global _TENSOR
    if _TENSOR is None:
        from .tensor import Tensor

        _TENSOR = Tensor
    return _TENSOR


_TENSOR: type | None = None


class BackwardCtx:
    """What an op's gradient function sees: its inputs, outputs, scalars and attributes."""

    __slots__ = ("inputs", "args", "outputs", "attrs", "needs_input_grad")

    def __init__(self, node: Node) -> None:
        # no detach: gradient functions run with recording off, so the inputs themselves are safe to use
        self.inputs = node.inputs
        self.args = node.args
        self.outputs = node.outputs
        self.attrs = node.attrs
        self.needs_input_grad = node.needs


def backward(roots: Sequence[Tensor], grads: Sequence[Tensor | None], retain_graph: bool = False) -> None:
    """Accumulates d(roots)/d(leaf) into every reachable leaf's ``.grad``."""
    from .ops import functional as F

    pending: dict[tuple[int, int], Tensor] = {}  # (id(node), output index) -> gradient so far
    leaf_grads: dict[int, tuple[Tensor, Tensor]] = {}
    with _set_grad(False):
        for root, grad in zip(roots, grads, strict=True):
            _check_root(root)
            grad = _root_grad(root, grad)
            _send(root, grad, pending, leaf_grads)
        for node in _topological(roots):
            outs = [pending.pop((id(node), i), None) for i in range(len(node.out_refs))]
            if all(g is None for g in outs):
                continue
            outs = _run_output_hooks(node, outs)
            in_grads = _call_backward(node, outs)
            for t, g in zip(node.inputs, in_grads, strict=True):
                if g is not None and t.requires_grad:
                    _send(t, g, pending, leaf_grads)
            if not retain_graph:
                node.freed = True
                node.outputs = ()
        pairs = list(leaf_grads.values())
        if _mode.coalesce:
            pairs = _coalesced(pairs, F)
        for leaf, grad in pairs:
            _accumulate_leaf(leaf, grad, F)


def _check_root(root: Tensor) -> None:
    if not root.requires_grad:
        raise AutogradError(
            f"backward() needs a tensor that requires grad, but got {root._describe()} with requires_grad=False "
            "and no grad_fn"
        )


def _root_grad(root: Tensor, grad: Tensor | None) -> Tensor:

    if grad is None:
        if root.numel() != 1:
            raise AutogradError(
                f"backward() without a gradient needs a scalar output, but got {root._describe()}; "
                "pass gradient= with the output's shape"
            )
        return _ones_broadcast(root)
    if tuple(grad.shape) != tuple(root.shape):
        raise AutogradError(
            f"backward(gradient=...) needs the output's shape {list(root.shape)}, but got {grad._describe()}"
        )
    return grad


def _ones_broadcast(root: Tensor) -> Tensor:
    """The implicit root gradient: ones, broadcast on every rank (built directly: it is on every backward's path).

    B rather than the root's own SBP: a partial root would make every gradient below it partial too.
    """
    from .tensor import Tensor

    if root._local is not None:
        return Tensor._from_local(torch.ones_like(root._local))
    shape = tuple(root.shape)
    shards = {r: torch.ones(shape, dtype=root.dtype, device=t.device) for r, t in (root._shards or {}).items()}
    return Tensor._from_shards(shape, root.dtype, root.placement, (broadcast,) * root.placement.ndim, shards)


def _send(t: Tensor, grad: Tensor, pending: dict, leaf_grads: dict) -> None:  # type: ignore[type-arg]
    if t.grad_fn is None:
        if t._hooks:
            for hook in t._hooks:
                out = hook(grad)
                grad = grad if out is None else out
        previous = leaf_grads.get(id(t))
        leaf_grads[id(t)] = (t, grad if previous is None else previous[1] + grad)
        return
    key = (id(t.grad_fn), t._out_index)
    previous_grad = pending.get(key)
    pending[key] = grad if previous_grad is None else previous_grad + grad


def _run_output_hooks(node: Node, outs: list[Tensor | None]) -> list[Tensor | None]:
    for i, ref in enumerate(node.out_refs):
        t = ref()
        if t is None or outs[i] is None:
            continue
        g = outs[i]
        for hook in t._hooks or ():
            out = hook(g)  # type: ignore[arg-type]
            g = g if out is None else out
        outs[i] = g
        if t._retains_grad:
            t.grad = g if t.grad is None else t.grad + g  # type: ignore[operator]
    return outs


def _call_backward(node: Node, outs: list[Tensor | None]) -> Sequence[Tensor | None]:
    if node.freed:
        raise AutogradError(
            f"trying to run backward through {node.name} a second time; pass retain_graph=True to the first backward()"
        )
    for t, v in zip(node.inputs, node.versions, strict=True):
        if t._version != v:
            raise AutogradError(
                f"an input of {node.op.name} ({t._describe()}) was modified in place after the op used it; "
                "its gradient would be wrong"
            )
    if node.op.backward_fn is None:
        raise AutogradError(f"op {node.op.name!r} has no gradient")
    filled = [g if g is not None else _zeros_for(node, i) for i, g in enumerate(outs)]
    grads = node.op.backward_fn(BackwardCtx(node), *filled)
    if not isinstance(grads, (tuple, list)):
        grads = (grads,)
    if len(grads) != len(node.inputs):
        raise AssertionError(f"{node.name} returned {len(grads)} gradients for {len(node.inputs)} inputs")
    return grads


def _zeros_for(node: Node, index: int) -> Tensor | None:
    from .ops import functional as F

    out = node.out_refs[index]()
    if out is not None:
        return F.zeros_like(out)
    if not node.out_meta:
        raise AutogradError(f"{node.name}: output {index} is gone and has no gradient")
    shape, dtype, placement, sbp = node.out_meta[index]
    if not (dtype.is_floating_point or dtype.is_complex):
        return None  # integer outputs (indices) have no gradient
    from .creation import zeros

    return zeros(shape, dtype=dtype, placement=placement, sbp=sbp)


def _topological(roots: Sequence[Tensor]) -> list[Node]:
    """Nodes reachable from the roots, each after every node that consumes its outputs."""
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for t in node.inputs:
            if t.grad_fn is not None and id(t.grad_fn) not in seen:
                stack.append((t.grad_fn, False))
    return order[::-1]


def _accumulate_leaf(leaf: Tensor, grad: Tensor, F: Any) -> None:
    if leaf.is_global:
        if grad.placement != leaf.placement or grad.sbp != leaf.sbp:
            grad = F.to_global(grad, leaf.placement, leaf.sbp)
    if grad.dtype != leaf.dtype:
        grad = F.cast(grad, leaf.dtype)
    if leaf.grad is None:
        leaf.grad = grad
    else:
        leaf.grad = F.add(leaf.grad, grad)


def _coalesced(pairs: list[tuple[Tensor, Tensor]], F: Any) -> list[tuple[Tensor, Tensor]]:
    """(leaf, gradient) pairs with the partial-sum gradients of broadcast leaves already reduced, those of one
    (placement, dtype, SBP) through a single flat boxing to B. Order is the backward's, the same on every process."""
    buckets: dict[Any, list[int]] = {}
    for i, (leaf, grad) in enumerate(pairs):
        # A broadcast leaf whose gradient is partial on some mesh axes and broadcast on the others: the reduction
        # is elementwise, so concatenated buffers reduce to the concatenated results.
        if (leaf.is_global and grad.placement == leaf.placement and grad.dtype == leaf.dtype
                and all(s == broadcast for s in leaf.sbp) and partial_sum in grad.sbp
                and all(s in (broadcast, partial_sum) for s in grad.sbp)):
            buckets.setdefault((leaf.placement, grad.dtype, grad.sbp), []).append(i)
    out = list(pairs)
    tensor_cls: Any = _tensor_class()
    for (placement, dtype, _), members in buckets.items():
        if len(members) < 2:
            continue
        grads = [pairs[i][1] for i in members]
        shards = {r: torch.cat([g.local_tensors()[r].reshape(-1) for g in grads]) for r in grads[0].local_tensors()}
        numels = [g.numel() for g in grads]
        flat = tensor_cls._from_shards((sum(numels),), dtype, placement, grads[0].sbp, shards)  # logical (N,)
        reduced = F.to_global(flat, placement, pairs[members[0]][0].sbp).local_tensors()
        pieces = {r: torch.split(t, numels) for r, t in reduced.items()}
        for k, i in enumerate(members):
            leaf = pairs[i][0]
            local = {r: ps[k].view(leaf.shape) for r, ps in pieces.items()}  # B: local shape = logical shape
            out[i] = (leaf, tensor_cls._from_shards(leaf.shape, dtype, placement, leaf.sbp, local))
    return out
