"""What the planner reads off a traced training step: per-op costs, parameters, activations and cut points.

The input is the :class:`~sbpflow.graph.ir.LogicalGraph` of any ``nn.Graph`` step (``Graph.trace``, on a model
built under ``meta_init()``). Nothing here knows a model class; it reads:

* **forward ops** (micro phase, before the first loss gradient), each with its FLOPs (GEMMs, attention and
  convolutions from the IR's shapes, :func:`op_flops`) and its bytes through memory, at ``ACT_BYTES`` per
  element of a floating tensor (mixed precision, as the sizes planner prices);
* **module names**: an op belongs to the module of the parameter it reads (``h.3.mlp.c_fc.weight`` ->
  ``h.3.mlp.c_fc``), else to its program-order predecessor's;
* **parameters**: variables that a forward op reads and the optimizer writes back (an ``assign`` in the post
  phase); a tied weight is read by two modules and counted once per stage that reads it;
* **activations kept for backward**: the forward values that backward ops read;
* **tensor-parallel styles** (Megatron's, found on the graph): a Linear-like op (a GEMM with a 2-D parameter)
  whose output reaches exactly one other Linear-like op through ops without parameters or normalisation is
  ``colwise`` and that op ``rowwise``; the ops between them (attention included) run on ``1/tp`` of the
  features. An embedding indexed by the data is ``vocab``; a Linear-like op whose output reaches no other one but
  a softmax (the output layer) is ``colwise`` with its loss vocab-parallel (``vocab`` when its weight is the
  embedding's); everything else is ``replicate``;
* **cut points**: positions in the forward order that exactly one activation crosses (side values, at most
  ``SIDE_SHARE`` of it, cross too: a MoE router's logits kept for the loss), a small one (at most ``CUT_FACTOR``
  times the median such crossing: not the logits), where a module's forward starts (its first parameter is
  read: a stage is a set of modules). Stages are cut there (between blocks, but also between a block's
  attention and its MLP, or between any two layers of a chain; not before a residual's last op).

Forward ops between two cut points form a :class:`Segment`; each has its forward seconds per micro-batch as a
function of (micro-batch, tp) through :func:`segment_times` (roofline per op), and its backward is priced as
twice its forward (a GEMM's backward is two GEMMs of its size), as the sizes planner prices a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import PlanError
from ..graph.ir import LNode, LogicalGraph
from ..graph.repeat import op_classes
from ..graph.select import MATMUL_OPS, backward_nodes
from .cost import MIXED_STATE
from .profiles import DeviceProfile

ACT_BYTES = 2  # bytes per element of a floating activation (fp16/bf16 training)
# "mixed": bytes as mixed-precision training on accelerators holds them (the sizes planner's); "traced": as the
# traced step itself holds them (its dtypes, its optimizer's state), for plans that run that very step
PRECISIONS = ("mixed", "traced")
STYLES = ("colwise", "rowwise", "vocab", "replicate")
# layout ops: views, or copies fused into their neighbours' kernels (as Megatron's and the sizes planner's count)
LAYOUT_OPS = ("reshape", "view", "expand", "flatten", "squeeze", "unsqueeze", "permute", "transpose",
              "reshape_permute", "permute_reshape", "contiguous")
GATHER_OPS = ("embedding", "pick", "index_select", "gather")
CUT_FACTOR = 2.0  # a stage cut sends at most this many times the median one-tensor crossing
SIDE_SHARE = 0.25  # a value this share of the largest one crossing a cut or less does not stop it (a side value)
_Comm = dict[int, list[tuple[float, bool]]]  # forward op position -> (bytes all-reduced over tp, in forward)


@dataclass(frozen=True)
class Segment:
    """Forward ops ``lo .. hi - 1`` (positions in :attr:`GraphModel.ops`) between two cut points."""

    lo: int
    hi: int
    modules: tuple[str, ...]  # the modules its ops belong to, in order, without repeats
    params: dict[int, tuple[int, bool]]  # variable value id -> (elements, split by tp)
    kept: tuple[float, float]  # bytes kept for backward at the traced batch: (whole on every tp rank, split)
    wide: tuple[float, float]  # of ``kept``, the values wider than any GEMM operand (selective recompute drops)
    out_bytes: float  # the one activation crossing its end, at the traced batch (0 for the last)
    tp_comm: tuple[tuple[float, bool], ...]  # (bytes, in forward) all-reduced over tp per micro-batch, traced batch

    @property
    def first_module(self) -> str:
        return self.modules[0] if self.modules else ""


@dataclass(frozen=True)
class Experts:
    """A step's routed experts, read off its router ops (``topk_router``): the ops that run an expert's tokens, and
    what expert parallelism splits (their parameters) and exchanges (each token's k routed rows, each way)."""

    count: int  # experts per router (the fewest of any router: ep must divide every layer's)
    op: np.ndarray  # per forward op: runs an expert (its weights split over ep)
    params: frozenset[int]  # the experts' parameter value ids
    routed_bytes: np.ndarray  # per forward op: at a router, its tokens' bytes times k (rows routed), traced batch
    kept: np.ndarray  # per segment: (whole, split by tp) bytes the expert ops keep for backward, traced batch
    routed_share: float = 1.0  # k / E (the largest of any router): a token's routed rows' share of the dense work


@dataclass
class GraphModel:
    """A traced training step as the planner prices it (see the module docstring)."""

    batch: int  # the traced batch (dim 0 of the first input)
    names: list[str]  # forward op names
    modules: list[str]  # forward op modules
    flops: np.ndarray  # per forward op, at the traced batch
    nbytes: np.ndarray  # per forward op, at the traced batch
    batched: np.ndarray  # per forward op: scales with the batch
    split: np.ndarray  # per forward op: runs on 1/tp of the work under tensor parallelism
    gemm: np.ndarray  # per forward op: (m, n, k, batch) of its GEMMs at the traced batch; zeros for other ops
    gemm_axes: np.ndarray  # per forward op: (the gemm dim that scales with the batch, the one tp splits or -1)
    wide_op: np.ndarray  # per forward op: produces a value that selective recompute drops
    segments: list[Segment]
    styles: dict[str, str]  # parameter name -> colwise / rowwise / vocab / replicate
    param_names: dict[int, str]  # variable value id -> name
    param_shapes: dict[str, tuple[int, ...]]  # name -> logical shape
    tp_dims: tuple[int, ...]  # sizes that tensor parallelism must divide
    step_flops: float  # FLOPs of forward and backward as traced (every micro-phase op), at the traced batch
    step_flops_fixed: float  # of which do not scale with the batch
    block: np.ndarray  # per segment: part of a repeated block (recomputation applies to these)
    repeats: int  # how many times the most repeated segment occurs (graph.repeat's classes)
    notes: list[str] = field(default_factory=list)
    state_bytes: tuple[float, float, float] = MIXED_STATE  # per parameter: weights, gradients, optimizer state
    traced: bool = False  # bytes as the traced step holds them on sbpflow's runtime (precision="traced")
    kv_bytes: np.ndarray | None = None  # per forward op: an attention's K and V bytes at the traced batch, else 0
    seq_len: int = 0  # the sequence length attention sees (its query rows), 0 without attention
    experts: Experts | None = None  # routed experts (a MoE's), found on the graph; None without a router
    input_bytes: float = 0.0  # the step's inputs (a batch and its labels) at the traced batch, live the whole step

    @property
    def param_count(self) -> int:
        seen: dict[int, int] = {}
        for s in self.segments:
            seen.update({v: n for v, (n, _) in s.params.items()})
        return sum(seen.values())

    def model_flops(self, batch: int) -> float:
        """Forward and backward FLOPs of a step of ``batch`` samples, as traced (no recompute)."""
        scaled = self.step_flops - self.step_flops_fixed
        return scaled * batch / self.batch + self.step_flops_fixed

    def tp_allowed(self, tp: int) -> bool:
        return all(d % tp == 0 for d in self.tp_dims)

    def block_starts(self) -> list[int]:
        """The first segment of each repeated block, in order: a repeated segment whose module's parent (``h.3``
        for ``h.3.ln_1``) is not the previous segment's."""
        parents = [s.first_module.rpartition(".")[0] for s in self.segments]
        return [i for i, repeated in enumerate(self.block)
                if repeated and (i == 0 or parents[i] != parents[i - 1] or not self.block[i - 1])]


def layer_cuts(model: GraphModel, chunk_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Stage cuts (the segment where each chunk starts) that give chunk ``i`` the next ``chunk_layers[i]`` repeated
    blocks, as the sizes planner cuts a transformer by layers; the first chunk also takes what comes before them."""
    starts = model.block_starts()
    if sum(chunk_layers) != len(starts):
        raise PlanError(f"layer cuts give every repeated block a chunk, {len(starts)} in all, but got {chunk_layers}")
    layer, cuts = 0, [0]
    for n in chunk_layers[:-1]:
        layer += n
        cuts.append(starts[layer])
    return tuple(cuts)


@dataclass
class _Layout:
    """What the tensor-parallel styles found on the graph split, and the all-reduces they add."""

    styles: dict[int, str]  # parameter value id -> style
    split_ops: set[int] = field(default_factory=set)
    split_vals: set[int] = field(default_factory=set)
    comm: _Comm = field(default_factory=dict)
    dims: set[int] = field(default_factory=set)  # sizes tp must divide
    output_layers: set[int] = field(default_factory=set)  # op ids of the Linear-like ops that make the logits

    def all_reduce(self, position: int, nbytes: float, forward: bool) -> None:
        self.comm.setdefault(position, []).append((nbytes, forward))


def op_flops(name: str, shapes_in: list[tuple[int, ...]], shapes_out: list[tuple[int, ...]]) -> float:
    """Multiply-adds x 2 of one op from its global shapes: GEMMs, attention and convolutions; 0 for the others.

    >>> op_flops("linear", [(4, 8), (16, 8)], [(4, 16)])
    1024.0
    >>> op_flops("conv2d", [(2, 3, 8, 8), (4, 3, 3, 3)], [(2, 4, 6, 6)])  # 2 · 288 outputs · 27 taps
    15552.0
    """
    out = float(np.prod(shapes_out[0])) if shapes_out else 0.0
    if name in MATMUL_OPS and shapes_in and shapes_in[0]:
        return 2 * out * shapes_in[0][-1]
    if name == "linear_weight_grad" and shapes_in:
        return 2 * out * float(np.prod(shapes_in[0][:-1]))
    if name == "scaled_dot_product_attention" and len(shapes_in) >= 2:
        return 4.0 * float(np.prod(shapes_in[0])) * shapes_in[1][-2]
    if name == "sdpa_backward" and len(shapes_in) >= 3:
        return 2.5 * 4.0 * float(np.prod(shapes_in[1])) * shapes_in[2][-2]
    if name in ("conv2d", "conv2d_input_grad") and len(shapes_in) >= 2:
        w = shapes_in[1]
        taps = float(np.prod(w[1:])) if name == "conv2d" else w[0] * float(np.prod(w[2:]))
        return 2 * out * taps
    if name == "conv2d_weight_grad" and len(shapes_in) >= 2:
        dy = shapes_in[0]
        return 2 * out * dy[0] * float(np.prod(dy[2:]))
    return 0.0


def gemm_shape(name: str, shapes_in: list[tuple[int, ...]], shapes_out: list[tuple[int, ...]], style: str | None,
               split: bool) -> tuple[tuple[float, float, float, float], int, int]:
    """((m, n, k, batch), the dim that grows with the data batch, the dim tp splits or -1) of an op's GEMMs, for
    the profile's shape efficiency: a Linear's rows are its tokens, a column style splits n and a row style k;
    a batched product (attention's) and the fused attention (as FlashAttention tiles it: (s, d, s) per head)
    scale and split by their batch of heads. Zeros for ops that are not GEMMs.

    >>> gemm_shape("linear", [(8, 16, 64), (256, 64)], [(8, 16, 256)], "colwise", True)
    ((128.0, 256.0, 64.0, 1.0), 0, 1)
    >>> gemm_shape("scaled_dot_product_attention", [(2, 4, 32, 16)] * 3, [(2, 4, 32, 16)], None, True)
    ((32.0, 16.0, 32.0, 8.0), 3, 3)
    """
    none = (0.0, 0.0, 0.0, 0.0), 0, -1
    if not shapes_in or not shapes_out or not shapes_in[0]:
        return none
    out = shapes_out[0]
    weight_axis = {"colwise": 1, "vocab": 1, "rowwise": 2}.get(style or "", -1)
    if name == "linear" or (name in MATMUL_OPS and style is not None and len(out) >= 1):
        rows = float(np.prod(out[:-1])) if len(out) > 1 else 1.0
        return (rows, float(out[-1]), float(shapes_in[0][-1]), 1.0), 0, weight_axis if split else -1
    if name in MATMUL_OPS and len(out) >= 2:
        heads = float(np.prod(out[:-2])) if len(out) > 2 else 1.0
        batch_axis = 3 if len(out) > 2 else 0
        return (float(out[-2]), float(out[-1]), float(shapes_in[0][-1]), heads), batch_axis, (
            batch_axis if split else -1)
    if name == "scaled_dot_product_attention" and len(shapes_in) >= 2 and len(shapes_in[0]) >= 2:
        q, k = shapes_in[0], shapes_in[1]
        heads = float(np.prod(q[:-2]))
        return (float(q[-2]), float(q[-1]), float(k[-2]), heads), 3, 3 if split else -1
    if name == "conv2d" and len(shapes_in) >= 2 and len(out) == 4:
        w = shapes_in[1]
        return (float(out[0] * out[2] * out[3]), float(out[1]), float(np.prod(w[1:])), 1.0), 0, (
            weight_axis if split else -1)
    return none


def read_graph(g: LogicalGraph, precision: str = "mixed") -> GraphModel:
    """The :class:`GraphModel` of a traced training step (see the module docstring), its bytes priced by
    ``precision`` (:data:`PRECISIONS`)."""
    if precision not in PRECISIONS:
        raise PlanError(f"the planner prices bytes as one of {PRECISIONS}, but got precision={precision!r}")
    reader = _Reader(g, traced=precision == "traced")
    return reader.model()


class _Reader:
    """One pass over the graph's nodes; the steps are small methods in the order :meth:`model` calls them."""

    def __init__(self, g: LogicalGraph, traced: bool = False) -> None:
        self.g, self.traced = g, traced
        self.backward = set(backward_nodes(g))
        if not self.backward:
            raise PlanError("the planner reads a training step, but the traced step has no backward (call "
                            "loss.backward() in build())")
        self.forward = [n for n in g.nodes if n.kind == "op" and n.phase == "micro" and n.id not in self.backward]
        self.position = {n.id: i for i, n in enumerate(self.forward)}
        self.variables = {n.outputs[0]: n.name for n in g.nodes if n.kind == "variable"}
        assigned = {n.name for n in g.nodes if n.kind == "assign"}
        self.params = {v: name for v, name in self.variables.items() if name in assigned
                       and any(v in n.inputs for n in self.forward)}
        self.readers: dict[int, list[LNode]] = {}
        for n in g.nodes:
            if n.kind == "op" and n.phase == "micro":
                for v in n.inputs:
                    self.readers.setdefault(v, []).append(n)
        inputs = [n for n in g.nodes if n.kind == "input"]
        if not inputs or not g.values[inputs[0].outputs[0]].shape:
            raise PlanError("the planner scales a step by its batch, dim 0 of the step's first input, but the "
                            "traced step has no input with a batch dimension")
        self.batch = g.values[inputs[0].outputs[0]].shape[0]
        self.data = self._data_dependent({v for n in inputs for v in n.outputs})

    def _data_dependent(self, seeds: set[int]) -> set[int]:
        out = set(seeds)
        for n in self.g.nodes:
            if n.kind == "op" and any(v in out for v in n.inputs):
                out.update(n.outputs)
        return out

    def _weight(self, n: LNode) -> int | None:
        """The 2-D parameter a Linear-like op or an embedding reads, if any."""
        if n.name not in MATMUL_OPS and n.name != "embedding":
            return None
        found = [v for v in n.inputs if v in self.params and len(self.g.values[v].shape) == 2]
        return found[0] if found else None

    def model(self) -> GraphModel:
        modules = self._modules()
        layout = self._tensor_parallel()
        styles, split_ops, split_vals, comm, dims = (layout.styles, layout.split_ops, layout.split_vals,
                                                     layout.comm, layout.dims)
        wide_vals = self._wide(layout)
        cuts = self._cuts()
        segments = [self._segment(lo, hi, modules, split_vals, wide_vals, comm, styles)
                    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
        block, repeats = self._blocks(segments)
        g = self.g
        flops, nbytes, gemms, axes = [], [], [], []
        for n in self.forward:
            ins, outs = [g.values[v].shape for v in n.inputs], [g.values[v].shape for v in n.outputs]
            flops.append(op_flops(n.name, ins, outs))
            nbytes.append(self._op_bytes(n))
            weight = self._weight(n) if n.name != "conv2d" else next((v for v in n.inputs if v in self.params), None)
            gemm, batch_axis, split_axis = gemm_shape(n.name, ins, outs, styles.get(weight, "replicate")
                                                      if weight is not None else None, n.id in split_ops)
            gemms.append(gemm)
            axes.append((batch_axis, split_axis))
        step, fixed = 0.0, 0.0
        for n in g.nodes:
            if n.kind == "op" and n.phase == "micro":
                f = op_flops(n.name, [g.values[v].shape for v in n.inputs], [g.values[v].shape for v in n.outputs])
                step += f
                fixed += 0.0 if any(v in self.data for v in n.outputs) else f
        names = {v: self.params[v] for v in self.params}
        attention = [n for n in self.forward if n.name == "scaled_dot_product_attention"]
        seq = g.values[attention[0].inputs[0]].shape[-2] if attention else 0
        return GraphModel(experts=self._experts(segments, split_vals),
            state_bytes=self._state_bytes() if self.traced else MIXED_STATE, traced=self.traced,
            kv_bytes=np.array([sum(self._bytes(v) for v in n.inputs[1:3]) if n in attention else 0.0
                               for n in self.forward]), seq_len=seq,
            batch=self.batch, names=[n.name for n in self.forward], modules=modules,
            flops=np.array(flops), nbytes=np.array(nbytes),
            batched=np.array([any(v in self.data for v in n.outputs) for n in self.forward]),
            split=np.array([n.id in split_ops for n in self.forward]),
            gemm=np.array(gemms, dtype=float).reshape(-1, 4), gemm_axes=np.array(axes, dtype=int).reshape(-1, 2),
            wide_op=np.array([any(v in wide_vals for v in n.outputs) for n in self.forward]),
            segments=segments, styles={names[v]: s for v, s in styles.items()}, param_names=names,
            param_shapes={name: tuple(g.values[v].shape) for v, name in names.items()},
            tp_dims=tuple(sorted(dims)), step_flops=step, step_flops_fixed=fixed, block=block, repeats=repeats,
            input_bytes=sum(self._bytes(v) for n in g.nodes if n.kind == "input" for v in n.outputs))

    def _op_bytes(self, n: LNode) -> float:
        """Bytes an op moves: its inputs and outputs; a layout op none; a gather (embedding, pick) its indices
        and its output, not the whole table it picks from."""
        if n.name in LAYOUT_OPS:
            return 0.0
        if n.name in GATHER_OPS:
            return self._bytes(n.outputs[0]) * 2 + sum(self._bytes(v) for v in n.inputs[1:] if v not in self.params)
        return sum(self._bytes(v) for v in n.inputs + n.outputs)

    def _bytes(self, vid: int) -> float:
        v = self.g.values[vid]
        elements = float(np.prod(v.shape)) if v.shape else 1.0
        if v.dtype.is_floating_point and not self.traced:
            return elements * ACT_BYTES
        return elements * torch.empty((), dtype=v.dtype).element_size()

    def _state_bytes(self) -> tuple[float, float, float]:
        """Bytes per parameter element as the traced step holds them: its weights' own size (their gradients
        alike) and the optimizer's state (the other variables the step writes back: Adam's two moments, ...)."""
        elements = sum(float(np.prod(self.g.values[v].shape)) for v in self.params) or 1.0
        weights = sum(self._bytes(v) for v in self.params) / elements
        assigned = {n.name for n in self.g.nodes if n.kind == "assign"}
        state = [v for v, name in self.variables.items() if name in assigned and v not in self.params]
        return weights, weights, sum(self._bytes(v) for v in state) / elements

    def _modules(self) -> list[str]:
        out, last = [], ""
        self.module_starts: set[int] = set()  # positions whose op opens a module (reads its first parameter)
        for i, n in enumerate(self.forward):
            owned = [self.params[v] for v in n.inputs if v in self.params]
            if owned and owned[0].rsplit(".", 1)[0] != last:
                last = owned[0].rsplit(".", 1)[0]
                self.module_starts.add(i)
            out.append(last)
        return out

    # -- tensor parallelism ------------------------------------------------------------------------

    def _tensor_parallel(self) -> _Layout:
        """Megatron's styles found on the graph (see the module docstring), the ops and values they split, the
        all-reduces they add and the sizes tp must divide."""
        layout = _Layout({v: "replicate" for v in self.params})
        groups: dict[int, list[tuple[LNode, set[int]]]] = {}  # row op id -> its columns and their regions
        taken: set[int] = set()  # ops already a column or a row
        for n in self.forward:
            w = self._weight(n)
            if w is None or n.id in taken:
                continue
            if n.name == "embedding":
                if any(v in self.data for v in n.inputs):  # a table read at fixed positions stays whole
                    layout.styles[w] = "vocab"  # the vocabulary is padded to a multiple of tp, as Megatron pads it
                    layout.all_reduce(self.position[n.id], self._bytes(n.outputs[0]), forward=True)
                continue
            region, ends = self._region(n)
            if region is None:
                continue
            if not ends and any("softmax" in self._node(r).name for r in region):  # the output layer
                # column-parallel logits, the loss vocab-parallel; a weight tied to the embedding stays "vocab"
                layout.styles[w] = "vocab" if layout.styles[w] == "vocab" else "colwise"
                layout.output_layers.add(n.id)
                self._split(layout, n, region)
                tokens = float(np.prod(self.g.values[n.outputs[0]].shape[:-1]))
                layout.all_reduce(self.position[n.id], 3 * 4 * tokens, forward=True)  # max, sum, target logit
            elif len(ends) == 1 and (next(iter(ends)) in groups or next(iter(ends)) not in taken):
                end = next(iter(ends))
                groups.setdefault(end, []).append((n, region))
                taken.update((n.id, end))
        for row_id, columns in groups.items():
            self._pair(layout, self._node(row_id), columns)
        for v, style in list(layout.styles.items()):
            if style != "replicate":
                for bias in self._biases(v):
                    layout.styles[bias] = "colwise" if style in ("colwise", "vocab") else "replicate"
        return layout

    def _pair(self, layout: _Layout, row: LNode, columns: list[tuple[LNode, set[int]]]) -> None:
        """Columns feeding one row: the row's output is all-reduced forward, the columns' input backward."""
        w_row = self._weight(row)
        assert w_row is not None  # ends are Linear-like
        layout.styles[w_row] = "rowwise"
        layout.split_ops.add(row.id)
        layout.dims.add(self.g.values[w_row].shape[1])
        layout.all_reduce(self.position[row.id], self._bytes(row.outputs[0]), forward=True)
        fed = set()
        for col, region in columns:
            w_col = self._weight(col)
            assert w_col is not None
            layout.styles[w_col] = "colwise"
            layout.dims.add(self.g.values[w_col].shape[0])
            self._split(layout, col, region)
            fed.add(col.inputs[0])
            # (B, heads, T, d) inside the region: each rank keeps whole heads
            layout.dims.update(self.g.values[v].shape[1] for r in region for v in self._node(r).outputs
                               if len(self.g.values[v].shape) == 4)
        for x in fed:
            layout.all_reduce(self.position[columns[0][0].id], self._bytes(x), forward=False)

    def _split(self, layout: _Layout, start: LNode, region: set[int]) -> None:
        layout.split_ops.update({start.id} | region)
        layout.split_vals.update(start.outputs)
        layout.split_vals.update(v for r in region for v in self._node(r).outputs)

    def _biases(self, weight: int) -> list[int]:
        """The 1-D parameters read by the same ops as ``weight`` (a Linear's bias)."""
        return [v for n in self.readers.get(weight, []) if n.id in self.position
                for v in n.inputs if v in self.params and len(self.g.values[v].shape) == 1]

    def _node(self, nid: int) -> LNode:
        return self.forward[self.position[nid]]

    def _region(self, start: LNode) -> tuple[set[int] | None, set[int]]:
        """Forward ops reached from ``start``'s output before any Linear-like op, and the Linear-like ops
        reached; None when the region reads parameters, normalises, or lets its values escape elsewhere."""
        region: set[int] = set()
        ends: set[int] = set()
        todo = list(start.outputs)
        while todo:
            for reader in self.readers.get(todo.pop(), []):
                if reader.id not in self.position or reader.id in region or reader.id in ends:
                    continue
                if self._weight(reader) is not None:
                    ends.add(reader.id)
                    continue
                if "norm" in reader.name or any(v in self.params for v in reader.inputs):
                    return None, set()
                region.add(reader.id)
                todo.extend(reader.outputs)
        return region, ends

    # -- routed experts ----------------------------------------------------------------------------

    def _experts(self, segments: list[Segment], split_vals: set[int]) -> Experts | None:
        """The routed experts of every router (see :class:`Experts`): an expert is the forward ops between the
        router's tokens (its gate's input) and a product with a routing weight (the dense form, every expert on
        every token), or a ``member_experts`` op (the traced exchange)."""
        routers = [n for n in self.forward if n.name == "topk_router"]
        if not routers:
            return None
        ops: set[int] = set()
        routed = np.zeros(len(self.forward))
        counts, shares = [], []
        for router in routers:
            tokens = self._router_tokens(router)
            counts.append(self.g.values[router.outputs[1]].shape[-1])  # probabilities (..., E)
            k = self.g.values[router.outputs[0]].shape[-1]  # routing weights (..., k)
            shares.append(k / counts[-1])
            routed[self.position[router.id]] = self._bytes(tokens) * k
            ops |= self._expert_ops(router, tokens)
        ops |= {n.id for n in self.forward if n.name == "member_experts"}
        params = frozenset(v for i in ops for v in self._node(i).inputs if v in self.params)
        kept = np.zeros((len(segments), 2))
        for i, segment in enumerate(segments):
            for n in self.forward[segment.lo:segment.hi]:
                for v in n.outputs if n.id in ops else ():
                    if any(r.id in self.backward for r in self.readers.get(v, [])):
                        kept[i, int(v in split_vals)] += self._bytes(v)
        return Experts(min(counts), np.array([n.id in ops for n in self.forward]), params, routed, kept, max(shares))

    def _router_tokens(self, router: LNode) -> int:
        """The tokens a router routes: the input of the Linear-like op (its gate) that makes its logits, through
        casts and other ops without parameters."""
        producer = {v: n for n in self.forward for v in n.outputs}
        value = router.inputs[0]
        while value in producer:
            n = producer[value]
            if self._weight(n) is not None:
                return n.inputs[0]
            value = n.inputs[0]
        return router.inputs[0]

    def _expert_ops(self, router: LNode, tokens: int) -> set[int]:
        """Forward ops that the router's tokens reach, the routing does not, and whose result a routing weight
        multiplies: each expert's (a shared expert's sum is not weighted by the routing)."""
        routing = self._descendants(set(router.outputs))
        reached = self._descendants({tokens})
        producer = {v: n for n in self.forward for v in n.outputs}
        out: set[int] = set()
        for n in self.forward:
            if n.name != "mul" or not any(v in routing for v in n.inputs):
                continue
            todo = [v for v in n.inputs if v not in routing and v in reached and v != tokens]
            while todo:
                op = producer.get(todo.pop())
                if op is None or op.id in out or not all(v in reached for v in op.outputs):
                    continue
                out.add(op.id)
                todo.extend(v for v in op.inputs if v in reached and v not in routing and v != tokens)
        return out

    def _descendants(self, seeds: set[int]) -> set[int]:
        """Forward values computed from ``seeds`` (the seeds included)."""
        out = set(seeds)
        for n in self.forward:
            if any(v in out for v in n.inputs):
                out.update(n.outputs)
        return out

    # -- activations and cuts ----------------------------------------------------------------------

    def _wide(self, layout: _Layout) -> set[int]:
        """Forward values with more elements per sample than any GEMM operand (the output layer's aside):
        attention scores and the like."""
        def per_sample(v: int) -> float:
            shape = self.g.values[v].shape
            return float(np.prod(shape[1:])) if len(shape) > 1 else 0.0

        gemms = [n for n in self.forward
                 if n.name in MATMUL_OPS and self._weight(n) is not None and n.id not in layout.output_layers]
        widest = max((per_sample(v) for n in gemms for v in (n.inputs[0], n.outputs[0])), default=0.0)
        return {v for n in self.forward for v in n.outputs if widest and per_sample(v) > widest}

    def _cuts(self) -> list[int]:
        """Forward positions that exactly one activation crosses (besides side values: a router's logits kept for
        the loss), no larger than ``CUT_FACTOR`` times the median such crossing, with 0 and the end; fills
        ``crossing_bytes`` (side values included)."""
        n = len(self.forward)
        volume = np.zeros(n + 2)
        spans = []  # (first position, last position it is read at, bytes) of each forward value
        for i, node in enumerate(self.forward):
            for v in node.outputs:
                last = max((self.position[r.id] for r in self.readers.get(v, []) if r.id in self.position),
                           default=i)
                spans.append((i, last, self._bytes(v)))
        for i, last, nbytes in spans:
            if last > i:  # crosses the cuts i + 1 .. last
                volume[i + 1] += nbytes
                volume[last + 1] -= nbytes
        self.crossing_bytes = np.cumsum(volume)
        largest, runner_up = _two_largest([span for span in spans if span[1] > span[0]], n)
        # one activation crosses: any other is a side value; a stage starts where a module's forward starts (the
        # only place a stage's modules can be moved to)
        single = [k for k in range(1, n) if largest[k] > 0 and runner_up[k] <= SIDE_SHARE * largest[k]
                  and k in self.module_starts]
        if not single:
            return [0, n]
        small = CUT_FACTOR * float(np.median(self.crossing_bytes[single]))  # not a cut that sends the logits
        return [0] + [k for k in single if self.crossing_bytes[k] <= small] + [n]

    def _segment(self, lo: int, hi: int, modules: list[str], split_vals: set[int], wide_vals: set[int],
                 comm: _Comm, styles: dict[int, str]) -> Segment:
        ops = self.forward[lo:hi]
        params = {}
        for n in ops:
            for v in n.inputs:
                if v in self.params:
                    params[v] = (int(np.prod(self.g.values[v].shape)), styles[v] != "replicate")
        kept = [0.0, 0.0]
        wide = [0.0, 0.0]
        for n in ops:
            for v in n.outputs:
                if any(r.id in self.backward for r in self.readers.get(v, [])):
                    part = int(v in split_vals)
                    kept[part] += self._bytes(v)
                    wide[part] += self._bytes(v) if v in wide_vals else 0.0
        seen: list[str] = []
        for m in modules[lo:hi]:
            if not seen or seen[-1] != m:
                seen.append(m)
        crossing = float(self.crossing_bytes[hi]) if hi < len(self.forward) else 0.0
        return Segment(lo, hi, tuple(seen), params, (kept[0], kept[1]), (wide[0], wide[1]), crossing,
                       tuple(b for i in range(lo, hi) for b in comm.get(i, [])))

    def _blocks(self, segments: list[Segment]) -> tuple[np.ndarray, int]:
        """Which segments repeat (graph.repeat's classes of their ops, round 0: op, attributes and shapes
        alike), and the count of the most repeated one."""
        classes = op_classes(self.g, lambda n: (n.name, n.attrs, tuple(self.g.values[v].shape for v in n.inputs)),
                             rounds=0)
        keys = [tuple(classes.get(n.id, -1) for n in self.forward[s.lo:s.hi]) for s in segments]
        count: dict[tuple[int, ...], int] = {}
        for key in keys:
            count[key] = count.get(key, 0) + 1
        return np.array([count[key] > 1 for key in keys]), max(count.values(), default=1)


def _two_largest(spans: list[tuple[int, int, float]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cut ``1 .. n - 1``: the largest and the second largest bytes of the values crossing it (value ``(i,
    last, bytes)`` crosses the cuts ``i + 1 .. last``), by painting cuts largest value first.

    >>> first, second = _two_largest([(0, 3, 8.0), (1, 2, 2.0), (0, 1, 1.0)], 4)
    >>> first[1:4].tolist(), second[1:4].tolist()
    ([8.0, 8.0, 8.0], [1.0, 2.0, 0.0])
    """
    first, second = np.zeros(n + 1), np.zeros(n + 1)
    owner = np.full(n + 1, -1)
    for painted, skip_own in ((first, False), (second, True)):
        after = list(range(n + 2))  # after[k]: the first cut >= k not painted yet (path-halving find)

        def find(k: int, after: list[int] = after) -> int:
            while after[k] != k:
                after[k] = after[after[k]]
                k = after[k]
            return k

        for index in sorted(range(len(spans)), key=lambda j: -spans[j][2]):
            i, last, nbytes = spans[index]
            k = find(i + 1)
            while k <= last:
                if skip_own and owner[k] == index:  # the largest value is not its own runner-up
                    k = find(k + 1)
                    continue
                painted[k] = nbytes
                if not skip_own:
                    owner[k] = index
                after[k] = k + 1
                k = find(k + 1)
    return first, second


def segment_times(model: GraphModel, micro_batch: float, tp: int, profile: DeviceProfile,
                  only: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per segment, seconds of one micro-batch: (forward, the forward of its wide values, model FLOPs forward);
    ``only`` (per forward op) counts those ops alone.

    Each op is a roofline kernel on its per-rank share: ``micro_batch / batch`` of the traced work when it
    scales with the batch, and ``1 / tp`` when tensor parallelism splits it.
    """
    scale = np.where(model.batched, micro_batch / model.batch, 1.0) / np.where(model.split, tp, 1)
    flops, nbytes = model.flops * scale, model.nbytes * scale
    compute = flops / (profile.matmul_flops * _gemm_efficiency(model, micro_batch, tp, profile))
    memory = nbytes / profile.memory_throughput
    launch = np.where(model.nbytes + model.flops > 0, profile.launch_s, 0.0)  # layout ops launch nothing
    per_op = np.maximum(compute, memory) + launch
    if only is not None:
        per_op, flops = np.where(only, per_op, 0.0), np.where(only, flops, 0.0)
    bounds = np.array([s.lo for s in model.segments])
    forward = np.add.reduceat(per_op, bounds)
    wide = np.add.reduceat(np.where(model.wide_op, per_op, 0.0), bounds)
    return forward, wide, np.add.reduceat(flops, bounds)


def _gemm_efficiency(model: GraphModel, micro_batch: float, tp: int, profile: DeviceProfile) -> np.ndarray:
    """Per forward op, the profile's efficiency for its local GEMM shape under (micro-batch, tp); 1 elsewhere."""
    dims = model.gemm.copy()
    rows = np.arange(len(dims))
    batch_axis, split_axis = model.gemm_axes[:, 0], model.gemm_axes[:, 1]
    dims[rows, batch_axis] *= np.where(model.batched, micro_batch / model.batch, 1.0)
    has_split = split_axis >= 0
    dims[rows[has_split], split_axis[has_split]] /= tp
    is_gemm = dims[:, 0] > 0
    out = np.ones(len(dims))
    if is_gemm.any():
        d = dims[is_gemm]
        out[is_gemm] = profile.gemm_efficiency(d[:, 0], d[:, 1], d[:, 2], d[:, 3])
    return out
