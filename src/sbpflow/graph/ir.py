"""The logical IR: what tracing ``build()`` records. Small, SSA, printable.

A :class:`LogicalGraph` is a list of :class:`LNode` in program order, each reading and defining
:class:`Value` s (one producer each). Mutations are explicit: an in-place op defines a new value, and an
``assign`` writes a variable back at the end of the step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..placement import Placement
from ..sbp import NdSbp, format_nd

NODE_KINDS = ("input", "variable", "constant", "op", "to_global", "accumulate", "pack", "assign", "output")


@dataclass(eq=False)
class Value:
    """An SSA value: one logical tensor, with its logical shape, dtype and placement; its SBP is SBP selection's
    choice (at first the greedy, eager-like one made while tracing)."""

    id: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement
    sbp: NdSbp  # the chosen SBP (greedy while tracing, then the selection pass's)
    producer: int = -1  # node id
    index: int = 0  # which output of the producer

    def name(self) -> str:
        return f"%{self.id}"

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{list(self.shape)} {dtype} {self.placement} {format_nd(self.sbp)}"

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(eq=False)
class LNode:
    """One logical node. ``kind``::

        input      a step input (graph argument)          -> value
        variable   a parameter, buffer or optimizer state -> value (its current content)
        constant   a tensor created while tracing         -> value (captured data)
        op         a registry op                          values -> values
        to_global  a user's explicit conversion           value -> value (output layout fixed)
        accumulate sum over the micro-batches (gradients)  micro value -> post value
        pack       join the micro-batches (sum, mean, cat) micro value -> post value
        assign     write a variable                       value ->
        output     a step result                          value ->

    ``phase``: ``micro`` (forward and backward, once per micro-batch) or ``post`` (clipping and the optimizer,
    once per step, on accumulated gradients).
    """

    id: int
    kind: str
    name: str  # op name, variable/input/output name
    inputs: tuple[int, ...] = ()  # value ids of tensor arguments
    outputs: tuple[int, ...] = ()
    args: tuple[tuple[str, Any], ...] = ()  # positional template: ("t", i) tensor input i, ("c", v), ("k", n) key
    attrs: tuple[tuple[str, Any], ...] = ()
    in_sbps: tuple[NdSbp, ...] = ()  # the signature's input SBPs (the boxing targets of the inputs)
    phase: str = "micro"
    where: str = ""  # the user's source line that created it
    fixed: bool = False  # its output SBP is a constraint (input, variable, to_global)
    control: tuple[int, ...] = ()  # value ids that must exist before it runs, though it reads none (recomputation)

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise ValueError(f"LNode kind must be one of {NODE_KINDS}, but got {self.kind!r}")


@dataclass(frozen=True)
class Gather:
    """One ZeRO-3 unit's parameters gathered whole (``to_global`` S -> B) for one pass over the unit.

    Recorded while tracing, in trace order: each unit's forward gather, then (after the loss) its gather again
    in backward, whose ``to_global`` nodes carry a control edge on the gradient reaching the unit's output.
    The prefetch pass (:mod:`.prefetch`) windows them.
    """

    unit: int  # the unit's index in the ZeRO plan
    backward: bool  # the gather again in backward (else the forward gather)
    values: tuple[int, ...]  # the gathered values (outputs of to_global nodes)
    nested: bool = False  # the unit contains other units: it stays gathered around them, outside any window


@dataclass
class LogicalGraph:
    """Nodes in program order and the values they define."""

    nodes: list[LNode] = field(default_factory=list)
    values: dict[int, Value] = field(default_factory=dict)
    micro_batches: int = 1
    grad_seeds: list[int] = field(default_factory=list)  # value ids of implicit loss gradients: the backward starts
    gathers: list[Gather] = field(default_factory=list)  # ZeRO-3 parameter gathers, in trace order
    watch: dict[str, list[int]] = field(default_factory=dict)  # named value sets whose live bytes the runtime counts

    def value(self, vid: int) -> Value:
        return self.values[vid]

    def of_kind(self, kind: str) -> Iterator[LNode]:
        return (n for n in self.nodes if n.kind == kind)

    def consumers(self) -> dict[int, list[int]]:
        """Value id -> ids of the nodes reading it, in program order."""
        out: dict[int, list[int]] = {v: [] for v in self.values}
        for n in self.nodes:
            for v in n.inputs:
                out[v].append(n.id)
        return out

    def format(self) -> str:
        """One line per node, SSA style: ``%3 = matmul(%1, %2)  [8, 32] float32 cpu:[0, 1] S(0)``."""
        lines = []
        for n in self.nodes:
            outs = ", ".join(self.values[v].name() for v in n.outputs)
            call = _call_text(n, self)
            meta = "; ".join(self.values[v].describe() for v in n.outputs)
            lhs = f"{outs} = " if outs else ""
            phase = "" if n.phase == "micro" else f"  ({n.phase})"
            lines.append(f"{lhs}{call}{'  ' + meta if meta else ''}{phase}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({
            "micro_batches": self.micro_batches,
            "values": [{"id": v.id, "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                        "placement": str(v.placement), "sbp": format_nd(v.sbp)} for v in self.values.values()],
            "nodes": [{"id": n.id, "kind": n.kind, "name": n.name, "inputs": list(n.inputs),
                       "outputs": list(n.outputs), "attrs": {k: repr(a) for k, a in n.attrs},
                       "in_sbps": [format_nd(s) for s in n.in_sbps], "phase": n.phase, "where": n.where}
                      for n in self.nodes],
        }, indent=1)


def _call_text(n: LNode, g: LogicalGraph) -> str:
    if n.kind in ("input", "variable", "constant"):
        return f"{n.kind} {n.name!r}"
    if n.kind in ("assign", "output"):
        return f"{n.kind} {n.name!r} <- {g.values[n.inputs[0]].name()}"
    parts = []
    for how, v in n.args or tuple(("t", i) for i in range(len(n.inputs))):
        if how == "t":
            parts.append(g.values[n.inputs[v]].name())
        elif how == "k":
            parts.append(f"key+{v}")
        else:
            parts.append(repr(v))
    parts += [f"{k}={a!r}" for k, a in n.attrs]
    sig = ""
    if n.in_sbps:
        sig = "  sig (" + ", ".join(format_nd(s) for s in n.in_sbps) + ")"
    return f"{n.name}({', '.join(parts)}){sig}"
