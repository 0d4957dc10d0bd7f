"""A Llama-style decoder (Llama 2 and 3) with transformers' parameter names, so a Hugging Face checkpoint loads
by name (:mod:`sbpflow.models.hf`).

>>> import sbpflow
>>> from sbpflow.models.llama import Llama, LlamaConfig, parallelize
>>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                      num_attention_heads=4, num_key_value_heads=2)
>>> model = Llama(config)
>>> ids, targets = parallelize(model, data=2, tensor=2).shard_inputs([[1, 2, 3, 4]] * 2, [[2, 3, 4, 5]] * 2)
>>> model(ids, targets)[0].sbp
(Split(dim=0), Split(dim=2))
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

import sbpflow
from sbpflow import nn
from sbpflow.errors import SbpflowError
from sbpflow.models import hf
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, VocabParallelEmbedding
from sbpflow.nn.parallelize import HF_STYLES, STYLES, Strategy
from sbpflow.ops import functional as F
from sbpflow.sbp import broadcast
from sbpflow.tensor import Tensor


@dataclass
class LlamaConfig:
    """The fields of a Hugging Face ``LlamaConfig`` that define the network (see :meth:`from_dict`)."""

    vocab_size: int = 128  # number of token ids
    hidden_size: int = 64  # width of the residual stream
    intermediate_size: int = 128  # width of the SwiGLU MLP
    num_hidden_layers: int = 2  # decoder layers
    num_attention_heads: int = 4  # query heads; the tensor-parallel degree must divide the key/value heads
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k, v, o
    mlp_bias: bool = False  # biases on gate, up, down
    initializer_range: float = 0.02
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)  # every other config.json field, written back on save

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """From a ``config.json`` dict; transformers 5's ``rope_parameters`` and 4's ``rope_scaling`` both work."""
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in known}
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if rope:
            kwargs["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
            kind = rope.get("rope_type", rope.get("type", "default"))
            kwargs["rope_scaling"] = None if kind == "default" else dict(rope, rope_type=kind)
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", cls.num_attention_heads)
        config = cls(**kwargs, extra={k: v for k, v in d.items() if k not in known})
        _check_config(config)
        return config

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict transformers reads (rotary settings under both 4's and 5's keys)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "rope_scaling")}
        rope = dict(self.rope_scaling or {"rope_type": "default"}, rope_theta=self.rope_theta)
        return {**self.extra, **d, "rope_parameters": rope, "rope_scaling": self.rope_scaling}


def _check_config(c: LlamaConfig) -> None:
    if c.num_attention_heads % c.num_key_value_heads:
        raise SbpflowError(f"Llama needs num_attention_heads divisible by num_key_value_heads, but got "
                           f"{c.num_attention_heads} and {c.num_key_value_heads}")
    kind = (c.rope_scaling or {}).get("rope_type", "default")
    if kind not in ("default", "llama3"):
        raise SbpflowError(f"Llama supports rope_type 'default' and 'llama3', but the config has {kind!r}")


# ----------------------------------------------------------------------------- rotary embeddings


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies (head_dim / 2,), with Llama 3's scaling when the config asks for it."""
    dim = config.dim_per_head
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    # Llama 3: long wavelengths slowed by ``factor``, short ones kept, the band between blended smoothly.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: LlamaConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles at global ``positions`` (T,), each (T, head_dim) fp32 as transformers makes them.

    Computed on the host, they enter as a logical constant: under a split of the sequence each shard reads
    the rows of its own positions, so a split sequence gets the right angles."""
    freqs = positions.float()[:, None] * rope_inv_freq(config)[None, :]  # (T, hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return F.cat([F.neg(F.narrow(x, -1, half, half)), F.narrow(x, -1, 0, half)], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` over logical (B, H, T, hd) ``x`` and (T, hd) tables."""
    return F.add(F.mul(x, cos), F.mul(_rotate_half(x), sin))


# ----------------------------------------------------------------------------- modules

_SWAP_HT = (0, 2, 1, 3)  # (B, T, H, hd) <-> (B, H, T, hd)


class LlamaAttention(nn.Module):
    """Grouped-query causal attention: ``num_key_value_heads`` k/v heads, each shared by a group of q heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.hd = config.num_attention_heads, config.num_key_value_heads, config.dim_per_head
        c, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(c, self.n_head * self.hd, bias=bias)
        self.k_proj = nn.Linear(c, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(c, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_head * self.hd, c, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape  # logical (B, T, C)
        q = F.reshape_permute(self.q_proj(x), (b, t, self.n_head, self.hd), _SWAP_HT)  # logical (B, H, T, hd)
        k = F.reshape_permute(self.k_proj(x), (b, t, self.n_kv, self.hd), _SWAP_HT)  # logical (B, Hkv, T, hd)
        v = F.reshape_permute(self.v_proj(x), (b, t, self.n_kv, self.hd), _SWAP_HT)  # logical (B, Hkv, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = self._repeat_kv(k), self._repeat_kv(v)  # logical (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # logical (B, H, T, hd)
        return self.o_proj(F.permute_reshape(y, _SWAP_HT, (b, t, self.n_head * self.hd)))  # logical (B, T, C)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """Each k/v head repeated for its group of q heads; a split of the k/v heads stays a split of the heads."""
        group = self.n_head // self.n_kv
        if group == 1:
            return x
        b, _, t, hd = x.shape
        x = F.expand(F.unsqueeze(x, 2), (b, self.n_kv, group, t, hd))  # logical (B, Hkv, group, T, hd)
        return F.reshape(x, (b, self.n_head, t, hd))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c, m, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(c, m, bias=bias)
        self.up_proj = nn.Linear(c, m, bias=bias)
        self.down_proj = nn.Linear(m, c, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (transformers' ``model.`` prefix)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Llama(nn.Module):
    """The causal language model. ``model(ids, targets)`` returns ``(logits, loss)``; ``loss`` is None without targets.

    ``targets`` are the next tokens of ``ids`` (already shifted, as for :class:`~sbpflow.models.gpt.GPT`);
    ``positions`` (logical (T,) ints, default ``0..T-1``) give each column's global position.
    """

    layer_plan: dict[str, Any] = {}  # each decoder layer's tensor-parallel plan (set below the class)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        _check_config(config)
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.strategy: Strategy | None = None
        self._init_weights()

    @property
    def parallel_plan(self) -> dict[str, Any]:
        """The rules :func:`sbpflow.parallelize` reads (:func:`llama_plan`)."""
        return llama_plan(self)

    def _init_weights(self) -> None:
        """N(0, initializer_range) for Linear and Embedding weights, zero biases (transformers' init)."""
        config = self.config
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, config.initializer_range)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, ids: Tensor, targets: Tensor | None = None,
                positions: Any = None) -> tuple[Tensor, Tensor | None]:
        b, t = ids.shape  # logical (B, T)
        angles = torch.arange(t) if positions is None else torch.as_tensor(positions)
        x = self.model.embed_tokens(ids)  # logical (B, T, C)
        tables: dict[Any, tuple[Tensor, Tensor]] = {}  # the rotary tables of each pipeline stage
        for i, layer in enumerate(self.model.layers):
            x = self._to_stage(x, i)
            where = x.placement if x.is_global else None
            if where not in tables:
                tables[where] = self._rope(x, angles)
            x = layer(x, *tables[where])
        x = self.model.norm(self._to_stage(x, -1))
        head = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(x, self._to_stage(head, -1))  # logical (B, T, V)
        if targets is None:
            return logits, None
        v = self.config.vocab_size
        return logits, F.cross_entropy(F.reshape(logits, (b * t, v)), F.reshape(targets, (b * t,)))

    @sbpflow.no_grad()
    def generate(self, ids: Tensor, max_new_tokens: int, temperature: float = 1.0, seed: int = 0) -> list[int]:
        """Samples ``max_new_tokens`` ids after the single sequence ``ids`` (logical (1, T)); returns them all."""
        rng = np.random.default_rng(seed)
        tokens = [int(i) for i in np.asarray(ids.numpy()).reshape(-1)]
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            window = np.asarray([tokens[-self.config.max_position_embeddings:]], dtype=np.int64)
            x = self.strategy.shard_inputs(window)[0] if self.strategy is not None else sbpflow.tensor(window)
            last = self(x)[0].numpy()[0, -1].astype(np.float64) / max(temperature, 1e-6)
            probs = np.exp(last - last.max())
            tokens.append(int(rng.choice(len(probs), p=probs / probs.sum())))
        self.train(was_training)
        return tokens

    def save_pretrained(self, folder: str | Path) -> None:
        """Writes ``config.json`` and ``model.safetensors`` that transformers' ``LlamaForCausalLM`` loads."""
        config = dict(self.config.to_dict(), architectures=["LlamaForCausalLM"], dtype="float32")
        hf.save_folder(folder, config, self)

    def _to_stage(self, x: Tensor, layer: int) -> Tensor:
        """Moves ``x`` to the pipeline stage of ``layer`` (-1: the last), its SBP kept; the gradient moves back."""
        if self.strategy is None:
            return x
        target = self.strategy.stages[self.strategy.block_stage[layer] if layer >= 0 else -1]
        return x if x.placement == target else x.to_global(placement=target)

    def _rope(self, ids: Tensor, positions: torch.Tensor) -> tuple[Tensor, Tensor]:
        """The (T, hd) cos and sin tables, broadcast where ``ids`` lives (a sequence split slices them)."""
        if positions.shape != (ids.shape[1],):
            raise SbpflowError(f"Llama: positions must be logical ({ids.shape[1]},) for ids of shape "
                               f"{tuple(ids.shape)}, but got shape {tuple(positions.shape)}")
        cos, sin = rope_tables(self.config, positions)
        if not ids.is_global:
            return sbpflow.tensor(cos), sbpflow.tensor(sin)
        p, nd = ids.placement, (broadcast,) * ids.placement.ndim
        return sbpflow.tensor(cos, placement=p, sbp=nd), sbpflow.tensor(sin, placement=p, sbp=nd)


# ----------------------------------------------------------------------------- strategy

# Megatron on the tensor axis: column-parallel q, k, v, gate and up (whole heads per rank), row-parallel o and down.
LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}
TENSOR_AXIS = 1  # mesh axes are (data, tensor)
Llama.layer_plan = LAYER_PLAN


def llama_plan(model: Llama) -> dict[str, Any]:
    """The plan :func:`sbpflow.parallelize` reads for a Llama (or Mixtral): the model's ``layer_plan`` in
    every layer (or, for a folder whose config.json carries Hugging Face's ``base_model_tp_plan``, its entries
    that name sbpflow's modules with a style sbpflow has), a vocab-parallel embedding and an untied head."""
    layers = {f"model.layers.*.{k}": v for k, v in model.layer_plan.items()}
    hf_plan = model.config.extra.get("base_model_tp_plan")
    if isinstance(hf_plan, dict) and hf_plan:
        names = [name for name, _ in model.named_modules()]
        layers = {f"model.{k}": v for k, v in hf_plan.items()
                  if (v in STYLES or v in HF_STYLES) and any(fnmatch.fnmatchcase(n, f"model.{k}") for n in names)}
    plan: dict[str, Any] = {"model.embed_tokens": VocabParallelEmbedding(), **layers}
    if not model.config.tie_word_embeddings:
        plan["lm_head"] = ColwiseParallel()
    return plan


def parallelize(model: Llama, data: int = 1, tensor: int = 1, pipeline: int = 1, device: str = "cpu",
                expert: int = 1) -> Strategy:
    """Places ``model``'s parameters on (data, tensor) meshes: B over data, Megatron over tensor, and
    ``pipeline`` stages of consecutive layers (the embedding on the first, the norm and head on the last).

    :func:`sbpflow.parallelize` with :func:`llama_plan`. The embedding and an untied head are split over the
    vocabulary; a tied head reads the embedding's split. Returns the :class:`~sbpflow.nn.parallelize.Strategy`
    whose ``shard_inputs`` lays out ids and targets. ``expert`` cuts a Mixtral's experts into groups over the data
    axis (:func:`sbpflow.parallelize`).

    >>> import sbpflow
    >>> sbpflow.manual_seed(0)
    >>> model = Llama(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1))
    >>> s = parallelize(model, tensor=2)
    >>> sbpflow.sbp.format_nd(model.model.layers[0].self_attn.o_proj.weight.sbp)
    '(B, S(1))'
    """
    _check_degrees(model.config, data, tensor, pipeline)
    return sbpflow.parallelize(model, data, tensor, pipeline, expert=expert, device=device)


def _check_degrees(config: LlamaConfig, data: int, tensor: int, pipeline: int) -> None:
    for what, n in (("data", data), ("tensor", tensor), ("pipeline", pipeline)):
        if not isinstance(n, int) or n < 1:
            raise SbpflowError(f"Llama parallelize needs {what} >= 1, but got {n!r}")
    if config.num_key_value_heads % tensor or config.vocab_size % tensor:
        raise SbpflowError(f"Llama parallelize: tensor={tensor} must divide num_key_value_heads="
                           f"{config.num_key_value_heads} (whole heads per rank) and vocab_size={config.vocab_size}")


__all__ = ["Llama", "LlamaAttention", "LlamaConfig", "LlamaDecoderLayer", "LlamaMLP", "LlamaModel", "LAYER_PLAN",
           "apply_rotary", "llama_plan", "parallelize", "rope_inv_freq", "rope_tables"]
