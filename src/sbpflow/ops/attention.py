"""Scaled dot-product attention on (..., heads, T, D) shards, with torch's fused kernel per shard.

SBP rules (q, k, v of shape (B, H, T, D), logical; ``mask`` broadcastable to (B, H, Tq, Tk)):

    q        k        v        out       why
    S(b)     S(b)     S(b)     S(b)      batch or head dims: attention never mixes them
    S(Tq)    B        B        S(Tq)     query rows are independent (the causal mask shifts by the shard's offset)
    S(T)     S(T)     S(T)     S(T)      context parallel: ring attention (ops.ring_attention), no mask tensor
    Z(T)     Z(T)     Z(T)     Z(T)      the same, zigzag: causal work balanced over the ring
    B        B        P(sum)   P(sum)    linear in v
    B        B        B        B

The mask follows the split of the dim it shares with the output, else stays B.
The forward also returns the logsumexp of each query row (``diff_outputs=1``:
a saved statistic, no gradient), so that the backward op calls torch's own
flash backward kernel on each shard instead of running attention a second time.
It maps the same splits; with queries split, dk and dv are partial sums over
the query rows. With ``enable_gqa`` (as torch's), k and v may have fewer heads
than q, a divisor of them; heads are then never split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as TF

from ..errors import DTypeError, OpError, ShapeError
from ..sbp import Partial, SbpParallel, Split, broadcast
from ..tensor import Tensor
from . import _rules as R
from . import ring_attention as ring
from .schema import Meta, ShardCtx, Sig, op

__all__ = ["scaled_dot_product_attention"]

B = broadcast
PSUM = Partial("sum")


def _sdpa_meta(q: Meta, k: Meta, v: Meta, *mask: Meta, is_causal: bool, scale: float | None,
               enable_gqa: bool = False) -> Meta:
    if not (q.ndim == k.ndim == v.ndim and q.ndim >= 2):
        raise ShapeError(f"scaled_dot_product_attention needs q, k, v with one number of dims (at least 2), but got "
                         f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"scaled_dot_product_attention needs q and k with one head dim, but got q {list(q.shape)} "
                         f"(head dim {q.shape[-1]}) and k {list(k.shape)} (head dim {k.shape[-1]})")
    if k.shape[-2] != v.shape[-2] or not _heads_match(q, k, enable_gqa) or k.shape[:-2] != v.shape[:-2]:
        raise ShapeError(f"scaled_dot_product_attention needs q, k, v with equal batch/head dims (with enable_gqa, "
                         f"k and v heads dividing q heads) and k, v of one length, but got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)} (enable_gqa={enable_gqa})")
    R.check_dtypes_equal("scaled_dot_product_attention", q, k, v)
    if not q.dtype.is_floating_point:
        raise DTypeError(f"scaled_dot_product_attention needs floating-point q, k, v, but got {q.dtype}")
    scores = q.shape[:-1] + (k.shape[-2],)  # logical (..., Tq, Tk)
    if mask:
        if mask[0].dtype not in (torch.bool, q.dtype):
            raise DTypeError(f"scaled_dot_product_attention needs a bool mask or one of q's dtype {q.dtype}, "
                             f"but got {mask[0].dtype}")
        if R.broadcast_shapes(mask[0].shape, scores) != scores:
            raise ShapeError(f"scaled_dot_product_attention needs attn_mask broadcastable to {list(scores)}, "
                             f"but got {list(mask[0].shape)}")
    return Meta(q.shape[:-1] + (v.shape[-1],), q.dtype)


def _heads_match(q: Meta, k: Meta, enable_gqa: bool) -> bool:
    """Equal batch dims, and equal heads, or (grouped-query attention) k heads dividing q heads."""
    if q.shape[:-2] == k.shape[:-2]:
        return True
    return (enable_gqa and q.ndim >= 3 and q.shape[:-3] == k.shape[:-3] and k.shape[-3] > 0
            and q.shape[-3] % k.shape[-3] == 0)


def _mask_sbp(mask: tuple[Meta, ...], d: int, ndim: int, size: int) -> tuple[SbpParallel, ...]:
    """The mask follows a split of logical score dim ``d`` when it has that dim at full size."""
    if not mask:
        return ()
    k = d - (ndim - mask[0].ndim)
    return (Split(k),) if k >= 0 and mask[0].shape[k] == size else (B,)


def _sdpa_sigs(q: Meta, k: Meta, v: Meta, *mask: Meta, outs: tuple[Meta, ...], **_: Any) -> list[Sig]:
    """Outputs (out, logsumexp): the logsumexp (..., Tq) depends on q and k only, so it splits like the rows."""
    mb = (B,) if mask else ()
    sigs = [Sig((B, B, B) + mb, (B, B)), Sig((B, B, PSUM) + mb, (PSUM, B))]
    for d in range(q.ndim - 2):
        if q.shape[d] != k.shape[d]:  # grouped-query heads: q's and k's head splits would not line up
            continue
        s = Split(d)
        sigs.append(Sig((s, s, s) + _mask_sbp(mask, d, q.ndim, q.shape[d]), (s, s)))
    rows = Split(q.ndim - 2)
    sigs.append(Sig((rows, B, B) + _mask_sbp(mask, q.ndim - 2, q.ndim, q.shape[-2]), (rows, rows)))
    if not mask:  # ring attention; a mask tensor would have to travel with its key columns
        zigzag = Split(q.ndim - 2, zigzag=True)
        sigs += [Sig((rows, rows, rows), (rows, rows)), Sig((zigzag,) * 3, (zigzag, zigzag))]
    return sigs


def _sdpa_meta_with_lse(q: Meta, k: Meta, v: Meta, *mask: Meta, is_causal: bool,
                        scale: float | None, enable_gqa: bool = False) -> tuple[Meta, Meta]:
    out = _sdpa_meta(q, k, v, *mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    lse_dtype = q.dtype if q.dtype == torch.float64 else torch.float32  # torch's flash kernel keeps fp32 stats
    return out, Meta(q.shape[:-1], lse_dtype)


_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LSE_ROWS = 32  # torch's memory-efficient CUDA kernel pads its logsumexp rows to a multiple of this
_ALIGN = 8  # ... and wants head dims and the bias's row stride in multiples of this


def _flash_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether torch's CPU flash kernel (forward and backward, with a saved logsumexp) applies to this shard;
    it divides by zero on empty shards (a batch of one split over three ranks)."""
    return q.is_cpu and q.dim() == 4 and q.dtype in _FLASH_DTYPES and q.numel() > 0 and k.numel() > 0


def _efficient_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether torch's memory-efficient CUDA kernel (forward with logsumexp, and its backward) applies: 4-D,
    non-empty, q and k of one head dim."""
    return (q.is_cuda and q.dim() == 4 and q.dtype in _CUDA_DTYPES and q.numel() > 0
            and k.numel() > 0 and q.shape[-1] == k.shape[-1])


def _aligned(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Head dims zero-padded to a multiple of _ALIGN (zero columns change no dot product; output columns are
    sliced off again)."""
    pad = -tensors[0].shape[-1] % _ALIGN
    return [TF.pad(t, (0, pad)) if pad else t for t in tensors]


def _bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """An additive (B, H, Tq, Tk) bias of q's dtype whose rows start at aligned addresses (the kernel's rule):
    padded to a multiple of _ALIGN columns, then viewed back."""
    bias = _additive(mask, q.dtype)
    if bias is None:
        return None
    n = bias.shape[-1]
    if n % _ALIGN:
        bias = TF.pad(bias, (0, -n % _ALIGN))[..., :n]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse (B, H, Tq)) from torch's memory-efficient CUDA kernel."""
    d = q.shape[-1]
    scale = scale if scale is not None else d ** -0.5  # of the real head dim, not the padded one
    aq, ak, av = _aligned(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        aq, ak, av, _bias(mask, q, k), True, 0.0, causal, scale=scale)[:2]
    return out[..., :d], lse[..., : q.shape[-2]]  # lse (B, H, padded Tq) -> (B, H, Tq)


def _efficient_backward(dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the saved out and lse, by the kernel's own backward (no second forward)."""
    d, rows = q.shape[-1], q.shape[-2]
    scale = scale if scale is not None else d ** -0.5
    lse = TF.pad(lse, (0, -rows % _LSE_ROWS))  # the kernel's layout back (its pad rows are never read)
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # dropout 0: no philox seed or offset
    ady, aq, ak, av, aout = _aligned(dy.contiguous(), q, k, v, out)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        ady, aq, ak, av, _bias(mask, q, k), aout, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq[..., :d], dk[..., :d], dv[..., :d]


def _shard_mask(ctx: ShardCtx, q: torch.Tensor, k: torch.Tensor, mask: tuple[torch.Tensor, ...], is_causal: bool,
                q_index: int) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) for this shard: a causal mask on a query-row shard is built at the shard's offset."""
    lo, hi = ctx.in_boxes[q_index][-2]
    attn_mask = mask[0] if mask else None
    if is_causal and (lo, hi) != (0, ctx.in_metas[q_index].shape[-2]):
        # torch's is_causal keeps key j for query i when j <= i (top-left aligned); i is logical here
        rows = torch.arange(lo, hi, device=q.device)[:, None]
        attn_mask = rows >= torch.arange(k.shape[-2], device=q.device)[None, :]
        is_causal = False
    return attn_mask, is_causal


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The flash kernel takes additive masks of q's dtype only: a bool mask (True keeps) becomes 0 / -inf."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _local_sdpa(ctx: ShardCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: tuple[torch.Tensor, ...],
                is_causal: bool, scale: float | None) -> torch.Tensor:
    """torch's sdpa on one shard, differentiable by torch autograd (the fallback backward recomputes it)."""
    attn_mask, is_causal = _shard_mask(ctx, q, k, mask, is_causal, q_index=0)
    return TF.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _is_ring(ctx: ShardCtx, k_index: int) -> bool:
    """Whether k is split on its sequence dim: the ring signature (k_index: k's position among the inputs)."""
    seq = ctx.in_metas[k_index].ndim - 2
    return any(isinstance(s, Split) and s.dim == seq for s in (ctx.in_sbps[k_index] if ctx.in_sbps else ()))


@op("scaled_dot_product_attention", meta=_sdpa_meta_with_lse, sbp=_sdpa_sigs, shard_aware=True, save_outputs=True,
    diff_outputs=1, communicating=ring.forward_talks)
def _sdpa(ctxs: dict[int, ShardCtx], q: dict[int, torch.Tensor], k: dict[int, torch.Tensor],
          v: dict[int, torch.Tensor], *mask: dict[int, torch.Tensor], is_causal: bool, scale: float | None,
          enable_gqa: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(out, logsumexp) of every owned rank: ring attention when k and v are split on the sequence, else each
    shard alone."""
    if _is_ring(next(iter(ctxs.values())), k_index=1):
        return ring.forward(ctxs, q, k, v, is_causal, scale)
    return {r: _sdpa_shard(ctx, q[r], k[r], v[r], *[m[r] for m in mask], is_causal=is_causal, scale=scale)
            for r, ctx in ctxs.items()}


def _sdpa_shard(ctx: ShardCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor,
                is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of one shard. The logsumexp is what torch's fused backward (CPU flash, CUDA
    memory-efficient) needs to rebuild the probabilities without a second forward; where no such kernel applies
    it is left unfilled."""
    k, v = ring._expand(k, q.shape[-3]), ring._expand(v, q.shape[-3])  # grouped-query heads, as torch's
    attn_mask, causal = _shard_mask(ctx, q, k, mask, is_causal, q_index=0)
    if _efficient_ok(q, k):
        return _efficient_forward(q, k, v, attn_mask, causal, scale)
    if not _flash_ok(q, k):
        out = _local_sdpa(ctx, q, k, v, mask, is_causal, scale)
        return out, torch.empty(q.shape[:-1], dtype=ctx.out_metas[1].dtype, device=q.device)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=_additive(attn_mask, q.dtype), scale=scale)
    return out, lse


@_sdpa.grad
def _sdpa_grad(ctx: Any, dy: Any) -> Any:
    q, k, v, *mask = ctx.inputs
    out, lse = ctx.outputs
    dq, dk, dv = sdpa_backward(dy, q, k, v, out, lse, *mask, **ctx.attrs)
    return (dq, dk, dv) + (None,) * len(mask)


def _sdpa_backward_meta(dy: Meta, q: Meta, k: Meta, v: Meta, out: Meta, lse: Meta, *mask: Meta,
                        **_: Any) -> tuple[Meta, Meta, Meta]:
    return q, k, v


def _sdpa_backward_sigs(dy: Meta, q: Meta, k: Meta, v: Meta, out: Meta, lse: Meta, *mask: Meta,
                        outs: tuple[Meta, ...], **_: Any) -> list[Sig]:
    """Inputs (dy, q, k, v, out, lse, mask?). Linear in dy; dq and dk are linear in (v, out) together (the
    kernel's row term is rowsum(dy * out)), and dv does not depend on v."""
    mb = (B,) if mask else ()
    sigs = [
        Sig((B, B, B, B, B, B) + mb, (B, B, B)),
        Sig((PSUM, B, B, B, B, B) + mb, (PSUM, PSUM, PSUM)),
        Sig((B, B, B, PSUM, PSUM, B) + mb, (PSUM, PSUM, B)),
    ]
    for d in range(q.ndim - 2):
        if q.shape[d] != k.shape[d]:  # grouped-query heads
            continue
        s = Split(d)
        sigs.append(Sig((s,) * 6 + _mask_sbp(mask, d, q.ndim, q.shape[d]), (s, s, s)))
    rows = Split(q.ndim - 2)
    row_mask = _mask_sbp(mask, q.ndim - 2, q.ndim, q.shape[-2])
    sigs.append(Sig((rows, rows, B, B, rows, rows) + row_mask, (rows, PSUM, PSUM)))  # dk, dv sum over query rows
    if not mask:  # ring attention: dk and dv travel the ring home
        zigzag = Split(q.ndim - 2, zigzag=True)
        sigs += [Sig((rows,) * 6, (rows, rows, rows)), Sig((zigzag,) * 6, (zigzag,) * 3)]
    return sigs


@op("sdpa_backward", meta=_sdpa_backward_meta, sbp=_sdpa_backward_sigs, shard_aware=True, differentiable=False,
    communicating=ring.backward_talks)
def sdpa_backward(ctxs: dict[int, ShardCtx], dy: dict[int, torch.Tensor], q: dict[int, torch.Tensor],
                  k: dict[int, torch.Tensor], v: dict[int, torch.Tensor], out: dict[int, torch.Tensor],
                  lse: dict[int, torch.Tensor], *mask: dict[int, torch.Tensor], is_causal: bool,
                  scale: float | None, enable_gqa: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]]:
    """(dq, dk, dv) of every owned rank: the ring's backward when k is split on the sequence, else each shard
    alone."""
    if _is_ring(next(iter(ctxs.values())), k_index=2):
        return ring.backward(ctxs, dy, q, k, v, out, lse, is_causal, scale)
    results: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for r, ctx in ctxs.items():
        kv_heads = k[r].shape[-3]
        heads = q[r].shape[-3]
        dq, dk, dv = _sdpa_backward_shard(ctx, dy[r], q[r], ring._expand(k[r], heads), ring._expand(v[r], heads),
                                          out[r], lse[r], *[m[r] for m in mask], is_causal=is_causal, scale=scale)
        results[r] = (dq, ring._fold(dk, kv_heads), ring._fold(dv, kv_heads))
    return results


def _sdpa_backward_shard(ctx: ShardCtx, dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, *mask: torch.Tensor, is_causal: bool,
                         scale: float | None) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of attention on one shard: torch's fused backward from the saved out and logsumexp (no
    second forward), else a recomputation under torch autograd."""
    if q.numel() == 0 or k.numel() == 0:  # an empty shard: no query reads a key (torch's kernels assert here)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    attn_mask, causal = _shard_mask(ctx, q, k, mask, is_causal, q_index=1)
    if _efficient_ok(q, k):
        return _efficient_backward(dy, q, k, v, out, lse, attn_mask, causal, scale)
    if _flash_ok(q, k):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(attn_mask, q.dtype), scale=scale)
        return tuple(grads)
    # the forward kernel reads q's box from in_boxes[0]: shift past dy so it sees q's
    fwd = ShardCtx(ctx.rank, ctx.placement, ctx.in_boxes[1:], ctx.out_boxes, ctx.in_metas[1:], ctx.out_metas,
                   ctx.in_sbps[1:], ctx.out_sbps)
    with torch.enable_grad():
        lq, lk, lv = leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        y = _local_sdpa(fwd, lq, lk, lv, mask, is_causal, scale)
        grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves, strict=True))


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``softmax(q k^T * scale + mask) v`` over (..., T, D) tensors, as torch's; batch and head splits need no
    communication, and neither does a split of the query rows.

    ``attn_mask`` is bool (True keeps) or additive float, and gets no gradient.
    ``enable_gqa``: k and v may have fewer heads than q (grouped-query attention).
    q, k and v all split on the sequence (``S(T)``) run ring attention (context parallelism).
    ``dropout_p`` must be 0: the backward recomputes attention per shard, and a
    dropout mask would have to be drawn identically in both passes.

    >>> import sbpflow
    >>> q = sbpflow.randn(2, 4, 5, 8)  # (B, H, T, D)
    >>> sbpflow.functional.scaled_dot_product_attention(q, q, q, is_causal=True).shape
    torch.Size([2, 4, 5, 8])
    """
    if dropout_p != 0.0:
        raise OpError(
            f"scaled_dot_product_attention supports dropout_p=0 only (got {dropout_p}): its backward recomputes "
            f"attention per shard and would draw a different dropout mask; q {q._describe()}"
        )
    if is_causal and attn_mask is not None:
        raise OpError("scaled_dot_product_attention takes attn_mask or is_causal=True, not both (as torch); "
                      f"q {q._describe()}, attn_mask {attn_mask._describe()}")
    mask = (attn_mask,) if attn_mask is not None else ()
    gqa = {"enable_gqa": True} if enable_gqa else {}  # left out when off: the attrs of existing plans stay
    out, _ = _sdpa(q, k, v, *mask, is_causal=bool(is_causal), scale=None if scale is None else float(scale), **gqa)
    return out  # type: ignore[no-any-return]
