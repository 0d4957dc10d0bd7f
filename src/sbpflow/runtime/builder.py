"""Hand-built physical plans, for the executors' tests and benchmarks.

The compiler (:mod:`sbpflow.graph`) derives plans from a traced step; this builder writes one
node at a time, so a test can state exactly the plan it means (a chain, a reconvergent DAG, a
hand-corrupted plan) without a model or a tracer. Ops come from the registry, boxing nodes from
the boxing planner: one node per planner step, collectives on a ``comm:<ranks>`` stream.

>>> import torch, sbpflow
>>> from sbpflow import sbp as S
>>> p = sbpflow.placement("cpu", [0, 1])
>>> b = PlanBuilder(micro_batches=2)
>>> x = b.unpack(b.input("x", (4, 3), p, (S.split(0),)))
>>> y = b.boxing(b.compute("relu", x), (S.broadcast,))
>>> b.output("y", b.pack(y))
>>> plan = b.build()
>>> [n.kind for n in plan.nodes]
['input', 'unpack', 'compute', 'boxing', 'pack', 'output']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import boxing
from ..boxing.plan import MOVES_NOTHING
from ..graph.physical import COMPUTE_STREAM, Buf, PhysicalPlan, PNode, Register
from ..ops.registry import REGISTRY, Meta, Scalar
from ..placement import Placement
from ..sbp import NdSbp

_PHASE_ORDER = {"pre": 0, "micro": 1, "post": 2}


@dataclass(frozen=True)
class Const:
    """A constant positional argument of a compute node (a scalar), as opposed to a buffer id."""

    value: Any


class PlanBuilder:
    """Appends nodes in a valid sequential order; :meth:`build` fills in the registers."""

    def __init__(self, micro_batches: int = 1) -> None:
        self.micro_batches = micro_batches
        self.nodes: list[PNode] = []
        self.bufs: dict[int, Buf] = {}
        self.phase_of: dict[int, str] = {}  # buf id -> phase of its producer

    # -- raw pieces ------------------------------------------------------------------------------

    def buf(self, shape: tuple[int, ...], dtype: torch.dtype, placement: Placement, sbp: NdSbp) -> int:
        bid = len(self.bufs)
        self.bufs[bid] = Buf(bid, tuple(shape), dtype, boxing.Layout(placement, tuple(sbp)))
        return bid

    def node(self, kind: str, name: str, inputs: tuple[int, ...], outputs: tuple[int, ...], **fields: Any) -> int:
        """Appends a node; ``ranks`` default to the placements of its buffers."""
        if "ranks" not in fields:
            fields["ranks"] = _ranks(self.bufs[b] for b in inputs + outputs)
        nid = len(self.nodes)
        self.nodes.append(PNode(nid, kind, name, tuple(inputs), tuple(outputs), **fields))
        for b in outputs:
            self.phase_of[b] = fields.get("phase", "micro")
        return nid

    # -- sources and micro-batch helpers ---------------------------------------------------------

    def input(self, name: str, shape: tuple[int, ...], placement: Placement, sbp: NdSbp,
              dtype: torch.dtype = torch.float32) -> int:
        out = self.buf(shape, dtype, placement, sbp)
        self.node("input", name, (), (out,), phase="pre")
        return out

    def variable(self, name: str, shape: tuple[int, ...], placement: Placement, sbp: NdSbp,
                 dtype: torch.dtype = torch.float32) -> int:
        out = self.buf(shape, dtype, placement, sbp)
        self.node("variable", name, (), (out,), phase="pre")
        return out

    def unpack(self, src: int) -> int:
        """Micro-batch k of ``src``: dim 0 cut into ``micro_batches`` chunks (logical shape too)."""
        b = self.bufs[src]
        shape = (b.shape[0] // self.micro_batches, *b.shape[1:])
        out = self.buf(shape, b.dtype, b.layout.placement, b.layout.sbp)
        self.node("unpack", f"unpack {src}", (src,), (out,), phase="micro")
        return out

    def repeat(self, src: int) -> int:
        b = self.bufs[src]
        out = self.buf(b.shape, b.dtype, b.layout.placement, b.layout.sbp)
        self.node("repeat", f"repeat {src}", (src,), (out,), phase="micro")
        return out

    def accumulate(self, src: int) -> int:
        b = self.bufs[src]
        out = self.buf(b.shape, b.dtype, b.layout.placement, b.layout.sbp)
        self.node("accumulate", f"accumulate {src}", (src,), (out,), phase="post")
        return out

    def pack(self, src: int, mode: str = "cat") -> int:
        b = self.bufs[src]
        shape = b.shape if mode == "mean" else (b.shape[0] * self.micro_batches, *b.shape[1:])
        out = self.buf(shape, b.dtype, b.layout.placement, b.layout.sbp)
        self.node("pack", f"pack {src}", (src,), (out,), phase="post", mode=mode)
        return out

    # -- compute and boxing ----------------------------------------------------------------------

    def compute(self, op: str, *operands: int | Const, phase: str | None = None, out_sbp: NdSbp | None = None,
                control: tuple[int, ...] = (), **attrs: Any) -> int:
        """``REGISTRY[op]`` on ``operands`` (buffer ids or :class:`Const`); the output keeps the first input's
        layout unless ``out_sbp`` is given (the test states the signature; no SBP inference here)."""
        ins = tuple(o for o in operands if not isinstance(o, Const))
        metas = [Scalar(type(o.value)) if isinstance(o, Const) else Meta(self.bufs[o].shape, self.bufs[o].dtype)
                 for o in operands]
        REGISTRY[op].check_traceable()  # a plan's buffers need every shape before anything runs
        meta = REGISTRY[op].meta(*metas, **attrs)
        first = self.bufs[ins[0]]
        out = self.buf(meta.shape, meta.dtype, first.layout.placement, out_sbp or first.layout.sbp)
        args = tuple(("c", o.value) if isinstance(o, Const) else ("t", ins.index(o)) for o in operands)
        self.node("compute", op, ins, (out,), phase=phase or self._phase(ins), op=op, args=args,
                  attrs=tuple(sorted(attrs.items())), control=control,
                  in_sbps=tuple(self.bufs[b].layout.sbp for b in ins), out_sbps=(self.bufs[out].layout.sbp,))
        return out

    def boxing(self, src: int, sbp: NdSbp, placement: Placement | None = None, phase: str | None = None,
               stream: str | None = None) -> int:
        """Moves ``src`` to ``sbp`` (on ``placement``): one node per step of the planner's plan."""
        b = self.bufs[src]
        dst = boxing.Layout(placement or b.layout.placement, tuple(sbp))
        plan = boxing.plan(b.shape, b.dtype, b.layout, dst)
        current = src
        for step in plan.steps:
            out = self.buf(b.shape, b.dtype, step.dst.placement, step.dst.sbp)
            one = boxing.Plan(b.shape, b.dtype, step.src, step.dst, (step,))
            ranks = _ranks([self.bufs[current], self.bufs[out]])
            self.node("boxing", f"{step.kind} {step.src} -> {step.dst}", (current,), (out,), ranks=ranks,
                      phase=phase or self._phase((current,)), boxing=one, stream=stream or _stream(step, ranks))
            current = out
        return current

    # -- sinks -----------------------------------------------------------------------------------

    def output(self, name: str, src: int) -> None:
        self.node("output", name, (src,), (), phase=self.phase_of[src])

    def assign(self, name: str, src: int) -> None:
        self.node("assign", name, (src,), (), phase=self.phase_of[src])

    def build(self, register_num: int | dict[int, int] = 1) -> PhysicalPlan:
        """The plan, with a register per buffer: ``register_num`` slots (one count, or per buffer id)."""
        counts = register_num if isinstance(register_num, dict) else {}
        default = register_num if isinstance(register_num, int) else 1
        registers = {b: Register(b, counts.get(b, default), _slot_bytes(buf), self._consumers(b))
                     for b, buf in self.bufs.items()}
        world = _ranks(self.bufs.values())
        return PhysicalPlan(list(self.nodes), dict(self.bufs), registers, self.micro_batches, world=world)

    def _consumers(self, buf: int) -> tuple[int, ...]:
        return tuple(n.id for n in self.nodes if buf in n.inputs)

    def _phase(self, ins: tuple[int, ...]) -> str:
        phases = [self.phase_of[b] for b in ins] or ["micro"]
        return max(phases, key=_PHASE_ORDER.__getitem__)


def _ranks(bufs: Any) -> tuple[int, ...]:
    return tuple(sorted({r for b in bufs for r in b.layout.placement.flat_ranks}))


def _stream(step: boxing.Step, ranks: tuple[int, ...]) -> str:
    """Collectives go on their group's communication stream; local slices stay on compute."""
    if step.kind in MOVES_NOTHING:
        return COMPUTE_STREAM
    return "comm:" + ",".join(map(str, ranks))


def _slot_bytes(buf: Buf) -> tuple[tuple[int, int], ...]:
    return tuple((r, buf.nbytes(r)) for r in buf.layout.placement.flat_ranks)
