"""Activation checkpointing: keep a segment's inputs, recompute its inside in backward, so that peak
activation memory holds the segments' inputs plus one recomputed segment.

>>> import sbpflow
>>> lin = sbpflow.nn.Linear(4, 4)
>>> x = sbpflow.randn(2, 4, requires_grad=True)
>>> sbpflow.utils.checkpoint(lambda t: lin(t).relu(), x).sum().backward()
>>> x.grad.shape, lin.weight.grad.shape
(torch.Size([2, 4]), torch.Size([4, 4]))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import amp, random
from ..autograd import enable_grad, is_grad_enabled
from ..autograd.engine import grad
from ..errors import AutogradError
from ..graph import trace
from ..nn.module import Module
from ..ops.dispatch import record
from ..ops.schema import OpDef
from ..tensor import Tensor

# not a registered op: it never dispatches, it only records the node whose gradient recomputes the segment
_checkpoint_def = OpDef("checkpoint", kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [],
                        shard_aware=False, save_outputs=False, differentiable=True, mesh_aware=False)


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, whose internal activations are recomputed in backward instead of kept.

    ``fn`` returns a tensor or a tuple/list of tensors (other values pass through). Forward records one node
    in place of the segment, whose inputs are the arguments that need gradients and the parameters ``fn``
    read; the segment's own graph is dropped. Backward runs ``fn`` again with the same random keys (the same
    dropout masks) and hands the gradients to the outer backward, which reduces and accumulates them as
    without checkpointing (partial gradients stay partial, ZeRO-2 shards).
    """
    if not is_grad_enabled():
        return fn(*args, **kwargs)
    rng = random.get_state()  # replayed by the recomputation
    detached = _detach_args(args)
    with enable_grad():
        out = fn(*detached, **kwargs)
    outs = _output_tensors(out, fn)
    arg_inputs = [a for a in args if isinstance(a, Tensor) and a.requires_grad]
    leaves = _reachable_leaves(outs, exclude={id(a) for a in detached if isinstance(a, Tensor)})
    if not arg_inputs and not leaves:
        return out  # nothing to differentiate: no node needed
    results = tuple(o.detach() for o in outs)
    attrs = {"fn": fn, "args": args, "kwargs": kwargs, "rng": rng, "n_args": len(arg_inputs), "leaves": leaves,
             "amp": amp.active_dtype()}
    differentiable = tuple(r for r, o in zip(results, outs, strict=True) if o.requires_grad)
    record(_checkpoint_def, arg_inputs + leaves, attrs, differentiable)
    return _rebuild(out, outs, results)


@_checkpoint_def.grad
def _checkpoint_grad(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
    attrs = ctx.attrs
    detached = _detach_args(attrs["args"])
    tracer = trace.tracing()
    first = len(tracer.graph.nodes) if tracer is not None else 0
    # the recomputation runs under the forward's autocast (backward turns autocast off), so that it casts as the
    # forward did
    low = attrs["amp"]
    with random.replay(attrs["rng"]), enable_grad(), amp.autocast(low or amp.LOW_DTYPES[0], enabled=low is not None):
        out = attrs["fn"](*detached, **attrs["kwargs"])
    if tracer is not None:  # nn.Graph: the recomputed forward is a clone in backward, delayed by a control edge
        _delay(tracer, first, grads)
    outs = [o for o in _output_tensors(out, attrs["fn"]) if o.requires_grad]
    if len(outs) != len(grads):
        raise AutogradError(f"checkpoint: the recomputed segment returned {len(outs)} differentiable outputs, but "
                            f"its first run returned {len(grads)}; the function must not depend on state that "
                            "changes between forward and backward")
    targets = [a for a in detached if isinstance(a, Tensor) and a.requires_grad] + list(attrs["leaves"])
    return tuple(grad(outs, list(grads), targets))


def _delay(tracer: Any, first: int, grads: tuple[Tensor, ...]) -> None:
    """Makes the ops traced since node ``first`` wait for the segment's incoming gradients."""
    control = tuple(g._lazy.value.id for g in grads if g is not None and g._lazy is not None)
    for node in tracer.graph.nodes[first:]:
        if node.kind == "op":
            node.control = control


def _detach_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Fresh leaves sharing the arguments' shards, so the segment's graph stops at them."""
    return tuple(a.detach().requires_grad_(True) if isinstance(a, Tensor) and a.requires_grad else a for a in args)


def _output_tensors(out: Any, fn: Callable[..., Any]) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, Tensor)]
    raise AutogradError(f"checkpoint needs {getattr(fn, '__name__', fn)!r} to return a tensor or a tuple/list of "
                        f"tensors, but it returned {type(out).__name__}")


def _rebuild(out: Any, outs: list[Tensor], results: tuple[Tensor, ...]) -> Any:
    if isinstance(out, Tensor):
        return results[0]
    swap = {id(o): r for o, r in zip(outs, results, strict=True)}
    return type(out)(swap.get(id(o), o) for o in out)


def _reachable_leaves(outs: list[Tensor], exclude: set[int]) -> list[Tensor]:
    """The leaves needing gradients that the outputs depend on (the segment's parameters), in first-seen order."""
    leaves: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for t in node.inputs:
            if t.grad_fn is not None:
                stack.append(t.grad_fn)
            elif t.requires_grad and id(t) not in exclude:
                leaves.setdefault(id(t), t)
    return list(leaves.values())


def checkpoint_module(module: Module) -> Module:
    """Makes every later call of ``module`` a checkpointed segment (its forward recomputed in backward).

    Hooks still run around the segment, once per forward; the recomputation calls the forward alone.

    >>> import sbpflow
    >>> block = checkpoint_module(sbpflow.nn.Linear(3, 3))
    >>> block(sbpflow.randn(2, 3, requires_grad=True)).grad_fn.name
    'checkpoint_backward'
    """
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, **kwargs)

    object.__setattr__(module, "forward", checkpointed)
    return module


def activation_bytes(*roots: Tensor, rank: int | None = None) -> int:
    """Bytes that backward from ``roots`` still needs on ``rank`` (the first owned rank if None): every tensor the
    reachable autograd nodes hold, parameters and other leaves excepted, each storage counted once.

    Measures activation memory independently of the allocator (CPU has no peak counter): checkpointed segments
    hold only their inputs.

    >>> import sbpflow
    >>> w = sbpflow.ones(4, requires_grad=True)
    >>> activation_bytes((sbpflow.ones(4) * w).exp().sum())  # ones (for w's gradient) and exp's output: 16 B each
    32
    """
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for t in (*node.inputs, *node.outputs):
            if t.grad_fn is None and t.requires_grad:
                continue  # a parameter: not an activation
            _add_storage(t, rank, storages)
        stack += [t.grad_fn for t in node.inputs if t.grad_fn is not None]
    return sum(storages.values())


def _add_storage(t: Tensor, rank: int | None, storages: dict[int, int]) -> None:
    if t.is_meta:  # the layout an op's gradient reads without the data (Tensor._shell): holds nothing
        return
    shards = t.local_tensors()
    if not shards:
        return
    shard = shards.get(rank if rank is not None else min(shards))
    if shard is not None:
        storage = shard.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
