"""Micro-batches as a split of the batch over time: how each traced value joins across them.

A step runs ``build()`` once per micro-batch, on every input cut in m along dim 0. Each value gets a layout
over the micro-batches, read off the op's own SBP signatures as if they were m ranks of one more mesh axis::

    S(d)   each micro-batch holds its slice of dim d      (inputs: S(0))      joined by cat
    P      each holds a part; the step's value is their sum / scale          joined by sum / scale
    B      the same in every micro-batch                 (variables)          joined by taking one

A function of ``P`` values with no exact per-micro-batch form (``sqrt``, a product of two) is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import SbpflowError
from ..sbp import Broadcast, Partial, SbpParallel, Split


class MicroBatchError(SbpflowError):
    """A value of ``build()`` has no exact join over the micro-batches of gradient accumulation."""


@dataclass(frozen=True)
class Micro:
    """One value's layout over the micro-batches: ``sbp`` (S(d), P(sum) or B; None for unknown, "?") and, for a
    partial, the scale its sum is divided by."""

    sbp: SbpParallel | None
    scale: int = 1
    origin: str = ""  # the op that made it (for messages)
    reads: tuple[SbpParallel, ...] = field(default=(), compare=False)  # how that op read its inputs (its signature)

    def __str__(self) -> str:
        if self.sbp is None:
            return "?"
        return f"{self.sbp}/{self.scale}" if isinstance(self.sbp, Partial) else str(self.sbp)


SAME = Micro(Broadcast())
DATA = Micro(Split(0), origin="input")
MEANS = ("mean",)  # reductions that divide by the (micro-batch's) count of what they reduce


def propagate(opdef: Any, sigs: Sequence[Any], ins: Sequence[Micro], m: int, where: str) -> Micro:
    """The layout of ``opdef``'s outputs from its inputs' (``sigs``: the op's 1-D signatures for these shapes).

    A sum over a split dim gives ``P`` (scale 1); a mean gives ``P`` with scale m, since each micro-batch
    divides by its m-times-smaller count. A reduction of step data alone (the count of kept targets) is traced
    again on the whole step's inputs (``graph.trace._whole_of``): ``B``, so a loss divided by it stays an
    exact partial; a ratio of two partials that remain is refused. A loss ``P`` with scale s is
    ``sum_k L_k / s``: backward is seeded with ``1 / s`` per micro-batch. ``"?"`` marks what an op without
    a matching signature made from split data: joined as before (cat, or the mean of scalars), and refused
    where it would need the exact join."""
    if all(isinstance(i.sbp, Broadcast) for i in ins):
        return SAME
    partials = [i for i in ins if isinstance(i.sbp, Partial)]
    if any(i.sbp is None for i in ins):
        if partials:
            raise _refuse(opdef.name, ins, where, "it reads a value of unknown join together with a partial one")
        return Micro(None, origin=opdef.name)
    scales = {i.scale for i in partials}
    if len(scales) > 1:
        raise _refuse(opdef.name, ins, where, "it combines partials of different scales (a sum over the "
                      "micro-batch split with a mean over it)")
    scale = scales.pop() if scales else 1
    found = _match(sigs, ins, scale, m)
    if found is None:
        if partials:
            raise _refuse(opdef.name, ins, where, "no signature of the op keeps that partial a partial: the op is "
                          "not linear in it, so the micro-batches' results cannot be joined into the full batch's")
        return Micro(None, origin=opdef.name)
    out, reads = found
    if isinstance(out, Partial):
        if out.op != "sum":
            return Micro(None, origin=opdef.name)
        if not partials:  # a reduction over the split dim
            scale = m if opdef.name in MEANS else 1
        return Micro(out, scale, opdef.name, reads)
    return Micro(out, 1, opdef.name, reads)


def _match(sigs: Sequence[Any], ins: Sequence[Micro], scale: int,
           m: int) -> tuple[SbpParallel, tuple[SbpParallel, ...]] | None:
    """The output SBP and input SBPs of the signature needing the fewest conversions: B reads as any split of itself
    (the same rows in each micro-batch) and, beside partials of scale m (averages), as a partial of itself."""
    best: tuple[int, SbpParallel, tuple[SbpParallel, ...]] | None = None
    for sig in sigs:
        cost = 0
        for have, want in zip(ins, sig.ins, strict=True):
            if have.sbp == want:
                continue
            if isinstance(have.sbp, Broadcast) and (isinstance(want, Split) or (
                    isinstance(want, Partial) and want.op == "sum" and scale == m)):
                cost += 1
                continue
            break
        else:
            if sig.outs and (best is None or cost < best[0]):
                best = (cost, sig.outs[0], tuple(sig.ins))
    return None if best is None else (best[1], best[2])


def _refuse(op: str, ins: Sequence[Micro], where: str, why: str) -> MicroBatchError:
    layouts = ", ".join(str(i) for i in ins)
    return MicroBatchError(
        f"{where}: op {op!r} cannot be computed exactly per micro-batch under gradient accumulation: {why}. Its "
        f"inputs' layouts over the micro-batches are ({layouts}) (S: split, P/s: a sum over micro-batches divided "
        "by s, B: the same in each). Compute it after the step from the returned values, or use "
        "set_gradient_accumulation_steps(m, average=True) to average the micro-batches as OneFlow does")


def join(layout: Micro, ndim: int, what: str, m: int) -> tuple[str, int]:
    """How the micro-batches of an output or loss join: ``("cat" | "sum" | "mean", scale)``."""
    if layout.sbp is None:
        if ndim == 0:
            raise MicroBatchError(
                f"{what} comes from op {layout.origin!r}, which has no signature for its inputs split over the "
                "micro-batches, so its micro-batch values have no exact join; use "
                "set_gradient_accumulation_steps(m, average=True) to average them")
        return "cat", 1
    if isinstance(layout.sbp, Split):
        if layout.sbp.dim != 0:
            raise MicroBatchError(f"{what} is split over the micro-batches along dim {layout.sbp.dim} (from op "
                                  f"{layout.origin!r}); outputs are joined along dim 0: move that dim first")
        return "cat", 1
    if isinstance(layout.sbp, Partial):
        return ("sum", 1) if layout.scale == 1 else ("mean", m)
    return "mean", m
