"""Llama and Mixtral tp2 on 2 gloo processes, loaded from Hugging Face folders, against transformers.

Each process reads only its rank's slices of the safetensors file; logits,
loss and every gradient must equal transformers' (fp32, rtol 1e-4 / atol 1e-5),
and the folder ``save_pretrained`` writes from the processes must load in transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

transformers = pytest.importorskip("transformers")

import sbpflow  # noqa: E402
from hf_train import batch, hf_grad_of  # noqa: E402
from sbpflow.models import from_pretrained  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
TIMEOUT = 150.0


def tp2_job(folder: str, out: str) -> dict[str, Any]:
    """Runs on each process: load with tensor=2, one forward and backward, then save_pretrained to ``out``."""
    model = from_pretrained(folder, tensor=2)
    q = model.model.layers[0].self_attn.q_proj.weight
    held = {rank: tuple(shard.shape) for rank, shard in q._shards.items()}
    ids, targets = model.strategy.shard_inputs(*batch(2))
    logits, loss = model(ids, targets)
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    model.save_pretrained(out)
    return {"rank": sbpflow.rank(), "held": held, "logits": logits.numpy(), "loss": float(loss.numpy()),
            "grads": grads}


def _hf_model(kind: str) -> Any:
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).float()
    config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **sizes)
    return transformers.MixtralForCausalLM(config).float()


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_tp2_on_two_processes_matches_transformers(kind: str, tmp_path: Path) -> None:
    ref = _hf_model(kind)
    ref.save_pretrained(tmp_path / "in")
    ids, targets = batch(2)
    logits = ref(input_ids=torch.as_tensor(ids)).logits  # Mixtral's loss leaves out the aux term by default
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.as_tensor(targets).reshape(-1))
    loss.backward()
    want = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    results = run_ranks(tp2_job, 2, args=(str(tmp_path / "in"), str(tmp_path / "out")), timeout=TIMEOUT)
    for r, got in enumerate(results):
        assert got["rank"] == r and got["held"] == {r: (16, 32)}  # its own half of q_proj's rows, nothing more
        np.testing.assert_allclose(got["logits"], logits.detach().numpy(), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got["loss"], float(loss.detach()), rtol=RTOL)
        for name, grad in got["grads"].items():
            np.testing.assert_allclose(grad, hf_grad_of(name, want), rtol=RTOL, atol=ATOL, err_msg=name)
    back = type(ref).from_pretrained(tmp_path / "out")
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), ref.state_dict()[name].numpy(), err_msg=name)
