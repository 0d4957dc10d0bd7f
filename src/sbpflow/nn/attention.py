"""torch's ``nn.MultiheadAttention`` and ``nn.LSTM`` built from sbpflow ops: torch's parameters and state dicts,
and every op keeps the splits it can (a batch split runs per shard).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import SbpError, ShapeError
from ..ops import functional as F
from ..placement import Placement
from ..sbp import Broadcast, Split
from ..tensor import Tensor
from . import init
from ._build import empty_param
from .layers import Linear
from .module import Module


class MultiheadAttention(Module):
    """Attention over ``num_heads`` heads of ``embed_dim // num_heads``; inputs (L, N, E), or (N, L, E) with
    ``batch_first``. Returns ``(output, weights)``: the weights averaged over heads (or per head), None when
    ``need_weights=False``.

    >>> import sbpflow
    >>> mha = MultiheadAttention(8, 2, batch_first=True)
    >>> out, weights = mha(*(sbpflow.randn(3, 5, 8),) * 3)
    >>> out.shape, weights.shape
    (torch.Size([3, 5, 8]), torch.Size([3, 5, 5]))
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, *, placement: Placement | None = None,
                 sbp: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ShapeError(f"MultiheadAttention needs embed_dim ({embed_dim}) divisible by num_heads ({num_heads})")
        if add_bias_kv or add_zero_attn or (kdim not in (None, embed_dim)) or (vdim not in (None, embed_dim)):
            raise ShapeError("MultiheadAttention supports kdim = vdim = embed_dim without add_bias_kv/add_zero_attn")
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = empty_param((3 * embed_dim, embed_dim), "in_proj_weight", placement, sbp,
                                          "MultiheadAttention", dtype)
        if bias:
            self.in_proj_bias = empty_param((3 * embed_dim,), "in_proj_bias", placement, sbp, "MultiheadAttention",
                                            dtype)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, placement=placement, sbp=sbp, dtype=dtype)
        init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            init.zeros_(self.in_proj_bias)
            init.zeros_(self.out_proj.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = (F.transpose(t, 0, 1) for t in (query, key, value))
        n, tgt, src = query.shape[0], query.shape[1], key.shape[1]
        q, k, v = (self._project(t, i) for i, t in enumerate((query, key, value)))  # (N, H, L, D) each, global
        scores = F.mul(F.matmul(q, F.transpose(k, -1, -2)), 1.0 / math.sqrt(self.head_dim))  # (N, H, L, S)
        scores = self._masked(scores, attn_mask, key_padding_mask, is_causal, n, tgt, src)
        weights = F.softmax(scores, -1)
        if self.dropout > 0 and self.training:
            weights = F.dropout(weights, self.dropout)
        out = F.reshape(F.permute(F.matmul(weights, v), (0, 2, 1, 3)), (n, tgt, self.embed_dim))  # (N, L, E)
        out = self.out_proj(out)
        if not self.batch_first:
            out = F.transpose(out, 0, 1)
        if not need_weights:
            return out, None
        return out, F.mean(weights, dim=1) if average_attn_weights else weights

    def _project(self, x: Tensor, part: int) -> Tensor:
        """Rows ``part * E .. (part + 1) * E`` of the packed projection, split into heads: (N, H, L, D)."""
        e = self.embed_dim
        w = F.narrow(self.in_proj_weight, 0, part * e, e)
        b = F.narrow(self.in_proj_bias, 0, part * e, e) if self.in_proj_bias is not None else None
        y = F.linear(x, w, b)  # (N, L, E)
        return F.permute(F.reshape(y, (x.shape[0], x.shape[1], self.num_heads, self.head_dim)), (0, 2, 1, 3))

    def _masked(self, scores: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool,
                n: int, tgt: int, src: int) -> Tensor:
        if is_causal and attn_mask is None:
            attn_mask = Tensor._from_local(torch.ones(tgt, src, dtype=torch.bool).triu(1))
        if attn_mask is not None:
            mask = attn_mask if attn_mask.ndim == 2 else F.reshape(attn_mask, (n, self.num_heads, tgt, src))
            scores = F.masked_fill(scores, mask, float("-inf")) if mask.dtype == torch.bool else F.add(scores, mask)
        if key_padding_mask is not None:  # (N, S), True: a key to leave out
            pad = F.reshape(key_padding_mask, (n, 1, 1, src))
            scores = F.masked_fill(scores, pad, float("-inf")) if pad.dtype == torch.bool else F.add(scores, pad)
        return scores

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


class LSTM(Module):
    """torch's ``nn.LSTM`` (gates i, f, g, o; ``num_layers``, ``bidirectional``, ``batch_first``, dropout between
    layers), one time step at a time from linear, sigmoid and tanh; parameters and state dict are torch's.

    Under a global layout it runs per shard under batch splits only: the input split on its batch dim (or
    broadcast) and every weight broadcast. Any other layout is refused, since the recurrence would communicate
    at every time step.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 *, placement: Placement | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if proj_size:
            raise ShapeError("LSTM(proj_size=...) is not supported")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout, self.bidirectional = bias, batch_first, dropout, bidirectional
        directions = 2 if bidirectional else 1
        bound = 1.0 / math.sqrt(hidden_size)
        for layer in range(num_layers):
            width = input_size if layer == 0 else hidden_size * directions
            for suffix in [f"_l{layer}", f"_l{layer}_reverse"][:directions]:
                shapes: dict[str, tuple[int, ...]] = {"weight_ih": (4 * hidden_size, width),
                                                      "weight_hh": (4 * hidden_size, hidden_size)}
                if bias:
                    shapes.update({"bias_ih": (4 * hidden_size,), "bias_hh": (4 * hidden_size,)})
                for name, shape in shapes.items():
                    p = empty_param(shape, name + suffix, placement, None, "LSTM", dtype)
                    init.uniform_(p, -bound, bound)  # torch's init for every LSTM weight
                    setattr(self, name + suffix, p)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        self._check_layout(x)
        if self.batch_first:
            x = F.transpose(x, 0, 1)  # (L, N, in), global
        directions = 2 if self.bidirectional else 1
        n = x.shape[1]
        hs, cs = [], []
        for layer in range(self.num_layers):
            outs = []
            for d in range(directions):
                k = layer * directions + d
                h0 = F.select_row(state[0], k) if state is not None else F.new_full(x, (n, self.hidden_size), 0.0)
                c0 = F.select_row(state[1], k) if state is not None else F.new_full(x, (n, self.hidden_size), 0.0)
                out, h, c = self._run(x, h0, c0, f"_l{layer}" + ("_reverse" if d else ""), reverse=d == 1)
                outs.append(out)
                hs.append(h)
                cs.append(c)
            x = F.cat(outs, -1) if directions == 2 else outs[0]  # (L, N, D * H)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout)
        out = F.transpose(x, 0, 1) if self.batch_first else x
        return out, (F.stack(hs, 0), F.stack(cs, 0))

    def _run(self, x: Tensor, h: Tensor, c: Tensor, suffix: str, reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
        w_ih, w_hh = getattr(self, "weight_ih" + suffix), getattr(self, "weight_hh" + suffix)
        b_ih, b_hh = (getattr(self, "bias_ih" + suffix), getattr(self, "bias_hh" + suffix)) if self.bias else (None,
                                                                                                             None)
        projected = F.linear(x, w_ih, b_ih)  # (L, N, 4H): every step's input part at once
        steps = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
        outs: list[Tensor] = []
        for t in steps:
            gates = F.add(F.select_row(projected, t), F.linear(h, w_hh, b_hh))  # (N, 4H)
            i, f, g, o = F.chunk(gates, 4, -1)
            c = F.add(F.mul(F.sigmoid(f), c), F.mul(F.sigmoid(i), F.tanh(g)))
            h = F.mul(F.sigmoid(o), F.tanh(c))
            outs.append(h)
        if reverse:
            outs.reverse()
        return F.stack(outs, 0), h, c

    def _check_layout(self, x: Tensor) -> None:
        if not x.is_global:
            return
        batch = 0 if self.batch_first else 1
        fits = all(s == Split(batch) or isinstance(s, Broadcast) for s in x.sbp)
        weights = [p for p in self.parameters() if not p.is_global or any(not isinstance(s, Broadcast) for s in p.sbp)]
        if not fits or weights:
            bad = x._describe() if not fits else f"parameter {weights[0]._describe()}"
            raise SbpError(f"LSTM runs per shard under batch splits only: the input split on its batch dim {batch} "
                           f"(or broadcast) and every weight broadcast, but got {bad}; a recurrence split any other "
                           "way would communicate at every time step")

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"batch_first={self.batch_first}, bidirectional={self.bidirectional}")
