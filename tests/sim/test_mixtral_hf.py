"""Mixtral (top-k routed SwiGLU experts) from a Hugging Face folder equals transformers' ``MixtralForCausalLM``.

Logits, the loss with the load-balancing term, the auxiliary loss itself and
every gradient (router and experts included) on one device and data parallel
(virtual ranks), a ``save_pretrained`` round trip, and the capacity factor's drops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import sbpflow  # noqa: E402
from hf_train import batch, hf_grad_of, train  # noqa: E402
from sbpflow import nn  # noqa: E402
from sbpflow.errors import SbpflowError  # noqa: E402
from sbpflow.models import from_pretrained  # noqa: E402
from sbpflow.models.moe import expert_tokens  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
E, K = 4, 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: Any) -> tuple[Any, Path]:
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                        num_experts_per_tok=K, output_router_logits=True, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).float()
    folder = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(folder)
    return model, folder


def _reference(model: Any, ids: np.ndarray, targets: np.ndarray) -> dict[str, Any]:
    model.zero_grad()
    out = model(input_ids=torch.as_tensor(ids), output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), torch.as_tensor(targets).reshape(-1))
    loss = ce + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return {"logits": out.logits.detach().numpy(), "loss": float(loss.detach()), "aux": float(out.aux_loss.detach()),
            "grads": grads}


@pytest.mark.parametrize("parallel", [{}, {"data": 2}, {"tensor": 2}, {"data": 2, "tensor": 2}, {"pipeline": 2}])
def test_logits_loss_aux_loss_and_gradients_match_transformers(hf_folder: Any, parallel: dict[str, int]) -> None:
    ref, folder = hf_folder
    ids, targets = batch(4)
    want = _reference(ref, ids, targets)
    model = from_pretrained(folder, **parallel)
    x, y = model.strategy.shard_inputs(ids, targets) if parallel else (sbpflow.tensor(ids), sbpflow.tensor(targets))
    logits, loss = model(x, y)
    loss.backward()
    np.testing.assert_allclose(logits.numpy(), want["logits"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(loss.numpy()), want["loss"], rtol=RTOL)
    np.testing.assert_allclose(float(model.aux_loss.numpy()), want["aux"], rtol=RTOL)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), hf_grad_of(name, want["grads"]), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    counts = expert_tokens(model)
    assert len(counts) == 2 and all(int(c.sum()) == ids.size * K for c in counts)


@pytest.mark.parametrize("parallel", [{}, {"data": 2, "tensor": 2, "expert_axis": 1}], ids=["whole", "dp2xep2"])
def test_save_pretrained_round_trips_through_transformers(hf_folder: Any, tmp_path: Path,
                                                          parallel: dict[str, int]) -> None:
    """Also from experts stacked and split over an ep axis: the folder keeps one tensor per expert."""
    ref, folder = hf_folder
    from_pretrained(folder, **parallel).save_pretrained(tmp_path)
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path)
    want = ref.state_dict()
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), want[name].numpy(), err_msg=name)


def test_capacity_factor_drops_tokens_past_an_experts_capacity() -> None:
    moe = nn.MoE(8, 16, num_experts=E, top_k=K, capacity_factor=0.5)
    flat = sbpflow.randn(12, 8)
    weights = moe.route(flat).numpy()  # (12, E)
    probs = torch.softmax(torch.as_tensor(flat.numpy()) @ torch.as_tensor(moe.gate.weight.numpy()).T, -1)
    top, index = probs.topk(K, -1)
    top = top / top.sum(-1, keepdim=True)
    capacity = 3  # ceil(0.5 * 12 * 2 / 4)
    want, seen = np.zeros((12, E), np.float32), [0] * E
    for t in range(12):  # first come, first served, in token order
        for j in range(K):
            e = int(index[t, j])
            seen[e] += 1
            want[t, e] = top[t, j] if seen[e] <= capacity else 0.0
    np.testing.assert_allclose(weights, want, rtol=1e-6, atol=1e-7)
    assert ((weights > 0).sum(0) <= capacity).all() and (weights > 0).sum() < 12 * K


def test_moe_rejects_bad_settings() -> None:
    with pytest.raises(SbpflowError, match="top_k <= num_experts.*top_k=5"):
        nn.MoE(8, 16, num_experts=4, top_k=5)
    with pytest.raises(SbpflowError, match="capacity_factor must be positive"):
        nn.MoE(8, 16, num_experts=4, capacity_factor=0.0)


def test_shared_experts_add_their_output_for_every_token() -> None:
    """A shared expert sees every token unweighted; routed experts keep their routing (torch reference)."""
    moe = nn.MoE(8, 16, num_experts=E, top_k=K, shared_experts=1)
    x = sbpflow.randn(2, 5, 8)
    got = moe(x).numpy()
    flat = torch.as_tensor(x.numpy()).reshape(-1, 8)

    def swiglu(expert: Any, h: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (torch.as_tensor(getattr(expert, n).weight.numpy()) for n in ("w1", "w2", "w3"))
        return (torch.nn.functional.silu(h @ w1.T) * (h @ w3.T)) @ w2.T

    probs = torch.softmax(flat @ torch.as_tensor(moe.gate.weight.numpy()).T, -1)
    top, index = probs.topk(K, -1)
    top = top / top.sum(-1, keepdim=True)
    want = swiglu(moe.shared[0], flat)
    for t in range(flat.shape[0]):
        for j in range(K):
            want[t] += top[t, j] * swiglu(moe.experts[int(index[t, j])], flat[t:t + 1])[0]
    np.testing.assert_allclose(got.reshape(-1, 8), want.numpy(), rtol=1e-5, atol=1e-6)


def test_compiled_dp2_training_matches_one_device_eager(hf_folder: Any) -> None:
    (losses, params), (ref_losses, ref_params) = (train(hf_folder[1], parallel, compiled)
                                                  for parallel, compiled in (({"data": 2}, True), ({}, False)))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=1e-4, err_msg=name)
