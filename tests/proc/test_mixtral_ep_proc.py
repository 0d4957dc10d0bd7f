"""Mixtral with its experts split on real processes (gloo): ep2 on two processes (each holds only its two experts)
and dp2 x ep2 on four, tokens sent to their experts by gloo's all_to_all_single with uneven, data-dependent splits;
logits, loss and every gradient equal transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

transformers = pytest.importorskip("transformers")

import sbpflow  # noqa: E402
from hf_train import batch, hf_grad_of, train  # noqa: E402
from sbpflow._layout import shard_box  # noqa: E402
from sbpflow.models import from_pretrained  # noqa: E402
from sbpflow.models.moe import split_experts  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
TIMEOUT = 150.0


def ep_job(folder: str, parallel: dict[str, int], axis: int) -> dict[str, Any]:
    """Runs on each process: the experts split over mesh axis ``axis``, one forward and backward."""
    model = from_pretrained(folder, **parallel, expert_axis=axis)  # each process reads only its experts
    w1 = model.model.layers[0].block_sparse_moe.experts.w1  # stacked (E, I, C), split S(0) on the ep axis
    held = {r: shard_box(tuple(w1.shape), w1.placement, w1.sbp, r)[0] for r in w1.local_tensors()}
    ids, targets = model.strategy.shard_inputs(*batch(2))
    with sbpflow.comm.record() as log:
        logits, loss = model(ids, targets)
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    return {"rank": sbpflow.rank(), "held": held, "logits": logits.numpy(), "loss": float(loss.numpy()),
            "grads": grads, "collectives": log.counts()}


# name -> (processes, parallel arguments, expert axis, the experts [first, last) each rank holds in layer 0)
CASES = {
    "ep2": (2, {"data": 2}, 0, lambda r: {r: (2 * r, 2 * r + 2)}),
    "dp2xep2": (4, {"data": 2, "tensor": 2}, 1, lambda r: {r: (0, 2) if r % 2 == 0 else (2, 4)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_experts_on_processes_match_transformers(case: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    ref = transformers.MixtralForCausalLM(config).float()
    ref.save_pretrained(tmp_path)
    ids, targets = batch(2)
    logits = ref(input_ids=torch.as_tensor(ids)).logits  # Mixtral's loss leaves out the aux term by default
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.as_tensor(targets).reshape(-1))
    loss.backward()
    want = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    nprocs, parallel, axis, held = CASES[case]
    for r, got in enumerate(run_ranks(ep_job, nprocs, args=(str(tmp_path), parallel, axis), timeout=TIMEOUT)):
        assert got["rank"] == r and got["held"] == held(r)
        # per layer: the counts, the rows there, the rows back, in the rank's one ep group
        assert got["collectives"].get("all_to_all", 0) >= 2 * 3 and "broadcast" not in got["collectives"]
        np.testing.assert_allclose(got["logits"], logits.detach().numpy(), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got["loss"], float(loss.detach()), rtol=RTOL)
        for name, grad in got["grads"].items():
            np.testing.assert_allclose(grad, hf_grad_of(name, want), rtol=RTOL, atol=ATOL, err_msg=name)


def compiled_job(folder: str) -> dict[str, Any]:
    """Runs on each process: ep2 AdamW steps of a 2-layer Mixtral compiled by nn.Graph (each layer's exchange one
    communicating node, beside the layers' gradient all-reduces in flight)."""
    losses, params = train(Path(folder), {"data": 2}, True, prepare=lambda model: split_experts(model, 0))
    return {"losses": losses, "params": params}


def test_compiled_ep2_training_on_two_processes_matches_one_device(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    transformers.MixtralForCausalLM(config).float().save_pretrained(tmp_path)
    want_losses, want_params = train(tmp_path, {}, False)
    for got in run_ranks(compiled_job, 2, args=(str(tmp_path),), timeout=TIMEOUT):
        np.testing.assert_allclose(got["losses"], want_losses, rtol=RTOL)
        for name, value in want_params.items():
            np.testing.assert_allclose(got["params"][name], value, rtol=RTOL, atol=1e-4, err_msg=name)
