"""Hand-built physical plans, so the executors' tests and benchmarks state exactly the plan they mean.

>>> import torch, sbpflow
>>> from sbpflow import sbp as S
>>> p = sbpflow.placement("cpu", [0, 1])
>>> b = PlanBuilder(micro_batches=2)
>>> x = b.unpack(b.input("x", (4, 3), p, (S.split(0),)))
>>> b.output("y", b.pack(b.boxing(b.compute("relu", x), (S.broadcast,))))
>>> [n.kind for n in b.build().nodes]
['input', 'unpack', 'compute', 'boxing', 'pack', 'output']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import boxing
from ..boxing.plan import MOVES_NOTHING
from ..graph.physical import COMPUTE_STREAM, Buf, PhysicalPlan, PNode, Register
from ..ops.schema import REGISTRY, Meta, Scalar
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
                control: tuple[int, ...] = (), out_shape: tuple[int, ...] | None = None, **attrs: Any) -> int:
        """``REGISTRY[op]`` on ``operands`` (buffer ids or :class:`Const`); the output keeps the first input's
        layout unless ``out_sbp`` is given (the test states the signature; no SBP inference here).
        ``out_shape`` replaces meta inference where logical shapes do not apply (rows routed at run time)."""
        outs = self.compute_n(op, *operands, phase=phase, out_sbps=(out_sbp,) if out_sbp else None, control=control,
                              out_shapes=(out_shape,) if out_shape else None, **attrs)
        if len(outs) != 1:
            raise ValueError(f"op {op!r} has {len(outs)} outputs: use compute_n")
        return outs[0]

    def compute_n(self, op: str, *operands: int | Const, phase: str | None = None,
                  out_sbps: tuple[NdSbp, ...] | None = None, control: tuple[int, ...] = (),
                  out_shapes: tuple[tuple[int, ...], ...] | None = None, **attrs: Any) -> tuple[int, ...]:
        """:meth:`compute` for ops with several outputs (``max_dim``: values and indices)."""
        REGISTRY[op].check_traceable()  # a plan holds shapes known before data: data-dependent ops cannot be nodes
        ins = tuple(o for o in operands if not isinstance(o, Const))
        first = self.bufs[ins[0]]
        if out_shapes is None:
            inferred = self._infer(op, operands, attrs)
        else:  # no logical meta: the first input's dtype
            inferred = tuple(Meta(shape, first.dtype) for shape in out_shapes)
        sbps = out_sbps or (first.layout.sbp,) * len(inferred)
        outs = tuple(self.buf(meta.shape, meta.dtype, first.layout.placement, sbp)
                     for meta, sbp in zip(inferred, sbps, strict=True))
        args = tuple(("c", o.value) if isinstance(o, Const) else ("t", ins.index(o)) for o in operands)
        self.node("compute", op, ins, outs, phase=phase or self._phase(ins), op=op, args=args,
                  attrs=tuple(sorted(attrs.items())), control=control,
                  in_sbps=tuple(self.bufs[b].layout.sbp for b in ins),
                  out_sbps=tuple(self.bufs[b].layout.sbp for b in outs))
        return outs

    def _infer(self, op: str, operands: tuple[int | Const, ...], attrs: dict[str, Any]) -> tuple[Meta, ...]:
        metas = [Scalar(type(o.value)) if isinstance(o, Const) else Meta(self.bufs[o].shape, self.bufs[o].dtype)
                 for o in operands]
        inferred = REGISTRY[op].meta(*metas, **attrs)
        return tuple(inferred) if isinstance(inferred, (tuple, list)) else (inferred,)

    # -- dynamic routing (runtime.route) ---------------------------------------------------------

    def route_dispatch(self, x: int, dest: int) -> tuple[int, int]:
        """Rows of ``x`` to the group members ``dest`` names; returns (received rows, routing record).

        The received rows' buffer has the bound shape: every row of the group could land on one rank."""
        b = self.bufs[x]
        group = b.layout.placement.flat_ranks
        rows = self.buf((len(group) * b.shape[0], *b.shape[1:]), b.dtype, b.layout.placement, b.layout.sbp)
        local_rows = b.shape[0] // len(group)
        record = self.buf((len(group) * (2 * len(group) + local_rows),), torch.int64, b.layout.placement,
                          b.layout.sbp)
        self.node("route", f"dispatch %{x} by %{dest}", (x, dest), (rows, record), mode="dispatch",
                  phase=self._phase((x, dest)), stream=_route_stream(group))
        return rows, record

    def route_back(self, y: int, record: int, like: int, mode: str = "combine") -> int:
        """``combine`` (rows back to their source, in ``like``'s order and shape) or ``redispatch``."""
        b = self.bufs[like]
        out = self.buf(b.shape, self.bufs[y].dtype, b.layout.placement, b.layout.sbp)
        group = b.layout.placement.flat_ranks
        self.node("route", f"{mode} %{y} by %{record}", (y, record), (out,), mode=mode,
                  phase=self._phase((y, record)), stream=_route_stream(group))
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


def _route_stream(group: tuple[int, ...]) -> str:
    return "comm:" + ",".join(map(str, group))


def _slot_bytes(buf: Buf) -> tuple[tuple[int, int], ...]:
    return tuple((r, buf.nbytes(r)) for r in buf.layout.placement.flat_ranks)
