"""Reverse-mode autodiff over sbpflow ops: backward gets SBP inference and boxing like forward.

A partial gradient stays partial between ops and is reduced only where a consumer, or a leaf's own layout,
needs otherwise; the partial gradients of broadcast leaves are reduced in DDP-style buckets while backward runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import amp
from ..boxing import Layout, execute, plan
from ..comm import get_backend
from ..creation import zeros
from ..distributed import activity
from ..errors import AutogradError
from ..host_memory import keep_freed_host_memory
from ..ops import functional as F
from ..ops.dispatch import interpreter_for
from ..ops.elementwise import comm_cast
from ..sbp import Partial, broadcast, partial_sum
from ..tensor import Tensor
from .mode import FIRST_BUCKET_MB, _mode, _set_grad, no_grad, output_hooks
from .node import Node


def zero_grads(params: Iterable[Tensor], set_to_none: bool = True) -> None:
    """Clears the gradients of ``params``: ``None`` by default, else zeros in each gradient's own layout."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            with no_grad():
                p.grad.zero_()  # type: ignore[attr-defined]  # bound by sbpflow.ops.methods


def backward(roots: Sequence[Tensor], grads: Sequence[Tensor | None], retain_graph: bool = False) -> None:
    """Accumulates d(roots)/d(leaf) into every reachable leaf's ``.grad``."""
    keep_freed_host_memory()  # the next step's activations reuse this one's pages
    with _set_grad(False):
        for leaf, grad in _leaf_gradients(roots, grads, retain_graph, _mode.coalesce):
            _accumulate_leaf(leaf, grad, F)


def grad(roots: Sequence[Tensor], grads: Sequence[Tensor | None], inputs: Sequence[Tensor]) -> list[Tensor | None]:
    """d(roots)/d(inputs) for leaf ``inputs``, returned as computed (any SBP, partial included) instead of
    accumulated into ``.grad``; ``None`` for an input the roots do not depend on. Other leaves are left alone,
    and leaf hooks do not run: they run once, where the gradient is finally accumulated.

    Activation checkpointing uses it to hand a recomputed segment's gradients to the outer backward, which then
    reduces and accumulates them as if the segment had never been recomputed.

    >>> import sbpflow
    >>> x = sbpflow.ones(3, requires_grad=True)
    >>> [g.tolist() for g in grad([(x * x).sum()], [None], [x])]
    [[2.0, 2.0, 2.0]]
    """
    with _set_grad(False):
        by_leaf = {id(leaf): g for leaf, g in _leaf_gradients(roots, grads, False, coalesce=False, leaf_hooks=False)}
    return [by_leaf.get(id(t)) for t in inputs]


def _leaf_gradients(roots: Sequence[Tensor], grads: Sequence[Tensor | None], retain_graph: bool,
                    coalesce: bool, leaf_hooks: bool = True) -> list[tuple[Tensor, Tensor]]:
    """Runs backward from ``roots``; returns each reached leaf with its summed gradient (reduced in buckets when
    ``coalesce``)."""
    with amp.suspended():  # gradients follow the dtypes forward chose, as in torch
        return _run_nodes(roots, grads, retain_graph, coalesce, F, leaf_hooks)


def _run_nodes(roots: Sequence[Tensor], grads: Sequence[Tensor | None], retain_graph: bool, coalesce: bool,
               F: Any, leaf_hooks: bool) -> list[tuple[Tensor, Tensor]]:
    pending: dict[Any, Tensor] = {}  # id(node) for output 0, else (id(node), output index) -> gradient so far
    leaf_grads: dict[int, tuple[Tensor, Tensor]] = {}
    for root, grad in zip(roots, grads, strict=True):
        _check_root(root)
        grad = _root_grad(root, grad)
        _send(root, grad, pending, leaf_grads, leaf_hooks)
    nodes = _topological(roots)
    # local graphs have nothing to reduce; a traced one (nn.Graph) has no shards yet: its plan reduces
    coalesce = coalesce and any(r._local is None and r._lazy is None for r in roots)
    bucketer = _Bucketer(nodes, roots, _mode.bucket_bytes) if coalesce else None
    if bucketer is not None and not bucketer.uses:
        bucketer = None  # no leaf to reduce (one rank): no bookkeeping per node; _coalesced is not needed either
    pop = pending.pop
    for node in nodes:
        nid = id(node)
        if len(node.out_refs) == 1:  # most ops: one output, no list of gradients to scan
            first = pop(nid, None)
            outs: list[Tensor | None] | None = None if first is None else [first]
        else:
            outs = [pop(nid, None)] + [pop((nid, i), None) for i in range(1, len(node.out_refs))]
            if all(g is None for g in outs):
                outs = None
        if outs is not None:
            if output_hooks.seen:
                outs = _run_output_hooks(node, outs)
            in_grads = _call_backward(node, outs)  # as many as node.inputs (checked there)
            for t, g in zip(node.inputs, in_grads, strict=True):
                if g is not None and t.requires_grad:
                    g_dtype, t_dtype = g.dtype, t.dtype
                    if g_dtype is not t_dtype and g_dtype.is_floating_point and t_dtype.is_floating_point:
                        g = F.cast(g, t_dtype)  # a promoted op (bf16 + fp32): each input's gradient in its dtype
                    fn = t.grad_fn
                    if fn is None:
                        _send(t, g, pending, leaf_grads, leaf_hooks)
                    else:  # _send's non-leaf branch, inlined: the most common case by far
                        key = id(fn) if t._out_index == 0 else (id(fn), t._out_index)
                        previous: Any = pending.get(key)  # (Tensor operators are bound at import)
                        pending[key] = g if previous is None else previous + g
        if bucketer is not None:
            bucketer.consumed(node, leaf_grads)
        if outs is not None and not retain_graph:
            _release(node)
    pairs = list(leaf_grads.values())
    if bucketer is not None:
        reduced = bucketer.finish()
        rest = _coalesced([p for p in pairs if id(p[0]) not in reduced], F)
        by_leaf = {id(leaf): (leaf, grad) for leaf, grad in rest} | reduced
        pairs = [by_leaf[id(leaf)] for leaf, _ in pairs]
    return pairs


def _release(node: Node) -> None:
    """Drops what a node's backward needed once it has run (as torch frees saved tensors): the activations it held
    are freed during backward, not at its end. A later backward through it raises (``node.freed``)."""
    node.freed = True
    node.outputs = node.inputs = node.args = node.versions = node.needs_input_grad = ()
    node.attrs = {}


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
    """The implicit root gradient: ones (built directly: it is on every backward's path)."""
    if root._local is not None:
        return Tensor._from_local(torch.ones_like(root._local))
    return interpreter_for(root).root_grad(root)  # traced: the tracer's seed; meta: metadata; eager: ones, B


def _send(t: Tensor, grad: Tensor, pending: dict, leaf_grads: dict,  # type: ignore[type-arg]
          leaf_hooks: bool = True) -> None:
    if t.grad_fn is None:
        if t._hooks and leaf_hooks:
            for hook in t._hooks:
                out = hook(grad)
                grad = grad if out is None else out
        previous = leaf_grads.get(id(t))
        leaf_grads[id(t)] = (t, grad if previous is None else previous[1] + grad)
        return
    key = id(t.grad_fn) if t._out_index == 0 else (id(t.grad_fn), t._out_index)
    previous_grad = pending.get(key)
    pending[key] = grad if previous_grad is None else previous_grad + grad


def _run_output_hooks(node: Node, outs: list[Tensor | None]) -> list[Tensor | None]:
    for i, ref in enumerate(node.out_refs):
        t = ref()
        if t is None and node.out_hooks and outs[i] is not None:  # the output is gone, its hooks are not
            g = outs[i]
            for hook in node.out_hooks.get(i, ()):
                out = hook(g)
                g = g if out is None else out
            outs[i] = g
            continue
        if t is None or outs[i] is None or not (t._hooks or t._retains_grad):
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
    op = node.op
    backward_fn = op.backward_fn
    if backward_fn is None:
        raise AutogradError(f"op {op.name!r} has no gradient")
    if op.diff_outputs is not None:
        outs = outs[:op.diff_outputs]  # the other outputs are saved statistics: no gradient
    for g in outs:  # (no `None in outs`: that would compare tensors with ==, an op)
        if g is None:
            outs = [g if g is not None else _zeros_for(node, i) for i, g in enumerate(outs)]
            break
    grads = backward_fn(node, *outs)  # the node is the gradient's ctx (see Node)
    if not isinstance(grads, (tuple, list)):
        grads = (grads,)
    if len(grads) != len(node.inputs):
        raise AssertionError(f"{node.name} returned {len(grads)} gradients for {len(node.inputs)} inputs")
    return grads


def _zeros_for(node: Node, index: int) -> Tensor | None:

    out = node.out_refs[index]()
    if out is not None:
        return F.zeros_like(out)
    if not node.out_meta:
        raise AutogradError(f"{node.name}: output {index} is gone and has no gradient")
    shape, dtype, placement, sbp = node.out_meta[index]
    if not (dtype.is_floating_point or dtype.is_complex):
        return None  # integer outputs (indices) have no gradient

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
        # Inputs pushed last-first, so the first input's subgraph is explored first and its nodes run last: a
        # node's later inputs (weights, and ZeRO-3's gathers of them) get their backward right after it, and
        # free what they hold, instead of waiting for the whole activation chain of the first input.
        for t in reversed(node.inputs):
            if t.grad_fn is not None and id(t.grad_fn) not in seen:
                stack.append((t.grad_fn, False))
    return order[::-1]


def _accumulate_leaf(leaf: Tensor, grad: Tensor, F: Any) -> None:
    if leaf.is_global:
        # the leaf's layout, unless it names another gradient SBP (ZeRO-2's S: the partial gradient is
        # reduce-scattered straight into the optimizer's shard)
        target = leaf._grad_sbp or leaf.sbp
        if grad.placement != leaf.placement or grad.sbp != target:
            grad = _reduce_grad(grad, leaf.placement, target, F)
    if grad.dtype != leaf.dtype:
        grad = F.cast(grad, leaf.dtype)
    if leaf.grad is None:
        leaf.grad = grad
    else:
        leaf.grad = F.add(leaf.grad, grad)


def _reduce_grad(grad: Tensor, placement: Any, sbp: Any, F: Any) -> Tensor:
    """Boxes a leaf's gradient to its layout; a partial fp32 one travels in amp.gradient_communication's dtype."""

    low = amp.grad_comm_dtype()
    if low is None or grad.dtype != torch.float32 or not any(isinstance(s, Partial) for s in grad.sbp):
        return F.to_global(grad, placement, sbp)  # type: ignore[no-any-return]

    narrow = comm_cast(grad, dtype=low)  # each rank rounds its partial piece: the reduction runs narrow
    return F.cast(F.to_global(narrow, placement, sbp), grad.dtype)  # type: ignore[no-any-return]


# By default the partial gradients of broadcast leaves (weights under split data) are reduced as DDP does: flat
# buckets, issued asynchronously while backward runs, one all-reduce each; coalesce_grad_reductions(False) opts
# out (one reduction per leaf). Weights split on other axes (tensor parallel) join the bucket of their partial
# axis: each rank's shards are raveled, and the all-reduce runs in that axis's groups.
def _coalescible(leaf: Tensor, grad: Tensor) -> bool:
    """A broadcast leaf whose gradient is partial on some mesh axes and broadcast on the others: the reduction
    is elementwise, so concatenated buffers reduce to the concatenated results."""
    if leaf._placement is None or leaf._grad_sbp is not None or grad._sbp is None or partial_sum not in grad._sbp:
        return False  # asked per leaf, per backward: cheap checks first
    if amp.grad_comm_dtype() is not None:
        return False  # reduced one by one in the narrow dtype (_reduce_grad)
    return (grad._placement == leaf._placement and grad._dtype == leaf._dtype
            and all(s == broadcast for s in leaf._sbp or ()) and all(s in (broadcast, partial_sum) for s in grad._sbp))


def _coalescible_in_groups(leaf: Tensor, grad: Tensor) -> bool:
    """A leaf split on some mesh axes (a tensor-parallel weight) whose gradient is partial on exactly one axis,
    where the leaf is broadcast, and laid out as the leaf on the others: the reduction runs in the groups along
    that axis, whose members hold shards of one shape, so their raveled shards reduce together with other
    gradients' (a bucket holds local shards, not a logical tensor)."""
    if leaf._placement is None or leaf._grad_sbp is not None or grad._sbp is None or leaf._sbp is None:
        return False
    partial = [a for a, s in enumerate(grad._sbp) if s == partial_sum]
    if len(partial) != 1 or leaf._sbp[partial[0]] != broadcast or amp.grad_comm_dtype() is not None:
        return False
    sizes = leaf._placement.hierarchy  # on an axis of one rank, a split is the whole tensor too
    return (grad._placement == leaf._placement and grad._dtype == leaf._dtype
            and all(g == s or sizes[a] == 1 for a, (g, s) in enumerate(zip(grad._sbp, leaf._sbp, strict=True))
                    if a != partial[0]))


def _reduced_axes(grad: Tensor) -> tuple[Any, ...]:
    """A bucket's layout: the gradient's partial axes, every other axis broadcast (the reduction's groups do not
    depend on how the other axes split)."""
    return tuple(s if s == partial_sum else broadcast for s in grad.sbp)


def _coalesced(pairs: list[tuple[Tensor, Tensor]], F: Any) -> list[tuple[Tensor, Tensor]]:
    """(leaf, gradient) pairs with the partial-sum gradients of broadcast leaves already reduced, those of one
    (placement, dtype, SBP) through a single flat boxing to B. Order is the backward's, the same on every process."""
    buckets: dict[Any, list[int]] = {}
    for i, (leaf, grad) in enumerate(pairs):
        if _coalescible(leaf, grad):
            buckets.setdefault((leaf.placement, grad.dtype, grad.sbp), []).append(i)
    out = list(pairs)
    for members in buckets.values():
        if len(members) < 2:
            continue
        flat = _flatten([pairs[i][1] for i in members])
        reduced = F.to_global(flat, flat.placement, pairs[members[0]][0].sbp).local_tensors()
        leaves, grads = [pairs[i][0] for i in members], [pairs[i][1] for i in members]
        for i, grad in zip(members, _unflatten(reduced, leaves, grads, flat.dtype), strict=True):
            out[i] = (pairs[i][0], grad)
    return out


def _flatten(grads: Sequence[Tensor]) -> Tensor:
    """Same-layout gradients as one logical (N,) tensor: each rank's shards raveled and concatenated."""
    first = grads[0]
    shards = {r: torch.cat([g.local_tensors()[r].reshape(-1) for g in grads]) for r in first.local_tensors()}
    return Tensor._from_shards((sum(g.numel() for g in grads),), first.dtype, first.placement,  # type: ignore[no-any-return]
                                   first.sbp, shards)


def _unflatten(reduced: dict[int, torch.Tensor], leaves: Sequence[Tensor], grads: Sequence[Tensor],
               dtype: torch.dtype) -> list[Tensor]:
    """The leaves' reduced gradients, in the leaves' layouts, as views of each rank's reduced flat shard (the
    inverse of raveling the gradients' shards one after another)."""
    shapes = {r: [g.local_tensors()[r].shape for g in grads] for r in reduced}
    pieces = {r: torch.split(t, [s.numel() for s in shapes[r]]) for r, t in reduced.items()}
    return [Tensor._from_shards(leaf.shape, dtype, leaf.placement, leaf.sbp,
                                    {r: ps[k].view(shapes[r][k]) for r, ps in pieces.items()})
            for k, leaf in enumerate(leaves)]


class _Bucket:
    """Final gradients of one (placement, dtype, SBP) waiting to be reduced together."""

    __slots__ = ("leaves", "grads", "nbytes")

    def __init__(self) -> None:
        self.leaves: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.nbytes = 0


class _Bucketer:
    """DDP-style overlap for coalesce_grad_reductions: reduces leaf gradients in flat buckets while backward runs.

    Each leaf awaits one contribution per use as an input of a reachable node; once the last node using it has
    run, its gradient is final and joins the open bucket of its (placement, dtype, SBP). A bucket that reaches
    the byte cap is issued at once, without waiting; the rest are issued by ``finish``. Every process runs the
    same backward, so buckets fill, and collectives are issued, in the same order everywhere.
    """

    def __init__(self, nodes: Sequence[Node], roots: Sequence[Tensor], cap: int) -> None:
        self.cap = cap
        self.uses: dict[int, int] = {}  # id(leaf) -> uses by nodes that have not run yet
        for node in nodes:
            for t in node.inputs:
                # a leaf on one rank has nothing to reduce (a partial there is a relabel): left to the end
                if t.grad_fn is None and t.requires_grad and t._placement is not None and t._placement.size > 1:
                    self.uses[id(t)] = self.uses.get(id(t), 0) + 1
        for root in roots:
            self.uses.pop(id(root), None)  # a leaf root's gradient is never handed over early: left to the end
        self.first_cap = min(cap, int(FIRST_BUCKET_MB * 2**20))
        self.open: dict[Any, _Bucket] = {}
        self.started: set[Any] = set()  # keys whose first bucket was issued
        self.issued: list[tuple[_Bucket, Callable[[], dict[int, torch.Tensor]]]] = []

    def consumed(self, node: Node, leaf_grads: dict[int, tuple[Tensor, Tensor]]) -> None:
        """``node`` has run (or was skipped): its leaf inputs await one contribution fewer."""
        for t in node.inputs:
            left = self.uses.get(id(t))
            if left is None:
                continue
            if left > 1:
                self.uses[id(t)] = left - 1
                continue
            del self.uses[id(t)]
            pair = leaf_grads.get(id(t))
            if pair is not None and (_coalescible(*pair) or _coalescible_in_groups(*pair)):
                self._add(*pair)

    def _add(self, leaf: Tensor, grad: Tensor) -> None:
        key = (grad.placement, grad.dtype, _reduced_axes(grad))
        bucket = self.open.setdefault(key, _Bucket())
        bucket.leaves.append(leaf)
        bucket.grads.append(grad)
        bucket.nbytes += grad.numel() * grad.element_size()
        if bucket.nbytes >= (self.cap if key in self.started else self.first_cap):
            del self.open[key]
            self.started.add(key)
            self._issue(bucket)

    def _issue(self, bucket: _Bucket) -> None:
        first = bucket.grads[0]
        shards = {r: torch.cat([g.local_tensors()[r].reshape(-1) for g in bucket.grads]) for r in first.local_tensors()}
        placement, src = first.placement, _reduced_axes(first)
        if not shards:  # a process that holds no rank of the bucket's placement (another pipeline stage's)
            self.issued.append((bucket, dict))
            return
        length = next(iter(shards.values())).numel()  # the same on every rank of a group (not across groups)
        steps = plan((length,), first.dtype, Layout(placement, src), Layout(placement, (broadcast,) * len(src)))
        if len(steps.steps) != 1 or steps.steps[0].kind != "all_reduce":
            reduced = execute(steps, shards)  # another plan: run it now, in order
            self.issued.append((bucket, lambda: reduced))
            return
        backend = get_backend()
        backend.prepare(steps)
        step = steps.steps[0]
        assert step.axis is not None
        source = src[step.axis]
        assert isinstance(source, Partial)
        with activity(lambda: f"coalesced gradient bucket of {len(bucket.leaves)} leaves: {steps.steps[0]}"):
            # the flat shards were built for this reduction alone: donated, reduced without another copy
            handles = [backend.all_reduce_async(group, {r: shards[r] for r in backend.owned(group)}, source.op,
                                                donate=True)
                       for group in step.src.placement.axis_groups(step.axis) if backend.owned(group)]
        self.issued.append((bucket, lambda: {r: t for h in handles for r, t in h.wait().items()}))

    def finish(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Issues the open buckets, waits for every bucket; id(leaf) -> (leaf, its reduced B gradient)."""
        for bucket in list(self.open.values()):
            self._issue(bucket)
        self.open.clear()
        out: dict[int, tuple[Tensor, Tensor]] = {}
        for bucket, wait in self.issued:
            grads = _unflatten(wait(), bucket.leaves, bucket.grads, bucket.grads[0].dtype)
            out.update((id(leaf), (leaf, g)) for leaf, g in zip(bucket.leaves, grads, strict=True))
        return out


def _tensor_backward(self: Tensor, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
    backward([self], [gradient], retain_graph=retain_graph)


Tensor.backward = _tensor_backward  # type: ignore[method-assign]  # Tensor is data: the engine gives it backward()
