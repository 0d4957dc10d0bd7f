"""A nanoGPT-style GPT, written once for logical tensors, and its data x tensor x pipeline strategy, which only
places parameters: SBP inference and boxing insert every collective (row-parallel all-reduces, data-parallel
gradients, sends between stages).

>>> import sbpflow
>>> from sbpflow.models.gpt import GPT, GPTConfig, parallelize
>>> sbpflow.manual_seed(0)
>>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
>>> strategy = parallelize(model, data=2, tensor=2)
>>> ids, targets = strategy.shard_inputs([[1, 2, 3, 4]] * 2, [[2, 3, 4, 5]] * 2)
>>> model(ids, targets)[0].sbp
(Split(dim=0), Split(dim=2))
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import sbpflow
from sbpflow import nn
from sbpflow.errors import SbpflowError
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, VocabParallelEmbedding
from sbpflow.nn.parallelize import Strategy, split_blocks, stage_placements
from sbpflow.ops import functional as F
from sbpflow.sbp import broadcast
from sbpflow.tensor import Tensor


@dataclass
class GPTConfig:
    vocab_size: int = 96  # number of token ids
    block_size: int = 64  # longest sequence (rows of the position embedding)
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads; the tensor-parallel degree must divide it
    n_embd: int = 64  # width of the residual stream
    dropout: float = 0.0  # on embeddings, after attention c_proj and after the MLP
    bias: bool = True  # biases in Linear and LayerNorm layers
    tie_weights: bool = True  # the head reuses the token embedding


# ----------------------------------------------------------------------------- modules


_SWAP_HT = (0, 2, 1, 3)  # (B, T, H, hd) <-> (B, H, T, hd)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with separate q, k, v projections.

    Separate projections make a column-parallel split of each keep whole heads
    on a rank: the split of C = H * hd becomes a split of H after the reshape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise SbpflowError(f"GPT needs n_embd divisible by n_head, but got {config.n_embd} and {config.n_head}")
        self.n_head = config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # logical (B, T, C)
        heads = (b, t, self.n_head, c // self.n_head)
        # reshape to heads and swap T and H in one op each (one dispatch, one gradient node)
        q = F.reshape_permute(self.q(x), heads, _SWAP_HT)  # logical (B, H, T, hd)
        k = F.reshape_permute(self.k(x), heads, _SWAP_HT)  # logical (B, H, T, hd)
        v = F.reshape_permute(self.v(x), heads, _SWAP_HT)  # logical (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # logical (B, H, T, hd)
        y = F.permute_reshape(y, _SWAP_HT, (b, t, c))  # logical (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The language model: embeddings, ``n_layer`` blocks, final LayerNorm, head.

    ``model(ids, targets)`` returns ``(logits, loss)``; ``loss`` is None
    without targets. Parameters start from nanoGPT's initialisation drawn from
    sbpflow's placement-independent random stream, so every strategy starts
    from the weights one device would have.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        if not config.tie_weights:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.strategy: Strategy | None = None
        _init_weights(self)

    @property
    def parallel_plan(self) -> dict[str, Any]:
        """The rules :func:`sbpflow.parallelize` reads (see :data:`BLOCK_PLAN`)."""
        return _gpt_plan(self)

    def forward(self, ids: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        b, t = ids.shape  # logical (B, T)
        if t > self.config.block_size:
            raise SbpflowError(f"GPT got a sequence of {t} tokens, but its block_size is {self.config.block_size}")
        x = self.drop(self.wte(ids) + self.wpe(self._positions(ids)))  # logical (B, T, C)
        for i, block in enumerate(self.h):
            x = block(self._to_stage(x, self._block_stage(i)))
        x = self.ln_f(self._to_stage(x, -1))
        logits = F.linear(x, self._head_weight())  # logical (B, T, V)
        if targets is None:
            return logits, None
        v = self.config.vocab_size
        loss = F.cross_entropy(F.reshape(logits, (b * t, v)), F.reshape(targets, (b * t,)))  # logical (B*T, V)
        return logits, loss

    def _positions(self, ids: Tensor) -> Tensor:
        """Logical positions 0..T-1, broadcast where ``ids`` lives: a split sequence reads its own rows."""
        t = ids.shape[1]
        if self.strategy is not None:
            first = self.strategy.stages[0]
            return sbpflow.arange(t, placement=first, sbp=(broadcast,) * first.ndim)
        if ids.is_global:
            return sbpflow.arange(t, placement=ids.placement, sbp=(broadcast,) * ids.placement.ndim)
        return sbpflow.arange(t)

    def _block_stage(self, i: int) -> int:
        return self.strategy.block_stage[i] if self.strategy is not None else 0

    def _to_stage(self, x: Tensor, stage: int) -> Tensor:
        """Moves an activation to a pipeline stage's placement (its SBP kept); the gradient moves back."""
        if self.strategy is None:
            return x
        target = self.strategy.stages[stage]
        return x if x.placement == target else x.to_global(placement=target)

    def _head_weight(self) -> Tensor:
        if not self.config.tie_weights:
            return self.lm_head.weight
        # The tied head reads the token embedding on the last stage; to_global's
        # backward carries the head's gradient back to the embedding's stage.
        return self._to_stage(self.wte.weight, -1)

    @sbpflow.no_grad()
    def generate(self, ids: Tensor, max_new_tokens: int, temperature: float = 1.0, seed: int = 0) -> list[int]:
        """Samples ``max_new_tokens`` ids after the single sequence ``ids`` (logical (1, T)); returns them all.

        Sampling reads the logical logits of the last position, so it does not
        depend on the strategy.
        """
        rng = np.random.default_rng(seed)
        tokens = [int(i) for i in np.asarray(ids.numpy()).reshape(-1)]
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            window = tokens[-self.config.block_size :]
            x = self._inputs([window])
            logits, _ = self(x)
            last = logits.numpy()[0, -1].astype(np.float64) / max(temperature, 1e-6)
            probs = np.exp(last - last.max())
            tokens.append(int(rng.choice(len(probs), p=probs / probs.sum())))
        self.train(was_training)
        return tokens

    def _inputs(self, ids: Any) -> Tensor:
        if self.strategy is None:
            return sbpflow.tensor(np.asarray(ids, dtype=np.int64))
        return self.strategy.shard_inputs(ids)[0]


def _init_weights(model: GPT) -> None:
    """nanoGPT's init: N(0, 0.02) weights and embeddings, zero biases, unit LayerNorm scales, and
    residual projections (``c_proj``) scaled by 1/sqrt(2 n_layer)."""
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, residual_std if name.endswith("c_proj") else 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)


# ----------------------------------------------------------------------------- strategy

# Megatron on the tensor axis, written as nn.parallel styles: column-parallel q, k, v and MLP fc (output
# features split, so each rank keeps whole heads), row-parallel c_proj layers (input features split: a partial
# sum that the framework reduces where the residual stream needs it), vocabulary-parallel embedding and head.
BLOCK_PLAN = {
    "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
    "attn.c_proj": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
}
TENSOR_AXIS = 1  # mesh axes are (data, tensor)


def _gpt_plan(model: GPT) -> dict[str, Any]:
    """The GPT's plan for :func:`sbpflow.parallelize`: :data:`BLOCK_PLAN` in every block, vocab-parallel
    embedding and (untied) head."""
    plan: dict[str, Any] = {"wte": VocabParallelEmbedding(), **{f"h.*.{k}": v for k, v in BLOCK_PLAN.items()}}
    if not model.config.tie_weights:
        plan["lm_head"] = ColwiseParallel()  # weight S(0): vocab parallel
    return plan


def parallelize(model: GPT, data: int = 1, tensor: int = 1, pipeline: int | tuple[int, ...] = 1,
                device: str = "cpu", virtual: int = 1) -> Strategy:
    """Places ``model``'s parameters for data x tensor x pipeline parallelism; returns the :class:`Strategy`.

    :func:`sbpflow.parallelize` with the GPT's own plan (:data:`BLOCK_PLAN`, vocab-parallel embedding and
    head): stage ``s`` holds its blocks (the embeddings on stage 0, the final LayerNorm and head on the last),
    and on each stage's (data, tensor) mesh a parameter is B on the data axis and Megatron's split on the
    tensor axis. ``pipeline`` is a number of stages (blocks spread as evenly as possible) or the blocks of
    each stage, such as ``(1, 3)`` (the planner's cuts may be uneven). ``virtual`` > 1 cuts the blocks into
    ``virtual * pipeline`` stages instead, stage ``k`` on placement ``k mod pipeline`` (interleaved 1F1B).

    >>> import sbpflow
    >>> sbpflow.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8))
    >>> s = parallelize(model, tensor=2, pipeline=2)
    >>> stage, sbp, shape = s.params["h.1.attn.c_proj.weight"]
    >>> stage, sbpflow.sbp.format_nd(sbp)
    (1, '(B, S(1))')
    """
    stages = None
    if isinstance(pipeline, tuple):
        block_stage = _blocks_from_sizes(pipeline, model.config.n_layer)
        stages = [f"h.{block_stage.index(s)}" for s in range(len(pipeline))]
        pipeline = len(pipeline)
    _check_degrees(model.config, data, tensor, pipeline)
    if not isinstance(virtual, int) or virtual < 1 or (virtual > 1 and stages is not None):
        raise SbpflowError(f"parallelize needs virtual >= 1 (and pipeline as a number of stages when virtual > 1), "
                           f"but got virtual={virtual!r} with pipeline={pipeline!r}")
    if pipeline * virtual > max(model.config.n_layer, 1):
        raise SbpflowError(f"pipeline={pipeline} with virtual={virtual} stages per placement needs at least "
                           f"{pipeline * virtual} blocks (one per stage), but the GPT has {model.config.n_layer}")
    return sbpflow.parallelize(model, data, tensor, pipeline, virtual, stages=stages, device=device)


def _blocks_from_sizes(sizes: tuple[int, ...], n_layer: int) -> tuple[int, ...]:
    if not sizes or sum(sizes) != n_layer or min(sizes) < 1 or not all(isinstance(n, int) for n in sizes):
        raise SbpflowError(f"pipeline as blocks per stage must give every stage at least one block, {n_layer} in "
                           f"all, but got {sizes}")
    return tuple(s for s, n in enumerate(sizes) for _ in range(n))


def _check_degrees(config: GPTConfig, data: int, tensor: int, pipeline: int) -> None:
    for what, n in (("data", data), ("tensor", tensor), ("pipeline", pipeline)):
        if not isinstance(n, int) or n < 1:
            raise SbpflowError(f"parallelize needs {what} >= 1, but got {n!r}")
    if config.n_head % tensor:
        raise SbpflowError(f"parallelize: tensor={tensor} must divide n_head={config.n_head}, so that each rank "
                           "keeps whole heads")


def parse_strategy(spec: str | dict[str, int] | None) -> dict[str, int]:
    """``"dp=2,tp=2,pp=1"`` (or a dict, or None / "single") as ``{"data": 2, "tensor": 2, "pipeline": 1}``.

    >>> parse_strategy("dp=2,tp=2")
    {'data': 2, 'tensor': 2, 'pipeline': 1}
    """
    out = {"data": 1, "tensor": 1, "pipeline": 1}
    if spec is None or spec in ("", "single", "none"):
        return out
    aliases = {"dp": "data", "tp": "tensor", "pp": "pipeline", "data": "data", "tensor": "tensor",
               "pipeline": "pipeline"}
    items: Iterator[tuple[str, Any]]
    if isinstance(spec, dict):
        items = iter(spec.items())
    else:
        items = (_split_item(part, spec) for part in spec.split(",") if part.strip())
    for key, value in items:
        if key not in aliases:
            raise SbpflowError(f"strategy keys are dp, tp and pp, but {spec!r} has {key!r}")
        out[aliases[key]] = int(value)
    return out


def _split_item(part: str, spec: str) -> tuple[str, str]:
    key, sep, value = part.partition("=")
    if not sep or not value.strip().isdigit():
        raise SbpflowError(f"strategy entries look like 'dp=2', but {spec!r} has {part.strip()!r}")
    return key.strip(), value.strip()


__all__ = ["GPT", "GPTConfig", "Block", "MLP", "CausalSelfAttention", "Strategy", "parallelize", "parse_strategy",
           "stage_placements", "split_blocks", "BLOCK_PLAN"]
