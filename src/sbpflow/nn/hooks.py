"""Module hooks: removable handles, and the identity nodes behind full backward hooks.

>>> import sbpflow
>>> lin = sbpflow.nn.Linear(3, 2)
>>> seen = []
>>> handle = lin.register_full_backward_hook(lambda m, gi, go: seen.append((gi[0].shape, go[0].shape)))
>>> lin(sbpflow.randn(4, 3, requires_grad=True)).sum().backward()
>>> seen
[(torch.Size([4, 3]), torch.Size([4, 2]))]
>>> handle.remove()
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..autograd import is_grad_enabled
from ..errors import AutogradError
from ..ops.dispatch import record
from ..ops.schema import OpDef
from ..tensor import Tensor

if TYPE_CHECKING:
    from .module import Module

_ids = itertools.count()  # hook ids: unique, so removing one registration never removes another


class RemovableHandle:
    """What ``register_*_hook`` returns: ``handle.remove()`` (or ``handle()``, or a ``with`` block) unregisters."""

    def __init__(self, table: dict[int, Any]) -> None:
        self._table = table
        self.id = next(_ids)

    def remove(self) -> None:
        self._table.pop(self.id, None)

    __call__ = remove

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def add_hook(table: dict[int, Any], hook: Any, prepend: bool = False) -> RemovableHandle:
    """Registers ``hook`` in ``table`` (called in insertion order; ``prepend`` puts it first)."""
    handle = RemovableHandle(table)
    table[handle.id] = hook
    if prepend:
        rest = [(k, v) for k, v in table.items() if k != handle.id]
        table.clear()
        table[handle.id] = hook
        table.update(rest)
    return handle


# -- full backward hooks ---------------------------------------------------------------------------------


# A full backward hook needs the gradients at the module's boundary, which backward never gathers in one place:
# grad_output arrives at the outputs, grad_input leaves at the inputs. So, as in torch, the tensor inputs and the
# outputs each pass through one identity node: the outputs' node remembers grad_output, and the inputs' node,
# reached last, calls the hooks with both and passes on what they return. The identities share their inputs'
# shards: the hooks cost no copy and no communication.
class _Boundary:
    """One forward call's state, shared by its two identity nodes."""

    def __init__(self, module: Module, args: tuple[Any, ...], hooks: list[Callable[..., Any]]) -> None:
        self.module = module
        self.n_args = len(args)
        self.hooks = hooks  # the hooks registered when forward ran, as torch uses
        self.positions: list[int] = []  # which positional args went through the inputs' identity node
        self.grad_output: tuple[Any, ...] = ()

    def call_hooks(self, grad_input: tuple[Any, ...]) -> tuple[Any, ...]:
        for hook in self.hooks:
            result = hook(self.module, grad_input, self.grad_output)
            if result is None:
                continue
            result = tuple(result) if isinstance(result, (tuple, list)) else (result,)
            if len(result) != len(grad_input):
                raise AutogradError(
                    f"a full backward hook of {type(self.module).__name__} returned {len(result)} gradients, but the "
                    f"module's forward takes {len(grad_input)} positional inputs (one entry each, None allowed)"
                )
            grad_input = result
        return grad_input


def _identity_def(name: str) -> OpDef:
    # not a registered op: it never dispatches, it only records a node whose gradient runs the hooks
    return OpDef(name, kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [], shard_aware=False,
                 save_outputs=False, differentiable=True, mesh_aware=False)


_inputs_def = _identity_def("module_backward_hook_inputs")
_outputs_def = _identity_def("module_backward_hook_outputs")


@_inputs_def.grad
def _inputs_grad(ctx: Any, *grads: Any) -> Any:
    boundary: _Boundary = ctx.attrs["boundary"]
    grad_input: list[Any] = [None] * boundary.n_args
    for pos, g in zip(boundary.positions, grads, strict=True):
        grad_input[pos] = g
    result = boundary.call_hooks(tuple(grad_input))
    return tuple(result[pos] for pos in boundary.positions)


@_outputs_def.grad
def _outputs_grad(ctx: Any, *grads: Any) -> Any:
    boundary: _Boundary = ctx.attrs["boundary"]
    boundary.grad_output = grads
    if not boundary.positions:  # no input needs a gradient: torch calls the hooks here, with grad_input all None
        boundary.call_hooks((None,) * boundary.n_args)
    return grads


def _alias(t: Tensor) -> Tensor:
    return t.detach()  # the same shards: an identity needs no copy


def wrap_inputs(module: Module, args: tuple[Any, ...], hooks: list[Callable[..., Any]]) -> tuple[_Boundary, tuple]:  # type: ignore[type-arg]
    """Passes the positional tensor args that need gradients through one identity node."""
    boundary = _Boundary(module, args, hooks)
    boundary.positions = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
    if not boundary.positions:
        return boundary, args
    inputs = tuple(args[i] for i in boundary.positions)
    aliases = tuple(_alias(t) for t in inputs)
    record(_inputs_def, inputs, {"boundary": boundary}, aliases)
    new_args = list(args)
    for pos, alias in zip(boundary.positions, aliases, strict=True):
        new_args[pos] = alias
    return boundary, tuple(new_args)


def wrap_outputs(boundary: _Boundary, output: Any) -> Any:
    """Passes the module's output tensor(s) through the outputs' identity node (a tensor or a tuple/list of them)."""
    single = isinstance(output, Tensor)
    items = [output] if single else list(output) if isinstance(output, (tuple, list)) else None
    if items is None:
        raise AutogradError(f"a full backward hook needs {type(boundary.module).__name__}'s forward to return a "
                            f"tensor or a tuple of tensors, but it returned {type(output).__name__}")
    slots = [i for i, o in enumerate(items) if isinstance(o, Tensor) and o.requires_grad]
    if not slots or not is_grad_enabled():
        return output
    tensors = tuple(items[i] for i in slots)
    aliases = tuple(_alias(t) for t in tensors)
    record(_outputs_def, tensors, {"boundary": boundary}, aliases)
    for i, alias in zip(slots, aliases, strict=True):
        items[i] = alias
    return items[0] if single else type(output)(items)
