"""A Mixtral-style mixture-of-experts decoder: Llama's attention with :class:`sbpflow.nn.MoE` blocks, named as
transformers' ``MixtralForCausalLM`` so a Mixtral safetensors folder loads by name.

>>> import sbpflow
>>> from sbpflow.models.moe import Mixtral, MixtralConfig
>>> model = Mixtral(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
...                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4))
>>> logits, loss = model(sbpflow.tensor([[1, 2, 3]]), sbpflow.tensor([[2, 3, 4]]))
>>> logits.shape, model.aux_loss is not None
(torch.Size([1, 3, 32]), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sbpflow import nn
from sbpflow.errors import SbpflowError
from sbpflow.models import hf
from sbpflow.models.llama import Llama, LlamaAttention, LlamaConfig
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel
from sbpflow.ops import functional as F
from sbpflow.tensor import Tensor


@dataclass
class MixtralConfig(LlamaConfig):
    """A Hugging Face ``MixtralConfig``: Llama's fields plus the experts'."""

    num_local_experts: int = 8  # routed experts per layer
    num_experts_per_tok: int = 2  # top-k
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in the training loss
    output_router_logits: bool = False  # add the load-balancing loss to the loss
    model_type: str = "mixtral"


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config: MixtralConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_sparse_moe = nn.MoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                                       config.num_experts_per_tok)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = F.add(x, self.self_attn(self.input_layernorm(x), cos, sin))
        return F.add(x, self.block_sparse_moe(self.post_attention_layernorm(x)))


class Mixtral(Llama):
    """The causal MoE language model; after a forward, ``aux_loss`` holds the load-balancing loss, which the
    loss adds times ``router_aux_loss_coef`` when ``output_router_logits`` is set, as transformers does."""

    config: MixtralConfig
    # Megatron inside each expert (w1, w3 column-parallel, w2 row-parallel); the router stays whole on every rank
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "block_sparse_moe.experts.*.w1": ColwiseParallel(), "block_sparse_moe.experts.*.w3": ColwiseParallel(),
        "block_sparse_moe.experts.*.w2": RowwiseParallel(),
    }

    def __init__(self, config: MixtralConfig) -> None:
        super().__init__(config)
        self.model.layers = nn.ModuleList([MixtralDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self._init_weights()
        self._routed = False  # whether a forward ran: aux_loss reads its layers' routing statistics

    def forward(self, ids: Tensor, targets: Tensor | None = None,
                positions: Any = None) -> tuple[Tensor, Tensor | None]:
        logits, loss = super().forward(ids, targets, positions)
        self._routed = True
        c = self.config
        if loss is not None and c.output_router_logits:
            loss = F.add(loss, F.mul(self.aux_loss, c.router_aux_loss_coef))
        return logits, loss

    @property
    def aux_loss(self) -> Tensor | None:
        """The load-balancing loss of the last forward, built when read (a traced step that leaves it out of its
        loss has none of its ops, which do not split over micro-batches); None before any forward."""
        if not self._routed:
            return None
        c = self.config
        # each layer's routing statistics, gathered on the last pipeline stage (where the loss is)
        stats = [(self._to_stage(counts, -1), self._to_stage(probs, -1))
                 for counts, probs in (layer.block_sparse_moe.aux_stats for layer in self.model.layers)]
        return nn.moe.load_balancing_loss(stats, c.num_local_experts, c.num_experts_per_tok)

    def save_pretrained(self, folder: str | Path) -> None:
        """Writes ``config.json`` and ``model.safetensors`` that transformers' ``MixtralForCausalLM`` loads."""
        config = dict(self.config.to_dict(), architectures=["MixtralForCausalLM"], dtype="float32")
        hf.save_folder(folder, config, self)


def expert_tokens(model: Mixtral) -> list[torch.Tensor]:
    """Tokens each expert received in the last forward, one (num_experts,) count per layer."""
    return [torch.as_tensor(layer.block_sparse_moe.aux_stats[0].numpy()) for layer in model.model.layers]


def split_experts(model: Mixtral, mesh_axis: int = 0) -> None:
    """Expert parallelism over ``mesh_axis`` of each layer's (data, tensor) mesh: the experts are stacked and split
    S(0) on that axis, so group ``g`` of them lies on the ranks at coordinate ``g`` (a Megatron split inside each
    expert on the other axis stays), and tokens reach them by all-to-all (:func:`sbpflow.nn.moe.split_experts`).
    Call after ``parallelize``; checkpoints keep one tensor per expert (:func:`hf.checkpoint_names`)."""
    for layer in model.model.layers:
        moe = layer.block_sparse_moe
        weight = moe.experts[0].w1.weight
        if not weight.is_global or not 0 <= mesh_axis < weight.placement.ndim:
            raise SbpflowError(f"split_experts needs a parallelized Mixtral and a mesh axis of its mesh, but got "
                               f"mesh_axis={mesh_axis} for an expert weight with {weight._describe()}")
        nn.moe.split_experts(moe, weight.placement, mesh_axis)


__all__ = ["Mixtral", "MixtralConfig", "MixtralDecoderLayer", "expert_tokens", "split_experts"]
