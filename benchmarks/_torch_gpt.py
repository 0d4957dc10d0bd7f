"""sbpflow.models.gpt.GPT written in plain torch, for side-by-side benchmarks (same parameter names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as TF

from sbpflow.models.gpt import GPTConfig


class TorchBlock(torch.nn.Module):
    """The block of sbpflow.models.gpt in torch: pre-LN attention (separate q, k, v) and a GELU MLP."""

    def __init__(self, c: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
        self.attn = torch.nn.ModuleDict({k: torch.nn.Linear(c, c) for k in ("q", "k", "v", "c_proj")})
        self.mlp = torch.nn.ModuleDict({"c_fc": torch.nn.Linear(c, 4 * c), "c_proj": torch.nn.Linear(4 * c, c)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # local (B, T, C)
        h = self.ln_1(x)
        q, k, v = (self.attn[n](h).reshape(b, t, self.n_head, c // self.n_head).transpose(1, 2) for n in "qkv")
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        x = x + self.attn["c_proj"](y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp["c_proj"](TF.gelu(self.mlp["c_fc"](self.ln_2(x))))


class TorchGPT(torch.nn.Module):
    """sbpflow.models.gpt.GPT in torch (tied head, no dropout), with the same parameter names."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = torch.nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = torch.nn.ModuleList([TorchBlock(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer)])
        self.ln_f = torch.nn.LayerNorm(cfg.n_embd)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))  # local (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # local (B, T, V)
        return TF.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def copy_weights(source: Any, target: torch.nn.Module) -> None:
    """sbpflow parameters (logical values) into the torch model of the same names."""
    values = {n: torch.from_numpy(p.numpy()) for n, p in source.named_parameters()}
    with torch.no_grad():
        for name, p in target.named_parameters():
            p.copy_(values[name])
    assert set(values) == {n for n, _ in target.named_parameters()}


def adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """The demo trainer's AdamW in torch: weight decay on matrices only, nanoGPT's betas, torch's fused kernel
    (the one sbpflow's AdamW runs)."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def tokens(cfg: GPTConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random (B, T) ids and their next-token targets: the same batch for every contender."""
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(batch, cfg.block_size + 1))
    return ids[:, :-1], ids[:, 1:]


def torch_step(cfg: GPTConfig, batch: int, reference: Any, lr: float,
               device: str = "cpu") -> Callable[[], torch.Tensor]:
    """One torch training step (forward, backward, clipping at 1.0, AdamW) of the twin of ``reference``."""
    model = TorchGPT(cfg).to(device)
    copy_weights(reference, model)
    params = list(model.parameters())
    opt = adamw(params, lr)
    ids, targets = (torch.from_numpy(a).to(device) for a in tokens(cfg, batch))

    def step() -> torch.Tensor:
        loss = model(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss

    return step
