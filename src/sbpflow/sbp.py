"""SBP: how a logical tensor maps onto the shards of one mesh axis; an n-D SBP is a tuple, one per mesh axis.

These are frozen values; the collectives between them live in :mod:`sbpflow.boxing`. ``zigzag(d)``
(printed ``Z(d)``) is a split whose rank r of p holds chunks r and 2p-1-r of 2p (balanced causal attention;
:mod:`sbpflow._layout` says where).

>>> from sbpflow import sbp
>>> sbp.split(0), sbp.broadcast, sbp.partial_sum, str(sbp.split(1))
(Split(dim=0), Broadcast(), Partial(op='sum'), 'S(1)')
>>> sbp.parse("Z(1)")
Split(dim=1, zigzag=True)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import SbpError

if TYPE_CHECKING:
    from .placement import Placement

PARTIAL_OPS = ("sum", "max", "min")


@dataclass(frozen=True, repr=False)
class Split:
    """Each rank along the axis holds a contiguous slice along tensor dim ``dim``; uneven lengths give the first
    ranks one more element, as ``torch.tensor_split`` does. With ``zigzag``, the two chunks ``r`` and ``2p-1-r`` of
    ``2p`` (the order boxing and ``_layout`` keep it in; never the user's)."""

    dim: int
    zigzag: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise SbpError(f"split(dim) needs a non-negative int dim, but got {self.dim!r}")

    def __str__(self) -> str:
        return f"Z({self.dim})" if self.zigzag else f"S({self.dim})"

    def __repr__(self) -> str:
        return f"Split(dim={self.dim}, zigzag=True)" if self.zigzag else f"Split(dim={self.dim})"


@dataclass(frozen=True)
class Broadcast:
    """Each rank along the axis holds the whole value."""

    def __call__(self) -> Broadcast:
        """``sbp.broadcast()`` is ``sbp.broadcast``, as OneFlow's code calls it."""
        return self

    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a piece; the logical value is their reduction by ``op``."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise SbpError(f"partial SBP op must be one of {PARTIAL_OPS}, but got {self.op!r}")

    def __str__(self) -> str:
        return f"P({self.op})"

    def __call__(self) -> Partial:
        """``sbp.partial_sum()`` is ``sbp.partial_sum``, as OneFlow's code calls it."""
        return self


SbpParallel = Split | Broadcast | Partial
NdSbp = tuple[SbpParallel, ...]
SBP_TYPES = (Split, Broadcast, Partial)


def split(dim: int) -> Split:
    """``S(dim)``: shards are slices along tensor dim ``dim``."""
    return Split(dim)


def zigzag(dim: int) -> Split:
    """``Z(dim)``: rank ``r`` of ``p`` holds chunks ``r`` and ``2p-1-r`` of ``2p`` along ``dim`` (stored in that
    order). Under a causal mask every rank then attends to as many keys as the others."""
    return Split(dim, zigzag=True)


broadcast = Broadcast()
partial_sum = Partial("sum")
partial_max = Partial("max")
partial_min = Partial("min")

_PATTERN = re.compile(r"^\s*(?:([SZ])\((\d+)\)|(B)|P\((sum|max|min)\))\s*$")


def parse(text: str) -> SbpParallel:
    """Parses ``S(0)``, ``Z(1)``, ``B`` or ``P(sum)`` back into an SBP value.

    >>> parse("P(max)")
    Partial(op='max')
    """
    m = _PATTERN.match(text) if isinstance(text, str) else None
    if m is None:
        raise SbpError(f"cannot parse {text!r} as an SBP; expected 'S(<dim>)', 'Z(<dim>)', 'B' or 'P(sum|max|min)'")
    if m.group(1) is not None:
        return Split(int(m.group(2)), zigzag=m.group(1) == "Z")
    if m.group(3):
        return broadcast
    return Partial(m.group(4))


def is_sbp(x: Any) -> bool:
    return isinstance(x, SBP_TYPES)


def normalize(sbp: Any, placement: Placement, ndim: int | None = None, what: str = "tensor") -> NdSbp:
    """Turns a single SBP or a sequence into a tuple with one entry per mesh axis.

    Strings such as ``"S(0)"`` are parsed. With ``ndim`` given, split dims are
    checked against the tensor's number of dims.
    """
    if isinstance(sbp, (str,) + SBP_TYPES):
        items: tuple[Any, ...] = (sbp,)
    elif isinstance(sbp, (list, tuple)):
        items = tuple(sbp)
    else:
        raise SbpError(
            f"sbp of {what} must be an SBP such as sbp.split(0), sbp.broadcast or sbp.partial_sum, "
            f"or a tuple of them, but got {sbp!r} of type {type(sbp).__name__}"
        )
    out = tuple(parse(s) if isinstance(s, str) else s for s in items)
    for s in out:
        if not is_sbp(s):
            raise SbpError(
                f"sbp of {what} must contain SBP values (sbp.split(d), sbp.broadcast, sbp.partial_*), "
                f"but got {s!r} of type {type(s).__name__}"
            )
    if len(out) != placement.ndim:
        raise SbpError(
            f"sbp of {what} needs one entry per mesh axis: placement {placement} has {placement.ndim} "
            f"axis(es), but got {len(out)} SBP(s) {format_nd(out)}"
        )
    if ndim is not None:
        for s in out:
            if isinstance(s, Split) and s.dim >= ndim:
                raise SbpError(
                    f"sbp of {what} splits dim {s.dim}, but the tensor has only {ndim} dim(s); "
                    f"expected split(d) with 0 <= d < {ndim}"
                )
    _check_zigzag(out, what)
    return out


def zigzag_valid(nd_sbp: NdSbp) -> bool:
    """Whether a zigzag split, if any, is the only split of its dim and the only zigzag entry: its chunks are
    cut from the whole dim, and one dim out of logical order is all boxing converts."""
    zigzags = [s for s in nd_sbp if isinstance(s, Split) and s.zigzag]
    if not zigzags:
        return True
    dims = [s.dim for s in nd_sbp if isinstance(s, Split)]
    return len(zigzags) == 1 and dims.count(zigzags[0].dim) == 1


def _check_zigzag(nd_sbp: NdSbp, what: str) -> None:
    if not zigzag_valid(nd_sbp):
        raise SbpError(f"sbp of {what} is {format_nd(nd_sbp)}, but a zigzag split Z(d) must be the only entry "
                       f"splitting dim d and the only zigzag entry")


def format_nd(sbp: NdSbp) -> str:
    """Short form of an n-D SBP: ``(S(0), B)``."""
    return "(" + ", ".join(str(s) for s in sbp) + ")"
