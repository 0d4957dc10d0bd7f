"""nn.MoE with a Qwen-MoE shared expert (its own width, sigmoid-gated) computes what transformers'
``Qwen2MoeSparseMoeBlock`` computes: outputs and every gradient, with and without ``norm_topk_prob``, on one
device, with the tokens split over two ranks, and with the experts split over them too (tokens by all-to-all)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock  # noqa: E402

import sbpflow  # noqa: E402
from harness import per_expert  # noqa: E402
from sbpflow import nn  # noqa: E402
from sbpflow.sbp import split  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
HIDDEN, INTER, SHARED, EXPERTS = 16, 12, 20, 4


def _weights(block: Any) -> dict[str, torch.Tensor]:
    """The block's weights under nn.MoE's names (transformers stacks its experts; nn.MoE keeps w1, w3, w2)."""
    ref = {n: p.detach() for n, p in block.named_parameters()}
    out = {"gate.weight": ref["gate.weight"], "shared_expert_gate.weight": ref["shared_expert_gate.weight"]}
    for e in range(EXPERTS):
        out[f"experts.{e}.w1.weight"] = ref["experts.gate_up_proj"][e, :INTER]
        out[f"experts.{e}.w3.weight"] = ref["experts.gate_up_proj"][e, INTER:]
        out[f"experts.{e}.w2.weight"] = ref["experts.down_proj"][e]
    for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        out[f"shared_expert.{ours}.weight"] = ref[f"shared_expert.{theirs}.weight"]
    return out


def _grads(block: Any) -> dict[str, torch.Tensor]:
    saved = {n: p.data for n, p in block.named_parameters()}
    for p in block.parameters():
        p.data = p.grad
    grads = _weights(block)
    for n, p in block.named_parameters():
        p.data = saved[n]
    return grads


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("layout", ["one_device", "tokens_split", "experts_split"])
def test_shared_expert_moe_matches_qwen2_moe_block(norm_topk_prob: bool, layout: str) -> None:
    config = transformers.Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                         shared_expert_intermediate_size=SHARED, num_experts_per_tok=2,
                                         norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(config).float()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 5, HIDDEN)
    want = block(x)
    want.square().sum().backward()

    moe = nn.MoE(HIDDEN, INTER, num_experts=EXPERTS, top_k=2, norm_topk_prob=norm_topk_prob,
                 shared_expert_intermediate=SHARED)
    weights = _weights(block)
    assert sorted(weights) == sorted(n for n, _ in moe.named_parameters())
    for name, p in moe.named_parameters():
        p._take_storage(sbpflow.tensor(weights[name].clone()))
    xs = sbpflow.tensor(x)
    if layout != "one_device":
        placement = sbpflow.placement("cpu", [0, 1])
        moe.to_global(placement, sbpflow.sbp.broadcast)
        xs = sbpflow.tensor(x, placement=placement, sbp=split(0))
        if layout == "experts_split":  # two experts per rank, tokens to them by all-to-all
            nn.moe.split_experts(moe, placement, 0)
    with sbpflow.comm.record() as log:
        got = moe(xs)
    assert ("all_to_all" in log.kinds()) == (layout == "experts_split")
    sbpflow.functional.sum(sbpflow.functional.square(got)).backward()
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=RTOL, atol=ATOL)
    grads = _grads(block)
    for name, grad in per_expert(moe, lambda p: p.grad.numpy()).items():  # (split: stacked, compared per expert)
        np.testing.assert_allclose(grad, grads[name].numpy(), rtol=RTOL, atol=ATOL, err_msg=name)


def test_without_a_shared_expert_there_is_no_gate() -> None:
    names = [n for n, _ in nn.MoE(HIDDEN, INTER, num_experts=EXPERTS).named_parameters()]
    assert not any(n.startswith("shared_expert") for n in names)
