"""Tracing: ``build()`` runs once on lazy tensors that carry metadata only, recording one node per op.

Data never flows while tracing: reading a lazy tensor's value (``item()``, ``bool()``, printing) raises an
error that points at the user's line, since Python control flow on data cannot be compiled.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..autograd import is_grad_enabled, no_grad
from ..comm import get_backend
from ..errors import SbpflowError
from ..ops.dispatch import INTERPRETERS
from ..ops.indexing import cat
from ..ops.propagation import arg_meta, decide_traced, describe_args
from ..ops.schema import REGISTRY
from ..placement import Placement
from ..random import KEY_HOOKS
from ..sbp import Broadcast, NdSbp, Partial, Split, broadcast
from ..tensor import Tensor
from .ir import LNode, LogicalGraph, Value
from .micro import DATA, SAME, Micro, join, propagate


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
    """Builds one :class:`LogicalGraph` from a ``build()`` call.

    A lazy tensor is an ordinary Tensor without shards whose ``_lazy`` handle names an SSA value. Ops reach
    :func:`record_op` from dispatch (the tracer is on its interpreter stack), where meta inference and the
    eager SBP choice run on metadata. Autograd records lazy ops like any others, so ``loss.backward()`` traces
    each op's ``@op.grad`` into the same graph. Parameters and buffers are the model's own tensors, turned
    lazy for the trace (their shards are put back afterwards)."""

    def __init__(self, micro_batches: int = 1, target_factors: tuple[Any, ...] = (), average: bool = False) -> None:
        self.graph = LogicalGraph(micro_batches=micro_batches)
        # each value's layout over the micro-batches (graph.micro), when they join exactly (not averaged)
        self.micro: dict[int, Micro] | None = {} if micro_batches > 1 and not average else None
        self.data_only: set[int] = set()  # values computed from step inputs and constants alone (with micro)
        self.whole: dict[int, Tensor | None] = {}  # value id -> its whole-step twin (pre phase), None: none
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
            if self.micro is not None:
                self.data_only.add(vid)
        return vid

    # -- graph inputs and variables --------------------------------------------------------------

    def add_input(self, name: str, shape: Sequence[int], dtype: torch.dtype, placement: Placement,
                  sbp: NdSbp) -> Tensor:
        v = self.new_value(shape, dtype, placement, sbp)
        self.add_node(LNode(0, "input", name, outputs=(v.id,), fixed=True))
        if self.micro is not None:
            self.micro[v.id] = DATA
            self.data_only.add(v.id)
        return self.tensor_of(v)

    def micro_of(self, vid: int) -> Micro:
        """``vid``'s layout over the micro-batches (variables and constants: the same in each)."""
        return SAME if self.micro is None else self.micro.get(vid, SAME)

    def join_of(self, t: Tensor, what: str) -> tuple[str, int]:
        """How the micro-batch values of ``t`` join into the step's: ("cat" | "sum" | "mean", scale); averaged
        (scalars by their mean) when the micro-batches are not joined exactly."""
        m = self.graph.micro_batches
        if self.micro is None:
            return ("mean" if t.ndim == 0 else "cat"), (m if t.ndim == 0 else 1)
        assert t._lazy is not None
        return join(self.micro_of(t._lazy.value.id), t.ndim, what, m)

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
    layout = None
    if tracer.micro is not None and tracer.phase == "micro":
        layout = _micro_layout(tracer, opdef, args, attrs, inputs, decision.out_metas)
        whole = _whole_step(tracer, opdef, args, attrs, inputs, template, layout, decision.out_metas)
        if whole is not None:
            return whole
    outs = tuple(tracer.new_value(m.shape, m.dtype, placement, s).id
                 for m, s in zip(decision.out_metas, decision.out_sbps, strict=True))
    if tracer.micro is not None and layout is not None:
        tracer.micro.update(dict.fromkeys(outs, layout))
        if all(v in tracer.data_only for v in inputs) and all(how in ("t", "c") for how, _ in template):
            tracer.data_only.update(outs)
    tracer.add_node(LNode(0, "op", opdef.name, inputs, outs, template, tuple(sorted(attrs.items())),
                          tuple(decision.in_sbps), where=user_line()))
    results = tuple(tracer.tensor_of(tracer.graph.values[v]) for v in outs)
    return results[0] if len(results) == 1 else results


# ----------------------------------------------------------------------------- whole-step values

WHOLE_SHAPES = ("reshape", "expand", "permute_reshape")  # ops whose ``shape`` attribute is their output's shape


def _whole_of(tracer: Tracer, vid: int) -> Tensor | None:
    """The whole-step twin of data-only value ``vid``, traced in the current (pre) phase: inputs at their
    full batch, ops and conversions again on the twins; None where an op refuses the whole batch."""
    if vid in tracer.whole:
        return tracer.whole[vid]
    v = tracer.graph.values[vid]
    node = tracer.graph.nodes[v.producer]
    twin: Tensor | None = None
    if node.kind == "input":
        full = tracer.new_value((v.shape[0] * tracer.graph.micro_batches, *v.shape[1:]), v.dtype, v.placement, v.sbp)
        tracer.add_node(LNode(0, "input", node.name, outputs=(full.id,), fixed=True))
        twin = tracer.tensor_of(full)
    elif node.kind == "constant":
        twin = tracer.tensor_of(v)
    elif node.kind == "to_global":
        src = _whole_of(tracer, node.inputs[0])
        twin = None if src is None else record_to_global(src, v.placement, v.sbp)
    elif node.kind == "op":
        srcs = _tiled(tracer, [_whole_of(tracer, i) for i in node.inputs], node, vid)
        if all(s is not None for s in srcs):
            out = None
            for attrs in _whole_attrs(tracer, node, vid):
                out = _replay(REGISTRY[node.name], node.args, attrs, srcs)
                if out is not None:
                    break
            twin = out[v.index] if isinstance(out, tuple) else out
    if twin is not None and tuple(twin.shape) != _whole_shape(tracer, vid):
        twin = None  # an op that took the micro-batch's shape from an attribute: no whole-step twin
    tracer.whole[vid] = twin
    return twin

def _tiled(tracer: Tracer, twins: list[Tensor | None], node: LNode, vid: int) -> list[Tensor | None]:
    """The twins of ``node``'s inputs as it reads them. One that is the same in every micro-batch but read as
    split must be the whole step's rows: an expansion along that dim (class weights expanded to the rows) is
    its rows m times over; any other (rows that differ, in an order the ranks' shards interleave) has none."""
    reads = tracer.micro_of(vid).reads
    out = list(twins)
    for k, (i, twin) in enumerate(zip(node.inputs, twins, strict=True)):
        want = reads[k] if k < len(reads) else None
        if twin is None or not isinstance(tracer.micro_of(i).sbp, Broadcast) or not isinstance(want, Split):
            continue
        out[k] = None
        if _expanded_along(tracer, i, want.dim):
            try:
                out[k] = cat([twin] * tracer.graph.micro_batches, dim=want.dim)
            except SbpflowError:
                pass
    return out

def _expanded_along(tracer: Tracer, vid: int, dim: int) -> bool:
    """Whether ``vid`` is an ``expand`` that repeats one value along ``dim`` (all its rows there are equal)."""
    v = tracer.graph.values[vid]
    node = tracer.graph.nodes[v.producer] if v.producer >= 0 else None
    if node is None or node.kind != "op" or node.name != "expand":
        return False
    src = tracer.graph.values[node.inputs[0]].shape
    at = dim - (len(v.shape) - len(src))
    return at < 0 or src[at] == 1

def _whole_shape(tracer: Tracer, vid: int) -> tuple[int, ...]:
    """``vid``'s shape over the whole step: its split dim over the micro-batches m times larger."""
    v, sbp = tracer.graph.values[vid], tracer.micro_of(vid).sbp
    if not isinstance(sbp, Split):
        return v.shape
    return tuple(n * tracer.graph.micro_batches if d == sbp.dim else n for d, n in enumerate(v.shape))

def _whole_attrs(tracer: Tracer, node: LNode, vid: int) -> list[dict[str, Any]]:
    """The attributes to replay ``node`` with on the whole step: its own, then, for an op whose ``shape`` is its
    output's (a reshape of the targets, an expand), that shape with the micro-batch split dim m times larger."""
    attrs = dict(node.attrs)
    layout = tracer.micro_of(vid)
    if node.name not in WHOLE_SHAPES or "shape" not in attrs or not isinstance(layout.sbp, Split):
        return [attrs]
    shape = list(attrs["shape"])
    shape[layout.sbp.dim] *= tracer.graph.micro_batches
    return [attrs, {**attrs, "shape": tuple(shape)}]


def _whole_step(tracer: Tracer, opdef: Any, args: Sequence[Any], attrs: dict[str, Any], inputs: tuple[int, ...],
                template: tuple[tuple[str, Any], ...], layout: Micro, out_metas: Any) -> Tensor | None:
    """A reduction over the micro-batch split of step data alone (the count of kept targets that a mean loss
    divides by) is computed once, on the whole step's inputs, before the micro-batches: each micro-batch then reads
    the batch's value, and a loss divided by it is an exact partial. None where that does not apply."""
    if not isinstance(layout.sbp, Partial) or not all(v in tracer.data_only for v in inputs) or \
            any(how not in ("t", "c") for how, _ in template):
        return None
    saved = tracer.phase
    tracer.phase = "pre"
    try:
        twins = [_whole_of(tracer, v) for v in inputs]
        if any(t is None for t in twins):
            return None
        result = _replay(opdef, template, attrs, twins)
    finally:
        tracer.phase = saved
    if not isinstance(result, Tensor) or result._lazy is None or len(out_metas) != 1 or \
            tuple(result.shape) != tuple(out_metas[0].shape):
        return None
    tracer.data_only.add(result._lazy.value.id)
    return result


def _replay(opdef: Any, template: tuple[tuple[str, Any], ...], attrs: dict[str, Any],
            tensors: Sequence[Tensor | None]) -> Any:
    """``opdef`` called again (no gradients) on ``tensors`` in place of its tensor arguments; None if it refuses
    them (an attribute that holds the micro-batch's shape)."""
    args = [tensors[v] if how == "t" else v for how, v in template]
    try:
        with no_grad():
            return opdef(*args, **attrs)
    except SbpflowError:
        return None


# ----------------------------------------------------------------------------- layouts over micro-batches


def _micro_layout(tracer: Tracer, opdef: Any, args: Sequence[Any], attrs: dict[str, Any], inputs: tuple[int, ...],
                  out_metas: Any) -> Micro:
    """The op's output layout over the micro-batches (graph.micro). Refusals are for the forward (grad mode on):
    a backward is exact by its seed, so there an unmatched op only makes its outputs' join unknown."""
    ins = tuple(tracer.micro_of(v) for v in inputs)
    if all(i == SAME for i in ins):
        return SAME
    m = tracer.graph.micro_batches
    strict = is_grad_enabled()
    key = (opdef.name, tuple(arg_meta(a) for a in args), repr(sorted(attrs.items())), ins, strict)
    found = _MICRO.get(key)
    if found is None:
        # each micro-batch holds whole rows, so a split's pieces always divide (a reshape merging it): one "rank"
        extra = {"mesh": (1,)} if opdef.mesh_aware else {}
        sigs = opdef.sbp(*key[1], outs=out_metas, **extra, **attrs)
        try:
            found = propagate(opdef, sigs, ins, m, user_line())
        except SbpflowError:
            if strict:
                raise
            found = Micro(None, origin=opdef.name)
        _MICRO[key] = found
    return found


_MICRO: dict[Any, Micro] = {}  # (op, arg metas, attrs, input layouts) -> output layout


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
    if tracer.micro is not None and tracer.phase == "micro":  # a move: the same rows of the same micro-batch
        tracer.micro[v.id] = tracer.micro_of(src)
        if src in tracer.data_only:
            tracer.data_only.add(v.id)
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
    """The implicit gradient of a scalar root while tracing, broadcast: 1 / s for a root that is the sum of its
    micro-batch values divided by s (graph.micro: 1 for a sum over the batch, m for a mean), 1/m averaged."""
    tracer = ACTIVE[-1]
    _, m = tracer.join_of(root, "the loss backward() starts from")
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



