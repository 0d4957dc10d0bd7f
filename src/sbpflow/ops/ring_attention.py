"""Ring attention: q, k and v split on the sequence (``S(T)``) over one or more mesh axes, no gather of K or V.

Each ring is the ranks that hold one sequence (every mesh coordinate equal but those of the axes splitting T),
in sequence order. Rank p of a ring of c holds q_p, k_p, v_p (local (B, H, T/c, D)); in step s it holds the
K/V block of member (p - s) mod c, which it sends on to member p + 1 while it computes (the send/recv is posted
before the block's math and waited for after it: gloo's threads move the next block meanwhile)::

    forward    out_p, lse_p = logsumexp-combine over s of attention(q_p, k_(p-s), v_(p-s))
    backward   dq_p += ds k_j;   dk_j, dv_j follow k_j, v_j and each member adds its share;
               after the last step every (dk_j, dv_j) is one hop from home and takes it

K/V travel c - 1 hops in the forward; K, V, dK, dV c - 1 hops in the backward and dK, dV one more (2c - 1
messages). In the backward dK and dV travel one step behind K and V: a member computes its share of the held
block's, then waits for what the earlier holders summed, adds, and posts the sum on, which moves while the
next step computes.

Why a *communicating kernel* (``ops.schema.run_shards``) rather than ring nodes in the physical plan: the ring's
c steps interleave transfers with block math whose shapes (uneven blocks, causal skips) follow from the ring
position, which would be 2c nodes per attention call and per layer for the plan, and the eager path would need
a second implementation. One kernel runs identically in eager dispatch and in both executors; nn.Graph puts
its node on a stream of its own (graph.lower), in plan order like a collective, and never fuses it.

A block pair runs torch's CPU flash kernel where that is exact (no mask, or the diagonal block with
``is_causal``), else its own math. nn.Graph prices the ring's hops (:func:`forward_talks`) against other
signatures: with heads split instead, boxing's all-to-alls from sequence to heads make the Ulysses variant.

Under a causal mask, blocks wholly above the diagonal are skipped, so member p of plain ``S(T)`` computes
p + 1 of c blocks: the work is unbalanced. Under the zigzag split ``Z(T)`` (``sbp.zigzag``) member p holds the
chunks p and 2c-1-p of 2c; each block is then two pieces by two, and every member computes 2c + 1 chunk pairs
(two of them diagonal halves), the same work (docs/benchmarks.md)::

    chunk pairs seen, c = 2     rank 0 holds c0 c3: (c0,c0) (c3,c0) (c3,c1) (c3,c2) (c3,c3)
                                rank 1 holds c1 c2: (c1,c0) (c1,c1) (c2,c0) (c2,c1) (c2,c2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .._layout import logical_pieces, shard_box
from ..comm import get_backend
from ..comm.base import Transfer, nbytes
from ..placement import Placement
from ..sbp import Split
from .schema import Meta, ShardCtx

Shards = dict[int, torch.Tensor]
Piece = tuple[slice, tuple[int, int]]  # (where along the local sequence dim, which logical rows)
# one kernel call: (q's local rows, K/V's local rows, q_rows, k_rows, masked); q_rows and k_rows are the logical
# positions a masked block is cut by (local ones for a diagonal of increasing rows), unused when it is not masked
Block = tuple[slice, slice, tuple[int, int], tuple[int, int], bool]
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def ring_axes(ctx: ShardCtx, dim: int) -> tuple[int, ...]:
    """The mesh axes on which k (input 1) is split along ``dim``: K/V blocks travel along them."""
    return tuple(a for a, s in enumerate(ctx.in_sbps[1]) if isinstance(s, Split) and s.dim == dim)


def rings(ctx: ShardCtx, dim: int) -> list[tuple[int, ...]]:
    """Every ring of the placement (all of them, so that every process builds the same transfers), each in
    sequence order: the ranks sharing all coordinates off the ring axes, sorted by their K block's start."""
    placement = ctx.placement
    assert placement is not None  # ring signatures exist on global tensors only
    axes = ring_axes(ctx, dim)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in placement.flat_ranks:
        coords = placement.coords(rank)
        groups.setdefault(tuple(c for a, c in enumerate(coords) if a not in axes), []).append(rank)
    k_meta, k_sbp = ctx.in_metas[1], ctx.in_sbps[1]
    return [tuple(sorted(g, key=lambda r: shard_box(k_meta.shape, placement, k_sbp, r)[dim][0]))
            for g in groups.values()]


def forward_talks(metas: tuple[Meta, ...], sbps: tuple[tuple, ...], placement: Placement) -> tuple[int, int]:
    """Messages and bytes one rank sends in the forward (inputs q, k, v): c - 1 hops of its K and V blocks."""
    hops, kv = _ring_blocks(metas[1:3], sbps[1:3], placement)
    return (hops, hops * kv) if hops else (0, 0)


def backward_talks(metas: tuple[Meta, ...], sbps: tuple[tuple, ...], placement: Placement) -> tuple[int, int]:
    """... in the backward (inputs dy, q, k, v, ...): c - 1 hops of K and V, each followed by one of their fp32
    gradients, then one more of the gradients (counted at K and V's size: fp32 gradients of fp32 inputs)."""
    hops, kv = _ring_blocks(metas[2:4], sbps[2:4], placement)
    return (2 * hops + 1, (2 * hops + 1) * kv) if hops else (0, 0)


def causal_work(length: int, placement: Placement, nd_sbp: tuple) -> list[int]:
    """The (query, key) pairs each rank of a 1-D ring computes under a causal mask for a sequence of ``length``
    split by ``nd_sbp`` (``(S(0),)`` or ``(Z(0),)``): every block pair the kernel does not skip, whole."""
    shape = (length,)
    pieces = {r: [box[0] for box in logical_pieces(shape, placement, nd_sbp, r)] for r in placement.flat_ranks}
    return [sum((q1 - q0) * (k1 - k0) for held in pieces.values() for k0, k1 in held for q0, q1 in pieces[r]
                if _visible((q0, q1), (k0, k1), causal=True)) for r in placement.flat_ranks]


def contexts(placement: Placement, in_metas: tuple[Meta, ...], out_metas: tuple[Meta, ...],
             nd_sbp: tuple) -> dict[int, ShardCtx]:
    """The kernel contexts of every rank of ``placement`` with each input and output laid out ``nd_sbp``: to call
    :func:`forward` (inputs q, k, v; outputs out, lse) or :func:`backward` (inputs dy, q, k, v, out, lse) outside
    dispatch, as the benchmarks do."""
    def boxes(metas: tuple[Meta, ...], rank: int) -> tuple:
        return tuple(shard_box(m.shape, placement, nd_sbp, rank) for m in metas)

    return {r: ShardCtx(r, placement, boxes(in_metas, r), boxes(out_metas, r), in_metas, out_metas,
                        (nd_sbp,) * len(in_metas), (nd_sbp,) * len(out_metas)) for r in placement.flat_ranks}


def _ring_blocks(kv: Sequence[Meta], sbps: Sequence[tuple], placement: Placement) -> tuple[int, int]:
    """(c - 1, bytes of one rank's K and V blocks) for k and v split on the sequence; (0, 0) otherwise."""
    seq = kv[0].ndim - 2
    c = 1
    for axis, s in enumerate(sbps[0]):
        if isinstance(s, Split) and s.dim == seq:
            c *= placement.hierarchy[axis]
    if c == 1:
        return 0, 0
    rank = placement.flat_ranks[0]
    return c - 1, sum(nbytes(_block_shape(m, placement, s, rank), m.dtype) for m, s in zip(kv, sbps, strict=True))


def _block_shape(meta: Meta, placement: Placement, nd_sbp: tuple, rank: int) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in shard_box(meta.shape, placement, nd_sbp, rank))


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V of fewer heads (grouped-query attention) repeated to q's ``heads``: local (B, H, t, D)."""
    if kv.shape[-3] in (0, heads):  # no grouping (or an empty shard of heads)
        return kv
    return kv.repeat_interleave(heads // kv.shape[-3], dim=-3)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: each kv head sums its group's q heads."""
    if kv_heads in (0, grad.shape[-3]):
        return grad
    return grad.unflatten(-3, (kv_heads, grad.shape[-3] // kv_heads)).sum(-3)  # (B, Hkv, group, t, D) -> (B, Hkv, t, D)


def _scores(q: torch.Tensor, k: torch.Tensor, q_lo: int, k_lo: int, causal: bool, scale: float) -> torch.Tensor:
    """Scaled q k^T of one block pair (local (B, H, tq, tk)); -inf above the diagonal, in logical positions."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q_lo, q_lo + q.shape[-2], device=q.device)[:, None]
        cols = torch.arange(k_lo, k_lo + k.shape[-2], device=q.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _visible(q_rows: tuple[int, int], k_rows: tuple[int, int], causal: bool) -> bool:
    """Whether any query of the block sees any key of it (a causal block wholly above the diagonal: none)."""
    empty = q_rows[0] == q_rows[1] or k_rows[0] == k_rows[1]
    return not empty and (not causal or k_rows[0] <= q_rows[1] - 1)


def _exp_safe(x: torch.Tensor) -> torch.Tensor:
    """exp with exp(-inf - -inf) (a row that sees nothing) taken as 0, not nan."""
    return torch.exp(x).nan_to_num(nan=0.0)


class _Ring:
    """One kernel call's rings, as seen from this process: who holds which block in step s, and the moves."""

    def __init__(self, ctx: ShardCtx, dim: int, k_index: int) -> None:
        self.ctx, self.dim, self.k_index = ctx, dim, k_index
        self.placement: Placement = ctx.placement  # type: ignore[assignment]  # global tensors only
        self.rings = rings(ctx, dim)
        self.position = {r: (ring, i) for ring in self.rings for i, r in enumerate(ring)}

    def holder_block(self, rank: int, step: int) -> int:
        """The rank whose K/V block ``rank`` holds in ``step``."""
        ring, i = self.position[rank]
        return ring[(i - step) % len(ring)]

    def pieces(self, index: int, rank: int) -> list[Piece]:
        """The logical row ranges input ``index``'s shard on ``rank`` holds (two under a zigzag split), with
        where each sits in the shard."""
        meta, nd_sbp = self.ctx.in_metas[index], self.ctx.in_sbps[index]
        out, start = [], 0
        for box in logical_pieces(meta.shape, self.placement, nd_sbp, rank):
            lo, hi = box[self.dim]
            out.append((slice(start, start + hi - lo), (lo, hi)))
            start += hi - lo
        return out

    def pass_on(self, step: int, payloads: Mapping[int, Sequence[torch.Tensor]],
                metas: Sequence[tuple[Meta, tuple]]) -> dict[int, list[torch.Tensor]]:
        """Every member sends the blocks it holds in ``step`` to the next member; returns what each owned rank
        receives (the blocks it holds in ``step + 1``). ``metas``: (meta, nd-SBP) of each payload tensor."""
        return self.post(step, payloads, metas)()

    def post(self, step: int, payloads: Mapping[int, Sequence[torch.Tensor]],
             metas: Sequence[tuple[Meta, tuple]]) -> Callable[[], dict[int, list[torch.Tensor]]]:
        """:meth:`pass_on`, posted: returns at once (cpu shards: the transport's threads move them while the
        caller computes, reading but never writing the payloads) with a function that waits for the result."""
        transfers: list[Transfer] = []
        tensors: dict[int, torch.Tensor] = {}
        for ring in self.rings:
            for i, src in enumerate(ring):
                owner = ring[(i - step) % len(ring)]  # whose block src holds
                for j, (meta, nd_sbp) in enumerate(metas):
                    if src in payloads:
                        tensors[len(transfers)] = payloads[src][j]
                    shape = _block_shape(meta, self.placement, nd_sbp, owner)
                    transfers.append(Transfer(src, ring[(i + 1) % len(ring)], shape, meta.dtype))
        backend = get_backend()
        if all(t.is_cpu for t in tensors.values()):
            pending = backend.send_recv_async(transfers, tensors)
            return lambda: _by_destination(transfers, pending.wait())
        received = backend.send_recv(transfers, tensors)
        return lambda: _by_destination(transfers, received)


def _by_destination(transfers: Sequence[Transfer],
                    received: Mapping[int, torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """The received pieces of each owned destination rank, in transfer order."""
    out: dict[int, list[torch.Tensor]] = {}
    for n, t in enumerate(transfers):
        if n in received:
            out.setdefault(t.dst, []).append(received[n])
    return out


def forward(ctxs: dict[int, ShardCtx], q: Shards, k: Shards, v: Shards, causal: bool,
            scale: float | None, overlap: bool = True) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(out, lse) of every owned rank (local (B, H, tq, Dv) and (B, H, tq)); lse in fp32 (fp64 for fp64).
    ``overlap=False``: each hop waits until the step's math is done (the same messages and math, for timing the
    overlap against)."""
    ctx = next(iter(ctxs.values()))
    dim = ctx.in_metas[0].ndim - 2
    ring = _Ring(ctx, dim, k_index=1)
    acc_dtype = torch.float64 if ctx.in_metas[0].dtype == torch.float64 else torch.float32
    scale_of = scale if scale is not None else ctx.in_metas[0].shape[-1] ** -0.5
    out = {r: torch.zeros(q[r].shape[:-1] + v[r].shape[-1:], dtype=acc_dtype, device=q[r].device) for r in ctxs}
    lse = {r: torch.full(q[r].shape[:-1], float("-inf"), dtype=acc_dtype, device=q[r].device) for r in ctxs}
    held = {r: [k[r], v[r]] for r in ctxs}
    kv_metas = [(ctx.in_metas[1], ctx.in_sbps[1]), (ctx.in_metas[2], ctx.in_sbps[2])]
    steps = max(len(g) for g in ring.rings)
    for step in range(steps):
        last = step == steps - 1
        arriving = ring.post(step, held, kv_metas) if overlap and not last else None  # the next blocks, meanwhile
        for r in ctxs:
            for qs, ks, q_rows, k_rows, masked in _blocks(ring, r, step, causal):
                block_out, block_lse = _block_forward(_rows_of(q[r], qs), _rows_of(held[r][0], ks),
                                                      _rows_of(held[r][1], ks), q_rows, k_rows, masked, scale_of,
                                                      acc_dtype)
                seen = lse[r][..., qs]  # local (B, H, tq)
                total = torch.logaddexp(seen, block_lse)
                out[r][..., qs, :] = (out[r][..., qs, :] * _exp_safe(seen - total)[..., None]
                                      + block_out * _exp_safe(block_lse - total)[..., None])
                lse[r][..., qs] = total
        if not last:
            held = (arriving if arriving is not None else ring.post(step, held, kv_metas))()
    lse_dtype = ctx.out_metas[1].dtype
    return {r: (out[r].to(q[r].dtype), lse[r].to(lse_dtype)) for r in ctxs}


def backward(ctxs: dict[int, ShardCtx], dy: Shards, q: Shards, k: Shards, v: Shards, out: Shards, lse: Shards,
             causal: bool, scale: float | None,
             overlap: bool = True) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(dq, dk, dv) of every owned rank from the saved out and lse; dk, dv travel the ring one step behind k, v:
    a member adds its share of the held block's dK, dV to what the previous holders summed (waited for after its
    math, posted on at once, so that the sum's hop overlaps the next step's math). ``overlap=False``: every hop
    is posted after the step's math and waited for at once."""
    ctx = next(iter(ctxs.values()))  # inputs (dy, q, k, v, out, lse)
    dim = ctx.in_metas[1].ndim - 2
    ring = _Ring(_shifted(ctx), dim, k_index=1)
    acc_dtype = torch.float64 if ctx.in_metas[1].dtype == torch.float64 else torch.float32
    scale_of = scale if scale is not None else ctx.in_metas[1].shape[-1] ** -0.5
    dq = {r: torch.zeros(q[r].shape, dtype=acc_dtype, device=q[r].device) for r in ctxs}
    row_term = {r: (dy[r].to(acc_dtype) * out[r].to(acc_dtype)).sum(-1) for r in ctxs}  # local (B, H, tq)
    held = {r: [k[r], v[r]] for r in ctxs}
    k_meta, v_meta = (ctx.in_metas[2], ctx.in_sbps[2]), (ctx.in_metas[3], ctx.in_sbps[3])
    acc = [(Meta(m.shape, acc_dtype), s) for m, s in (k_meta, v_meta)]
    steps = max(len(g) for g in ring.rings)
    summed: Callable[[], dict[int, list[torch.Tensor]]] | None = None  # the held block's dK, dV from earlier holders
    for step in range(steps):
        last = step == steps - 1
        arriving = ring.post(step, held, [k_meta, v_meta]) if overlap and not last else None
        shares = {r: [torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in held[r]] for r in ctxs}
        for r in ctxs:
            for qs, ks, q_rows, k_rows, masked in _blocks(ring, r, step, causal):
                block = [_rows_of(t, ks) for t in held[r]] + [t[..., ks, :] for t in shares[r]]  # dk, dv: views
                q_r, dy_r, out_r = (_rows_of(t, qs) for t in (q[r], dy[r], out[r]))
                _block_grads(q_r, dy_r, out_r, lse[r][..., qs].contiguous(), row_term[r][..., qs], block,
                             dq[r][..., qs, :], q_rows, k_rows, masked, scale_of, acc_dtype)
        if summed is not None:
            for r, earlier in summed().items():
                for share, other in zip(shares[r], earlier, strict=True):
                    share.add_(other)
        if not last:
            if arriving is None:  # not overlapped: K and V leave after the math
                arriving = ring.post(step, held, [k_meta, v_meta])
            summed = ring.post(step, shares, acc)
            if not overlap:
                summed = _waited(summed)
            held = arriving()
    home = ring.pass_on(steps - 1, shares, acc)  # every dk, dv one hop from home
    return {r: (dq[r].to(q[r].dtype), home[r][0].to(k[r].dtype), home[r][1].to(v[r].dtype)) for r in ctxs}


def _waited(pending: Callable[[], dict[int, list[torch.Tensor]]]) -> Callable[[], dict[int, list[torch.Tensor]]]:
    """``pending`` waited for now; returns its result when called."""
    result = pending()
    return lambda: result


def _blocks(ring: _Ring, rank: int, step: int, causal: bool) -> list[Block]:
    """The kernel calls ``rank`` makes in ``step``: its q pieces by the held K block's, as few calls as exact.
    Its own block under a causal mask, rows increasing (a zigzag's two chunks), is one causal call in local
    positions; q pieces that see the same K pieces whole share one unmasked call (a zigzag rank's two chunks
    against an earlier member's first chunk, or its second chunk against a later member's two); a pair cut by
    the mask is a call of its own."""
    q_pieces = [p for p in ring.pieces(0, rank) if p[1][0] < p[1][1]]
    k_pieces = [p for p in ring.pieces(1, ring.holder_block(rank, step)) if p[1][0] < p[1][1]]
    rows = [p[1] for p in q_pieces]
    if causal and rows == [p[1] for p in k_pieces] and rows == sorted(rows):
        n = sum(hi - lo for lo, hi in rows)
        return [(_span(q_pieces), _span(k_pieces), (0, n), (0, n), True)] if n else []
    blocks: list[Block] = []
    whole: dict[tuple[int, ...], list[Piece]] = {}  # the K pieces a q piece sees whole -> those q pieces
    for qp in q_pieces:
        seen = tuple(i for i, kp in enumerate(k_pieces) if not causal or kp[1][1] - 1 <= qp[1][0])
        blocks += [(qp[0], kp[0], qp[1], kp[1], True) for i, kp in enumerate(k_pieces)
                   if i not in seen and _visible(qp[1], kp[1], causal)]
        if seen:
            whole.setdefault(seen, []).append(qp)
    for seen, qps in whole.items():
        blocks += [(qs, ks, (0, 0), (0, 0), False) for qs in _runs(qps) for ks in _runs([k_pieces[i] for i in seen])]
    return blocks


def _runs(pieces: list[Piece]) -> list[slice]:
    """The storage ranges of ``pieces`` (in storage order), adjacent ones joined."""
    out: list[slice] = []
    for where, _ in pieces:
        if out and out[-1].stop == where.start:
            out[-1] = slice(out[-1].start, where.stop)
        else:
            out.append(where)
    return out


def _span(pieces: list[Piece]) -> slice:
    """The one storage range of adjacent ``pieces``."""
    (joined,) = _runs(pieces)
    return joined


def _rows_of(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of a local (..., t, D) shard; a part is made contiguous for torch's fused kernels."""
    if rows.start == 0 and rows.stop == t.shape[-2]:
        return t
    return t[..., rows, :].contiguous()


def _flash_mode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: tuple[int, int],
                k_rows: tuple[int, int], causal: bool) -> bool | None:
    """The ``is_causal`` with which torch's CPU flash kernel computes this block pair exactly: False when every
    key precedes every query (or no mask), True on the diagonal (one range of rows), None when it cannot (a
    partial mask, a GPU shard, unequal head dims, an empty shard): the block is then computed by :func:`_scores`."""
    if not (q.is_cpu and q.dim() == 4 and q.dtype in _FLASH_DTYPES and q.shape[-1] == k.shape[-1] == v.shape[-1]
            and q.numel() > 0 and k.numel() > 0):  # torch's kernel divides by zero on an empty batch or head shard
        return None
    if not causal or k_rows[1] - 1 <= q_rows[0]:
        return False
    return True if q_rows == k_rows else None


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: tuple[int, int],
                   k_rows: tuple[int, int], causal: bool, scale: float,
                   acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one block pair in ``acc_dtype`` (local (B, H, tq, Dv) and (B, H, tq))."""
    k, v = _expand(k, q.shape[-3]), _expand(v, q.shape[-3])
    mode = _flash_mode(q, k, v, q_rows, k_rows, causal)
    if mode is not None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, mode, scale=scale)
        return out.to(acc_dtype), lse.to(acc_dtype)
    s = _scores(q.to(acc_dtype), k.to(acc_dtype), q_rows[0], k_rows[0], causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # local (B, H, tq)
    return torch.matmul(_exp_safe(s - lse[..., None]), v.to(acc_dtype)), lse


def _block_grads(q: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, row_term: torch.Tensor,
                 held: list[torch.Tensor], dq: torch.Tensor, q_rows: tuple[int, int], k_rows: tuple[int, int],
                 causal: bool, scale: float, acc_dtype: torch.dtype) -> None:
    """Adds one block pair's share to dq and to the travelling dk, dv (``held[2]``, ``held[3]``) in place. With
    the final out and lse, torch's flash backward of the block gives exactly its share (the softmax it rebuilds
    is the whole row's)."""
    k, v, dk, dv = held
    heads, kv_heads = q.shape[-3], k.shape[-3]
    ke, ve = _expand(k, heads), _expand(v, heads)
    mode = _flash_mode(q, ke, ve, q_rows, k_rows, causal)
    if mode is not None:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, ke, ve, out, lse, 0.0, mode, scale=scale)
        dq.add_(grads[0])
        dk.add_(_fold(grads[1], kv_heads))
        dv.add_(_fold(grads[2], kv_heads))
        return
    qa, dya, ke, ve = q.to(acc_dtype), dy.to(acc_dtype), ke.to(acc_dtype), ve.to(acc_dtype)
    p = _exp_safe(_scores(qa, ke, q_rows[0], k_rows[0], causal, scale) - lse.to(acc_dtype)[..., None])
    dv.add_(_fold(torch.matmul(p.transpose(-1, -2), dya), kv_heads))
    ds = p * (torch.matmul(dya, ve.transpose(-1, -2)) - row_term[..., None])
    dq.add_(torch.matmul(ds, ke) * scale)
    dk.add_(_fold(torch.matmul(ds.transpose(-1, -2), qa) * scale, kv_heads))


def _shifted(ctx: ShardCtx) -> ShardCtx:
    """The backward's context with dy dropped, so that input 0 is q and input 1 is k, as in the forward."""
    return ShardCtx(ctx.rank, ctx.placement, ctx.in_boxes[1:], ctx.out_boxes, ctx.in_metas[1:], ctx.out_metas,
                    ctx.in_sbps[1:], ctx.out_sbps)
