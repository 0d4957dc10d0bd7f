"""Views: outputs of view methods (``x[1:]``, ``x.view(12)``, ``x.t()`` ...) that in-place writes reach through.

sbpflow's ops return fresh shards (in-place writes are tracked per tensor by a version counter, so an output
must not alias its input): a view records its base and a writer that carries its new value back.

>>> import sbpflow
>>> x = sbpflow.zeros(2, 3)
>>> _ = x[:, 0].fill_(7)
>>> _ = x.view(6)[1:3].add_(1)
>>> x.tolist()
[[7.0, 1.0, 1.0], [7.0, 0.0, 0.0]]
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..autograd import no_grad
from ..errors import OpError
from ..tensor import Tensor

Writer = Callable[[Tensor, Tensor], None]  # (base, new value of the view): writes the base in place


class Link:
    """How a view came from its base: enough to write back, and to replay the op on a stride-only probe."""

    __slots__ = ("base", "write", "op", "args", "kwargs", "item", "parent", "version")

    def __init__(self, base: Tensor, write: Writer, op: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 item: int | None) -> None:
        # A base that owns its data is held weakly (a view must not keep a large base alive, and a base nobody
        # holds can no longer be observed); a base that is itself a view is held strongly, since in
        # ``x.view(6)[1:3].add_(1)`` nothing else keeps the middle view alive and the write must pass through it.
        self.base: Callable[[], Tensor | None] = weakref.ref(base) if base._view_of is None else (lambda: base)
        self.parent: Tensor | tuple[int, ...] = base if base._view_of is not None else tuple(base.shape)
        self.write, self.op, self.args, self.kwargs, self.item = write, op, args, kwargs, item
        self.version = base._version  # the base's version this view's values reflect

    def refresh(self, view: Tensor) -> None:
        """Brings ``view`` (whose link this is) up to date with its base: Tensor asks its link, not this module."""
        refresh(view)

    def copy(self) -> Link:
        """The same link for another tensor holding the same values (``view.detach()``), its version its own."""
        twin = object.__new__(Link)
        for name in Link.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin


def mark_view(out: Tensor, base: Tensor, write: Writer, op: str, *args: Any, item: int | None = None,
              **kwargs: Any) -> Tensor:
    """Records that ``out`` came from ``base`` by torch's view op ``op(*args, **kwargs)`` (``[item]`` of its
    result for split/chunk), unless the op returned ``base`` itself."""
    if out is not base:
        out._view_of = Link(base, write, op, args, kwargs, item)
    return out


def probe(t: Tensor) -> torch.Tensor:
    """A meta tensor (strides, no data) standing for ``t``: its root base's, with every view op replayed.

    torch decides from strides whether ``reshape`` gives a view or a copy, and refuses ``view`` where the
    strides do not allow it; replaying the ops on this probe gives the same answers at no data cost.
    """
    link: Link | None = t._view_of
    if link is None:
        return torch.empty(tuple(t.shape), device="meta")
    parent = probe(link.parent) if isinstance(link.parent, Tensor) else torch.empty(link.parent, device="meta")
    out = getattr(parent, link.op)(*link.args, **link.kwargs)
    return out if link.item is None else out[link.item]


def write_back(t: Tensor) -> None:
    """After an in-place write into ``t``: carries its new value into the tensor it is a view of, if any.

    Every in-place op (``fill_``, ``+=``, ``x[...] = v``) ends here: ``t``'s writer runs, then its base's, up
    to the tensor that owns the data. Where torch's op made a copy (``reshape`` of a transposed tensor, decided
    as torch does from strides, on a data-free :func:`probe`) the write stays in ``t``, as in torch.
    """
    link: Link | None = t._view_of
    if link is None:
        return
    base = link.base()
    if base is None:
        return
    try:
        is_view = probe(t)._base is not None
    except RuntimeError as e:  # view() of strides torch cannot view: torch raises at the view() call itself
        raise OpError(f"an in-place write into the output of {link.op}() cannot reach its input "
                      f"({base._describe()}): torch refuses that {link.op}() ({e})") from None
    if is_view:
        with no_grad():
            link.write(base, t)
        link.version = base._version


def refresh(t: Tensor) -> None:
    """Brings view ``t`` up to date with its base, if the base was written since (not through ``t``).

    torch's views share storage, so ``v = x[0]; x.fill_(1)`` changes ``v`` too. Here ``v`` holds its own
    shards, so a read of ``v`` (dispatch, ``numpy()``, an in-place op) first replays the view op on the base.
    Cheap when nothing changed: one version comparison per base up the chain.

    >>> import sbpflow
    >>> x = sbpflow.zeros(2, 3)
    >>> row = x[1]
    >>> _ = x.fill_(2)
    >>> row.tolist()
    [2.0, 2.0, 2.0]
    """
    link: Link | None = t._view_of
    base = None if link is None else link.base()
    if link is None or base is None:
        return
    refresh(base)
    if base._version == link.version:
        return
    link.version = base._version
    if probe(t)._base is None:  # torch's op made a copy (reshape of a transposed tensor): it does not follow
        return
    with no_grad():
        value = getattr(base, link.op)(*link.args, **link.kwargs)
    t._assign(value if link.item is None else value[link.item])


def not_writable(name: str) -> Writer:
    """Writer of views whose elements alias one another (expand): refuses, as torch does, rather than guess."""

    def write(base: Tensor, view: Tensor) -> None:
        raise OpError(
            f"an in-place write into the output of {name}() cannot reach its input ({base._describe()}): several "
            f"elements of the view are one element of the input; write into the input, or use {name}(...).clone()"
        )

    return write


# -- top-level view functions ------------------------------------------------------------------------------------
#
# ``sbpflow.reshape(x, ...)`` is a view as ``torch.reshape`` is, so it is ``x.reshape(...)``, which records the
# view. The functional module's own reshape, transpose ... stay plain ops: internal code (gradients, composites)
# never writes into their outputs and should not pay for the bookkeeping.


def _view_function(name: str) -> Callable[..., Any]:
    def fn(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        return getattr(x, name)(*args, **kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"``torch.{name}``: ``x.{name}(...)``, a view of ``x`` (in-place writes into the result reach "
                  f"``x``; see :mod:`sbpflow.ops.views`).")
    return fn


reshape, transpose, permute, t = (_view_function(n) for n in ("reshape", "transpose", "permute", "t"))
squeeze, unsqueeze, flatten, unflatten = (_view_function(n) for n in ("squeeze", "unsqueeze", "flatten", "unflatten"))
narrow, split, chunk = (_view_function(n) for n in ("narrow", "split", "chunk"))
