"""Mixtral ep2 on two real processes (gloo): with the experts split over the data axis each process holds
only its two experts, and logits, loss and every gradient equal transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

transformers = pytest.importorskip("transformers")

import sbpflow  # noqa: E402
from hf_train import hf_grad_of  # noqa: E402
from sbpflow.models import from_pretrained  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
TIMEOUT = 150.0


def _batch() -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(1).integers(0, 64, size=(2, 11))
    return tokens[:, :-1], tokens[:, 1:]


def ep2_job(folder: str) -> dict[str, Any]:
    """Runs on each process: data=2 with the experts split over it, one forward and backward."""
    model = from_pretrained(folder, data=2, expert_axis=0)  # each process reads only its experts
    experts = model.model.layers[0].block_sparse_moe.experts
    held = [sorted(e.w1.weight._shards) for e in experts]
    ids, targets = model.strategy.shard_inputs(*_batch())
    logits, loss = model(ids, targets)
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    return {"rank": sbpflow.rank(), "held": held, "logits": logits.numpy(), "loss": float(loss.numpy()),
            "grads": grads}


def test_ep2_on_two_processes_matches_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    ref = transformers.MixtralForCausalLM(config).float()
    ref.save_pretrained(tmp_path)
    ids, targets = _batch()
    logits = ref(input_ids=torch.as_tensor(ids)).logits  # Mixtral's loss leaves out the aux term by default
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.as_tensor(targets).reshape(-1))
    loss.backward()
    want = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    for r, got in enumerate(run_ranks(ep2_job, 2, args=(str(tmp_path),), timeout=TIMEOUT)):
        assert got["rank"] == r and got["held"] == ([[0], [0], [], []] if r == 0 else [[], [], [1], [1]])
        np.testing.assert_allclose(got["logits"], logits.detach().numpy(), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got["loss"], float(loss.detach()), rtol=RTOL)
        for name, grad in got["grads"].items():
            np.testing.assert_allclose(grad, hf_grad_of(name, want), rtol=RTOL, atol=ATOL, err_msg=name)
