"""The comm backend interface: moves shards between global ranks, ``{rank: tensor}`` in and out.

A process owns some ranks (the simulated backend all, a torch.distributed process one) and passes only
those. Every shape a receiver cannot know is passed in, so uneven shards need no extra round trip.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .record import emit

if TYPE_CHECKING:
    from ..boxing.plan import Plan
    from ..placement import Placement

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Transfer:
    """One point-to-point piece: ``src`` sends ``tensor`` (known on src only) to ``dst``."""

    src: int
    dst: int
    shape: Shape
    dtype: torch.dtype


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor made per call (on a comm thread each torch call may hand the GIL over)


class PendingReduce(Protocol):
    """An all-reduce issued by :meth:`Backend.all_reduce_async`; ``wait()`` gives its ``{rank: tensor}`` result."""

    def wait(self) -> dict[int, torch.Tensor]: ...


class Pending(Protocol):
    """A collective issued without waiting (:meth:`Backend.all_gather_async`); ``wait()`` gives its result."""

    def wait(self) -> Any: ...


class Completed:
    """A collective that finished when it was issued (the simulated backend, one-member groups)."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result


# How the cluster's transports compose collectives the planner prices as one step: gloo (cpu) has no
# reduce-scatter, torch.distributed runs it as an all-reduce, twice the bytes (NCCL has one). Every backend costs
# with these (Backend.cost_factors), so a plan made on virtual ranks is the cluster's plan.
TARGET_COST_FACTORS: tuple[tuple[tuple[str, str], float], ...] = ((("cpu", "reduce_scatter"), 2.0),)


KERNEL_CHANNEL = "kernel"  # the channel (Backend.on_channel) of communicating kernels' collectives


class Backend(ABC):
    """Base class of comm backends; subclasses implement the ``_``-prefixed primitives.

    A collective is issued by every owned member of ``group`` (global ranks in mesh order); ``op`` is
    ``"sum"``, ``"max"`` or ``"min"``. A process records (:mod:`.record`) only the collectives it joins."""

    name = "base"
    # whether a collective issued without waiting (all_reduce_async, ...) can progress while the caller computes:
    # a transport with threads of its own; on one process's virtual ranks it completes when issued
    in_flight = False

    @abstractmethod
    def owns(self, rank: int) -> bool:
        """Whether this process holds the shard of global rank ``rank``."""

    def owned(self, ranks: Iterable[int]) -> list[int]:
        return [r for r in ranks if self.owns(r)]

    @abstractmethod
    def device_for(self, device_type: str, rank: int) -> torch.device:
        """The torch device that holds rank ``rank``'s shards for a placement type."""

    def prepare(self, plan: Plan) -> None:  # noqa: B027 - optional hook, a no-op unless a backend needs it
        """Called on every process before ``plan`` runs; nothing by default.

        Every process runs every boxing plan in the same order, even one owning no rank of its placements, so a
        multi-process backend creates its process groups here (creation is collective over the whole job)."""

    def prepare_channel(self, placement: Placement, channel: str) -> None:  # noqa: B027 - optional hook
        """Called on every process, in one order: the process groups of ``placement``'s axes for ``channel`` (see
        :meth:`on_channel`); nothing by default."""

    def on_channel(self, channel: str) -> AbstractContextManager[None]:
        """Collectives issued in this block by this thread go over ``channel``'s own process groups (made by
        :meth:`prepare_channel`): a kernel that talks on a thread of its own then never interleaves with other
        threads' collectives over the same ranks. A no-op by default (one thread issues everything)."""
        return nullcontext()

    def cost_factors(self) -> tuple[tuple[tuple[str, str], float], ...]:
        """``((device_type, step kind), factor)``: how many times the planner's α-β time and bytes a step
        costs on the cluster's transports, for collectives they compose from others (:data:`TARGET_COST_FACTORS`).
        Every backend gives the target's factors, virtual ranks included: eager dispatch and compiled plans then
        choose the same collectives on a laptop as on the cluster, whichever backend executes them."""
        return TARGET_COST_FACTORS

    def cost_factor(self, kind: str, device_type: str) -> float:
        for key, factor in self.cost_factors():
            if key == (device_type, kind):
                return factor
        return 1.0

    def local_shapes(self, placement: Placement, shape: Shape) -> dict[int, Shape]:
        """Every rank's local shape when each process offers ``shape`` as its ranks' shard (local_to_global).

        One process owns every rank here, so all ranks offer the same shape.
        """
        return {r: tuple(shape) for r in placement.flat_ranks}

    def check_replicas(  # noqa: B027 - optional hook, a no-op unless a backend has processes to compare
        self, placement: Placement, nd_sbp: Any, shards: dict[int, torch.Tensor], what: str
    ) -> None:
        """Under ``SBPFLOW_DEBUG``, checks that ranks holding replicas of one value along a B axis hold equal ones.

        Called where per-process data becomes a global tensor (``to_global`` of a local tensor, ``tensor(...,
        placement=)``). One process here builds every replica from one value, so they cannot differ.
        """

    def barrier(self) -> None:  # noqa: B027 - one process has nothing to wait for
        """Returns once every process of the job has called it (file writers use it to agree a save is done)."""

    def everywhere(self, placement: Placement) -> Placement:
        """A placement on which every process owns a rank: where ``.numpy()`` gathers a value to."""
        return placement

    # -- collectives; each records itself, then calls the primitive ---------------

    def all_gather(
        self, group: tuple[int, ...], inputs: dict[int, torch.Tensor], shapes: Sequence[Shape], dtype: torch.dtype
    ) -> dict[int, list[torch.Tensor]]:
        """Every member gets every member's tensor: ``out[r][j]`` came from ``group[j]``."""
        total = sum(nbytes(s, dtype) for s in shapes)
        emit("all_gather", group, (len(group) - 1) * total)
        return self._all_gather(group, inputs, shapes, dtype)

    def all_gather_async(self, group: tuple[int, ...], inputs: dict[int, torch.Tensor], shapes: Sequence[Shape],
                         dtype: torch.dtype) -> Pending:
        """:meth:`all_gather` that returns at once; ``wait()`` gives its result (the same rules as
        :meth:`all_reduce_async`)."""
        total = sum(nbytes(s, dtype) for s in shapes)
        emit("all_gather", group, (len(group) - 1) * total)
        return self._all_gather_async(group, inputs, shapes, dtype)

    def all_reduce(self, group: tuple[int, ...], inputs: dict[int, torch.Tensor], op: str,
                   donate: bool = False) -> dict[int, torch.Tensor]:
        """Every member gets the reduction of every member's tensor. ``donate=True`` hands the inputs over (no
        one reads them afterwards): a backend may reduce in them instead of in a copy (see
        :meth:`all_reduce_async`)."""
        t = next(iter(inputs.values())) if inputs else None
        size = nbytes(t.shape, t.dtype) if t is not None else 0
        emit("all_reduce", group, 2 * (len(group) - 1) * size)
        return self._all_reduce(group, inputs, op, donate)

    def all_reduce_async(self, group: tuple[int, ...], inputs: dict[int, torch.Tensor], op: str,
                         donate: bool = False) -> PendingReduce:
        """:meth:`all_reduce` that returns at once; the caller may compute meanwhile and ``wait()`` for the result.

        Recorded when issued, as the blocking one. Every process must issue its asynchronous collectives in
        the same order as its blocking ones (the same program), and may wait for them in any order.
        ``donate=True`` hands the (contiguous) inputs over: a backend may reduce in them instead of in a copy,
        as gradient buckets allow (a bucket's flat buffer is built for the reduction and read by no one else).
        """
        t = next(iter(inputs.values())) if inputs else None
        size = nbytes(t.shape, t.dtype) if t is not None else 0
        emit("all_reduce", group, 2 * (len(group) - 1) * size)
        return self._all_reduce_async(group, inputs, op, donate)

    def reduce_scatter(
        self, group: tuple[int, ...], inputs: dict[int, list[torch.Tensor]], op: str
    ) -> dict[int, torch.Tensor]:
        """``inputs[r][j]`` is rank r's piece for ``group[j]``; member j gets the reduction of its pieces."""
        chunks = next(iter(inputs.values())) if inputs else []
        size = sum(nbytes(c.shape, c.dtype) for c in chunks)
        factor = self.cost_factor("reduce_scatter", chunks[0].device.type) if chunks else 1.0
        emit("reduce_scatter", group, int(factor * (len(group) - 1) * size))
        return self._reduce_scatter(group, inputs, op)

    def all_to_all(
        self,
        group: tuple[int, ...],
        inputs: dict[int, list[torch.Tensor]],
        recv_shapes: dict[int, list[Shape]],
        dtype: torch.dtype,
        total_bytes: int,
    ) -> dict[int, list[torch.Tensor]]:
        """``inputs[r][j]`` goes to ``group[j]``; ``out[r][j]`` came from ``group[j]``."""
        emit("all_to_all", group, total_bytes)
        return self._all_to_all(group, inputs, recv_shapes, dtype)

    def all_to_all_rows(
        self, group: tuple[int, ...], inputs: dict[int, torch.Tensor], send_rows: dict[int, list[int]],
        recv_rows: dict[int, list[int]],
    ) -> dict[int, torch.Tensor]:
        """Rows of one tensor per member: the ``send_rows[r][j]`` rows after those for members before ``j`` go to
        ``group[j]``; ``out[r]`` holds the ``recv_rows[r][j]`` rows from each member, in member order (uneven,
        data-dependent sizes; torch's ``all_to_all_single`` with split sizes)."""
        mine = list(inputs)
        if not mine:
            return {}
        sample = inputs[mine[0]]
        row = nbytes(tuple(sample.shape[1:]), sample.dtype)
        emit("all_to_all", group, sum(row * n for r in mine for j, n in enumerate(recv_rows[r]) if group[j] != r))
        return self._all_to_all_rows(group, inputs, send_rows, recv_rows)

    def _all_to_all_rows(self, group, inputs, send_rows, recv_rows):  # type: ignore[no-untyped-def]
        """Default: :meth:`_all_to_all` of the pieces, concatenated."""
        sample = next(iter(inputs.values()))
        tail = tuple(sample.shape[1:])
        pieces = {r: list(torch.split(t, send_rows[r])) for r, t in inputs.items()}
        shapes = {r: [(n, *tail) for n in recv_rows[r]] for r in inputs}
        got = self._all_to_all(group, pieces, shapes, sample.dtype)
        return {r: torch.cat(got[r]) for r in inputs}

    def broadcast(
        self, group: tuple[int, ...], root: int, inputs: dict[int, torch.Tensor], shape: Shape, dtype: torch.dtype,
        device_type: str = "cpu",
    ) -> dict[int, torch.Tensor]:
        """``root`` (a member) sends its tensor to every member; results lie on ``device_type`` devices."""
        if not self.owned(group):
            return {}
        emit("broadcast", group, (len(group) - 1) * nbytes(shape, dtype))
        return self._broadcast(group, root, inputs, shape, dtype, device_type)

    def reduce(
        self, group: tuple[int, ...], root: int, inputs: dict[int, torch.Tensor], op: str, shape: Shape,
        dtype: torch.dtype,
    ) -> dict[int, torch.Tensor]:
        """``root`` (a member) gets the reduction of every member's tensor."""
        if not self.owned(group):
            return {}
        emit("reduce", group, (len(group) - 1) * nbytes(shape, dtype))
        return self._reduce(group, root, inputs, op, shape, dtype)

    def send_recv(
        self, transfers: Sequence[Transfer], tensors: dict[int, torch.Tensor], device_type: str = "cpu"
    ) -> dict[int, torch.Tensor]:
        """Point-to-point pieces. ``tensors[i]`` is transfer i's payload where its src is owned;
        the result maps i to the received tensor where its dst is owned. ``device_type`` is
        "cuda" when both ends are cuda placements (a backend may then move pieces GPU to GPU)."""
        self._emit_send_recv(transfers)
        return self._send_recv(transfers, tensors, device_type)

    def send_recv_async(self, transfers: Sequence[Transfer], tensors: dict[int, torch.Tensor]) -> Pending:
        """:meth:`send_recv` of cpu pieces that returns once the sends and receives are posted; ``wait()`` gives
        the received tensors (the same rules as :meth:`all_reduce_async`). A process that only sends need not
        wait: the backend holds its sends until they are out, at the latest until :meth:`settle_sends`."""
        self._emit_send_recv(transfers)
        return self._send_recv_async(transfers, tensors)

    def settle_sends(self) -> None:  # noqa: B027 - a backend whose sends complete when posted holds none
        """Waits for the sends :meth:`send_recv_async` posted that nobody waited for (an executor calls it at the
        end of a step: its peers receive them within their step, which needs nothing more of this process)."""

    def _emit_send_recv(self, transfers: Sequence[Transfer]) -> None:
        moved = [t for t in transfers if t.src != t.dst]
        if moved and any(self.owns(t.src) or self.owns(t.dst) for t in moved):
            ranks = tuple(sorted({t.src for t in moved} | {t.dst for t in moved}))
            emit("send_recv", ranks, sum(nbytes(t.shape, t.dtype) for t in moved))

    # -- primitives ---------------------------------------------------------------

    @abstractmethod
    def _all_gather(self, group, inputs, shapes, dtype):  # type: ignore[no-untyped-def]
        ...

    @abstractmethod
    def _all_reduce(self, group, inputs, op, donate=False):  # type: ignore[no-untyped-def]
        ...

    def _send_recv_async(self, transfers, tensors):  # type: ignore[no-untyped-def]
        """Default: the blocking primitive, complete when posted."""
        return Completed(self._send_recv(transfers, tensors, "cpu"))

    def _all_gather_async(self, group, inputs, shapes, dtype):  # type: ignore[no-untyped-def]
        """Default: the blocking primitive, complete when issued (a backend whose transport has threads of its
        own overrides it)."""
        return Completed(self._all_gather(group, inputs, shapes, dtype))

    def _all_reduce_async(self, group, inputs, op, donate=False):  # type: ignore[no-untyped-def]
        """A backend without asynchronous collectives reduces at once."""
        return Completed(self._all_reduce(group, inputs, op))

    @abstractmethod
    def _reduce_scatter(self, group, inputs, op):  # type: ignore[no-untyped-def]
        ...

    @abstractmethod
    def _all_to_all(self, group, inputs, recv_shapes, dtype):  # type: ignore[no-untyped-def]
        ...

    @abstractmethod
    def _broadcast(self, group, root, inputs, shape, dtype, device_type):  # type: ignore[no-untyped-def]
        ...

    @abstractmethod
    def _reduce(self, group, root, inputs, op, shape, dtype):  # type: ignore[no-untyped-def]
        ...

    @abstractmethod
    def _send_recv(self, transfers, tensors, device_type):  # type: ignore[no-untyped-def]
        ...


# 16-bit floats whose sums every backend accumulates in fp32 and casts back: the simulated backend must give
# the numbers a real one gives, and summing bf16 pieces in bf16 loses digits at every addition.
WIDENED_SUMS = (torch.bfloat16, torch.float16)


def reduce_tensors(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Elementwise reduction of same-shaped tensors, in a fixed order (deterministic); 16-bit sums in fp32."""
    dtype = tensors[0].dtype
    widen = op == "sum" and dtype in WIDENED_SUMS
    out = tensors[0].float() if widen else tensors[0].clone()
    for t in tensors[1:]:
        if op == "sum":
            out.add_(t)
        elif op == "max":
            torch.maximum(out, t, out=out)
        else:
            torch.minimum(out, t, out=out)
    return out.to(dtype) if widen else out
