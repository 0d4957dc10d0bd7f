"""Tracing: ``build()`` runs once on lazy tensors that carry metadata only.

A lazy tensor is an ordinary :class:`~sbpflow.tensor.Tensor` without shards whose
``_lazy`` handle names an SSA :class:`~sbpflow.graph.ir.Value`. Ops reach
:func:`record_op` from dispatch (the tracer is on its interpreter stack) instead of running kernels:
meta inference and the eager SBP choice (``decide``, the greedy baseline) run
on metadata, and a node is appended to the graph. Autograd records lazy ops
like any others, so ``loss.backward()`` traces each op's ``@op.grad`` into the
same graph. Parameters and buffers are the model's own tensor objects,
temporarily turned lazy (their shards are put back afterwards).

Data never flows while tracing: reading a lazy tensor's value (``item()``,
``bool()``, printing) raises an error that points at the user's line, since
Python control flow on data cannot be compiled.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import get_backend
from ..errors import SbpflowError
from ..ops.dispatch import INTERPRETERS
from ..ops.propagation import decide_traced, describe_args
from ..placement import Placement
from ..random import KEY_HOOKS
from ..sbp import NdSbp, broadcast
from ..tensor import Tensor
from .ir import LNode, LogicalGraph, Value


class TraceError(SbpflowError):
    """Something in ``build()`` cannot be compiled; the message points at the user's line."""


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ACTIVE: list[Tracer] = []  # the tracer in force (at most one), also on ops.dispatch.INTERPRETERS while it traces


class StepScalar(float):
    """A Python number that changes from step to step (a learning rate, a step count): traced as a feed."""

    feed: str

    def __new__(cls, value: float, feed: str) -> StepScalar:
        self = super().__new__(cls, value)
        self.feed = feed
        return self


class RandomKey(int):
    """The ``n``-th random key drawn while tracing; at run time it is drawn afresh every micro-batch."""

    offset: int

    def __new__(cls, value: int, offset: int) -> RandomKey:
        self = super().__new__(cls, value)
        self.offset = offset
        return self


@dataclass
class Lazy:
    """A lazy tensor's handle: its tracer and value."""

    tracer: Tracer
    value: Value

    def name(self) -> str:
        return self.value.name()

    def tensor(self) -> Tensor:
        return self.tracer.tensor_of(self.value)

    def assign(self, target: Tensor, value: Tensor) -> Tensor:
        """An in-place write of ``value`` into ``target`` while tracing (Tensor._assign asks the lazy handle)."""
        return assign_lazy(target, value)

    def refuse_data(self, what: str) -> None:
        raise TraceError(
            f"{user_line()}: {what} of a lazy tensor ({self.value.name()}: {self.value.describe()}) while "
            "nn.Graph traces build(): build() runs once on metadata, so Python control flow or printing cannot "
            "depend on tensor values; use tensor ops (sbpflow.where, masks) or return the value from build()"
        )


def user_line() -> str:
    """``file:line`` of the innermost frame outside sbpflow (the user's code), for messages."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE_DIR) or "/tests/" in path.replace(os.sep, "/"):
            if "/graph/" not in path:
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


class Tracer:
    """Builds one :class:`LogicalGraph` from a ``build()`` call."""

    def __init__(self, micro_batches: int = 1, target_factors: tuple[Any, ...] = ()) -> None:
        self.graph = LogicalGraph(micro_batches=micro_batches)
        self.phase = "micro"
        self.target_factors = target_factors
        self.constants: dict[int, dict[int, torch.Tensor]] = {}  # value id -> captured shards
        self._captured: dict[tuple[int, int], int] = {}  # (id(tensor), version) -> value id
        self._keep: list[Tensor] = []  # captured tensors, alive so their ids stay unique
        self.variables: dict[str, tuple[Tensor, int]] = {}  # name -> (tensor, initial value id)
        self.random_keys = 0
        self.loss_seed: Any = None  # loss scaling: maps the backward's implicit gradient to it times the scale

    @contextmanager
    def active(self) -> Iterator[None]:
        """Traces inside the block: ops record nodes here, random draws become the step's keys."""
        self.push()
        try:
            yield
        finally:
            self.pop()

    def push(self) -> None:
        ACTIVE.append(self)
        INTERPRETERS.append(self)
        KEY_HOOKS.append(self)

    def pop(self) -> None:
        KEY_HOOKS.pop()
        INTERPRETERS.pop()
        ACTIVE.pop()

    # dispatch's interpreter interface (ops.dispatch.Interpreter): while pushed, ops record nodes here
    def apply_global(self, opdef: Any, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
        return record_op(opdef, args, attrs)

    def to_global(self, x: Tensor, placement: Placement, sbp: NdSbp) -> Tensor:
        return record_to_global(x, placement, sbp)

    def root_grad(self, root: Tensor) -> Tensor:
        return ones_root(root)

    def next_random_key(self, value: int) -> int:
        """A draw's key while tracing: it stands for 'the n-th draw of this micro-batch' (sbpflow.random)."""
        key = RandomKey(value, self.random_keys)
        self.random_keys += 1
        return key

    # -- values and nodes ------------------------------------------------------------------------

    def new_value(self, shape: Sequence[int], dtype: torch.dtype, placement: Placement, sbp: NdSbp) -> Value:
        v = Value(len(self.graph.values), tuple(shape), dtype, placement, tuple(sbp))
        self.graph.values[v.id] = v
        return v

    def add_node(self, node: LNode) -> LNode:
        node.id = len(self.graph.nodes)
        node.phase = self.phase if node.kind not in ("input", "variable", "constant") else "pre"
        for i, vid in enumerate(node.outputs):
            self.graph.values[vid].producer = node.id
            self.graph.values[vid].index = i
        self.graph.nodes.append(node)
        return node

    def tensor_of(self, value: Value, requires_grad: bool = False) -> Tensor:
        t = Tensor._from_shards(value.shape, value.dtype, value.placement, value.sbp, {}, requires_grad)
        t._shards = None
        t._lazy = Lazy(self, value)
        return t

    def value_of(self, t: Tensor, op: str) -> int:
        """The value id of a tensor argument; a real global tensor is captured as a constant."""
        if t._lazy is not None:
            if t._lazy.tracer is not self:
                raise TraceError(f"{user_line()}: op {op!r} got a lazy tensor of another graph ({t._describe()})")
            return t._lazy.value.id
        if t._local is not None:
            raise TraceError(
                f"{user_line()}: op {op!r} got a local tensor ({t._describe()}) inside nn.Graph.build(); graph "
                "tensors are global: convert it with .to_global(placement, sbp)"
            )
        key = (id(t), t._version)
        vid = self._captured.get(key)
        if vid is None:
            v = self.new_value(tuple(t.shape), t.dtype, t.placement, t.sbp)
            self.constants[v.id] = {r: s.detach().clone() for r, s in (t._shards or {}).items()}
            self.add_node(LNode(0, "constant", f"const{v.id}", outputs=(v.id,), fixed=True, where=user_line()))
            vid = self._captured[key] = v.id
            self._keep.append(t)
        return vid

    # -- graph inputs and variables --------------------------------------------------------------

    def add_input(self, name: str, shape: Sequence[int], dtype: torch.dtype, placement: Placement,
                  sbp: NdSbp) -> Tensor:
        v = self.new_value(shape, dtype, placement, sbp)
        self.add_node(LNode(0, "input", name, outputs=(v.id,), fixed=True))
        return self.tensor_of(v)

    def add_variable(self, name: str, t: Tensor) -> Value:
        """Makes the real tensor ``t`` lazy for the trace (``restore`` puts its shards back)."""
        v = self.new_value(tuple(t.shape), t.dtype, t.placement, t.sbp)
        self.add_node(LNode(0, "variable", name, outputs=(v.id,), fixed=True))
        self.variables[name] = (t, v.id)
        t._lazy = Lazy(self, v)
        return v


def tracing() -> Tracer | None:
    return ACTIVE[-1] if ACTIVE else None


# ----------------------------------------------------------------------------- ops


def record_op(opdef: Any, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """The lazy counterpart of ``ops.dispatch._apply_global``: meta, the greedy signature, a node."""
    tracer = ACTIVE[-1]
    try:
        opdef.check_traceable()
    except SbpflowError as e:
        raise TraceError(f"{user_line()}: {e}") from None
    tensors = [a for a in args if isinstance(a, Tensor)]
    placement = tensors[0].placement
    for t in tensors[1:]:
        if t.placement != placement:
            raise TraceError(f"{user_line()}: op {opdef.name!r} needs all inputs on one placement, but got "
                             f"{describe_args(args)}; move one with .to_global(placement=...)")
    inputs = tuple(tracer.value_of(t, opdef.name) for t in tensors)
    try:
        decision = decide_traced(opdef, args, attrs, placement, tracer.target_factors)
    except SbpflowError as e:
        raise type(e)(f"{user_line()}: {e}") from None
    template = _template(args)
    outs = tuple(tracer.new_value(m.shape, m.dtype, placement, s).id
                 for m, s in zip(decision.out_metas, decision.out_sbps, strict=True))
    tracer.add_node(LNode(0, "op", opdef.name, inputs, outs, template, tuple(sorted(attrs.items())),
                          tuple(decision.in_sbps), where=user_line()))
    results = tuple(tracer.tensor_of(tracer.graph.values[v]) for v in outs)
    return results[0] if len(results) == 1 else results


def _template(args: Sequence[Any]) -> tuple[tuple[str, Any], ...]:
    out: list[tuple[str, Any]] = []
    k = 0
    for a in args:
        if isinstance(a, Tensor):
            out.append(("t", k))
            k += 1
        elif isinstance(a, RandomKey):
            out.append(("k", a.offset))
        elif isinstance(a, StepScalar):
            out.append(("s", a.feed))
        else:
            out.append(("c", a))
    return tuple(out)


def record_to_global(x: Tensor, placement: Placement, sbp: NdSbp) -> Tensor:
    """An explicit conversion: its output layout is a constraint for SBP selection."""
    tracer = ACTIVE[-1]
    src = tracer.value_of(x, "to_global")
    v = tracer.new_value(tuple(x.shape), x.dtype, placement, sbp)
    tracer.add_node(LNode(0, "to_global", "to_global", (src,), (v.id,), fixed=True, where=user_line()))
    return tracer.tensor_of(v)


def assign_lazy(target: Tensor, value: Tensor) -> Tensor:
    """An in-place write while tracing: the target now stands for the new value (SSA); variables get an
    ``assign`` at the end of the trace."""
    tracer = ACTIVE[-1] if ACTIVE else None
    if tracer is None or target._lazy is None:
        raise TraceError(
            f"{user_line()}: build() writes in place into {target._describe()}, which is not a parameter or buffer "
            "of the graph's modules (nor a tensor computed inside build()); register it as a buffer"
        )
    vid = tracer.value_of(value, "assign")
    v = tracer.graph.values[vid]
    if (v.placement, v.sbp) != (target.placement, target.sbp):
        raise TraceError(f"{user_line()}: in-place write of {v.describe()} into {target._describe()}")
    target._lazy = Lazy(tracer, v)
    target._version += 1
    return target


def ones_root(root: Tensor) -> Tensor:
    """The implicit gradient of a scalar root while tracing: 1/m (m micro-batches), broadcast."""
    tracer = ACTIVE[-1]
    m = tracer.graph.micro_batches
    shape = tuple(root.shape)
    sbp = (broadcast,) * root.placement.ndim
    v = tracer.new_value(shape, root.dtype, root.placement, sbp)
    backend = get_backend()
    tracer.constants[v.id] = {r: torch.full(shape, 1.0 / m, dtype=root.dtype,
                                            device=backend.device_for(root.placement.type, r))
                              for r in backend.owned(root.placement.flat_ranks)}
    tracer.add_node(LNode(0, "constant", f"const{v.id}", outputs=(v.id,), fixed=True))
    tracer.graph.grad_seeds.append(v.id)  # where the backward starts (graph.pipeline tells F from B by it)
    seed = tracer.tensor_of(v)
    return seed if tracer.loss_seed is None else tracer.loss_seed(seed)



