"""One process per rank: shards move through torch.distributed (gloo for cpu, NCCL for cuda)."""

from __future__ import annotations

import datetime
import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._layout import numel
from ..distributed import Config, activity, activity_now, current_activity
from ..errors import CommError, PlacementError
from ..placement import Placement
from ..sbp import Broadcast
from .base import WIDENED_SUMS, Backend, Completed, Shape, Transfer
from .rendezvous import join_default_group

if TYPE_CHECKING:
    from ..boxing.plan import Plan
    from ..placement import Placement

Group = tuple[int, ...]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# How each boxing primitive maps onto torch.distributed:
#
#   primitive        gloo (cpu placements)                      NCCL (cuda placements)
#   all_gather       all_gather_single of flat shards padded     same
#                    to the largest (uneven shards)
#   all_reduce       all_reduce                                  all_reduce
#   reduce_scatter   one all_reduce of the concatenated pieces,  reduce_scatter_tensor of flat pieces padded
#                    each member keeps its own: 2x the bytes     to the largest
#   all_to_all       all_to_all_single with split sizes          same
#                    (uneven pieces flattened into one buffer)
#   all_to_all_rows  all_to_all_single on the rows themselves,   same
#                    data-dependent split sizes (MoE dispatch)
#   broadcast        broadcast                                   broadcast
#   reduce           reduce                                      reduce
#   send_recv        isend/irecv, tag = piece index              batch_isend_irecv
#
# gloo has no reduce-scatter (torch's runs one all-reduce per destination), so sbpflow runs one all-reduce: twice
# the ring reduce-scatter's bytes. base.TARGET_COST_FACTORS says so, the planner multiplies that step's cost by it
# (on virtual ranks too), and the recorder counts the real bytes.
class TorchDistBackend(Backend):
    """Owns global rank ``config.rank``; joins the default (gloo) process group on construction.

    Every group has the ``SBPFLOW_TIMEOUT`` timeout; a collective that fails or times out raises a CommError
    naming the op or boxing step it ran in. With ``SBPFLOW_DEBUG=1`` each collective is preceded by an exchange
    of fingerprints (kind, group, shapes, dtype) over the gloo group of its ranks, and a mismatch raises with
    every member's side. On NCCL a collective that outlives the timeout is aborted by torch's watchdog, which
    ends the process; the gloo check still reports mismatches before any NCCL call is issued.
    """

    name = "torch.distributed"
    in_flight = True  # gloo's and NCCL's own threads and streams move the bytes

    def __init__(self, config: Config) -> None:
        self.config = config
        self.rank = config.rank
        self.world_size = config.world_size
        self.timeout = datetime.timedelta(seconds=config.timeout)
        self._groups: dict[tuple[str, Group], Any] = {}  # (transport, sorted ranks) -> ProcessGroup
        self._ready: set[Any] = set()  # placements (and rank sets) whose groups exist
        # sends posted in flight that nobody waits for (a process that only sends): gloo drops a send whose work
        # object goes before the peer posted its receive, so they are held until settle_sends()
        self._sending: list[_Pending] = []
        self._channel = threading.local()  # .name: the channel this thread's collectives use (on_channel)
        if torch.cuda.is_available():
            torch.cuda.set_device(config.local_rank)
        if not dist.is_initialized():
            self._call("init_process_group", tuple(range(self.world_size)), self._init_process_group)

    def _init_process_group(self) -> None:
        """Joins the default gloo group through the job's store (:mod:`.rendezvous`: start-up failures say what
        failed). Under torchrun's agent store, which outlives a failed attempt of a job restarted by
        ``--max-restarts``, the keys go under a prefix of this attempt: the dead processes' must not be read."""
        join_default_group(self.config, self.timeout)

    def close(self) -> None:
        """Leaves every group and the default process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._groups.clear()
        self._ready.clear()

    # -- ownership and devices ------------------------------------------------------------

    def owns(self, rank: int) -> bool:
        return rank == self.rank

    def owned(self, ranks: Iterable[int]) -> list[int]:
        ranks = tuple(ranks)
        self._check_ranks(ranks)
        return [self.rank] if self.rank in ranks else []

    def _check_ranks(self, ranks: Sequence[int]) -> None:
        if ranks and max(ranks) >= self.world_size:
            raise PlacementError(
                f"placement ranks must be below the number of processes, {self.world_size} (ranks 0.."
                f"{self.world_size - 1}), but ranks {list(ranks)} include {max(ranks)}; launch more processes "
                f"(sbpflow launch -n {max(ranks) + 1}) or use fewer ranks"
            )

    def device_for(self, device_type: str, rank: int) -> torch.device:
        if device_type == "cuda":
            return torch.device("cuda", self.config.local_rank)
        return torch.device("cpu")

    def everywhere(self, placement: Placement) -> Placement:
        if set(placement.flat_ranks) >= set(range(self.world_size)):
            return placement
        return Placement(placement.type, list(range(self.world_size)))

    def barrier(self) -> None:
        """Waits (at most SBPFLOW_TIMEOUT) until every process of the job reaches the same barrier."""
        self._call("barrier", tuple(range(self.world_size)), lambda: dist.monitored_barrier(timeout=self.timeout)
                   if self.world_size > 1 else None)

    # -- process groups -------------------------------------------------------------------

    def prepare(self, plan: Plan) -> None:
        for step in plan.steps:
            for placement in (step.src.placement, step.dst.placement):
                if placement not in self._ready:
                    self._prepare_placement(placement)
            if step.kind == "send_recv" and self.config.debug:
                union = tuple(sorted(set(step.src.placement.flat_ranks) | set(step.dst.placement.flat_ranks)))
                self._ensure(union, "gloo")

    def _prepare_placement(self, placement: Placement) -> None:
        """Creates the groups of every axis rank set and of all ranks, in one order on every process.

        Called on the first plan that touches ``placement``, on every process (group creation is collective
        over the job). Groups are cached by (transport, sorted ranks); cuda rank sets get an NCCL group next to
        the gloo one, which then carries only the debug fingerprints."""
        self._check_ranks(placement.flat_ranks)
        rank_sets: list[Group] = []
        for axis in range(placement.ndim):
            rank_sets += placement.axis_groups(axis)
        rank_sets.append(placement.flat_ranks)
        if placement.type == "cuda":
            self._ensure(tuple(range(self.world_size)), "nccl")  # point-to-point pieces between GPUs
        for ranks in rank_sets:
            self._ensure(tuple(sorted(ranks)), "gloo")
            if placement.type == "cuda":
                self._ensure(tuple(sorted(ranks)), "nccl")
        self._ready.add(placement)

    def _ensure(self, ranks: Group, transport: str, channel: str = "") -> None:
        key = (transport + channel, ranks)
        if key in self._groups or len(ranks) < 2:
            return
        if transport == "gloo" and len(ranks) == self.world_size and not channel:
            self._groups[key] = dist.group.WORLD
            return
        self._groups[key] = self._call(
            f"new_group({transport})", ranks,
            lambda: dist.new_group(list(ranks), timeout=self.timeout, backend=transport))

    def prepare_channel(self, placement: Placement, channel: str) -> None:
        """Groups of every axis rank set of ``placement`` for ``channel``, made on every process in one order."""
        if (placement, channel) in self._ready:
            return
        self._check_ranks(placement.flat_ranks)
        transport = "nccl" if placement.type == "cuda" else "gloo"
        for axis in range(placement.ndim):
            for ranks in placement.axis_groups(axis):
                self._ensure(tuple(sorted(ranks)), transport, ":" + channel)
        self._ready.add((placement, channel))

    @contextmanager
    def on_channel(self, channel: str) -> Iterator[None]:
        before = getattr(self._channel, "name", "")
        self._channel.name = ":" + channel
        try:
            yield
        finally:
            self._channel.name = before

    def _group(self, group: Group, device: torch.device) -> Any:
        transport = "nccl" if device.type == "cuda" else "gloo"
        pg = self._groups.get((transport + getattr(self._channel, "name", ""), tuple(sorted(group))))
        if pg is None:
            raise CommError(
                f"internal: no {transport} process group for ranks {list(group)} on rank {self.rank} while "
                f"running {current_activity()}; groups are created by prepare() before a plan runs"
            )
        return pg

    # -- errors and debug checks ----------------------------------------------------------

    def _call(self, kind: str, group: Group, fn: Callable[[], Any]) -> Any:
        """Runs a torch.distributed call; a failure or timeout becomes a CommError that says where we were."""
        try:
            return fn()
        except CommError:
            raise
        except (RuntimeError, ValueError) as e:  # DistBackendError, DistStoreError, gloo errors
            error = CommError(self._explain(kind, group, e))
            # read by sbpflow.distributed.peer_failed: this rank failed because another one went away
            error.peer_failed = _closed(e)  # type: ignore[attr-defined]
            raise error from e

    def _explain(self, kind: str, group: Group, error: Exception) -> str:
        text = str(error)
        lowered = text.lower()
        if _closed(error):
            why = "a peer closed its connection: another rank probably failed (see its output)"
        elif "timed out" in lowered or "timeout" in lowered:
            why = (f"timed out after {self.config.timeout:g} s (SBPFLOW_TIMEOUT) waiting for the other ranks; one of "
                   "them may have failed, or skipped or reordered this collective (SBPFLOW_DEBUG=1 compares the "
                   "collectives every rank issues)")
        else:
            why = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        return f"{kind} on ranks {list(group)} failed on rank {self.rank} while running {current_activity()}: {why}"

    def _check_same(self, kind: str, group: Group, what: tuple[Any, ...]) -> None:
        """SBPFLOW_DEBUG: every member states what it is about to issue; any difference raises."""
        if not self.config.debug or len(group) < 2:
            return
        pg = self._groups.get(("gloo", tuple(sorted(group))))
        mine = (kind, tuple(group)) + what
        sides: list[Any] = [None] * len(group)
        self._call(f"debug check before {kind}", group,
                   lambda: dist.all_gather_object(sides, (mine, current_activity()), group=pg))
        if any(side[0] != mine for side in sides):
            members = sorted(group)
            lines = [f"  rank {members[i]}: {_fingerprint(side[0])}  in {side[1]}" for i, side in enumerate(sides)]
            raise CommError(
                f"ranks {members} issue different collectives (SBPFLOW_DEBUG check, seen on rank {self.rank}); "
                "every rank of a group must run the same ops in the same order:\n" + "\n".join(lines)
            )

    # -- collectives ------------------------------------------------------------------------

    def _all_gather(self, group, inputs, shapes, dtype):  # type: ignore[no-untyped-def]
        return self._all_gather_async(group, inputs, shapes, dtype, blocking=True).wait()

    def _all_gather_async(self, group, inputs, shapes, dtype, blocking=False):  # type: ignore[no-untyped-def]
        mine = inputs[self.rank]
        if len(group) == 1:
            return Completed({self.rank: [mine]})
        self._check_same("all_gather", group, (tuple(map(tuple, shapes)), str(dtype)))
        biggest = max(numel(s) for s in shapes)
        if biggest == 0:
            return Completed({self.rank: [torch.empty(s, dtype=dtype, device=mine.device) for s in shapes]})
        flat = _padded(mine, biggest)
        out = torch.empty(len(group) * biggest, dtype=flat.dtype, device=flat.device)
        pg = self._group(group, mine.device)
        work = self._call("all_gather" if blocking else "all_gather (async)", group,
                          lambda: dist.all_gather_single(out, flat, group=pg, async_op=not blocking))
        slots = out.view(len(group), biggest)
        order = sorted(group)  # torch orders a group's members by global rank
        return _Pending(self, "an all_gather", group, [work], lambda: {self.rank: [
            _unflat(slots[order.index(g)], shapes[j], dtype) for j, g in enumerate(group)]}, blocking=blocking)

    def _all_reduce(self, group, inputs, op, donate=False):  # type: ignore[no-untyped-def]
        return self._all_reduce_async(group, inputs, op, donate, blocking=True).wait()

    def _all_reduce_async(self, group, inputs, op, donate=False, blocking=False):  # type: ignore[no-untyped-def]
        mine = inputs[self.rank]
        if len(group) == 1:
            return Completed({self.rank: mine if donate else mine.clone()})
        self._check_same("all_reduce", group, (tuple(mine.shape), str(mine.dtype), op))
        own = mine if donate and mine.is_contiguous() else mine.contiguous().clone()  # donated: no copy
        buffer, reduce_op = _reduction_buffer(own, op)
        pg = self._group(group, mine.device)
        work = self._call("all_reduce" if blocking else "all_reduce (async)", group,
                          lambda: dist.all_reduce(buffer, op=reduce_op, group=pg, async_op=not blocking))
        return _Pending(self, "an all_reduce", group, [work],
                        lambda: {self.rank: buffer.to(mine.dtype).view(mine.shape)}, blocking=blocking)

    def _reduce_scatter(self, group, inputs, op):  # type: ignore[no-untyped-def]
        pieces = inputs[self.rank]
        me = group.index(self.rank)
        if len(group) == 1:
            return {self.rank: pieces[0].clone()}
        shapes = [tuple(p.shape) for p in pieces]
        self._check_same("reduce_scatter", group, (tuple(shapes), str(pieces[0].dtype), op))
        device, dtype = pieces[0].device, pieces[0].dtype
        pg = self._group(group, device)
        if device.type == "cuda":
            return {self.rank: self._reduce_scatter_nccl(group, pieces, op, pg)}
        # gloo: one all-reduce of every piece, each member keeps its own (see the table above the class)
        buffer, reduce_op = _reduction_buffer(torch.cat([p.reshape(-1) for p in pieces]), op)
        self._call("reduce_scatter (as all_reduce)", group, lambda: dist.all_reduce(buffer, op=reduce_op, group=pg))
        start = sum(numel(s) for s in shapes[:me])
        mine = buffer[start : start + numel(shapes[me])]
        return {self.rank: mine.to(dtype).view(shapes[me]).clone()}

    def _reduce_scatter_nccl(self, group: Group, pieces: list[torch.Tensor], op: str, pg: Any) -> torch.Tensor:
        order = sorted(group)
        biggest = max(p.numel() for p in pieces)
        me = group.index(self.rank)
        # torch sends chunk i of the input to group member i (by global rank order)
        ordered = [pieces[group.index(g)] for g in order]
        buffer, reduce_op = _reduction_buffer(torch.cat([_padded(p, biggest) for p in ordered]), op)
        out = torch.empty(biggest, dtype=buffer.dtype, device=buffer.device)
        self._call("reduce_scatter", group,
                   lambda: dist.reduce_scatter_tensor(out, buffer, op=reduce_op, group=pg))
        return _unflat(out.to(pieces[me].dtype), tuple(pieces[me].shape), pieces[me].dtype).clone()

    def _all_to_all(self, group, inputs, recv_shapes, dtype):  # type: ignore[no-untyped-def]
        pieces = inputs[self.rank]
        shapes = recv_shapes[self.rank]
        if len(group) == 1:
            return {self.rank: [pieces[0]]}
        order = sorted(group)
        send = [pieces[group.index(g)] for g in order]  # torch's split i goes to the i-th lowest rank
        recv = [shapes[group.index(g)] for g in order]
        self._check_same("all_to_all", group, (str(dtype),))  # piece shapes differ per member
        device = pieces[0].device
        send_buf = torch.cat([p.reshape(-1) for p in send])
        recv_buf = torch.empty(sum(numel(s) for s in recv), dtype=dtype, device=device)
        pg = self._group(group, device)
        self._call("all_to_all", group, lambda: dist.all_to_all_single(
            recv_buf, send_buf, output_split_sizes=[numel(s) for s in recv],
            input_split_sizes=[p.numel() for p in send], group=pg))
        chunks = torch.split(recv_buf, [numel(s) for s in recv])
        by_rank = {g: c.view(s) for g, c, s in zip(order, chunks, recv, strict=True)}
        return {self.rank: [by_rank[g] for g in group]}

    def _all_to_all_rows(self, group, inputs, send_rows, recv_rows):  # type: ignore[no-untyped-def]
        if len(group) == 1 or list(group) != sorted(group):  # torch's split i goes to the i-th lowest rank
            return super()._all_to_all_rows(group, inputs, send_rows, recv_rows)
        rows = inputs[self.rank].contiguous()
        out = rows.new_empty((sum(recv_rows[self.rank]), *rows.shape[1:]))
        self._check_same("all_to_all", group, (str(rows.dtype), tuple(rows.shape[1:])))
        pg = self._group(group, rows.device)
        self._call("all_to_all", group, lambda: dist.all_to_all_single(
            out, rows, output_split_sizes=recv_rows[self.rank], input_split_sizes=send_rows[self.rank], group=pg))
        return {self.rank: out}

    def _broadcast(self, group, root, inputs, shape, dtype, device_type):  # type: ignore[no-untyped-def]
        device = self.device_for(device_type, self.rank)
        if self.rank == root:
            buffer = inputs[root].to(device).contiguous().clone()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)
        if len(group) == 1:
            return {self.rank: buffer}
        self._check_same("broadcast", group, (tuple(shape), str(dtype), root))
        work, _ = _reducible(buffer, "sum")
        pg = self._group(group, device)
        self._call("broadcast", group, lambda: dist.broadcast(work, src=root, group=pg))
        return {self.rank: work.to(dtype).view(shape)}

    def _reduce(self, group, root, inputs, op, shape, dtype):  # type: ignore[no-untyped-def]
        mine = inputs[self.rank]
        if len(group) == 1:
            return {self.rank: mine.clone()}
        self._check_same("reduce", group, (tuple(shape), str(dtype), root, op))
        buffer, reduce_op = _reduction_buffer(mine.contiguous().clone(), op)
        pg = self._group(group, mine.device)
        self._call("reduce", group, lambda: dist.reduce(buffer, dst=root, op=reduce_op, group=pg))
        return {root: buffer.to(dtype).view(shape)} if self.rank == root else {}

    def _send_recv(self, transfers, tensors, device_type):  # type: ignore[no-untyped-def]
        return self._send_recv_async(transfers, tensors, device_type, blocking=True).wait()

    def _send_recv_async(self, transfers, tensors, device_type="cpu", blocking=False):  # type: ignore[no-untyped-def]
        moved = [t for t in transfers if t.src != t.dst]
        involved = tuple(sorted({t.src for t in moved} | {t.dst for t in moved}))
        if self.rank in involved:
            self._check_same("send_recv", involved, (tuple(moved),))
        out: dict[int, torch.Tensor] = {}
        device = self.device_for(device_type, self.rank)
        ops: list[tuple[str, int, torch.Tensor, int]] = []  # (send | recv, peer, buffer, transfer index)
        for i, t in enumerate(transfers):
            if t.src == t.dst:
                if self.owns(t.src):
                    out[i] = tensors[i]
            elif self.owns(t.src):
                payload = tensors[i] if tensors[i].device == device else tensors[i].to(device)  # no call for nothing:
                ops.append(("send", t.dst, _reducible(payload.contiguous(), "sum")[0], i))  # each may pass the GIL
            elif self.owns(t.dst):
                ops.append(("recv", t.src, _recv_buffer(t, device), i))
        works: Sequence[Any] = self._call("send_recv", involved, lambda: self._post_p2p(ops, device)) if ops else []

        def received() -> dict[int, torch.Tensor]:
            for kind, _, buffer, i in ops:
                if kind == "recv":
                    out[i] = buffer if buffer.dtype == transfers[i].dtype else buffer.to(transfers[i].dtype)
            return out

        pending = _Pending(self, "a send_recv", involved, works, received, call="send_recv", blocking=blocking)
        if blocking:
            pending.wait()
        elif any(kind == "send" for kind, *_ in ops):
            self._hold(pending)
        return pending

    def _release(self, pending: _Pending) -> None:
        """Drops a waited-for ``pending`` from the held sends: its buffers (a ring's K/V blocks, a pipeline's
        activations) are then freed as soon as its caller lets go, not at :meth:`settle_sends`."""
        try:
            self._sending.remove(pending)
        except ValueError:  # not held (nothing sent, blocking), or settle_sends took the list meanwhile
            pass

    def _hold(self, pending: _Pending) -> None:
        """Keeps ``pending`` until :meth:`settle_sends` (its work objects own the buffers gloo sends from); past
        ``SENDS_HELD`` the oldest are waited for, long since received unless a peer is stuck (then its timeout
        says so)."""
        sending = self._sending
        sending.append(pending)
        if len(sending) > SENDS_HELD:
            old, self._sending = sending[: SENDS_HELD // 2], sending[SENDS_HELD // 2:]
            for p in old:
                p.wait()

    def settle_sends(self) -> None:
        sending, self._sending = self._sending, []
        for p in sending:
            p.wait()

    def _post_p2p(self, ops: list[tuple[str, int, torch.Tensor, int]], device: torch.device) -> Sequence[Any]:
        if device.type == "cuda":
            pg = self._groups[("nccl", tuple(range(self.world_size)))]
            batch = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, buf, peer, group=pg)
                     for kind, peer, buf, _ in ops]
            return dist.batch_isend_irecv(batch)
        # the default group's own send/recv (peers are global ranks, the default group's): dist.isend and irecv
        # add checks and look-ups that cost about as much as posting a small message
        pg = dist.group.WORLD
        assert pg is not None  # prepare() ran: the process group exists
        return [pg.send([_wire(buf)], peer, i) if kind == "send" else pg.recv([_wire(buf)], peer, i)
                for kind, peer, buf, i in ops]

    # -- local_to_global --------------------------------------------------------------------

    def check_replicas(self, placement: Placement, nd_sbp: Any, shards: dict[int, torch.Tensor], what: str) -> None:
        """SBPFLOW_DEBUG: every process states a digest of its shard; ranks that are replicas of one another along
        a B axis (every other mesh coordinate equal) must agree, or a CommError names them and the digests."""
        if not self.config.debug or not any(isinstance(s, Broadcast) for s in nd_sbp):
            return
        mine = shards.get(self.rank)
        digest = None if mine is None else _digest(mine)
        everyone: list[Any] = [None] * self.world_size
        self._call(f"debug check of {what}", tuple(range(self.world_size)),
                   lambda: dist.all_gather_object(everyone, (self.rank, digest)))
        digests = dict(everyone)
        for axis, s in enumerate(nd_sbp):
            if not isinstance(s, Broadcast):
                continue
            for group in placement.axis_groups(axis):
                if len({digests[r] for r in group}) > 1:
                    sides = "\n".join(f"  rank {r}: {digests[r]}" for r in group)
                    raise CommError(
                        f"{what}: ranks {list(group)} hold replicas of one value along mesh axis {axis} (sbp "
                        f"{', '.join(map(str, nd_sbp))} on {placement}), but their values differ (SBPFLOW_DEBUG "
                        f"check, seen on rank {self.rank}); every process must pass the same value for a B "
                        f"tensor:\n{sides}"
                    )

    def local_shapes(self, placement: Placement, shape: Shape) -> dict[int, Shape]:
        """Each process states its shard's shape (every process calls this, members or not)."""
        self._check_ranks(placement.flat_ranks)
        offer = tuple(shape) if self.rank in placement.flat_ranks else None
        everyone: list[Any] = [None] * self.world_size
        self._call("local shape exchange", tuple(range(self.world_size)),
                   lambda: dist.all_gather_object(everyone, (self.rank, offer)))
        shapes = dict(everyone)
        return {r: shapes[r] for r in placement.flat_ranks}


SENDS_HELD = 1024  # sends in flight held before the oldest are waited for (TorchDistBackend._hold)


class _Pending:
    """A collective posted on torch.distributed's threads: ``wait()`` waits for its work objects (up to the backend's
    timeout; a None work: posted blocking, already done), then gives ``finish()``, the result cut from the buffers
    they wrote. Errors surface in ``wait()``, naming what was running when it was issued."""

    __slots__ = ("backend", "what", "group", "works", "finish", "call", "issued_in", "result", "done")
    issued_in: Callable[[], str] | None

    def __init__(self, backend: TorchDistBackend, what: str, group: Group, works: Sequence[Any],
                 finish: Callable[[], Any], call: str | None = None, blocking: bool = False) -> None:
        self.backend, self.what, self.group, self.works, self.finish = backend, what, group, works, finish
        self.call = call or f"{what.split()[-1]} (async)"  # the name comm errors give the wait
        # what was running when it was issued (waited for at once when blocking: the same), formatted only for an
        # error: naming a boxing step costs more than posting a small send
        self.issued_in = None if blocking else activity_now()
        self.result: Any = None
        self.done = False

    def wait(self) -> Any:
        if not self.done:
            backend, works = self.backend, [w for w in self.works if w is not None]
            if works:
                def finish() -> None:
                    for work in works:
                        work.wait(backend.timeout)

                issued, what = self.issued_in or activity_now(), self.what
                with activity(lambda: f"waiting for {what} issued in {issued()}"):
                    backend._call(self.call, self.group, finish)
            self.result, self.done, self.works = self.finish(), True, []
            self.backend._release(self)
        return self.result


# ----------------------------------------------------------------------------- helpers


def _closed(error: Exception) -> bool:
    """Whether a transport error means a peer went away (gloo: "Connection closed by peer", resets)."""
    text = str(error).lower()
    return "closed by peer" in text or "connection reset" in text or "broken pipe" in text or (
        "connection closed" in text and "timeout" not in text)


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` flattened and padded with zeros to ``length`` elements (uneven shards in equal-size collectives)."""
    flat = _reducible(t.contiguous().reshape(-1), "sum")[0]
    if flat.numel() == length:
        return flat
    out = torch.zeros(length, dtype=flat.dtype, device=flat.device)
    out[: flat.numel()] = flat
    return out


def _unflat(flat: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
    return flat[: numel(shape)].to(dtype).view(shape)


def _reducible(t: torch.Tensor, op: str) -> tuple[torch.Tensor, Any]:
    """A buffer the transport can reduce and the ReduceOp to use.

    bool travels as uint8; a sum of bools is their logical or (as torch's ``add_``
    on bool tensors), which is a max on 0/1 values.
    """
    if t.dtype == torch.bool:
        return t.to(torch.uint8), _OPS["max" if op == "sum" else op]
    return t, _OPS[op]


def _reduction_buffer(t: torch.Tensor, op: str) -> tuple[torch.Tensor, Any]:
    """Like :func:`_reducible`, but a sum of bf16/fp16 runs in fp32 (cast back by the caller), as NCCL users expect:
    adding many 16-bit partial sums in 16 bits loses digits at every hop of the ring."""
    if op == "sum" and t.dtype in WIDENED_SUMS:
        return t.float(), _OPS[op]
    return _reducible(t, op)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What gloo moves for ``t``: complex values as pairs of reals (a view: a receive lands in ``t``)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _recv_buffer(t: Transfer, device: torch.device) -> torch.Tensor:
    dtype = torch.uint8 if t.dtype == torch.bool else t.dtype
    return torch.empty(t.shape, dtype=dtype, device=device)


def _digest(t: torch.Tensor) -> str:
    """Shape, dtype and a hash of the bytes: equal exactly when two shards hold the same values."""
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')} sha1 {hashlib.sha1(raw).hexdigest()[:12]}"


def _fingerprint(side: tuple[Any, ...]) -> str:
    kind, group, *rest = side
    return f"{kind} on ranks {list(group)} with {', '.join(map(str, rest))}"
