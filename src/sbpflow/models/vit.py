"""A small Vision Transformer, written as a plain user of :mod:`sbpflow.nn`; its only tie to parallelism is
the :attr:`ViT.parallel_plan` that :func:`sbpflow.parallelize` reads.

>>> import sbpflow
>>> from sbpflow.models.vit import ViT, ViTConfig
>>> model = ViT(ViTConfig(image_size=8, patch_size=4, width=16, depth=2, n_head=2, num_classes=3))
>>> strategy = sbpflow.parallelize(model, data=2, tensor=2)
>>> logits, loss = model(sbpflow.randn(4, 3, 8, 8), sbpflow.tensor([0, 1, 2, 0]))
>>> logits.shape, logits.sbp
(torch.Size([4, 3]), (Split(dim=0), Broadcast()))
"""

from __future__ import annotations

from dataclasses import dataclass

import sbpflow
from sbpflow import nn
from sbpflow.errors import SbpflowError
from sbpflow.ops import functional as F
from sbpflow.tensor import Tensor


@dataclass
class ViTConfig:
    image_size: int = 16  # square images, image_size pixels a side
    patch_size: int = 4  # square patches; image_size must divide by it
    channels: int = 3  # input channels
    width: int = 32  # width of the token stream
    depth: int = 4  # encoder blocks
    n_head: int = 4  # attention heads; the tensor-parallel degree must divide it
    mlp_ratio: int = 4  # MLP hidden width / width
    num_classes: int = 10


_SWAP_HT = (0, 2, 1, 3)  # (B, N, H, hd) <-> (B, H, N, hd)


class Attention(nn.Module):
    """Bidirectional multi-head attention with separate q, k, v (a column split keeps whole heads per rank)."""

    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape  # logical (B, N, C)
        heads = (b, n, self.n_head, c // self.n_head)
        q = F.reshape_permute(self.q(x), heads, _SWAP_HT)  # logical (B, H, N, hd)
        k = F.reshape_permute(self.k(x), heads, _SWAP_HT)
        v = F.reshape_permute(self.v(x), heads, _SWAP_HT)
        y = F.scaled_dot_product_attention(q, k, v)  # logical (B, H, N, hd)
        return self.proj(F.permute_reshape(y, _SWAP_HT, (b, n, c)))  # logical (B, N, C)


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(config.width), nn.LayerNorm(config.width)
        self.attn = Attention(config.width, config.n_head)
        self.mlp = MLP(config.width, config.mlp_ratio * config.width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """``model(images, labels=None)`` returns ``(logits, loss)``: images logical (B, channels, S, S)."""

    # Megatron in each block: q, k, v and fc1 split by output features, proj and fc2 by input features
    parallel_plan = {
        "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise",
    }

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        if config.image_size % config.patch_size or config.width % config.n_head:
            raise SbpflowError(f"ViT needs image_size divisible by patch_size and width by n_head, but got "
                               f"{config.image_size}, {config.patch_size}, {config.width}, {config.n_head}")
        self.config = config
        patches = (config.image_size // config.patch_size) ** 2
        self.patch = nn.Conv2d(config.channels, config.width, config.patch_size, stride=config.patch_size)
        self.pos_embed = nn.Parameter(F.mul(sbpflow.randn(1, patches, config.width), 0.02))  # (1, N, C)
        self.blocks = nn.ModuleList([EncoderBlock(config) for _ in range(config.depth)])
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.num_classes)

    def forward(self, images: Tensor, labels: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        x = self.patch(images)  # logical (B, C, S/p, S/p)
        b, c, h, w = x.shape
        x = F.add(F.permute(F.reshape(x, (b, c, h * w)), (0, 2, 1)), self.pos_embed)  # logical (B, N, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(F.mean(self.norm(x), dim=1))  # logical (B, classes)
        return logits, None if labels is None else F.cross_entropy(logits, labels)


__all__ = ["Attention", "EncoderBlock", "MLP", "ViT", "ViTConfig"]
