"""SBP selection for the whole graph: an integer program over every op's signature (HiGHS, through highspy).

Each op picks one n-D signature (``x[v,k]`` binary); each edge pays the boxing planner's alpha-beta time from
the producer's SBP to the consumer's (``e[s,t]``, continuous: one-hot choices make the coupling exact); each op
pays its local roofline compute, so replicating work is never free. Gradient all-reduces cost only what
backward's compute does not cover (they go out in buckets, graph.bucket). An optional bound on the activation
bytes kept for backward (``activation_cap``) lets ZeRO ask for memory. The tracer's greedy choice is the
baseline, priced in the same model: the solver's answer is kept only when it is not worse.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import boxing
from .._layout import shard_shape
from ..boxing import Layout
from ..boxing.plan import transition_time
from ..ops.propagation import sig_fits, zigzag_twins
from ..ops.schema import REGISTRY, Meta, Scalar, Sig
from ..sbp import NdSbp, Partial, Split, broadcast, zigzag_valid
from . import milp
from .costs import FIRST_BUCKET, MEM_SECONDS_PER_BYTE, SECONDS_PER_FLOP
from .ir import LNode, LogicalGraph
from .repeat import op_classes

# ops whose time is their FLOPs (a linear's input and weight gradients, attention), see :func:`flops`
MATMUL_OPS = ("matmul", "linear", "bmm", "matmul_nd")
METHODS = ("ilp", "ilp-unmerged", "greedy")
# Gradient all-reduces (P(sum) -> B of whole tensors, read by the optimizer) go out in buckets on the
# communication stream while backward goes on (graph.bucket): they cost only what backward's compute cannot
# cover. Only this share of backward's compute counts as cover: the last bucket goes out after backward ends,
# and on CPUs a collective takes cycles from the compute thread.
HIDDEN_SHARE = 0.5
MIN_GAIN = 1e-5  # a sweep's plan is taken when it saves this fraction of the step's time: less is noise and ties
# Of plans equal in time, the one that keeps fewer activation bytes for backward wins (a data-parallel layout
# over one that computes the whole batch on every rank): a tenth of a memory pass over them, as a tie-break.
KEPT_TIE = 0.1 * MEM_SECONDS_PER_BYTE


@dataclass(frozen=True)
class Candidate:
    ins: tuple[NdSbp, ...]
    outs: tuple[NdSbp, ...]


@dataclass
class Selection:
    """The outcome: the objective of the greedy baseline and of the chosen assignment, and solve time."""

    greedy_cost: float
    chosen_cost: float
    method: str
    solve_s: float
    variables: int = 0
    classes: int = 0  # op nodes' classes: the ones whose choices the program makes (see :mod:`.repeat`)
    kept_bytes: int = 0  # per rank, activations the chosen layouts keep for backward (see :func:`kept_for_backward`)
    traced_kept_bytes: int = 0  # the same for the traced (greedy) choice


def candidates(g: LogicalGraph, n: LNode, current: Candidate, free_axis: int | None = None) -> list[Candidate]:
    """The n-D signatures of op node ``n``: products of its 1-D signatures over the mesh axes.

    With ``free_axis`` set, only that mesh axis varies and the others keep ``current``'s choice (one sweep of
    the per-axis search, see :func:`select`). On a mesh axis of one rank every signature names the same
    shards, so the current one is kept there. Repeated layers ask the same question many times: answers
    are cached by the op's metadata.
    """
    key = (signature_key(g, n), current, free_axis)
    found = _CANDIDATES.get(key)
    if found is None:
        found = _CANDIDATES[key] = _candidates(g, n, current, free_axis)
    return list(found)


def signature_key(g: LogicalGraph, n: LNode) -> tuple[Any, ...]:
    """What decides op node ``n``'s signatures and their costs: op, argument and output metadata, attributes
    and placement (never the node's identity or its neighbours)."""
    return (n.name, tuple(_arg_metas(g, n)), tuple((g.values[v].shape, g.values[v].dtype) for v in n.inputs),
            tuple((g.values[v].shape, g.values[v].dtype) for v in n.outputs), n.attrs, _placement_of(g, n))


_CANDIDATES: dict[Any, list[Candidate]] = {}


def _placement_of(g: LogicalGraph, n: LNode) -> Any:
    return g.values[n.outputs[0]].placement if n.outputs else g.values[n.inputs[0]].placement


def _candidates(g: LogicalGraph, n: LNode, current: Candidate, free_axis: int | None) -> list[Candidate]:
    opdef = REGISTRY[n.name]
    placement = g.values[n.outputs[0]].placement if n.outputs else g.values[n.inputs[0]].placement
    metas = _arg_metas(g, n)
    out_metas = tuple(Meta(g.values[v].shape, g.values[v].dtype) for v in n.outputs)
    extra = {"mesh": placement.hierarchy} if opdef.mesh_aware else {}
    in_metas = [m for m in metas if isinstance(m, Meta)]
    sigs = [s for s in opdef.sbp(*metas, outs=out_metas, **extra, **dict(n.attrs))
            if sig_fits(s, in_metas, out_metas)]  # type: ignore[arg-type]
    sigs += zigzag_twins(opdef, sigs, current.ins, in_metas, out_metas, dict(n.attrs))  # the traced choice's zigzag
    per_axis = []
    for axis, size in enumerate(placement.hierarchy):
        if size == 1 or (free_axis is not None and axis != free_axis):
            per_axis.append([Sig(tuple(s[axis] for s in current.ins), tuple(s[axis] for s in current.outs))])
        else:
            per_axis.append(sigs)
    out = []
    for combo in itertools.product(*per_axis):
        ins = tuple(tuple(sig.ins[i] for sig in combo) for i in range(len(n.inputs)))
        outs = tuple(tuple(sig.outs[j] for sig in combo) for j in range(len(n.outputs)))
        out.append(Candidate(ins, outs))
    return [c for c in dict.fromkeys(out) if not _rare_partial(c) and all(zigzag_valid(s) for s in c.ins + c.outs)]


def _rare_partial(c: Candidate) -> bool:
    """Partial max/min results only pay off where the traced (eager) choice made them: pruned otherwise."""
    return any(isinstance(s, Partial) and s.op != "sum" for sbp in c.ins + c.outs for s in sbp)


def _arg_metas(g: LogicalGraph, n: LNode) -> list[Any]:
    metas: list[Any] = []
    for how, v in n.args:
        if how == "t":
            val = g.values[n.inputs[v]]
            metas.append(Meta(val.shape, val.dtype))
        elif how == "k":
            metas.append(Scalar(int))
        elif how == "s":
            metas.append(Scalar(float))
        else:
            metas.append(Scalar(type(v)))
    return metas


# ----------------------------------------------------------------------------- costs


class _Costs:
    def __init__(self, g: LogicalGraph, model: boxing.CostModel, factors: tuple[Any, ...]) -> None:
        self.g, self.model, self.factors = g, model, factors
        self._boxing: dict[Any, float] = {}
        self._compute: dict[Any, float] = {}
        self._matrices: dict[Any, np.ndarray] = {}
        self._latency: dict[Any, float] = {}
        self._node_keys: dict[int, Any] = {}  # op node id -> what its compute cost depends on, besides the choice
        self._kept: dict[Any, int] = {}

    def boxing(self, vid: int, src: NdSbp, dst: NdSbp) -> float:
        if src == dst:
            return 0.0
        v = self.g.values[vid]
        key = (v.shape, v.dtype, v.placement, src, dst)
        cost = self._boxing.get(key)
        if cost is None:
            with boxing.target_factors(self.factors):
                seconds = transition_time(v.shape, v.dtype, Layout(v.placement, src), Layout(v.placement, dst),
                                          self.model)
            # a tiny tie-break, as the planner's: of equal times, moving nothing wins
            cost = self._boxing[key] = seconds + 1e-9
        return cost

    def synced(self, vid: int, src: NdSbp, dst: NdSbp) -> tuple[float, float]:
        """A gradient's all-reduce ``src -> dst`` (:func:`gradient_all_reduce`) as graph.bucket sends it: (its
        time on the communication stream, the time its bucket's copies take on the compute stream).

        A gradient of at least ``solo_bytes`` goes out alone: the planner's time. A smaller one shares a bucket
        with others (DDP's 1 MiB first, then bigger), so it pays a latency only in proportion to its share of a
        first bucket's bytes, plus its copies into and out of the flat buffer (each a read and a write). Priced
        per tensor, a data-parallel step's dozens of small gradients (biases, norms) each paid a whole latency, and
        the selection computed weight gradients whole on every rank to avoid them.
        """

        v = self.g.values[vid]
        seconds = self.boxing(vid, src, dst)
        nbytes = _numel(v.shape) * _itemsize(v)
        if nbytes >= solo_bytes(self.model, v.placement):
            return seconds, 0.0
        key = (v.dtype, v.placement, src, dst)
        latency = self._latency.get(key)
        if latency is None:
            with boxing.target_factors(self.factors):
                latency = self._latency[key] = transition_time((1,), v.dtype, Layout(v.placement, src),
                                                               Layout(v.placement, dst), self.model)
        # a tensor of at least a first bucket's bytes fills a bucket by itself: it pays the whole latency
        return seconds - latency * max(0.0, 1 - nbytes / FIRST_BUCKET), 4 * nbytes * MEM_SECONDS_PER_BYTE

    def synced_matrix(self, vid: int, srcs: tuple[NdSbp, ...], dsts: tuple[NdSbp, ...],
                      scatter: bool) -> tuple[np.ndarray, np.ndarray]:
        """For each pair of ``srcs`` x ``dsts`` that is a gradient all-reduce, :meth:`synced`'s two times; for a
        gradient reduce-scatter (where ``scatter``), its time and no copies; zeros elsewhere. Two arrays of shape
        (len(srcs), len(dsts))."""
        v = self.g.values[vid]
        key = ("synced", v.shape, v.dtype, v.placement, srcs, dsts, scatter)
        found = self._matrices.get(key)
        if found is None:
            pairs = [[self.synced(vid, s, t) if gradient_all_reduce(s, t) else
                      (self.boxing(vid, s, t), 0.0) if scatter and gradient_reduce_scatter(s, t) else (0.0, 0.0)
                      for t in dsts]
                     for s in srcs]
            found = self._matrices[key] = np.array(pairs).transpose(2, 0, 1)
        return found[0], found[1]

    def matrix(self, vid: int, srcs: tuple[NdSbp, ...], dsts: tuple[NdSbp, ...]) -> np.ndarray:
        """Boxing times of value ``vid`` from each of ``srcs`` to each of ``dsts``, shape (len(srcs), len(dsts));
        cached by the value's metadata, as repeated layers ask for the same matrices."""
        v = self.g.values[vid]
        key = (v.shape, v.dtype, v.placement, srcs, dsts)
        found = self._matrices.get(key)
        if found is None:
            found = self._matrices[key] = np.array([[self.boxing(vid, s, t) for t in dsts] for s in srcs])
        return found

    def compute(self, n: LNode, c: Candidate) -> float:
        node_key = self._node_keys.get(n.id)
        if node_key is None:
            node_key = self._node_keys[n.id] = (
                n.name, tuple(self.g.values[v].shape for v in n.inputs + n.outputs),
                tuple(self.g.values[v].dtype for v in n.inputs + n.outputs), _placement_of(self.g, n))
        key = (node_key, c)
        seconds = self._compute.get(key)
        if seconds is None:
            seconds = self._compute[key] = self._compute_uncached(n, c)
        return seconds

    def _compute_uncached(self, n: LNode, c: Candidate) -> float:
        nbytes = 0
        local_in = []
        for vid, sbp in zip(n.inputs, c.ins, strict=True):
            shape = self._local(vid, sbp)
            local_in.append(shape)
            nbytes += _numel(shape) * _itemsize(self.g.values[vid])
        out_numel = 0
        for vid, sbp in zip(n.outputs, c.outs, strict=True):
            shape = self._local(vid, sbp)
            out_numel += _numel(shape)
            nbytes += _numel(shape) * _itemsize(self.g.values[vid])
        # a roofline: an op streams its bytes or does its FLOPs, whichever takes longer (a matmul reads its weight
        # while it multiplies)
        logical_in = [self.g.values[vid].shape for vid in n.inputs]
        work = flops(n.name, local_in, out_numel, logical_in)
        return max(nbytes * MEM_SECONDS_PER_BYTE, work * SECONDS_PER_FLOP) + self._talk(n, c)

    def _talk(self, n: LNode, c: Candidate) -> float:
        """The α-β time of the messages a communicating kernel sends under ``c`` (ring attention's K/V hops)."""
        op = REGISTRY.get(n.name)
        if op is None or op.talks is None:
            return 0.0
        placement = _placement_of(self.g, n)
        metas = tuple(Meta(self.g.values[v].shape, self.g.values[v].dtype) for v in n.inputs)
        messages, nbytes = op.talks(metas, c.ins, placement)
        link = self.model.link(placement.type, tuple(placement.flat_ranks))
        return messages * link.alpha + nbytes * link.beta

    def kept(self, n: LNode, c: Candidate, outputs: tuple[int, ...]) -> int:
        """Bytes per rank of op node ``n``'s ``outputs`` (indices) in the layouts candidate ``c`` gives them."""
        key = (n.id, c, outputs)
        nbytes = self._kept.get(key)
        if nbytes is None:
            nbytes = self._kept[key] = sum(_numel(self._local(n.outputs[j], c.outs[j])) * _itemsize(
                self.g.values[n.outputs[j]]) for j in outputs)
        return nbytes

    def _local(self, vid: int, sbp: NdSbp) -> tuple[int, ...]:
        v = self.g.values[vid]
        return shard_shape(v.shape, v.placement, sbp, v.placement.flat_ranks[0])


def solo_bytes(model: boxing.CostModel, placement: Any) -> int:
    """The bytes from which graph.bucket sends a gradient on ``placement`` alone (its ``solo_bytes``, which takes
    the all-reduce's plan node): where copying it into a bucket would take longer than a collective's latency."""
    return int(model.link(placement.type, tuple(placement.flat_ranks)).alpha / MEM_SECONDS_PER_BYTE)


def flops(name: str, local_in: Sequence[tuple[int, ...]], out_numel: int,
          logical_in: Sequence[tuple[int, ...]] = ()) -> int:
    """Multiply-adds x 2 of op ``name`` on local shards (``local_in``: its inputs' local shapes, ``out_numel``: its
    outputs' local elements, ``logical_in``: their logical shapes, for attention's key count: a ring's query
    rows meet every key), for the ops whose FLOPs outweigh their bytes; 0 for every other op.

    A shard that splits a contracted dim (row-parallel, or the batch of a weight gradient) does its share of
    the work, a replicated one all of it: so a plan that computes a weight gradient whole on every rank pays
    for it, as one that sums halves and all-reduces pays for the all-reduce.
    """
    if not local_in or not local_in[0]:
        return 0
    if name in MATMUL_OPS:  # (..., k) @ (k, n) -> (..., n); linear: (..., in) x (out, in) -> (..., out)
        return 2 * out_numel * local_in[0][-1]
    if name == "linear_weight_grad":  # dy (..., out), x (..., in) -> (out, in): contracts the batch dims
        rows = _numel(local_in[0][:-1])
        return 2 * out_numel * rows
    if name in ("scaled_dot_product_attention", "sdpa_backward") and len(local_in) >= 3:
        q, k = local_in[0 if name == "scaled_dot_product_attention" else 1], \
            local_in[1 if name == "scaled_dot_product_attention" else 2]
        if len(q) < 2 or len(k) < 2:
            return 0
        k_at = 1 if name == "scaled_dot_product_attention" else 2
        keys = logical_in[k_at][-2] if len(logical_in) > k_at else k[-2]  # a ring's rows meet every key
        forward = 4 * _numel(q) * keys  # q k^T and p v: (..., T, d) x (..., S, d), 2 FLOPs a multiply-add
        return forward if name == "scaled_dot_product_attention" else 2 * forward + forward // 2
    return 0


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(v: Any) -> int:
    return _dtype_size(v.dtype) if _numel(v.shape) else 4


@functools.lru_cache(maxsize=64)
def _dtype_size(dtype: Any) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- the program


class _Problem:
    """Choices per node and the edges between them, in terms of output/required SBPs.

    ``classes`` ties op nodes together (:mod:`.repeat`): a class's nodes share one candidate list and, in the
    integer program, one set of variables. Their candidate lists are equal because a class's nodes agree on
    everything that decides them (:func:`signature_key` and the current choice).
    """

    def __init__(self, g: LogicalGraph, costs: _Costs, current: dict[int, Candidate], free_axis: int | None,
                 classes: dict[int, int], like: _Problem | None = None) -> None:
        self.g, self.costs, self.classes = g, costs, classes
        self.choices: dict[int, list[Candidate]] = {}  # op node id -> candidates (one list per class)
        self.current: dict[int, int] = {}  # op node id -> index of the current candidate
        self._options: dict[Any, tuple[tuple[NdSbp, ...], np.ndarray]] = {}  # per class and port (see in_options)
        for n in g.nodes:
            if n.kind != "op":
                continue
            rep = classes[n.id]
            if rep == n.id:
                cands = candidates(g, n, current[n.id], free_axis)
                if current[n.id] not in cands:
                    cands.append(current[n.id])
                self.choices[n.id] = cands
                self.current[n.id] = cands.index(current[n.id])
            else:
                self.choices[n.id] = self.choices[rep]
                self.current[n.id] = self.current[rep]
        self.alias: dict[int, int] = {}  # value id -> the value whose SBP it shares (accumulate/pack outputs)
        self.size: dict[int, int] = {}  # class -> how many nodes it ties
        self.backward: dict[int, int] = {}  # class -> how many of its nodes run in backward
        self.groups: list[Group] = []
        self.reads: list[Read] = []
        self.kept: dict[int, tuple[int, ...]] = {}  # op node id -> its outputs kept for backward
        if like is not None:  # these do not depend on the choices: share them
            self.alias, self.size, self.backward, self.reads = like.alias, like.size, like.backward, like.reads
            self.kept = like.kept
        else:
            for n in g.nodes:
                if n.kind in ("accumulate", "pack"):
                    self.alias[n.outputs[0]] = self.root(n.inputs[0])
            for rep in classes.values():
                self.size[rep] = self.size.get(rep, 0) + 1
            for nid in backward_nodes(g):
                self.backward[classes[nid]] = self.backward.get(classes[nid], 0) + 1
            self.reads = self._reads()
            self.kept = kept_for_backward(g)
        self.groups = self._edge_groups()

    def root(self, vid: int) -> int:
        while vid in self.alias:
            vid = self.alias[vid]
        return vid

    def out_options(self, vid: int) -> tuple[tuple[NdSbp, ...], np.ndarray]:
        """The SBPs value ``vid`` may have, and for each candidate of its producer the one it gives (none when
        the producer is fixed)."""
        vid = self.root(vid)
        v = self.g.values[vid]
        producer = self.g.nodes[v.producer]
        if producer.kind != "op":
            return (v.sbp,), np.zeros(0, dtype=np.int64)
        key = ("out", self.classes[producer.id], v.index)
        found = self._options.get(key)
        if found is None:
            found = self._options[key] = _options([c.outs[v.index] for c in self.choices[producer.id]])
        return found

    def in_options(self, n: LNode, i: int) -> tuple[tuple[NdSbp, ...], np.ndarray]:
        """The SBPs input ``i`` of ``n`` may require, and for each candidate of ``n`` the one it requires."""
        if n.kind != "op":
            return (n.in_sbps[i] if n.in_sbps else self.g.values[n.outputs[0]].sbp,), np.zeros(0, dtype=np.int64)
        key = ("in", self.classes[n.id], i)
        found = self._options.get(key)
        if found is None:
            found = self._options[key] = _options([c.ins[i] for c in self.choices[n.id]])
        return found

    def _reads(self) -> list[Read]:
        """Every read that may need boxing, with what does not depend on the choices: (value id, consumer, input
        index, the producer's class and output or its fixed SBP, the value's metadata, whether it is a gradient's
        read by the optimizer)."""
        out = []
        late = late_readers(self.g)
        for n in self.g.nodes:
            if n.kind not in ("op", "to_global", "assign", "output"):
                continue
            for i, vid in enumerate(n.inputs):
                root = self.g.values[self.root(vid)]
                producer = self.g.nodes[root.producer]
                src = ("op", self.classes[producer.id], root.index) if producer.kind == "op" else ("fixed", root.sbp)
                sync = n.id in late and producer.phase == "micro"
                out.append((vid, n, i, src, (root.shape, root.dtype, root.placement), sync))
        return out

    def _edge_groups(self) -> list[Group]:
        """Every read that may need boxing, merged where tied nodes make reads cost alike: (count, value id,
        consumer, input index, producer class, consumer class, whether it is a gradient's read by the optimizer),
        a class None where that end is fixed.

        Reads cost alike when they agree on the value's metadata, the producer's class and output, and the
        consumer's class and what each of its candidates requires of the input: so the many like inputs of one
        fused node (an optimizer's update of every gradient) merge as well as the reads of repeated layers.
        """
        groups: dict[Any, list[Any]] = {}
        for vid, n, i, src, meta, sync in self.reads:
            if n.kind == "op":
                sbps, of = self.in_options(n, i)
                dst: tuple[Any, ...] = ("op", self.classes[n.id], sbps, of.tobytes())
            else:
                dst = ("fixed", self.in_options(n, i)[0][0])
            key = (src, dst, meta, sync)
            found = groups.get(key)
            if found is None:
                groups[key] = [1, vid, n, i, src[1] if src[0] == "op" else None, dst[1] if dst[0] == "op" else None,
                               sync]
            else:
                found[0] += 1
        return [tuple(v) for v in groups.values()]  # type: ignore[misc]

    def cost_of(self, choice: dict[int, int]) -> float:
        """The estimated time of ``choice`` (op node id -> candidate index; tied nodes choose alike): compute, plus
        boxing, where gradient all-reduces cost what :data:`HIDDEN_SHARE` of backward's compute does not cover."""
        total = hidden = cover = 0.0
        for rep, size in self.size.items():
            seconds = self.costs.compute(self.g.nodes[rep], self.choices[rep][choice[rep]])
            total += size * seconds
            cover += HIDDEN_SHARE * self.backward.get(rep, 0) * seconds
        for count, vid, n, i, _, _, sync in self.groups:
            src = self._sbp_out(vid, choice)
            dst = self.choices[n.id][choice[n.id]].ins[i] if n.kind == "op" else self.in_options(n, i)[0][0]
            if sync and gradient_all_reduce(src, dst):
                comm, copies = self.costs.synced(self.root(vid), src, dst)
                hidden += count * comm
                total += count * copies
            elif sync and n.kind != "op" and gradient_reduce_scatter(src, dst):
                hidden += count * self.costs.boxing(self.root(vid), src, dst)
            else:
                total += count * self.costs.boxing(self.root(vid), src, dst)
        return total + max(0.0, hidden - cover) + KEPT_TIE * self.kept_bytes(choice)

    def kept_bytes(self, choice: dict[int, int]) -> int:
        """Bytes per rank that ``choice`` keeps from forward for backward (the activations of the peak)."""
        return sum(self.costs.kept(self.g.nodes[nid], self.choices[nid][choice[nid]], outs)
                   for nid, outs in self.kept.items())

    def _sbp_out(self, vid: int, choice: dict[int, int]) -> NdSbp:
        vid = self.root(vid)
        v = self.g.values[vid]
        producer = self.g.nodes[v.producer]
        if producer.kind != "op":
            return v.sbp
        return self.choices[producer.id][choice[producer.id]].outs[v.index]


Group = tuple[int, int, LNode, int, int | None, int | None, bool]
Read = tuple[int, LNode, int, tuple[Any, ...], tuple[Any, ...], bool]


def backward_nodes(g: LogicalGraph) -> list[int]:
    """Op nodes of the forward-backward phase that come after the first implicit loss gradient: backward's."""
    seeds = {g.values[v].producer for v in g.grad_seeds}
    out: list[int] = []
    started = False
    for n in g.nodes:
        started = started or n.id in seeds
        if started and n.kind == "op" and n.phase == "micro":
            out.append(n.id)
    return out


def kept_for_backward(g: LogicalGraph) -> dict[int, tuple[int, ...]]:
    """Forward's op nodes -> the indices of their outputs that backward reads: what a step holds from the end of
    forward into backward (its activations), in the layout the node's choice gives them.

    A checkpointed segment's inner values are made again in backward (their clones are backward's nodes), so
    only the segment's inputs count. A value also boxed in forward to a layout backward reads shares that copy
    (lowering boxes once per phase), which is not counted: the layout the producer gives is the bytes a choice
    controls.
    """
    backward = set(backward_nodes(g))
    read_in_backward = {v for nid in backward for v in g.nodes[nid].inputs}
    kept = {}
    for n in g.nodes:
        if n.kind == "op" and n.phase == "micro" and n.id not in backward:
            outs = tuple(j for j, v in enumerate(n.outputs) if v in read_in_backward)
            if outs:
                kept[n.id] = outs
    return kept


def late_readers(g: LogicalGraph) -> set[int]:
    """Nodes whose reads wait for nothing but the end of backward: the post phase's (the optimizer's), and
    conversions (a gradient's ``to_global`` to its parameter's layout) whose results only the post phase reads."""
    readers: dict[int, list[str]] = {}
    for n in g.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n.phase)
    return {n.id for n in g.nodes
            if n.phase == "post" or (n.kind == "to_global" and n.outputs
                                     and all(p == "post" for p in readers.get(n.outputs[0], ["micro"])))}


def gradient_all_reduce(src: NdSbp, dst: NdSbp) -> bool:
    """Whether boxing ``src -> dst`` is one all-reduce of whole tensors (P(sum) -> B on one mesh axis, no split
    anywhere): what graph.bucket packs into buckets that go out during backward."""
    changed = [(a, b) for a, b in zip(src, dst, strict=True) if a != b]
    return (len(changed) == 1 and isinstance(changed[0][0], Partial) and changed[0][0].op == "sum"
            and changed[0][1] == broadcast and not any(isinstance(s, Split) for s in (*src, *dst)))


def gradient_reduce_scatter(src: NdSbp, dst: NdSbp) -> bool:
    """Whether boxing ``src -> dst`` is one reduce-scatter (P(sum) -> S on one mesh axis, B on the others): a
    ZeRO-2/3 or tensor-parallel gradient's conversion to its parameter's layout. Read by that conversion (a fixed
    layout, in backward's phase), lowering issues it right after backward makes the gradient, on the
    communication stream, so like an all-reduce it hides behind the rest of backward (not bucketed: whole). Read
    by an optimizer op that chose a split, it would be boxed in the post phase: that is priced as any boxing."""
    changed = [(a, b) for a, b in zip(src, dst, strict=True) if a != b]
    return (len(changed) == 1 and isinstance(changed[0][0], Partial) and changed[0][0].op == "sum"
            and isinstance(changed[0][1], Split) and all(a == broadcast for a, b in zip(src, dst, strict=True)
                                                         if a == b))


def _options(sbps: list[NdSbp]) -> tuple[tuple[NdSbp, ...], np.ndarray]:
    """Distinct SBPs in order of appearance, and the index of each given one among them."""
    distinct = tuple(dict.fromkeys(sbps))
    where = {sbp: j for j, sbp in enumerate(distinct)}
    return distinct, np.array([where[sbp] for sbp in sbps], dtype=np.int64)


def _solve_ilp(p: _Problem, time_limit: float, kept_cap: float = np.inf) -> tuple[dict[int, int] | None, int]:
    """One integer program over the classes' choices; returns every op node's candidate index.

    Columns: each class's choices, then each merged edge's ``e[s, t]`` (a block of a cost matrix, priced once
    per value metadata and option lists). Rows: one choice per class; each edge's marginals equal its ends'
    choices. An edge with a fixed end folds its cost into the other end's choice costs.

    Gradient all-reduces (:func:`gradient_all_reduce` on a gradient's read by the optimizer) are priced apart:
    their sum, less the cover that backward's compute gives (:data:`HIDDEN_SHARE`), bounds one more continuous
    column from below, which the objective pays instead (so it costs ``max(0, hidden - cover)``, as
    :meth:`_Problem.cost_of`).

    ``kept_cap``: one more row, the bytes per rank the choices keep for backward (:meth:`_Problem.kept_bytes`) at
    most this many.
    """
    first: dict[int, int] = {}  # class -> its first choice column
    choice_cost: list[float] = []
    cover: list[float] = []
    twins: list[Any] = []  # per choice column, what makes it a twin of another class's (see milp.neighbourhood)
    for rep in sorted(p.size):
        first[rep] = len(choice_cost)
        # backward's ops trade compute for the cover of gradient all-reduces: like ones are interchangeable there
        kind = signature_key(p.g, p.g.nodes[rep]) if p.backward.get(rep) else rep
        twins += [(kind, c) for c in p.choices[rep]]
        seconds = [p.costs.compute(p.g.nodes[rep], c) for c in p.choices[rep]]
        choice_cost += [p.size[rep] * t for t in seconds]
        cover += [HIDDEN_SHARE * p.backward.get(rep, 0) * t for t in seconds]
    kept = np.zeros(len(choice_cost))  # per choice column, the activation bytes its classes keep for backward
    for nid, outs in p.kept.items():
        rep = p.classes[nid]
        kept[first[rep]:first[rep] + len(p.choices[rep])] += [
            p.costs.kept(p.g.nodes[nid], c, outs) for c in p.choices[rep]]
    prog = milp.Program(np.array(choice_cost) + KEPT_TIE * kept, np.array(cover))
    for rep in sorted(p.size):
        k = len(p.choices[rep])
        prog.add_rows(np.zeros(k, dtype=np.int64), first[rep] + np.arange(k), np.ones(k), 1.0, 1.0)
    for count, vid, n, i, src, dst, sync in p.groups:
        out_sbps, out_of = p.out_options(vid)
        in_sbps, in_of = p.in_options(n, i)
        a, b = len(out_sbps), len(in_sbps)
        matrix = count * p.costs.matrix(p.root(vid), out_sbps, in_sbps)  # (a, b)
        hidden = np.zeros_like(matrix)
        if sync:  # gradient all-reduces as buckets send them (see _Costs.synced)
            comm, copies = p.costs.synced_matrix(p.root(vid), out_sbps, in_sbps, dst is None)
            mask = _late_mask(out_sbps, in_sbps, dst is None) > 0
            hidden = count * comm
            matrix = np.where(mask, hidden + count * copies, matrix)
        if a == 1 and b == 1:
            prog.hidden_constant += float(hidden[0, 0])  # both ends fixed: a constant cost (the rest is moot)
        elif b == 1:  # the consumer is fixed: the cost is linear in the producer's choice
            prog.choice_cost[first[src]:first[src] + len(out_of)] += matrix[out_of, 0]  # type: ignore[index]
            prog.choice_hidden[first[src]:first[src] + len(out_of)] += hidden[out_of, 0]  # type: ignore[index]
        elif a == 1:
            prog.choice_cost[first[dst]:first[dst] + len(in_of)] += matrix[0, in_of]  # type: ignore[index]
            prog.choice_hidden[first[dst]:first[dst] + len(in_of)] += hidden[0, in_of]  # type: ignore[index]
        else:
            prog.add_edge(matrix, hidden, first[src] + np.arange(len(out_of)), out_of,  # type: ignore[index]
                          first[dst] + np.arange(len(in_of)), in_of)  # type: ignore[index]
    if np.isfinite(kept_cap):
        used = np.flatnonzero(kept)
        if len(used):
            prog.add_rows(np.zeros(len(used), dtype=np.int64), used, kept[used], -np.inf, kept_cap)
    x = milp.solve(*prog.arrays(), milp.intern(twins), time_limit)
    if x is None:
        return None, prog.n_col
    picked = {rep: int(np.argmax(x[first[rep]:first[rep] + len(p.choices[rep])])) for rep in p.size}
    return {nid: picked[rep] for nid, rep in p.classes.items()}, prog.n_col


def _late_mask(srcs: tuple[NdSbp, ...], dsts: tuple[NdSbp, ...], scatter: bool) -> np.ndarray:
    """(len(srcs), len(dsts)) floats: 1 where boxing the pair is a gradient all-reduce, or (``scatter``) a
    gradient reduce-scatter, else 0."""
    return np.array([[float(gradient_all_reduce(s, t) or (scatter and gradient_reduce_scatter(s, t))) for t in dsts]
                     for s in srcs])


def select(g: LogicalGraph, model: boxing.CostModel, factors: tuple[Any, ...], method: str = "ilp",
           time_limit: float = 600.0, agree: Callable[[Any], Any] | None = None,
           activation_cap: int | str | None = None) -> Selection:
    """Chooses every op's signature; rewrites ``n.in_sbps`` and the output values' SBPs in place.

    ``method``: "ilp" ties structurally repeated nodes (:mod:`.repeat`: a 24-layer model costs about one
    layer's variables), "ilp-unmerged" gives every node its own variables (slower; it checks the merge), and
    "greedy" keeps the traced choice.

    On 1-D meshes one integer program covers every signature. On n-D meshes the full product of per-axis
    choices squares (or cubes) the program, so the search sweeps the mesh axes instead: each sweep solves
    one axis exactly with the others held, twice over the axes (data and tensor axes barely interact).
    Each accepted step lowers the estimated time, starting from the greedy choice, so the result is never
    worse than greedy. ``agree`` makes every process adopt one process's choice (a solver may break ties
    differently under load, and processes must run one plan).

    ``activation_cap`` bounds the memory the layouts decide: the bytes per rank of the activations forward keeps
    for backward (:func:`kept_for_backward`), at the layouts chosen. None: no bound; "traced": no more than the
    traced choice keeps (a replicated activation holds the whole batch on every rank, where the traced
    data-parallel one holds its share); an int: that many bytes. A choice above the bound is taken only when
    the current one is above it too and it keeps less.
    """
    if method not in METHODS:
        raise ValueError(f"SBP selection method must be one of {METHODS}, but got {method!r}")
    start = time.perf_counter()
    costs = _Costs(g, model, factors)
    current = {n.id: Candidate(tuple(n.in_sbps), tuple(g.values[v].sbp for v in n.outputs))
               for n in g.nodes if n.kind == "op"}
    if method == "ilp":
        classes = op_classes(g, lambda n: (signature_key(g, n), current[n.id]))
    else:
        classes = {nid: nid for nid in current}
    axes = sorted({axis for n in g.nodes if n.kind == "op"
                   for axis, size in enumerate(_placement_of(g, n).hierarchy) if size > 1})
    sweeps: list[int | None] = [None] if len(axes) <= 1 else [*axes, *axes]
    first = _Problem(g, costs, current, sweeps[0], classes)
    greedy_cost = best_cost = first.cost_of(first.current)
    traced_kept = kept = first.kept_bytes(first.current)
    cap = _kept_cap(activation_cap, traced_kept)
    method_used, n_var = "greedy", 0
    if method != "greedy" and current:
        method_used = "ilp (greedy was as good)"
        settled: set[int | None] = set()  # sweeps solved since the last accepted change: solving again is moot
        for free in sweeps:
            if free in settled:
                continue
            p = first if free == sweeps[0] and _built_around(first, current) else \
                _Problem(g, costs, current, free, classes, like=first)
            solved, size = _solve_ilp(p, time_limit, max(cap, kept))
            n_var = max(n_var, size)
            settled.add(free)
            if solved is None:
                continue
            cost, solved_kept = p.cost_of(solved), p.kept_bytes(solved)
            fits = solved_kept <= cap or (kept > cap and solved_kept < kept)
            if fits and (cost < best_cost * (1 - MIN_GAIN) or kept > cap):
                current = {nid: p.choices[nid][k] for nid, k in solved.items()}
                best_cost, kept, method_used = cost, solved_kept, "ilp" if len(sweeps) == 1 else "ilp per mesh axis"
                settled = {free}
    if agree is not None:
        current = agree(current)
    _apply(g, current)
    return Selection(greedy_cost, best_cost, method_used, time.perf_counter() - start, n_var,
                     len(set(classes.values())), kept, traced_kept)


def _kept_cap(activation_cap: int | str | None, traced: int) -> float:
    """:func:`select`'s ``activation_cap`` as bytes (inf: no bound)."""
    if activation_cap is None:
        return np.inf
    if activation_cap == "traced":
        return float(traced)
    if isinstance(activation_cap, int) and not isinstance(activation_cap, bool) and activation_cap >= 0:
        return float(activation_cap)
    raise ValueError(f"activation_cap must be None, 'traced' or a number of bytes >= 0, but got {activation_cap!r}")


def _built_around(p: _Problem, current: dict[int, Candidate]) -> bool:
    """Whether ``p`` was built around ``current`` (so it can be solved without rebuilding)."""
    return all(p.choices[nid][k] == current[nid] for nid, k in p.current.items())


def _apply(g: LogicalGraph, chosen: dict[int, Candidate]) -> None:
    for nid, c in chosen.items():
        n = g.nodes[nid]
        n.in_sbps = c.ins
        for vid, sbp in zip(n.outputs, c.outs, strict=True):
            g.values[vid].sbp = sbp
    for n in g.nodes:  # accumulate/pack results share their input's SBP
        if n.kind in ("accumulate", "pack"):
            g.values[n.outputs[0]].sbp = g.values[n.inputs[0]].sbp
