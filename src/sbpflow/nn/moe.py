"""A mixture-of-experts block (Mixtral, Qwen-MoE): a top-k softmax router over SwiGLU experts.

Routing is dropless unless ``capacity_factor`` caps each expert's tokens; optional shared experts see every token
(Qwen's with a sigmoid gate); ``aux_stats`` feeds :func:`load_balancing_loss` (Switch Transformer's). Unsplit,
the experts run dense with zero weights off the chosen ones: exact for any routing, at ``experts / k`` times the
compute. Split over a mesh axis (:func:`split_experts`), tokens travel to their experts' ranks instead
(:mod:`sbpflow.nn.expert_parallel`).

>>> import sbpflow
>>> from sbpflow import nn
>>> moe = nn.MoE(8, 16, num_experts=4, top_k=2)
>>> moe(sbpflow.randn(2, 3, 8)).shape
torch.Size([2, 3, 8])
>>> float(moe.aux_stats[0].sum())  # each of the 6 tokens counted at 2 experts
12.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..amp import active_dtype
from ..autograd import no_grad
from ..creation import tensor
from ..errors import SbpflowError
from ..ops import functional as F
from ..ops.dispatch import INTERPRETERS
from ..ops.schema import Meta, Sig, op
from ..placement import Placement
from ..sbp import Split, broadcast
from ..tensor import Tensor
from .container import ModuleList
from .expert_parallel import ExpertLayout, Weights, check_layout, expert_exchange, routed_experts
from .layers import Linear
from .module import Module, Parameter, relayout_


class Expert(Module):
    """SwiGLU expert ``w2(silu(w1(x)) * w3(x))`` (Mixtral's names: w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = Linear(hidden, intermediate, bias=False)
        self.w2 = Linear(intermediate, hidden, bias=False)
        self.w3 = Linear(hidden, intermediate, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.mul(F.silu(self.w1(x)), self.w3(x)))


class StackedExperts(Module):
    """The routed experts as three stacked weights, gate ``w1`` (E, I, C), down ``w2`` (E, C, I), up ``w3``
    (E, I, C): what :func:`split_experts` splits S(0) over an ep mesh axis, so that one op on the mesh reads them
    all. ``stacked_names`` gives each expert's weight its :class:`Expert` name (checkpoints)."""

    def __init__(self, w1: Tensor, w2: Tensor, w3: Tensor) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Parameter(w1), Parameter(w2), Parameter(w3)

    def __len__(self) -> int:
        return int(self.w1.shape[0])

    def weights(self) -> Weights:
        return self.w1, self.w2, self.w3


class MoE(Module):
    """Top-k routed experts plus ``shared_experts`` always-on experts, over logical (..., hidden) inputs."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int = 2,
                 shared_experts: int = 0, capacity_factor: float | None = None, norm_topk_prob: bool = True,
                 shared_expert_intermediate: int | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise SbpflowError(f"MoE needs 1 <= top_k <= num_experts, but got top_k={top_k} and {num_experts} experts")
        if capacity_factor is not None and capacity_factor <= 0:
            raise SbpflowError(f"MoE capacity_factor must be positive (or None: dropless), but got {capacity_factor}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.norm_topk_prob = norm_topk_prob  # renormalise the top-k probabilities to sum to 1 (Mixtral)
        self.gate = Linear(hidden, num_experts, bias=False)
        # one Expert each, until split_experts stacks them (StackedExperts)
        self.experts: ModuleList | StackedExperts = ModuleList([Expert(hidden, intermediate)
                                                                for _ in range(num_experts)])
        self.shared = ModuleList([Expert(hidden, intermediate) for _ in range(shared_experts)])
        self.aux_stats: tuple[Tensor, Tensor] | None = None
        self.expert_layout: ExpertLayout | None = None  # set by split_experts: the all-to-all path
        self.gated_shared = shared_expert_intermediate is not None
        if shared_expert_intermediate is not None:  # Qwen-MoE: out += sigmoid(shared_expert_gate(x)) * shared_expert(x)
            self.shared_expert = Expert(hidden, shared_expert_intermediate)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = tuple(x.shape)
        flat = x if x.ndim == 2 else F.reshape(x, (-1, shape[-1]))  # logical (N, C) (a reshape less per pass)
        if isinstance(self.experts, StackedExperts):
            assert self.expert_layout is not None  # (set with the stack, by split_experts)
            out = self._exchanged(flat, self.expert_layout, self.experts.weights())
        else:
            out = self._dense(flat)
        for expert in self.shared:
            out = F.add(out, expert(flat))
        if self.gated_shared:
            out = F.add(out, F.mul(F.sigmoid(self.shared_expert_gate(flat)), self.shared_expert(flat)))
        return out if x.ndim == 2 else F.reshape(out, shape)

    def _dense(self, flat: Tensor) -> Tensor:
        """Every expert on every token, weighted by the routing (zero off a token's experts): logical (N, C)."""
        weights = self.route(flat)  # logical (N, E)
        out = F.mul(self._expert(0, flat), F.narrow(weights, 1, 0, 1))  # logical (N, C)
        for e in range(1, self.num_experts):
            out = F.add(out, F.mul(self._expert(e, flat), F.narrow(weights, 1, e, 1)))
        return out

    def _exchanged(self, flat: Tensor, layout: ExpertLayout, experts: Weights) -> Tensor:
        """Each token's k experts on their ranks, by the all-to-all of :func:`routed_experts` (eager) or
        :func:`expert_exchange` (traced, or meta tokens): logical (N, C)."""
        # local tokens (a model built whole, then split) are every rank's; tokens elsewhere move to the mesh
        sbp = flat.sbp if flat.is_global and flat.placement == layout.mesh else (broadcast,) * layout.mesh.ndim
        flat = F.to_global(flat, layout.mesh, layout.token_sbp(sbp, experts[0].sbp))
        eager = not INTERPRETERS and not flat.is_meta
        if self.capacity_factor is None:
            probs, top, index = self._gate(flat)  # logical (N, E), (N, k), (N, k)
            keep = None
        else:
            top, index, chosen, kept = self._route_topk(flat)  # logical (N, k), (N, k), (N, k, E), (N, E)
            assert kept is not None
            # a slot is kept if its expert kept the token: (N, k)
            keep = F.gt(F.sum(F.mul(chosen, F.unsqueeze(kept, 1)), dim=-1), 0.5)
        top, index = _laid_like(top, flat), _laid_like(index, flat)
        keep = None if keep is None else _laid_like(keep, flat)
        if eager:
            out, counts = routed_experts(flat, top, index, keep, experts, layout)
        else:  # (only the tracer is pushed, or meta tensors) one op with a static output: the routed rows inside
            if keep is not None:  # a dropped slot's expert becomes num_experts, which no member holds
                index = F.where(keep, index, _like(index, torch.tensor(self.num_experts)))
            chosen = F.eq(F.unsqueeze(index, -1), _like(index, torch.arange(self.num_experts)))  # (N, k, E)
            counts = F.sum(F.sum(F.cast(chosen, flat.dtype), dim=1), dim=0)  # logical (E,)
            out = expert_exchange(flat, top, index, *experts)
        if self.capacity_factor is None:  # dropless: the slots the experts received are the slots routed
            self.aux_stats = (counts, F.mean(probs, dim=0))
        return out

    def _expert(self, e: int, flat: Tensor) -> Tensor:
        """Expert ``e`` on every token; an expert placed elsewhere (:func:`place_experts`) gets the tokens
        broadcast to its placement and sends its output back in ``flat``'s layout (the gradient returns the
        same way)."""
        assert isinstance(self.experts, ModuleList)  # (stacked experts take the exchange instead)
        expert = self.experts[e]
        home = expert.w1.weight
        if not (home.is_global and flat.is_global) or home.placement == flat.placement:
            return expert(flat)  # type: ignore[no-any-return]
        x = F.to_global(flat, home.placement, (broadcast,) * home.placement.ndim)
        return F.to_global(expert(x), flat.placement, flat.sbp)

    def _gate(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The router's probabilities, logical (N, E), and each token's k routing weights and experts, (N, k)."""
        logits = self.gate(flat)  # logical (N, E)
        if active_dtype() is not None:  # under autocast the routing runs in fp32, as softmax does
            logits = F.cast(logits, torch.float32)
        top, probs, index = topk_router(logits, k=self.top_k, normalize=self.norm_topk_prob)
        return probs, top, index

    def _route_topk(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Each token's k routing weights and experts, logical (N, k); its choices one-hot, (N, k, E); and with a
        capacity which of its (N, E) expert choices the expert keeps (``None``: dropless). Sets ``aux_stats``."""
        probs, top, index = self._gate(flat)
        chosen = F.cast(F.eq(F.unsqueeze(index, -1), _like(index, torch.arange(self.num_experts))), probs.dtype)
        hits = F.sum(chosen, dim=1)  # logical (N, E): 1 where the token chose the expert
        self.aux_stats = (F.sum(hits, dim=0).detach(), F.mean(probs, dim=0))
        if self.capacity_factor is None:
            return top, index, chosen, None
        # an expert takes at most ceil(factor * tokens * k / experts) tokens, in token order, and drops the rest
        capacity = math.ceil(self.capacity_factor * flat.shape[0] * self.top_k / self.num_experts)
        kept = F.le(F.mul(F.cumsum(hits, dim=0), hits), float(capacity))  # a token's place in its expert's queue
        return top, index, chosen, F.cast(kept, probs.dtype)

    def route(self, flat: Tensor) -> Tensor:
        """Each token's weight on each expert, logical (N, E): renormalised top-k probabilities, zero elsewhere
        (and zero where a capacity drops the token)."""
        top, _, chosen, kept = self._route_topk(flat)
        weights = F.sum(F.mul(F.unsqueeze(top, -1), chosen), dim=1)  # logical (N, E)
        return weights if kept is None else F.mul(weights, kept)


# ----------------------------------------------------------------------------- the router as one op
#
# softmax, top-k and the renormalisation as sbpflow ops are 4 ops forward and 12 backward, each paying
# dispatch; as one op (and one for its gradient) the router costs two.


def _router_meta(logits: Meta, k: int, normalize: bool) -> tuple[Meta, Meta, Meta]:
    rows = logits.shape[:-1]
    return Meta((*rows, k), logits.dtype), Meta(logits.shape, logits.dtype), Meta((*rows, k), torch.int64)


def _router_sigs(logits: Meta, outs: Any, k: int, normalize: bool) -> list[Sig]:
    """Rows whole or split on any dim but the experts' (the last)."""
    return [Sig((broadcast,), (broadcast,) * 3)] + [Sig((Split(d),), (Split(d),) * 3)
                                                    for d in range(len(logits.shape) - 1)]


@op("topk_router", meta=_router_meta, sbp=_router_sigs, save_outputs=True, diff_outputs=2, grad_reads=())
def topk_router(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A token's top-k routing weights (renormalised to sum to 1 if ``normalize``), its router probabilities
    (softmax over the experts, the last dim) and its k experts: local (..., k), (..., E), (..., k).

    >>> import sbpflow
    >>> top, probs, index = topk_router(sbpflow.tensor([[0.0, 1.0, 2.0]]), k=2, normalize=True)
    >>> index.tolist(), round(float(top.sum()), 6)
    ([[2, 1]], 1.0)
    """
    probs = torch.softmax(logits, dim=-1)
    top, index = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    return top, probs, index


@topk_router.grad
def _topk_router_grad(ctx: Any, d_top: Tensor, d_probs: Tensor) -> Any:
    _, probs, index = ctx.outputs
    return (topk_router_backward(d_top, d_probs, probs, index, normalize=ctx.attrs["normalize"]),)


def _router_backward_meta(d_top: Meta, d_probs: Meta, probs: Meta, index: Meta, normalize: bool) -> Meta:
    return probs


def _router_backward_sigs(d_top: Meta, d_probs: Meta, probs: Meta, index: Meta, outs: Any,
                          normalize: bool) -> list[Sig]:
    return [Sig((broadcast,) * 4, (broadcast,))] + [Sig((Split(d),) * 4, (Split(d),))
                                                    for d in range(len(probs.shape) - 1)]


@op("topk_router_backward", meta=_router_backward_meta, sbp=_router_backward_sigs, differentiable=False)
def topk_router_backward(d_top: torch.Tensor, d_probs: torch.Tensor, probs: torch.Tensor, index: torch.Tensor,
                         normalize: bool) -> torch.Tensor:
    """The router logits' gradient, local (..., E), from its outputs' (:func:`topk_router`)."""
    d_raw = d_top
    if normalize:  # top = raw / s, s = sum(raw): d raw = (d top - sum(d top * top)) / s
        raw = probs.gather(-1, index)
        total = raw.sum(-1, keepdim=True)
        d_raw = (d_top - (d_top * raw).sum(-1, keepdim=True) / total) / total
    d_p = d_probs.scatter_add(-1, index, d_raw.to(d_probs.dtype))  # (the k experts of a row are distinct)
    return probs * (d_p - (d_p * probs).sum(-1, keepdim=True))  # softmax's gradient


def _like(anchor: Tensor, value: torch.Tensor) -> Tensor:
    """``value`` as a constant where ``anchor`` lives (broadcast on every mesh axis of a global anchor)."""
    if not anchor.is_global:
        return tensor(value)
    return tensor(value, placement=anchor.placement, sbp=(broadcast,) * anchor.placement.ndim)


def _laid_like(t: Tensor, anchor: Tensor) -> Tensor:
    """``t`` in ``anchor``'s layout (routing results are, unless a rule chose otherwise)."""
    if (t.placement, t.sbp) == (anchor.placement, anchor.sbp):
        return t
    return F.to_global(t, anchor.placement, anchor.sbp)


def split_experts(moe: MoE, mesh: Placement, mesh_axis: int) -> None:
    """Expert parallelism over ``mesh_axis`` of ``mesh`` (the tokens' placement): the experts' weights are
    stacked (:class:`StackedExperts`) and split S(0) on that axis, so the ranks at coordinate ``g`` hold the
    ``g``-th contiguous group of experts (an expert's SBP on the other axes kept, one dim up), and forwards send
    tokens to their experts by all-to-all. Each rank stacks only its own experts' shards: nothing moves.

    >>> import sbpflow
    >>> from sbpflow import nn
    >>> mesh = sbpflow.placement("cpu", [0, 1])
    >>> moe = nn.MoE(8, 16, num_experts=4, top_k=2).to_global(mesh, sbpflow.sbp.broadcast)
    >>> split_experts(moe, mesh, 0)
    >>> tuple(moe.experts.w1.shape), moe.experts.w1.sbp
    ((4, 16, 8), (Split(dim=0),))
    >>> x = sbpflow.randn(6, 8).to_global(mesh, sbpflow.sbp.split(0))
    >>> with sbpflow.comm.record() as log:
    ...     y = moe(x)
    >>> "all_to_all" in log.kinds() and "broadcast" not in log.kinds()
    True
    """
    layout = check_layout(mesh, mesh_axis, moe.num_experts)
    if isinstance(moe.experts, StackedExperts):
        raise SbpflowError(f"split_experts: the experts of this MoE are split already (over mesh axis "
                           f"{layout.axis if moe.expert_layout is None else moe.expert_layout.axis})")
    triples = [(e.w1.weight, e.w2.weight, e.w3.weight) for e in moe.experts]
    for i in range(3):
        for w in (t[i] for t in triples):
            if not w.is_global or w.placement != mesh or w.sbp != triples[0][i].sbp:
                raise SbpflowError(f"split_experts stacks expert weights laid out alike on {mesh}, but got one with "
                                   f"{w._describe()} and another with {triples[0][i]._describe()}")
    moe.experts = StackedExperts(*(_stack([t[i] for t in triples], layout) for i in range(3)))
    moe.expert_layout = layout


def _stack(weights: list[Tensor], layout: ExpertLayout) -> Tensor:
    """The experts' weights, each (O, I), as one (E, O, I) split S(0) on the ep axis: each rank stacks its own
    experts' shards (a weight split on the ep axis is first gathered there: its member holds it whole)."""
    first = weights[0]
    whole = tuple(broadcast if a == layout.axis else s for a, s in enumerate(first.sbp))
    shape = (len(weights), *first.shape)
    sbp = layout.weight_sbp(first.sbp)
    if first.is_meta:  # built under meta_init: a layout and no data
        return Tensor._meta(shape, first.dtype, layout.mesh, sbp)
    with no_grad():
        weights = [w if w.sbp == whole else F.to_global(w.detach(), layout.mesh, whole) for w in weights]
    per = layout.per_member
    shards = {}
    for r in weights[0].local_tensors():
        j = layout.mesh.coords(r)[layout.axis]
        shards[r] = torch.stack([w.local_tensors()[r] for w in weights[j * per:(j + 1) * per]])
    return Tensor._from_shards(shape, first.dtype, layout.mesh, sbp, shards)


def place_experts(moe: MoE, placements: Sequence[Placement]) -> None:
    """Expert parallelism by placement: expert ``e``'s weights move to ``placements[e]``, keeping their SBP
    (a tensor-parallel split inside the expert stays). The router stays where it is.

    >>> import sbpflow
    >>> from sbpflow import nn
    >>> moe = nn.MoE(8, 16, num_experts=2, top_k=1).to_global(sbpflow.placement("cpu", [0, 1]), sbpflow.sbp.broadcast)
    >>> place_experts(moe, [sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])])
    >>> [str(e.w1.weight.placement) for e in moe.experts]
    ['cpu:[0]', 'cpu:[1]']
    """
    if isinstance(moe.experts, StackedExperts):
        raise SbpflowError("place_experts moves Expert modules, but split_experts stacked this MoE's experts")
    if len(placements) != moe.num_experts:
        raise SbpflowError(f"place_experts needs one placement per expert ({moe.num_experts}), but got "
                           f"{len(placements)}")
    for expert, placement in zip(moe.experts, placements, strict=True):
        for p in expert.parameters():
            if not p.is_global or placement.ndim != p.placement.ndim:
                raise SbpflowError(f"place_experts moves global expert weights to a placement of as many mesh axes, "
                                   f"but got {p._describe()} and {placement}")
    for expert, placement in zip(moe.experts, placements, strict=True):
        for p in expert.parameters():
            relayout_(p, placement, p.sbp)
    moe.expert_layout = None  # experts placed by hand: the dense path (split_experts sets it again)


def load_balancing_loss(stats: list[tuple[Tensor, Tensor]], num_experts: int, top_k: int) -> Tensor:
    """Switch Transformer's auxiliary loss over layers, as transformers' Mixtral computes it.

    ``E * sum_e f_e * p_e``: ``f_e`` the share of token-slots routed to expert
    ``e`` and ``p_e`` its mean router probability, both averaged over the layers
    given (each layer's ``aux_stats``).
    """
    if not stats:
        raise SbpflowError("load_balancing_loss needs the aux_stats of at least one MoE forward, but got none")
    counts = stats[0][0]
    probs = stats[0][1]
    for c, p in stats[1:]:
        counts, probs = F.add(counts, c), F.add(probs, p)
    share = F.div(F.mul(counts, float(top_k)), F.sum(counts))  # each token fills top_k slots in every layer
    return F.mul(F.sum(F.mul(share, F.div(probs, float(len(stats))))), float(num_experts))


__all__ = ["Expert", "MoE", "StackedExperts", "load_balancing_loss", "place_experts", "split_experts", "topk_router"]
