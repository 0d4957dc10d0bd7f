"""Mixtral with its experts split over a mesh axis (tokens reach them by all-to-all) equals transformers'
``MixtralForCausalLM`` (logits, loss with the load-balancing term, every gradient) under ep2 and ep4 (experts
over the data axis of a dp2 or dp4 mesh), dp2 x ep2 (a (2, 2) mesh, experts over its second axis), ep2 x tp2
(experts over the data axis, Megatron inside each expert on the tensor axis) and pp2 x ep2 (each stage's experts
over its data axis); ep2 and dp2 x ep2 AdamW training, eager and nn.Graph, and pp2 x ep2 compiled (1f1b), equal
one device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import sbpflow  # noqa: E402
from hf_train import hf_grad_of, train  # noqa: E402
from sbpflow._layout import shard_box  # noqa: E402
from sbpflow.errors import SbpflowError  # noqa: E402
from sbpflow.models import from_pretrained  # noqa: E402
from sbpflow.models.moe import split_experts  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
E, K, VOCAB = 4, 2, 64

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: Any) -> tuple[Any, Path]:
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                        num_experts_per_tok=K, output_router_logits=True, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).float()
    folder = tmp_path_factory.mktemp("mixtral_ep")
    model.save_pretrained(folder)
    return model, folder


# name -> (parallel arguments, mesh axis the experts split over)
LAYOUTS = {"ep2": ({"data": 2}, 0), "ep4": ({"data": 4}, 0), "dp2xep2": ({"data": 2, "tensor": 2}, 1),
           "ep2xtp2": ({"data": 2, "tensor": 2}, 0), "pp2xep2": ({"data": 2, "pipeline": 2}, 0)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_split_experts_match_transformers(hf_folder: Any, layout: str) -> None:
    ref, folder = hf_folder
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(4, 11))
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    ref.zero_grad()
    out = ref(input_ids=torch.as_tensor(ids), output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), torch.as_tensor(targets).reshape(-1))
    want = ce + ref.config.router_aux_loss_coef * out.aux_loss
    want.backward()
    want_grads = {n: p.grad.numpy().copy() for n, p in ref.named_parameters()}

    parallel, axis = LAYOUTS[layout]
    model = from_pretrained(folder, **parallel, expert_axis=axis)  # experts split before their weights are read
    moe = model.model.layers[0].block_sparse_moe
    w1 = moe.experts.w1  # stacked (E, I, C), split S(0) on the ep axis
    mesh = w1.placement
    groups = list(parallel.values())[axis]
    for r in mesh.flat_ranks:  # contiguous groups of E / groups experts, at the rank's coordinate on the axis
        per, j = E // groups, mesh.coords(r)[axis]
        assert shard_box(tuple(w1.shape), mesh, w1.sbp, r)[0] == (j * per, (j + 1) * per)
    x, y = model.strategy.shard_inputs(ids, targets)
    with sbpflow.comm.record() as log:
        logits, loss = model(x, y)
    moe_groups = mesh.size // groups  # the ep groups of one stage
    assert log.counts()["all_to_all"] >= 2 * 3 * moe_groups and "broadcast" not in log.counts()
    loss.backward()
    np.testing.assert_allclose(logits.numpy(), out.logits.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(loss.numpy()), float(want.detach()), rtol=RTOL)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), hf_grad_of(name, want_grads), rtol=RTOL, atol=ATOL, err_msg=name)


def test_split_experts_needs_a_divisible_axis(hf_folder: Any) -> None:
    _, folder = hf_folder
    with pytest.raises(SbpflowError, match="needs a parallelized Mixtral"):
        split_experts(from_pretrained(folder), 0)
    with pytest.raises(SbpflowError, match="splits the experts of a parallel Mixtral"):
        from_pretrained(folder, expert_axis=0)
    with pytest.raises(SbpflowError, match="mesh_axis=2"):
        split_experts(from_pretrained(folder, data=2), 2)
    with pytest.raises(SbpflowError, match="mesh axis 0 has 3 ranks, which must divide the 4 experts"):
        split_experts(from_pretrained(folder, data=3), 0)


def _train(folder: Path, parallel: dict[str, int], expert_axis: int | None, compiled: bool) -> tuple[list[float], Any]:
    def prepare(model: Any) -> None:
        if expert_axis is not None:
            split_experts(model, expert_axis)

    return train(folder, parallel, compiled, prepare=prepare)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("layout", ["ep2", "dp2xep2"])
def test_ep_training_matches_one_device(hf_folder: Any, layout: str, compiled: bool) -> None:
    """AdamW steps with the experts split (eager, and compiled by nn.Graph, where the exchange is one node that
    moves only routed rows) against one device's eager steps: the same losses and parameters."""
    ref_losses, ref_params = _train(hf_folder[1], {}, None, False)
    parallel, axis = LAYOUTS[layout]
    losses, params = _train(hf_folder[1], parallel, axis, compiled)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=1e-4, err_msg=name)


def test_pp2xep2_compiled_training_matches_one_device(tmp_path: Path) -> None:
    """Each stage's experts over its data axis, compiled with 2 micro-batches under 1f1b: AdamW steps equal one
    device's. (The load-balancing loss stays out of the loss here: its counts' share is not linear in the
    micro-batches, so nn.Graph refuses it under accumulation.)"""
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                        num_experts_per_tok=K)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).float().save_pretrained(tmp_path)
    ref_losses, ref_params = train(tmp_path, {}, False)
    losses, params = train(tmp_path, {"data": 2, "pipeline": 2}, True, micro_batches=2, schedule="1f1b",
                           prepare=lambda model: split_experts(model, 0))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=1e-4, err_msg=name)
