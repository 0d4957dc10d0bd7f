"""SBP selection for the whole graph: an integer program over every op's signature (HiGHS, through highspy).

Each op node ``v`` picks one n-D signature ``k`` from its candidates (``x[v,k]`` binary, one per node).
Fixed nodes (inputs, variables, constants, explicit ``to_global``) have their layout. For each edge
from a value to a consumer's input, the producer's output SBP ``s`` and the consumer's required SBP
``t`` cost the boxing planner's α-β time ``C[s,t]``: edge variables ``e[s,t] >= 0`` whose marginals are
the producer's and the consumer's choices (with one-hot choices the coupling is exact, so ``e`` can be
continuous). Ops cost their local compute (a roofline: bytes moved through memory, or FLOPs for matmuls and
attention where those take longer), so a replicated signature pays for doing everything everywhere: a weight
gradient computed whole on every rank as much as one summed from halves and all-reduced. Gradient all-reduces
(P(sum) -> B of whole tensors, read by the optimizer) go out in buckets during backward (graph.bucket), so small
ones share a bucket's latency, and together they cost only what backward's compute does not cover. The
objective is the step's estimated time.

The eager, greedy choice (made while tracing, op by op in program order) is the baseline: its cost is
evaluated in the same model, and the solver's result is kept only when it is not worse.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import boxing
from .._layout import shard_shape
from ..boxing import Layout
from ..boxing.plan import transition_time
from ..ops.registry import REGISTRY, Meta, Scalar, Sig, _sig_fits
from ..sbp import NdSbp, Partial, Split, broadcast
from .ir import LNode, LogicalGraph
from .repeat import op_classes

MEM_SECONDS_PER_BYTE = 1 / 20e9  # local compute: bytes through memory (a CPU core's stream bandwidth)
SECONDS_PER_FLOP = 1 / 50e9  # matmul throughput
# ops whose time is their FLOPs (a linear's input and weight gradients, attention), see :func:`flops`
MATMUL_OPS = ("matmul", "linear", "bmm", "matmul_nd")
METHODS = ("ilp", "ilp-unmerged", "greedy")
# Gradient all-reduces (P(sum) -> B of whole tensors, read by the optimizer) go out in buckets on the
# communication stream while backward goes on (graph.bucket): they cost only what backward's compute cannot
# cover. Only this share of backward's compute counts as cover: the last bucket goes out after backward ends,
# and on CPUs a collective takes cycles from the compute thread.
HIDDEN_SHARE = 0.5
MIN_GAIN = 1e-5  # a sweep's plan is taken when it saves this fraction of the step's time: less is noise and ties
NODE_LIMIT = 5000  # branch-and-bound nodes; the greedy baseline stands if no better solution is proven by then


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
            if _sig_fits(s, in_metas, out_metas)]  # type: ignore[arg-type]
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
    return [c for c in dict.fromkeys(out) if not _rare_partial(c)]


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
        from .bucket import FIRST_BUCKET  # bucket.py imports this module

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

    def synced_matrix(self, vid: int, srcs: tuple[NdSbp, ...], dsts: tuple[NdSbp, ...]) -> tuple[np.ndarray,
                                                                                                  np.ndarray]:
        """For each pair of ``srcs`` x ``dsts`` that is a gradient all-reduce, :meth:`synced`'s two times; zeros
        elsewhere. Two arrays of shape (len(srcs), len(dsts))."""
        v = self.g.values[vid]
        key = ("synced", v.shape, v.dtype, v.placement, srcs, dsts)
        found = self._matrices.get(key)
        if found is None:
            pairs = [[self.synced(vid, s, t) if gradient_all_reduce(s, t) else (0.0, 0.0) for t in dsts]
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
        return max(nbytes * MEM_SECONDS_PER_BYTE, flops(n.name, local_in, out_numel) * SECONDS_PER_FLOP)

    def _local(self, vid: int, sbp: NdSbp) -> tuple[int, ...]:
        v = self.g.values[vid]
        return shard_shape(v.shape, v.placement, sbp, v.placement.flat_ranks[0])


def solo_bytes(model: boxing.CostModel, placement: Any) -> int:
    """The bytes from which graph.bucket sends a gradient on ``placement`` alone (its ``solo_bytes``, which takes
    the all-reduce's plan node): where copying it into a bucket would take longer than a collective's latency."""
    return int(model.link(placement.type, tuple(placement.flat_ranks)).alpha / MEM_SECONDS_PER_BYTE)


def flops(name: str, local_in: Sequence[tuple[int, ...]], out_numel: int) -> int:
    """Multiply-adds x 2 of op ``name`` on local shards (``local_in``: its inputs' local shapes, ``out_numel``: its
    outputs' local elements), for the ops whose FLOPs outweigh their bytes; 0 for every other op.

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
        forward = 4 * _numel(q) * k[-2]  # q k^T and p v: (..., T, d) x (..., S, d), 2 FLOPs a multiply-add
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
        if like is not None:  # these do not depend on the choices: share them
            self.alias, self.size, self.backward, self.reads = like.alias, like.size, like.backward, like.reads
        else:
            for n in g.nodes:
                if n.kind in ("accumulate", "pack"):
                    self.alias[n.outputs[0]] = self.root(n.inputs[0])
            for rep in classes.values():
                self.size[rep] = self.size.get(rep, 0) + 1
            for nid in backward_nodes(g):
                self.backward[classes[nid]] = self.backward.get(classes[nid], 0) + 1
            self.reads = self._reads()
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
            else:
                total += count * self.costs.boxing(self.root(vid), src, dst)
        return total + max(0.0, hidden - cover)

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


def _options(sbps: list[NdSbp]) -> tuple[tuple[NdSbp, ...], np.ndarray]:
    """Distinct SBPs in order of appearance, and the index of each given one among them."""
    distinct = tuple(dict.fromkeys(sbps))
    where = {sbp: j for j, sbp in enumerate(distinct)}
    return distinct, np.array([where[sbp] for sbp in sbps], dtype=np.int64)


def _solve_ilp(p: _Problem, time_limit: float) -> tuple[dict[int, int] | None, int]:
    """One integer program over the classes' choices; returns every op node's candidate index.

    Columns: each class's choices, then each merged edge's ``e[s, t]`` (a block of a cost matrix, priced once
    per value metadata and option lists). Rows: one choice per class; each edge's marginals equal its ends'
    choices. An edge with a fixed end folds its cost into the other end's choice costs.

    Gradient all-reduces (:func:`gradient_all_reduce` on a gradient's read by the optimizer) are priced apart:
    their sum, less the cover that backward's compute gives (:data:`HIDDEN_SHARE`), bounds one more continuous
    column from below, which the objective pays instead (so it costs ``max(0, hidden - cover)``, as
    :meth:`_Problem.cost_of`).
    """
    first: dict[int, int] = {}  # class -> its first choice column
    choice_cost: list[float] = []
    cover: list[float] = []
    twins: list[Any] = []  # per choice column, what makes it a twin of another class's (see _neighbourhood)
    for rep in sorted(p.size):
        first[rep] = len(choice_cost)
        # backward's ops trade compute for the cover of gradient all-reduces: like ones are interchangeable there
        kind = signature_key(p.g, p.g.nodes[rep]) if p.backward.get(rep) else rep
        twins += [(kind, c) for c in p.choices[rep]]
        seconds = [p.costs.compute(p.g.nodes[rep], c) for c in p.choices[rep]]
        choice_cost += [p.size[rep] * t for t in seconds]
        cover += [HIDDEN_SHARE * p.backward.get(rep, 0) * t for t in seconds]
    prog = _Program(np.array(choice_cost), np.array(cover))
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
            comm, copies = p.costs.synced_matrix(p.root(vid), out_sbps, in_sbps)
            mask = _all_reduce_mask(out_sbps, in_sbps) > 0
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
    x = _highs(*prog.arrays(), _intern(twins), time_limit)
    if x is None:
        return None, prog.n_col
    picked = {rep: int(np.argmax(x[first[rep]:first[rep] + len(p.choices[rep])])) for rep in p.size}
    return {nid: picked[rep] for nid, rep in p.classes.items()}, prog.n_col


def _intern(keys: list[Any]) -> np.ndarray:
    """Each key -> a small int, equal keys equal ints."""
    table: dict[Any, int] = {}
    return np.array([table.setdefault(k, len(table)) for k in keys], dtype=np.int64)


def _all_reduce_mask(srcs: tuple[NdSbp, ...], dsts: tuple[NdSbp, ...]) -> np.ndarray:
    """(len(srcs), len(dsts)) floats: 1 where boxing the pair is a gradient all-reduce, else 0."""
    return np.array([[float(gradient_all_reduce(s, t)) for t in dsts] for s in srcs])


class _Program:
    """An integer program in the making: choice columns first (binary), then edge columns (continuous), then,
    where gradient all-reduces may hide behind backward, the column of their uncovered time.

    ``*_hidden`` is the part of a column's cost that is gradient all-reduces (also in ``*_cost``), ``cover``
    what each choice column gives to cover them."""

    def __init__(self, choice_cost: np.ndarray, cover: np.ndarray) -> None:
        self.choice_cost = choice_cost
        self.choice_hidden = np.zeros_like(choice_cost)
        self.cover = cover
        self.hidden_constant = 0.0
        self.edge_cost: list[np.ndarray] = []
        self.edge_hidden: list[np.ndarray] = []
        self.n_col = len(choice_cost)
        self.n_row = 0
        self.entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, columns, values)
        self.bounds: list[tuple[int, float, float]] = []  # (rows, lower, upper), in order

    def add_rows(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, lower: float, upper: float) -> None:
        """Rows ``self.n_row + rows``, all with the same bounds."""
        n = int(rows.max()) + 1
        self.entries.append((self.n_row + rows, cols, vals))
        self.bounds.append((n, lower, upper))
        self.n_row += n

    def add_edge(self, matrix: np.ndarray, hidden: np.ndarray, src_cols: np.ndarray, src_option: np.ndarray,
                 dst_cols: np.ndarray, dst_option: np.ndarray) -> None:
        """Columns ``e[s, t]`` costing ``matrix`` (``hidden`` of it gradient all-reduces); rows: sum over t of
        ``e[s, t]`` = the producer's choices that give ``s`` (``src_option[k]``: the option choice ``k`` gives),
        and alike for the consumer."""
        a, b = matrix.shape
        e = self.n_col + np.arange(a * b)
        self.edge_cost.append(matrix.ravel())
        self.edge_hidden.append(hidden.ravel())
        self.n_col += a * b
        rows = np.concatenate([np.repeat(np.arange(a), b), a + np.tile(np.arange(b), a), src_option, a + dst_option])
        cols = np.concatenate([e, e, src_cols, dst_cols])
        vals = np.concatenate([np.ones(2 * a * b), -np.ones(len(src_cols) + len(dst_cols))])
        self.add_rows(rows, cols, vals, 0.0, 0.0)

    def arrays(self) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray, np.ndarray,
                              np.ndarray, int]:
        """(costs, matrix by columns, row lower bounds, row upper bounds, column upper bounds, number of binary
        columns)."""
        cost = np.concatenate([self.choice_cost, *self.edge_cost])
        hidden = np.concatenate([self.choice_hidden, *self.edge_hidden])
        upper = np.ones(self.n_col)
        if hidden.any():  # z >= hidden @ x - cover @ x + constant, z >= 0; the objective pays z, not hidden
            z = self.n_col
            cover = np.concatenate([self.cover, np.zeros(self.n_col - len(self.cover))])
            used = np.flatnonzero((hidden != 0) | (cover != 0))
            self.add_rows(np.zeros(len(used) + 1, dtype=np.int64), np.append(used, z),
                          np.append(cover[used] - hidden[used], 1.0), self.hidden_constant, np.inf)
            cost = np.append(cost - hidden, 1.0)
            upper = np.append(upper, np.inf)
            self.n_col += 1
        rows, cols, vals = (np.concatenate(part) for part in zip(*self.entries, strict=True))
        lo = np.concatenate([np.full(n, lower) for n, lower, _ in self.bounds])
        hi = np.concatenate([np.full(n, upper) for n, _, upper in self.bounds])
        return cost, _columnwise(rows, cols, vals, self.n_col), lo, hi, upper, len(self.choice_cost)


def _columnwise(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray,
                n_col: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, column, value) entries -> compressed columns (start, index, value), as HiGHS takes a matrix."""
    order = np.argsort(cols, kind="stable")
    start = np.searchsorted(cols[order], np.arange(n_col + 1))
    return start, rows[order], vals[order]


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """File descriptor 1 pointed at /dev/null for a while: what C++ code writes to stdout is dropped."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _highs(cost: np.ndarray, matrix: tuple[np.ndarray, np.ndarray, np.ndarray], lo: np.ndarray, hi: np.ndarray,
           upper: np.ndarray, n_choice: int, twins: np.ndarray, time_limit: float) -> np.ndarray | None:
    """Minimises ``cost @ x`` over ``lo <= matrix @ x <= hi`` (``matrix`` by columns) and ``0 <= x <= upper``,
    the first ``n_choice`` columns binary; returns x, or None when no solution was found.

    The relaxation is solved first: one-hot choices with marginal-coupled edges make it integral as a rule, and
    then it is the answer. The column of uncovered gradient all-reduces couples every choice; where it binds
    (the all-reduces just covered) the relaxation mixes two plans, and an integer program over the mixed choices
    and their twins (``twins``: an id per choice column, see :func:`_neighbourhood`) picks among them. Only when
    that finds nothing does the branch and bound cover the whole program.
    """
    import highspy

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), len(lo)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(len(cost)), upper
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = matrix
    with _stdout_silenced():  # HiGHS's constructor prints its banner from C++, before any option can stop it
        solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    # a node limit, not a time limit: the result must not depend on how busy the machine is, since every
    # process compiles its own copy of the plan and all must agree
    solver.setOptionValue("mip_max_nodes", NODE_LIMIT)
    solver.setOptionValue("time_limit", float(time_limit))
    solver.passModel(lp)
    solver.run()
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n_choice + \
        [highspy.HighsVarType.kContinuous] * (len(cost) - n_choice)
    if solver.getModelStatus() == highspy.HighsModelStatus.kOptimal:
        x = np.array(solver.getSolution().col_value)
        whole = np.minimum(x[:n_choice], 1 - x[:n_choice]) <= 1e-7
        if whole.all():
            return x
        found = _neighbourhood(solver, lp, x, np.flatnonzero(~np.isin(twins, twins[~whole])))
        if found is not None:
            return found
        lp.col_lower_, lp.col_upper_ = np.zeros(len(cost)), upper
    # the MIP presolve costs more than it saves on the whole program (24-layer dp2 x tp2 GPT: 3.8 s of selection
    # with it, 2.3 s without, the same plan)
    solver.setOptionValue("presolve", "off")
    solver.passModel(lp)
    solver.run()
    if not solver.getSolution().value_valid:
        return None
    return np.array(solver.getSolution().col_value)


def _neighbourhood(solver: Any, lp: Any, x: np.ndarray, fixed: np.ndarray) -> np.ndarray | None:
    """The integer program ``lp`` with the choice columns ``fixed`` held at their values in the relaxation's
    solution ``x``; its solution, or None where it has none.

    This is RENS (relaxation-induced neighbourhood search) widened by twins. Where the coupling column binds,
    the relaxation mixes a plan whose all-reduces are not covered with one that covers them by doing more of
    backward's work on every rank (a weight gradient computed whole rather than summed from halves); the
    optimum trades a few such choices against each other, like items of a knapsack. The free choices are the
    mixed ones and the same choices of their twins: backward's classes of the same op on the same shapes
    (another layer's or another projection's weight gradient), which the relaxation could have mixed instead.

    Why not the branch and bound over the whole program: it spends its time at the root (cuts, heuristics,
    strong branching), about 0.9 s a solve for a 24-layer GPT, although it ends within a few nodes. This program
    has a few dozen free choices, and HiGHS's presolve removes the fixed rest: about 0.1 s. Where measured
    (tests/sim/test_graph_select.py; the compile benchmark's GPTs, 2 to 24 layers, before small gradients were
    priced as bucketed) it found the whole program's plan, or one within 0.01 % of its estimated time; without
    the twins, one 0.04 % dearer on the 12-layer dp=2 GPT.
    """
    lower, upper = np.array(lp.col_lower_, dtype=float), np.array(lp.col_upper_, dtype=float)
    lower[fixed] = upper[fixed] = np.round(x[fixed])
    lp.col_lower_, lp.col_upper_ = lower, upper
    solver.passModel(lp)
    solver.run()
    if not solver.getSolution().value_valid:
        return None
    return np.array(solver.getSolution().col_value)


def select(g: LogicalGraph, model: boxing.CostModel, factors: tuple[Any, ...], method: str = "ilp",
           time_limit: float = 600.0, agree: Callable[[Any], Any] | None = None) -> Selection:
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
    method_used, n_var = "greedy", 0
    if method != "greedy" and current:
        method_used = "ilp (greedy was as good)"
        settled: set[int | None] = set()  # sweeps solved since the last accepted change: solving again is moot
        for free in sweeps:
            if free in settled:
                continue
            p = first if free == sweeps[0] and _built_around(first, current) else \
                _Problem(g, costs, current, free, classes, like=first)
            solved, size = _solve_ilp(p, time_limit)
            n_var = max(n_var, size)
            settled.add(free)
            if solved is None:
                continue
            cost = p.cost_of(solved)
            if cost < best_cost * (1 - MIN_GAIN):
                current = {nid: p.choices[nid][k] for nid, k in solved.items()}
                best_cost, method_used = cost, "ilp" if len(sweeps) == 1 else "ilp per mesh axis"
                settled = {free}
    if agree is not None:
        current = agree(current)
    _apply(g, current)
    return Selection(greedy_cost, best_cost, method_used, time.perf_counter() - start, n_var,
                     len(set(classes.values())))


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
