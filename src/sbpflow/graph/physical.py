"""The physical plan: what the compiler hands to an executor. Pure data.

One SPMD/MPMD program: :class:`PNode` s in a valid sequential order, each run by ``node.ranks`` on their
local shards, reading and writing :class:`Buf` s (one logical tensor in one layout) held in registers.
``PNode.kind``, its phases, control edges and overwrites: the comments at :class:`PNode`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .._layout import shard_shape
from ..boxing import Layout, Plan
from ..sbp import Split, format_nd

KINDS = ("input", "variable", "unpack", "repeat", "compute", "boxing", "accumulate", "pack", "assign", "output",
         "route", "update")
PHASES = ("pre", "micro", "post")
COMPUTE_STREAM = "compute"
GATHERING = ("accumulate", "pack")  # kinds that take the m micro-batch values of their input and write one output


@dataclass(frozen=True)
class Buf:
    """One logical tensor in one layout."""

    id: int
    shape: tuple[int, ...]  # logical (global) shape
    dtype: torch.dtype
    layout: Layout

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return shard_shape(self.shape, self.layout.placement, self.layout.sbp, rank)

    def nbytes(self, rank: int) -> int:
        n = 1
        for d in self.local_shape(rank):
            n *= d
        return n * _itemsize(self.dtype)

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"%{self.id}: {list(self.shape)} {dtype} {self.layout.placement} {format_nd(self.layout.sbp)}"


@dataclass(frozen=True)
class Register:
    """Where a buffer's values live between producer and consumers: ``register_num`` slots of
    ``bytes_per_rank`` each, read by ``consumers``."""

    buf: int
    register_num: int
    bytes_per_rank: tuple[tuple[int, int], ...]  # (rank, bytes of one slot on that rank)
    consumers: tuple[int, ...]  # node ids reading it

    def bytes_on(self, rank: int) -> int:
        for r, n in self.bytes_per_rank:
            if r == rank:
                return n
        return 0


# Node kinds (PNode.kind) and what an executor does with them:
#
#     kind        inputs -> outputs   action (per owned rank r of node.ranks)
#     input       ()     -> (b,)      the step's feed ``feeds[node.name]`` (already in b's layout)
#     variable    ()     -> (b,)      the variable ``variables[node.name]``'s current shards (no copy)
#     unpack      (a,)   -> (b,)      micro-batch k: local chunk k of a's shard along dim 0 (m chunks)
#     repeat      (a,)   -> (b,)      the same value for every micro-batch
#     compute     (...)  -> (...)     REGISTRY[op].kernel(*args, **attrs) on local shards
#     boxing      (a,)   -> (b,)      boxing.execute(node.boxing, shards): one planner step, a collective
#                                     on node.stream's process group, or a local slice/pad/zero
#     accumulate  (a..)  -> (b..)     sum of each a_i over the m micro-batches into b_i (gradients): one running
#                                     sum per input, a copy of micro-batch 0 then one torch._foreach_add_ per
#                                     micro-batch (several inputs: the gradients of one schedule act, graph.group)
#     pack        (a,)   -> (b,)      the m micro-batch values combined: mean (0-d losses) or cat on dim 0
#     assign      (a,)   -> ()        on success of the whole step: copy a into variables[node.name]
#     update      (...)  -> ()        on success of the whole step: IN_PLACE[op].kernel(*args, **attrs), which
#                                     writes new values into the variables among its inputs (an optimizer
#                                     update with its assigns, done in place: sbpflow.ops.optimizer)
#     output      (a,)   -> ()        the step's result ``outputs[node.name]``
#     route       (x, i) -> (y, r)    dynamic routing (runtime.route), over node.ranks as one group:
#                                     "dispatch": row j of x goes to member i[j] by an all-to-all whose
#                                     split sizes depend on the data; y: rows received (a bound shape),
#                                     r: the routing record. "combine" (y, r) -> (x,): the way back, in
#                                     x's order. "redispatch" (x, r) -> (y,): dispatch by a known record
#
# Phases. `pre` nodes run once before the micro-batches, `micro` nodes once
# per micro-batch (`plan.micro_batches` times), `post` nodes once after. The
# in-order executor runs pre, then micro k = 0..m-1, then post, each in list order;
# an actor runtime may run anything whose inputs are ready, but collectives on
# one `stream` keep list order (so every member of a group issues them alike).
#
# `control` lists nodes (same phase, same micro-batch) that must act before
# this one although no data flows: resource order, activation recomputation.
# `control_lead` (one per control edge, default 0) shifts the micro-batch: step
# k waits for the source's step k + lead (a pipeline schedule's order, see
# `graph.pipeline`).
#
# Overwrites. A compute node with `overwrites = i` is the only reader of its
# input `i`, a fresh buffer of the same shape, dtype and layout as its output:
# it writes the output there (`ops.inplace.OVERWRITING`) instead of allocating.
# A boxing node with `overwrites = 0` (one all-reduce step) is the only reader of
# its fresh input (a gradient bucket's flat buffer): the collective reduces in it.
#
# Args. `PNode.args` is the op's positional argument template: `("t", i)`
# is input buffer `i` of the node, `("c", v)` a constant scalar.
@dataclass(frozen=True)
class PNode:
    """One node of the physical plan (its kinds: the comment above)."""

    id: int
    kind: str
    name: str  # op name, variable/input/output name, or a boxing label
    inputs: tuple[int, ...]  # Buf ids
    outputs: tuple[int, ...]  # Buf ids
    ranks: tuple[int, ...]  # ranks taking part (placement ranks; src and dst ranks for boxing)
    phase: str = "micro"
    stream: str = COMPUTE_STREAM  # "compute" or "comm:<group key>"
    op: str | None = None  # registry op name (compute)
    args: tuple[tuple[str, Any], ...] = ()  # positional template: ("t", input index) or ("c", constant)
    attrs: tuple[tuple[str, Any], ...] = ()  # static keyword attributes of the op
    boxing: Plan | None = None  # a one-step plan (boxing)
    in_sbps: tuple[Any, ...] = ()  # chosen n-D SBPs of the tensor inputs (compute; for shard-aware kernels)
    out_sbps: tuple[Any, ...] = ()
    control: tuple[int, ...] = ()  # node ids that must act first (no data flows)
    control_lead: tuple[int, ...] = ()  # per control edge: step k waits for the source's step k + lead (default 0)
    logical: int | None = None  # the logical node it came from, for messages
    mode: str = ""  # pack: "mean", "sum" or "cat"; route: "dispatch", "combine" or "redispatch"
    overwrites: int | None = None  # the input whose storage it writes its output into (ops.inplace; boxing: 0)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"PNode kind must be one of {KINDS}, but got {self.kind!r}")
        if self.phase not in PHASES:
            raise ValueError(f"PNode phase must be one of {PHASES}, but got {self.phase!r}")

    @property
    def is_comm(self) -> bool:
        return self.stream != COMPUTE_STREAM

    def label(self) -> str:
        return f"#{self.id} {self.kind} {self.name}"


@dataclass
class PhysicalPlan:
    """All ranks' programs, from one logical pass.

    ``plan.for_rank(r)`` is rank ``r``'s own program (MPMD: pipeline stages hold different nodes). A process
    runs the nodes that involve a rank it owns, on the shards of all its owned ranks at once (one rank under
    torch.distributed, every rank on the simulated backend)."""

    nodes: list[PNode]
    bufs: dict[int, Buf]
    registers: dict[int, Register]
    micro_batches: int = 1
    peak_bytes: dict[int, int] = field(default_factory=dict)  # predicted per rank (memory plan)
    world: tuple[int, ...] = ()  # every rank the plan involves
    pipeline: Any = None  # graph.pipeline.Pipeline: stages, schedule and priorities (None: one stage)
    # sets of buffers (ZeRO-3's gathered parameters) whose live bytes an executor counts apart from the total
    # (Stats.watch_peak), so that a bound on one kind of memory can be checked
    watch: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> buffers whose live bytes are counted

    def node(self, nid: int) -> PNode:
        return self._by_id()[nid]

    def _by_id(self) -> dict[int, PNode]:
        cache = getattr(self, "_index", None)
        if cache is None or len(cache) != len(self.nodes):
            cache = {n.id: n for n in self.nodes}
            self._index = cache
        return cache

    def steps(self, node: PNode) -> int:
        """How many times ``node`` acts in a step: m for a micro-phase node and for an accumulate or pack (one
        micro-batch value taken per act), else 1."""
        return self.micro_batches if node.phase == "micro" or node.kind in GATHERING else 1

    def producers(self) -> dict[int, int]:
        """Buf id -> the node that writes it."""
        return {b: n.id for n in self.nodes for b in n.outputs}

    def for_rank(self, rank: int) -> list[PNode]:
        """Rank ``rank``'s program: its nodes, in plan order."""
        return [n for n in self.nodes if rank in n.ranks]

    def phase(self, phase: str) -> Iterator[PNode]:
        return (n for n in self.nodes if n.phase == phase)

    def rank_classes(self) -> dict[int, tuple[int, ...]]:
        """Ranks whose programs move the same bytes: ``{representative (smallest rank): every rank of its class}``.

        Two ranks are in one class when they run the same nodes and every buffer has as many bytes on one as on
        the other, so any count over a rank's acts (the memory plan's peak) is the same for both. A buffer's
        bytes on a rank depend on the rank's coordinates only along mesh axes that split some dim unevenly; on
        an even mesh (a GPT on TP8 x PP16 x DP8) each pipeline stage is one class of 64 ranks.
        """
        rank_sets = {n.ranks for n in self.nodes}
        placements = {b.layout.placement for b in self.bufs.values()}
        uneven: dict[Any, set[int]] = {p: set() for p in placements}
        found: dict[tuple[Any, ...], set[int]] = {}  # (shape, sbp, mesh) -> axes: stages of one mesh share it
        for shape, sbp, p in {(b.shape, b.layout.sbp, b.layout.placement) for b in self.bufs.values()}:
            key = (shape, sbp, p.hierarchy)
            if key not in found:
                found[key] = _uneven_axes(shape, sbp, p)
            uneven[p] |= found[key]
        keys: dict[int, list[Any]] = {r: [] for ranks in rank_sets for r in ranks}
        for i, ranks in enumerate(sorted(rank_sets)):
            for r in ranks:
                keys[r].append(i)
        for i, p in enumerate(sorted(placements, key=lambda q: (q.flat_ranks, q.hierarchy))):
            axes = sorted(uneven[p])
            for r in p.flat_ranks:
                coords = p.coords(r)
                keys.setdefault(r, []).append((i, tuple(coords[a] for a in axes)))
        classes: dict[tuple[Any, ...], list[int]] = {}
        for r in sorted(keys):
            classes.setdefault(tuple(keys[r]), []).append(r)
        return {members[0]: tuple(members) for members in classes.values()}

    def collectives(self, rank: int) -> list[PNode]:
        return [n for n in self.for_rank(rank) if n.kind == "boxing" and n.is_comm]

    def to_json(self) -> str:
        return json.dumps({
            "micro_batches": self.micro_batches,
            "peak_bytes": {str(r): b for r, b in sorted(self.peak_bytes.items())},
            "bufs": [{"id": b.id, "shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", ""),
                      "placement": str(b.layout.placement), "sbp": format_nd(b.layout.sbp)}
                     for b in self.bufs.values()],
            "nodes": [{"id": n.id, "kind": n.kind, "name": n.name, "inputs": list(n.inputs),
                       "outputs": list(n.outputs), "ranks": list(n.ranks), "phase": n.phase, "stream": n.stream,
                       "control": list(n.control),
                       "register_num": [self.registers[b].register_num for b in n.outputs if b in self.registers]}
                      for n in self.nodes],
        }, indent=1)


def _uneven_axes(shape: tuple[int, ...], sbp: Any, placement: Any) -> set[int]:
    """The mesh axes along which the shard size of a ``shape`` tensor with ``sbp`` changes with the coordinate."""
    if not any(isinstance(s, Split) for s in sbp):
        return set()
    mesh = placement.hierarchy
    sizes = np.array([_numel(shard_shape(shape, placement, sbp, r)) for r in placement.flat_ranks]).reshape(mesh)
    return {a for a in range(len(mesh)) if (sizes.max(axis=a) != sizes.min(axis=a)).any()}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@lru_cache(maxsize=64)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
