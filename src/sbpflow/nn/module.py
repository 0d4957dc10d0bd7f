"""Module and Parameter: the container that owns parameters, buffers and child modules, as torch's does; a
model is built once and then placed (:meth:`Module.to_global` re-lays it out in place).

>>> import sbpflow
>>> lin = sbpflow.nn.Linear(4, 3)
>>> _ = lin.to_global(sbpflow.placement("cpu", [0, 1]), sbpflow.sbp.broadcast)
>>> [name for name, _ in lin.named_parameters()], lin.weight.sbp, lin.weight.is_leaf, lin.weight.requires_grad
(['weight', 'bias'], (Broadcast(),), True, True)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..autograd import is_grad_enabled, no_grad
from ..autograd.engine import zero_grads
from ..errors import AutogradError, LocalGlobalError, PlacementError, SbpError, SbpflowError, ShapeError
from ..ops import functional as F
from ..placement import Placement
from ..sbp import NdSbp, broadcast, normalize
from ..tensor import Tensor, logical_value, shards_from_full
from . import hooks


class Parameter(Tensor):
    """A leaf tensor that a Module registers as a parameter (requires grad by default).

    ``Parameter(t)`` shares ``t``'s storage, cut from any graph. It is an
    sbpflow Tensor in every respect (``isinstance(p, sbpflow.Tensor)``).

    >>> import sbpflow
    >>> p = sbpflow.nn.Parameter(sbpflow.zeros(2, 3))
    >>> p.requires_grad, p.is_leaf, isinstance(p, sbpflow.Tensor)
    (True, True, True)
    """

    __slots__ = ()

    def __new__(cls, data: Tensor | None = None, requires_grad: bool = True) -> Parameter:
        if data is None:
            data = Tensor._from_local(torch.empty(0))
        if not isinstance(data, Tensor):
            raise SbpflowError(
                f"nn.Parameter needs an sbpflow Tensor, but got {type(data).__name__}; "
                "build it with sbpflow.tensor(...)"
            )
        self: Parameter = object.__new__(cls)
        self._take_storage(data.detach())
        self._init_autograd(False)
        if requires_grad:
            self.requires_grad_(True)
        return self

    def __init__(self, data: Tensor | None = None, requires_grad: bool = True) -> None:
        pass  # everything happens in __new__ (Tensor.__init__ refuses direct construction)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()

    __str__ = __repr__


class Buffer(Tensor):
    """A tensor that a Module registers as a buffer when assigned (torch's ``nn.Buffer``): state, not a parameter.

    >>> import sbpflow
    >>> m = sbpflow.nn.Module()
    >>> m.scale = sbpflow.nn.Buffer(sbpflow.ones(2), persistent=False)
    >>> [n for n, _ in m.named_buffers()], list(m.state_dict())
    (['scale'], [])
    """

    __slots__ = ("persistent",)
    persistent: bool

    def __new__(cls, data: Tensor, persistent: bool = True) -> Buffer:
        if not isinstance(data, Tensor):
            raise SbpflowError(f"nn.Buffer needs an sbpflow Tensor, but got {type(data).__name__}")
        self: Buffer = object.__new__(cls)
        self._take_storage(data.detach())
        self._init_autograd(False)
        self.persistent = persistent
        return self

    def __init__(self, data: Tensor, persistent: bool = True) -> None:
        pass  # everything happens in __new__


def relayout_(t: Tensor, placement: Placement, sbp: Any) -> Tensor:
    """Re-lays out leaf ``t`` in place to ``(placement, sbp)``, keeping its logical value and identity.

    A local tensor is cut into shards from its full value; a global one is
    boxed. Its ``.grad``, if any, moves with it. Internal helper of
    :meth:`Module.to_global` and :func:`sbpflow.nn.parallel.apply_plan`.
    """
    nd = normalize(sbp, placement, t.ndim, what=f"tensor with {t._describe()}")
    with no_grad():
        moved = _moved(t, placement, nd)
        grad = _moved(t.grad, placement, nd) if t.grad is not None else None
    t._take_storage(moved)
    t.grad = grad
    t._version += 1
    return t


def _moved(t: Tensor, placement: Placement, nd: NdSbp) -> Tensor:
    if t.is_meta:  # built under sbpflow.meta_init(): a layout and no data, before and after
        return Tensor._meta(tuple(t.shape), t.dtype, placement, nd)
    if not t.is_global:
        value = t.to_local()
        shards = shards_from_full(value, placement, nd)
        return Tensor._from_shards(tuple(value.shape), value.dtype, placement, nd, shards)
    if t.placement == placement and t.sbp == nd:
        return t
    return t.detach().to_global(placement, nd)


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class Module:
    """Base class of every layer; subclasses define ``forward``.

    >>> import sbpflow
    >>> from sbpflow import nn
    >>> class Mlp(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
    ...     def forward(self, x):
    ...         return self.fc2(sbpflow.functional.relu(self.fc1(x)))
    >>> Mlp()(sbpflow.randn(3, 4)).shape
    torch.Size([3, 2])
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_pre_hooks", {})  # hook id -> hook, in call order (see nn.hooks)
        object.__setattr__(self, "_forward_hooks", {})  # hook id -> (hook, with_kwargs)
        object.__setattr__(self, "_backward_hooks", {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Pre-hooks, forward, forward hooks; with full backward hooks, the inputs and the output pass through
        identity nodes that hand the boundary's gradients to the hooks (as torch orders them). An op that mixes
        local and global tensors raises a :class:`LocalGlobalError` that names the innermost module it ran in."""
        try:  # (free in Python 3.11 when nothing is raised)
            if not (self._pre_hooks or self._backward_hooks or self._forward_hooks):  # no hooks: forward alone
                return self.forward(*args, **kwargs)
            return self._call_hooked(args, kwargs)
        except LocalGlobalError as e:
            if e.module is not None:
                raise
            raise mixed_layouts(self, args, str(e)) from None

    def _call_hooked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for hook in list(self._pre_hooks.values()):
            out = hook(self, args)
            if out is not None:
                args = out if isinstance(out, tuple) else (out,)
        boundary = None
        if self._backward_hooks and is_grad_enabled():
            boundary, args = hooks.wrap_inputs(self, args, list(self._backward_hooks.values()))
        output = self.forward(*args, **kwargs)
        for hook, with_kwargs in list(self._forward_hooks.values()):
            result = hook(self, args, kwargs, output) if with_kwargs else hook(self, args, output)
            output = output if result is None else result
        return output if boundary is None else hooks.wrap_outputs(boundary, output)

    def register_forward_pre_hook(self, hook: Callable[[Module, tuple[Any, ...]], Any], *,
                                  prepend: bool = False) -> hooks.RemovableHandle:
        """Runs ``hook(module, args)`` before forward; a returned value (tuple or one input) replaces ``args``."""
        return hooks.add_hook(self._pre_hooks, hook, prepend)

    def register_forward_hook(self, hook: Callable[..., Any], *, prepend: bool = False,
                              with_kwargs: bool = False) -> hooks.RemovableHandle:
        """Runs ``hook(module, args, output)`` after forward (``hook(module, args, kwargs, output)`` with
        ``with_kwargs``); a returned value replaces the output. ``handle.remove()`` unregisters it.

        >>> import sbpflow
        >>> lin = sbpflow.nn.Linear(2, 3)
        >>> handle = lin.register_forward_hook(lambda m, args, out: out.relu())
        >>> bool((lin(sbpflow.randn(4, 2)) >= 0).all())
        True
        >>> handle.remove()
        """
        return hooks.add_hook(self._forward_hooks, (hook, with_kwargs), prepend)

    def register_full_backward_hook(self, hook: Callable[..., Any], *, prepend: bool = False) -> hooks.RemovableHandle:
        """Runs ``hook(module, grad_input, grad_output)`` when backward has the gradients of the module's
        positional inputs (None for those that need none) and of its outputs; a returned tuple replaces
        ``grad_input``. Gradients keep their layouts: under a split batch they are split too."""
        return hooks.add_hook(self._backward_hooks, hook, prepend)

    # -- registration ----------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise SbpflowError(f"{type(self).__name__}: call super().__init__() before assigning attributes")
        params, buffers, modules = self._parameters, self._buffers, self._modules
        if isinstance(value, Parameter):
            self._forget(name, keep=params)
            params[name] = value
        elif isinstance(value, Module):
            self._forget(name, keep=modules)
            modules[name] = value
        elif isinstance(value, Buffer):
            self.register_buffer(name, value, value.persistent)
        elif name in params:
            if value is not None:
                raise SbpflowError(
                    f"{type(self).__name__}.{name} is a parameter; assign an nn.Parameter (or None), "
                    f"not {type(value).__name__}"
                )
            params[name] = None
        elif name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise SbpflowError(f"{type(self).__name__}.{name} is a buffer; assign an sbpflow Tensor or None")
            buffers[name] = value
        elif name in modules and value is None:
            modules[name] = None
        else:
            object.__setattr__(self, name, value)

    def _forget(self, name: str, keep: Any = None) -> None:
        """Drops ``name`` from every table but ``keep`` (re-assigning keeps its place, as torch)."""
        for table in (self._parameters, self._buffers, self._modules):
            if table is not keep:
                table.pop(name, None)
        self._non_persistent.discard(name)
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: parameters, buffers and modules live in tables.
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            entries = d.get(table)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        if name in self._parameters or name in self._buffers or name in self._modules:
            self._forget(name)
        else:
            object.__delattr__(self, name)

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """A tensor that is state but not a parameter (running statistics); in ``state_dict`` if persistent."""
        if tensor is not None and not isinstance(tensor, Tensor):
            raise SbpflowError(
                f"register_buffer({name!r}) needs an sbpflow Tensor or None, not {type(tensor).__name__}"
            )
        self._forget(name)
        self._buffers[name] = tensor
        if not persistent:
            self._non_persistent.add(name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if param is not None and not isinstance(param, Parameter):
            raise SbpflowError(f"register_parameter({name!r}) needs an nn.Parameter or None")
        self._forget(name)
        self._parameters[name] = param

    def add_module(self, name: str, module: Module | None) -> None:
        self._forget(name)
        self._modules[name] = module

    # -- traversal -------------------------------------------------------------------------------

    def named_modules(self, prefix: str = "", memo: set[int] | None = None) -> Iterator[tuple[str, Module]]:
        """``(qualified name, module)`` for this module and every descendant, each once; the root is ``""``."""
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child.named_modules(f"{prefix}.{name}" if prefix else name, memo)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, Module]]:
        for name, child in self._modules.items():
            if child is not None:
                yield name, child

    def children(self) -> Iterator[Module]:
        for _, child in self.named_children():
            yield child

    def _named_members(self, table: str, prefix: str, recurse: bool) -> Iterator[tuple[str, Tensor]]:
        seen: set[int] = set()
        mods = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mod_prefix, mod in mods:
            for name, t in getattr(mod, table).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), t

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Parameter]]:
        """``(qualified name, parameter)``; a parameter shared by two modules appears once."""
        yield from self._named_members("_parameters", prefix, recurse)  # type: ignore[misc]

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Tensor]]:
        yield from self._named_members("_buffers", prefix, recurse)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def apply(self, fn: Callable[[Module], None]) -> Module:
        """Calls ``fn`` on every submodule (children first) and on this module."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    # -- modes and gradients ---------------------------------------------------------------------

    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def requires_grad_(self, flag: bool = True) -> Module:
        for p in self.parameters():
            p.requires_grad_(flag)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears every parameter's gradient (``None`` by default, else zeros in the grad's layout)."""
        zero_grads(self.parameters(), set_to_none)

    # -- dtype and device (torch's Module.to, .float(), .half() ...) ------------------------------

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``m.to(torch.float16)``, ``m.to("cpu")``, ``m.to(device, dtype)``: converts the floating-point
        parameters and buffers (and gradients) in place, shard by shard, keeping their layouts and identities.

        A global tensor's device comes from its placement: ``to("cuda")`` moves local tensors only and asks
        for ``to_global(sbpflow.placement("cuda", ...))`` for global ones. ``m.to(nn.graph.GraphModule)`` is
        OneFlow's way to reach the module's graph options (``.activation_checkpointing``, ``.set_stage``).

        >>> import sbpflow, torch
        >>> m = sbpflow.nn.Linear(2, 2).to(torch.float64)
        >>> m.weight.dtype, m(sbpflow.randn(1, 2, dtype=torch.float64)).dtype
        (torch.float64, torch.float64)
        """
        if len(args) == 1 and isinstance(args[0], type) and hasattr(args[0], "of_module"):
            return args[0].of_module(self)  # type: ignore[no-any-return]  # OneFlow's module.to(nn.graph.GraphModule)
        dtype, device = kwargs.get("dtype"), kwargs.get("device")
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, (str, torch.device)):
                device = torch.device(a)
            elif isinstance(a, Tensor):
                dtype = a.dtype
            else:
                raise SbpflowError(f"Module.to() takes a dtype, a device or a tensor, but got {a!r}")
        device = torch.device(device) if device is not None else None
        tensors = list(self.parameters()) + [b for b in self.buffers() if b is not None]
        for t in tensors:
            _check_device_move(t, device)
        for t in tensors:
            for holder in (t, t.grad):
                if holder is not None and (holder.dtype.is_floating_point or holder.dtype.is_complex):
                    _convert(holder, dtype, device)
        return self

    def float(self) -> Module:
        return self.to(torch.float32)

    def double(self) -> Module:
        return self.to(torch.float64)

    def half(self) -> Module:
        return self.to(torch.float16)

    def bfloat16(self) -> Module:
        return self.to(torch.bfloat16)

    def cpu(self) -> Module:
        return self.to("cpu")

    def cuda(self, device: Any = None) -> Module:
        return self.to(torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"))

    # -- layout ----------------------------------------------------------------------------------

    def to_global(self, placement: Placement, sbp: Any = None) -> Module:
        """Re-lays out every parameter and buffer in place to ``placement`` and ``sbp`` (all B by default).

        Parameters stay the same objects (leaves that require grad), so it is
        safe to build an optimizer before or after. ``sbp`` applies to every
        tensor; use :func:`sbpflow.nn.parallel.apply_plan` for per-layer SBPs.

        >>> import sbpflow
        >>> m = sbpflow.nn.Linear(4, 2).to_global(sbpflow.placement("cpu", [0, 1]))
        >>> m.weight.sbp
        (Broadcast(),)
        """
        if not isinstance(placement, Placement):
            raise SbpError(f"Module.to_global(placement=...) needs an sbpflow.placement, but got {placement!r}")
        nd = (broadcast,) * placement.ndim if sbp is None else sbp
        for _, t in self._all_tensors():
            relayout_(t, placement, nd)
        return self

    def _all_tensors(self) -> Iterator[tuple[str, Tensor]]:
        yield from self.named_parameters()
        yield from self.named_buffers()

    # -- state dict ------------------------------------------------------------------------------

    def state_dict(self, prefix: str = "") -> OrderedDict[str, Tensor]:
        """Qualified name -> tensor (detached, sharing storage) for parameters and persistent buffers."""
        out: OrderedDict[str, Tensor] = OrderedDict()
        for mod_prefix, mod in self.named_modules(prefix.rstrip(".")):
            for name, p in mod._parameters.items():
                if p is not None:
                    out[f"{mod_prefix}.{name}" if mod_prefix else name] = p.detach()
            for name, b in mod._buffers.items():
                if b is not None and name not in mod._non_persistent:
                    out[f"{mod_prefix}.{name}" if mod_prefix else name] = b.detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> _IncompatibleKeys:
        """Copies values into parameters and buffers in place, keeping each one's placement and SBP.

        Values may be sbpflow tensors (any layout), torch tensors or NumPy arrays
        (logical values), so ``load_state_dict(torch_module.state_dict())`` works.
        """
        own = self._persistent_tensors()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise SbpflowError(
                f"load_state_dict into {type(self).__name__}: the keys must match exactly, but "
                f"missing keys: {missing}, unexpected keys: {unexpected}"
            )
        sources = {name: _checked_source(target, state_dict[name], name)
                   for name, target in own.items() if name in state_dict}  # every entry checked before any copy
        with no_grad():
            for name, source in sources.items():
                own[name]._assign(_in_layout_of(own[name], source))
        return _IncompatibleKeys(missing, unexpected)

    def _persistent_tensors(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for mod_prefix, mod in self.named_modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    if t is not None and name not in mod._non_persistent:
                        out[f"{mod_prefix}.{name}" if mod_prefix else name] = t
        return out

    # -- repr ------------------------------------------------------------------------------------

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"({name}): " + _indent(repr(child)) for name, child in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers) | set(self._modules))


def mixed_layouts(module: Module, args: Sequence[Any], detail: str = "") -> LocalGlobalError:
    """The error for a module whose tensors are local given global inputs, or the other way round."""
    named: tuple[str, Tensor] | None = next(iter(module.named_parameters()), None)
    named = next(iter(module.named_buffers()), None) if named is None else named
    inputs = "; ".join(f"input {i}: {a._describe()}" for i, a in enumerate(args) if isinstance(a, Tensor))
    if named is None:
        held, fix = "holds no tensors", "use one kind of tensor (local or global) throughout"
    elif named[1].is_global:
        held, fix = f"holds global tensors ({named[0]}: {named[1]._describe()})", \
            "convert the inputs with .to_global(placement, sbp)"
    else:
        held, fix = f"holds local tensors ({named[0]}: {named[1]._describe()})", \
            "convert the module with .to_global(placement, sbp)"
    name = type(module).__name__
    error = LocalGlobalError(f"{name} {held}, but got {inputs}; {fix}" + (f" ({detail})" if detail else ""))
    error.module = name
    return error


def check_input_layout(module: Module, x: Tensor) -> None:
    """Refuses an input of another kind (local, global) or placement than ``module``'s own tensors, before a
    forward that updates state (running statistics) changes anything."""
    for t in list(module._parameters.values()) + list(module._buffers.values()):
        if t is None:
            continue
        if t.is_global != x.is_global:
            raise mixed_layouts(module, (x,))
        if t.is_global and t.placement != x.placement:
            raise PlacementError(f"{type(module).__name__} holds tensors on {t.placement} ({t._describe()}), but got "
                                 f"input {x._describe()}; move the input with .to_global(placement={t.placement})")


def _check_device_move(t: Tensor, device: torch.device | None) -> None:
    if device is not None and t.is_global and t.placement.type != device.type:
        raise SbpflowError(f"Module.to({str(device)!r}) cannot move a global tensor ({t._describe()}): its placement "
                           f"says where it lives; use module.to_global(sbpflow.placement({device.type!r}, ranks))")


def _convert(t: Tensor, dtype: torch.dtype | None, device: torch.device | None) -> None:
    """``t``'s shards converted in place (same object, same layout)."""
    def move(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device if t._local is not None else None, dtype=dtype)

    if t._local is not None:
        t._take_storage(Tensor._from_local(move(t._local)))
    elif t._shards is not None:
        shards = {r: move(x) for r, x in t._shards.items()}
        t._take_storage(Tensor._from_shards(tuple(t.shape), dtype or t.dtype, t.placement, t.sbp, shards))


def _indent(text: str) -> str:
    return text.replace("\n", "\n  ")


def _checked_source(target: Tensor, value: Any, name: str) -> Any:
    """``value`` as a tensor that fits ``target`` (its shape), or the error that refuses it."""
    if isinstance(value, Tensor):
        source: Any = value
    elif isinstance(value, torch.Tensor):
        source = value.detach()
    elif isinstance(value, np.ndarray):
        source = torch.from_numpy(np.ascontiguousarray(value))
    else:
        raise SbpflowError(f"load_state_dict: {name!r} needs a tensor or array, but got {type(value).__name__}")
    if tuple(source.shape) != tuple(target.shape):
        raise ShapeError(
            f"load_state_dict: {name!r} has shape {list(target.shape)} in the module, but the state dict holds "
            f"shape {list(source.shape)}"
        )
    if target.requires_grad and not target.is_leaf:
        raise AutogradError(f"load_state_dict: {name!r} is not a leaf")
    return source


def _in_layout_of(target: Tensor, source: Any) -> Tensor:
    """``source`` (sbpflow or torch tensor) as an sbpflow tensor with ``target``'s layout and dtype."""
    if isinstance(source, Tensor):
        if target.is_global and source.is_global:
            source = F.cast(source, target.dtype) if source.dtype != target.dtype else source
            return source.to_global(target.placement, target.sbp)
        source = logical_value(source)
    value = source.to(target.dtype)
    if not target.is_global:
        return Tensor._from_local(value)
    shards = shards_from_full(value, target.placement, target.sbp)
    return Tensor._from_shards(tuple(value.shape), value.dtype, target.placement, target.sbp, shards)
