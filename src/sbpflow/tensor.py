"""The one Tensor type: local (one torch tensor) or global (logical shape, placement, n-D SBP, shards).

>>> import sbpflow
>>> x = sbpflow.tensor([[1., 2.], [3., 4.]], placement=sbpflow.placement("cpu", [0, 1]), sbp=sbpflow.sbp.split(0))
>>> x.shape, x.sbp
(torch.Size([2, 2]), (Split(dim=0),))
>>> x.local_tensors()[1]
tensor([[3., 4.]])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import boxing
from . import meta as _metamod
from ._layout import Shape, logical_pieces, zigzag_axis
from .autograd.mode import note_output_hooks
from .comm import get_backend
from .distributed import activity
from .errors import AutogradError, SbpflowError
from .placement import Placement
from .sbp import NdSbp, Partial, broadcast, format_nd

if TYPE_CHECKING:
    from .autograd.node import Node


class Tensor:
    """A local or global tensor. A global one has a logical ``shape`` and ``dtype``, a ``placement``, an n-D
    ``sbp`` and a shard for each rank this process owns: shard ``r`` is the box
    :func:`sbpflow._layout.shard_box` assigns to rank ``r``."""

    __slots__ = (
        "_shape", "_dtype", "_placement", "_sbp", "_shards", "_local",
        "requires_grad", "grad", "grad_fn", "_out_index", "_retains_grad", "_hooks", "_version", "_boxed",
        "_lazy", "_view_of", "_grad_sbp", "__weakref__",
    )
    # The slots' types (annotations only: with __slots__ they declare, they do not create, attributes).
    _shape: tuple[int, ...] | None
    _dtype: torch.dtype | None
    _placement: Placement | None
    _sbp: NdSbp | None
    _shards: dict[int, torch.Tensor] | None
    _local: torch.Tensor | None
    requires_grad: bool
    grad: Tensor | None
    grad_fn: Node | None
    _out_index: int
    _retains_grad: bool
    _hooks: list[Callable[[Tensor], Tensor | None]] | None
    _version: int
    _boxed: dict[Any, tuple[tuple[int, ...], dict[int, torch.Tensor]]] | None
    _lazy: Any  # the graph value a tensor stands for while nn.Graph traces (metadata only, no shards)
    _view_of: Any  # an ops.views.Link when this tensor is a view of another (x[1:], x.view(12) ...), else None
    _grad_sbp: NdSbp | None  # a leaf's gradient layout when it differs from its own (ZeRO-2: S on the data axis)

    def __new__(cls, *data: Any) -> Tensor:
        """``sbpflow.Tensor([[1, 2], [3, 4]])`` (float32 values, as torch.Tensor and OneFlow's Tensor) or
        ``sbpflow.Tensor(2, 3)`` (zeros of that shape): a local tensor."""
        if len(data) == 1 and not isinstance(data[0], int):
            value = data[0]
            value = value.to_local() if isinstance(value, Tensor) and value._local is not None else value
            return cls._from_local(torch.as_tensor(value, dtype=torch.get_default_dtype()).clone())
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in data):
            raise TypeError(f"sbpflow.Tensor takes data (a list, array or tensor) or sizes, but got {data!r}")
        return cls._from_local(torch.zeros(data))

    def __init__(self, *data: Any) -> None:
        pass  # built by __new__

    # -- construction from parts (internal) ----------------------------------------------

    @classmethod
    def _from_local(cls, t: torch.Tensor, requires_grad: bool = False) -> Tensor:
        self = object.__new__(cls)
        self._local = t
        self._shards = None
        self._placement = None
        self._sbp = None
        self._shape = None
        self._dtype = None
        # _init_autograd inlined: every op result passes here
        self.requires_grad = requires_grad
        self.grad = self.grad_fn = self._hooks = self._boxed = self._lazy = self._view_of = self._grad_sbp = None
        self._out_index = self._version = 0
        self._retains_grad = False
        return self

    @classmethod
    def _from_shards(
        cls, shape: Shape, dtype: torch.dtype, placement: Placement, sbp: NdSbp, shards: dict[int, torch.Tensor],
        requires_grad: bool = False,
    ) -> Tensor:
        self = object.__new__(cls)
        self._local = None
        self._shards = shards
        self._placement = placement
        self._sbp = sbp
        self._shape = tuple(shape)
        self._dtype = dtype
        # _init_autograd inlined: every op result passes here
        self.requires_grad = requires_grad
        self.grad = self.grad_fn = self._hooks = self._boxed = self._lazy = self._view_of = self._grad_sbp = None
        self._out_index = self._version = 0
        self._retains_grad = False
        return self

    @classmethod
    def _meta(cls, shape: Shape, dtype: torch.dtype, placement: Placement, sbp: NdSbp,
              requires_grad: bool = False) -> Tensor:
        """A global meta tensor: layout and no shards (see :mod:`sbpflow.meta`)."""
        self = cls._from_shards(shape, dtype, placement, sbp, {}, requires_grad)
        self._shards = None
        return self

    def _shell(self) -> Tensor:
        """This tensor without its data: shape, dtype, layout, and the autograd identity (grad_fn, output index,
        version) through which a gradient reaches its producer. What eager autograd keeps of an input whose
        value the op's gradient does not read (``grad_reads`` in :func:`sbpflow.ops.registry.op`)."""
        if self._local is not None:
            local = self._local
            shell = Tensor._from_local(torch.empty(local.shape, dtype=local.dtype, device="meta"), self.requires_grad)
        else:
            shell = Tensor._meta(self._shape or (), self._dtype, self._placement, self._sbp,  # type: ignore[arg-type]
                                 self.requires_grad)
        shell.grad_fn, shell._out_index, shell._version = self.grad_fn, self._out_index, self._version
        return shell

    def _init_autograd(self, requires_grad: bool) -> None:
        self.requires_grad = requires_grad
        self.grad = None
        self.grad_fn = None
        self._out_index = 0
        self._retains_grad = False
        self._hooks = None
        self._version = 0
        # Boxed copies of this tensor, {(layout, version): (source shard versions, shards)}, so that several
        # consumers needing the same conversion share one collective (op outputs, see ops.registry.run), and
        # a parameter is not sliced again every step (leaves keep local conversions only, see _boxed).
        self._boxed = None
        self._lazy = None
        self._view_of = None
        self._grad_sbp = None

    # -- metadata ------------------------------------------------------------------------

    @property
    def is_global(self) -> bool:
        return self._placement is not None

    @property
    def is_local(self) -> bool:
        return self._local is not None

    @property
    def shape(self) -> torch.Size:
        """The logical shape (the whole tensor, not a shard)."""
        if self._local is not None:
            return self._local.shape
        return torch.Size(self._shape or ())

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype if self._local is not None else self._dtype  # type: ignore[return-value]

    @property
    def placement(self) -> Placement:
        if self._placement is None:
            raise SbpflowError("a local tensor has no placement; convert it with .to_global(placement, sbp)")
        return self._placement

    @property
    def sbp(self) -> NdSbp:
        if self._sbp is None:
            raise SbpflowError("a local tensor has no sbp; convert it with .to_global(placement, sbp)")
        return self._sbp

    @property
    def device(self) -> torch.device:
        if self._local is not None:
            return self._local.device
        return torch.device(self.placement.type)

    @property
    def is_meta(self) -> bool:
        """Whether this tensor holds metadata only (built under ``sbpflow.meta_init()``; see :mod:`sbpflow.meta`).

        A global meta tensor has no shards (a lazy tensor that ``nn.Graph`` traces has none either, but is not
        meta: it stands for a value of the step); a local one wraps a torch meta-device tensor.
        """
        if self._local is not None:
            return self._local.is_meta
        return self._shards is None and self._lazy is None and self._placement is not None

    @property
    def ndim(self) -> int:
        # read on many hot paths (functional wrappers, gradients): no torch.Size built for it
        return self._local.dim() if self._local is not None else len(self._shape or ())

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    def _describe(self) -> str:
        """Short description for error messages: shape, dtype, placement and sbp."""
        shape = list(self.shape)
        dtype = str(self.dtype).replace("torch.", "")
        if self.is_global:
            return f"shape {shape} {dtype} on {self.placement} sbp {format_nd(self.sbp)}"
        return f"local shape {shape} {dtype}"

    # -- shards --------------------------------------------------------------------------

    def local_tensors(self) -> dict[int, torch.Tensor]:
        """``{rank: shard}`` for every rank this process owns."""
        if self._lazy is not None:
            self._lazy.refuse_data("local_tensors()")
        if self.is_meta:
            _metamod.refuse(self, "local_tensors()")
        if self._view_of is not None:
            _refresh_view(self)
        if self._local is not None:
            return {0: self._local}
        return dict(self._shards or {})

    def to_local(self) -> torch.Tensor:
        """This process's shard (or the tensor itself, for a local tensor).

        Where one process simulates several ranks, it is the shard of the lowest of them (what OneFlow's rank 0
        prints); :meth:`local_tensors` gives them all. A process outside the placement gets an empty tensor, as
        in OneFlow, so that code written for 2 processes runs on 4.
        """
        if self._lazy is not None:
            self._lazy.refuse_data("to_local()")
        if self.is_meta:
            _metamod.refuse(self, "to_local()")
        if self._view_of is not None:
            _refresh_view(self)
        if self._local is not None:
            return self._local
        shards = self._shards or {}
        if not shards:
            return torch.empty(0, dtype=self.dtype)
        return shards[min(shards)]

    if TYPE_CHECKING:  # Tensor is data: sbpflow.ops.methods binds to_global, sbpflow.autograd.engine backward
        def to_global(self, placement: Placement | None = None, sbp: Any = None, *,
                      grad_sbp: Any = None, check_meta: bool = True) -> Tensor: ...

        def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None: ...

    def numpy(self) -> np.ndarray:
        """The logical value as a NumPy array (on every process)."""
        return logical_value(self).cpu().numpy() if self.dtype != torch.bfloat16 else (
            logical_value(self).float().cpu().numpy()
        )

    def tolist(self) -> Any:
        return logical_value(self).tolist()

    def item(self) -> Any:
        if self.numel() != 1:
            raise SbpflowError(f"item() needs a tensor with one element, but got {self._describe()}")
        return logical_value(self).reshape(()).item()

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return int(self.shape[0])

    def __iter__(self) -> Iterator[Tensor]:
        for i in range(len(self)):
            yield self[i]  # type: ignore[index]  # __getitem__ is bound by ops.indexing

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        return int(self.item())

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        if self._lazy is not None:
            return f"LazyTensor({self._lazy.name()}, {self._describe()})"
        if self.is_meta:
            return f"MetaTensor({self._describe()})"
        value = logical_value(self)
        body = repr(value)[len("tensor(") : -1] if repr(value).startswith("tensor(") else repr(value)
        extra = []
        if self.is_global:
            extra.append(f"placement={self.placement!r}, sbp={format_nd(self.sbp)}")
        extra.append(f"shape={list(self.shape)}")
        if self.grad_fn is not None:
            extra.append(f"grad_fn=<{self.grad_fn.name}>")
        elif self.requires_grad:
            extra.append("requires_grad=True")
        return f"tensor({body}, {', '.join(extra)})"

    __str__ = __repr__

    # -- autograd ------------------------------------------------------------------------

    def detach(self) -> Tensor:
        """The same values, cut from the graph (shards are shared, as torch shares storage).

        The detached tensor of a view is a view of the same base, as in torch: writes into either reach the
        base, and each reads the base's later writes.
        """
        if self._lazy is not None:
            return self._lazy.tensor()
        if self._view_of is not None:
            _refresh_view(self)
        if self._local is not None:
            out = Tensor._from_local(_detached(self._local))
        elif self._shards is None:  # a meta tensor stays one
            out = Tensor._meta(self._shape or (), self._dtype, self._placement, self._sbp)  # type: ignore[arg-type]
        else:
            shards = {r: _detached(t) for r, t in self._shards.items()}
            out = Tensor._from_shards(self._shape or (), self._dtype, self._placement, self._sbp,  # type: ignore[arg-type]
                                      shards)
        if self._view_of is not None:
            out._view_of = self._view_of.copy()
        return out

    def detach_(self) -> Tensor:
        """Cuts this tensor from the graph in place: it becomes a leaf that needs no gradient (as torch)."""
        self.grad_fn = None
        self._out_index = 0
        self.requires_grad = False
        return self

    @property
    def data(self) -> Tensor:
        """The same values and storage, cut from the graph (``detach()``), as ``torch.Tensor.data``."""
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        """Makes this tensor hold ``value``'s storage, shape, dtype and layout, keeping its identity and autograd
        state (``p.data = new`` in optimizer code). The version bumps, so a graph that saved the old value
        raises instead of using the new one, and boxed copies of the old value are dropped."""
        if not isinstance(value, Tensor):
            raise SbpflowError(f"x.data = ... needs an sbpflow Tensor, but got {type(value).__name__}; "
                               f"target {self._describe()}")
        self._take_storage(value)
        self._version += 1
        if self._boxed is not None:
            self._boxed = {}

    def _take_storage(self, src: Tensor) -> None:
        """Holds ``src``'s layout and shards (the same storage), keeping this tensor's identity and autograd state."""
        for name in ("_shape", "_dtype", "_placement", "_sbp", "_shards", "_local"):
            object.__setattr__(self, name, getattr(src, name))
        if getattr(self, "_boxed", None) is not None:  # copies of the old shards (a leaf's slices too) are stale
            self._boxed = {}  # (a Parameter takes its storage before its autograd fields exist)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        if not self.is_leaf:
            raise AutogradError("requires_grad_() applies to leaf tensors; use .detach().requires_grad_()")
        if flag and not (self.dtype.is_floating_point or self.dtype.is_complex):
            raise AutogradError(f"only floating-point tensors can require gradients, but got {self._describe()}")
        self.requires_grad = flag
        return self

    def retain_grad(self) -> None:
        note_output_hooks()  # backward looks for retained gradients from now on
        self._retains_grad = True

    def register_hook(self, hook: Callable[[Tensor], Tensor | None]) -> Callable[[], None]:
        """Calls ``hook(grad)`` when this tensor's gradient is computed; a returned tensor replaces it."""
        note_output_hooks()  # backward looks for hooks on op outputs from now on
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(hook)
        hooks = self._hooks
        if self.grad_fn is not None:  # the node keeps the list too: backward may outlive this tensor object
            if self.grad_fn.out_hooks is None:
                self.grad_fn.out_hooks = {}
            self.grad_fn.out_hooks[self._out_index] = hooks
        return lambda: hooks.remove(hook)

    # -- in-place support ----------------------------------------------------------------

    def _assign(self, value: Tensor) -> Tensor:
        """Copies ``value`` (already in this tensor's layout) into this tensor's storage."""
        if self._lazy is not None or value._lazy is not None:  # traced: the lazy handle (graph.trace.Lazy) records it
            lazy = self._lazy if self._lazy is not None else value._lazy
            return lazy.assign(self, value)  # type: ignore[no-any-return]
        if self.is_meta:  # metadata only: nothing to write (an initialiser under meta_init)
            self._version += 1
            return self
        if value.is_meta:
            _metamod.refuse(value, f"writing it into a tensor with data ({self._describe()})")
        if self._local is not None:
            _copy_into(self._local, value.to_local())
        else:
            src = value._shards or {}
            for r, t in (self._shards or {}).items():
                _copy_into(t, src[r])
        self._version += 1
        return self


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, where ``src`` may be a torch view of ``dst`` (a reshape kernel can return one, and a
    write through a view copies it back): the same elements are skipped, overlapping ones copied via a clone."""
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        if src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride() and src.shape == dst.shape:
            return
        src = src.clone()
    dst.copy_(src)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without torch autograd history; itself when it has none (shards of sbpflow results never do), which
    spares autograd's saved outputs a torch call per shard."""
    return t.detach() if t.requires_grad or t.grad_fn is not None else t


def logical_value(t: Tensor) -> torch.Tensor:
    """The whole logical value as one torch tensor (boxing to broadcast if needed).

    Every process gets it, also one that owns no rank of the placement: the
    value is then boxed onto a placement that covers every process.
    """
    if t._view_of is not None:
        _refresh_view(t)
    if t._local is not None:
        return t._local
    if t._lazy is not None:
        t._lazy.refuse_data("reading its value (item, numpy, tolist, bool, print)")
    if t.is_meta:
        _metamod.refuse(t, "reading its value (item, numpy, tolist, bool)")
    placement = get_backend().everywhere(t.placement)
    target = boxing.Layout(placement, (broadcast,) * placement.ndim)
    plan = boxing.plan(tuple(t.shape), t.dtype, _layout(t), target)
    with activity("reading a logical value (numpy, item, tolist, print)"):
        shards = boxing.execute(plan, t._shards or {})
    if not shards:
        raise SbpflowError(f"this process holds no shard of the tensor with {t._describe()}")
    return shards[min(shards)]


def _zigzag_dim(nd_sbp: NdSbp) -> int:
    """The tensor dim of the zigzag entry (a shard of two logical pieces is stored along it)."""
    axis = zigzag_axis(nd_sbp)
    assert axis is not None
    return nd_sbp[axis].dim  # type: ignore[union-attr]


def _refresh_view(t: Tensor) -> None:
    """A view whose base was written since it was taken shows the base's new values (ops.views.Link.refresh)."""
    t._view_of.refresh(t)


def _layout(t: Tensor) -> boxing.Layout:
    return boxing.Layout(t.placement, t.sbp)


def shards_from_full(
    value: torch.Tensor, placement: Placement, nd_sbp: NdSbp, ranks: Sequence[int] | None = None
) -> dict[int, torch.Tensor]:
    """Cuts a full logical value into the shards this process owns (each its own memory)."""
    backend = get_backend()
    out = {}
    shape = tuple(value.shape)
    for r in ranks if ranks is not None else backend.owned(placement.flat_ranks):
        pieces = [value[tuple(slice(a, b) for a, b in box)] for box in logical_pieces(shape, placement, nd_sbp, r)]
        piece = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=_zigzag_dim(nd_sbp))
        coords = placement.coords(r)
        zero = any(isinstance(s, Partial) and s.op == "sum" and c != 0 for s, c in zip(nd_sbp, coords, strict=True))
        device = backend.device_for(placement.type, r)
        out[r] = torch.zeros_like(piece, device=device) if zero else piece.to(device, copy=True)
    return out
