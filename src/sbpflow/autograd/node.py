"""The autograd node: one recorded op application, what backward needs to compute its input gradients.

Dispatch records nodes (below the engine, which walks them).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..tensor import Tensor

if TYPE_CHECKING:
    from ..ops.schema import OpDef


class Node:
    """One recorded op application: what backward needs to compute input gradients.

    It is also what the op's gradient function gets as ``ctx``: ``ctx.inputs`` (tensor inputs), ``ctx.args``
    (tensors and scalars in call order), ``ctx.outputs`` (kept with ``save_outputs``), ``ctx.attrs`` and
    ``ctx.needs_input_grad`` (one flag per tensor input). Gradient functions run with recording off, so the
    inputs themselves are safe to use (no detached copies).
    """

    __slots__ = ("op", "inputs", "versions", "outputs", "out_refs", "out_meta", "args", "attrs", "needs_input_grad",
                 "freed", "out_hooks", "__weakref__")

    def __init__(self, op: OpDef, inputs: Sequence[Any], outputs: Sequence[Tensor], attrs: dict[str, Any],
                 save_outputs: bool) -> None:
        self.op = op
        self.args = args = tuple(inputs) if op.grad_reads is None else _unread_as_shells(inputs, op.grad_reads)
        tensors: list[Tensor] = []
        versions: list[int] = []
        needs: list[bool] = []
        for a in args:  # one pass: the tensor inputs, their versions, which need a gradient
            if isinstance(a, Tensor):
                tensors.append(a)
                versions.append(a._version)
                needs.append(a.requires_grad)
        self.inputs = tuple(tensors)
        self.versions = tuple(versions)
        self.outputs = tuple([o.detach() for o in outputs]) if save_outputs else ()
        self.out_refs: tuple[weakref.ref[Tensor], ...]
        self.out_meta: tuple[Any, ...]
        if len(outputs) == 1:
            self.out_refs = (weakref.ref(outputs[0]),)
            self.out_meta = ()
        else:
            self.out_refs = tuple([weakref.ref(o) for o in outputs])
            # with several outputs, one may be dropped before backward (max's indices): keep what its zeros need
            self.out_meta = tuple([(tuple(o.shape), o.dtype, o._placement, o._sbp) for o in outputs])
        self.attrs = attrs
        self.needs_input_grad = tuple(needs)
        self.freed = False
        # output index -> that output's hook list (Tensor.register_hook): the hooks run even if the output itself
        # is gone by the time backward reaches this node (as torch keeps hooks on the graph, not on the tensor)
        self.out_hooks: dict[int, list[Any]] | None = None

    @property
    def name(self) -> str:
        return f"{self.op.name}_backward"


def _unread_as_shells(args: Sequence[Any], reads: tuple[int, ...]) -> tuple[Any, ...]:
    """The op's arguments with every computed tensor input whose value the gradient does not read replaced by
    its shell (metadata and autograd identity, no data: :meth:`Tensor._shell`). Leaves stay (their identity
    receives the gradient; whoever made them holds them anyway), and so do traced (lazy) tensors, which hold
    no data."""
    out = []
    index = 0
    for a in args:
        if isinstance(a, Tensor):
            if index not in reads and a.grad_fn is not None and a._lazy is None:
                a = a._shell()
            index += 1
        out.append(a)
    return tuple(out)
