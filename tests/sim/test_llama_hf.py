"""Llama from a Hugging Face folder equals transformers' ``LlamaForCausalLM``: logits, loss and every gradient.

Tiny random transformers models are built locally (no download), saved with
``save_pretrained`` and loaded with :func:`sbpflow.models.from_pretrained` on
one device, under tp2 and dp2 x tp2 (virtual ranks). The reference loss is
transformers' logits through torch's cross entropy on next-token targets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import sbpflow  # noqa: E402
from hf_train import train  # noqa: E402
from sbpflow.errors import SbpflowError  # noqa: E402
from sbpflow.models import from_pretrained  # noqa: E402
from sbpflow.models.llama import Llama, LlamaConfig, parallelize  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
VARIANTS = {
    # grouped-query attention (2 q heads per k/v head), Llama 3 rotary scaling, untied head
    "llama3_gqa": {"num_key_value_heads": 2, "tie_word_embeddings": False, "rope_parameters": LLAMA3_ROPE},
    # multi-head attention, plain rotary, tied head, biases on attention and MLP
    "tied_bias": {"num_key_value_heads": 4, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
}
PARALLEL = {"one": {}, "tp2": {"tensor": 2}, "dp2_tp2": {"data": 2, "tensor": 2}, "pp2": {"pipeline": 2},
            "dp2_tp2_pp2": {"data": 2, "tensor": 2, "pipeline": 2}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf_model(**overrides: Any) -> Any:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, **overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # random norm scales and biases, so that a mix-up of them shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_folder(request: Any, tmp_path_factory: Any) -> tuple[Any, Path]:
    model = _hf_model(**VARIANTS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 64, size=(4, 13))
    return tokens[:, :-1], tokens[:, 1:]  # ids and next-token targets, (4, 12)


def _reference(model: Any, ids: np.ndarray, targets: np.ndarray,
               positions: Any = None) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    model.zero_grad()
    pos = None if positions is None else torch.as_tensor(positions)[None].expand(ids.shape[0], -1)
    logits = model(input_ids=torch.as_tensor(ids), position_ids=pos).logits
    flat = logits.reshape(-1, logits.shape[-1])
    loss = torch.nn.functional.cross_entropy(flat, torch.as_tensor(targets).reshape(-1))
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return logits.detach().numpy(), float(loss.detach()), grads


def _run(model: Llama, ids: np.ndarray, targets: np.ndarray, positions: Any = None) -> tuple[Any, Any]:
    if model.strategy is None:
        x, y = sbpflow.tensor(ids), sbpflow.tensor(targets)
    else:
        x, y = model.strategy.shard_inputs(ids, targets)
    return model(x, y, positions=positions)


@pytest.mark.parametrize("parallel", sorted(PARALLEL))
def test_logits_loss_and_gradients_match_transformers(hf_folder: Any, parallel: str) -> None:
    ref, folder = hf_folder
    ids, targets = _batch()
    want_logits, want_loss, want_grads = _reference(ref, ids, targets)
    model = from_pretrained(folder, **PARALLEL[parallel])
    logits, loss = _run(model, ids, targets)
    loss.backward()
    np.testing.assert_allclose(logits.numpy(), want_logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(loss.numpy()), want_loss, rtol=RTOL)
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(want_grads)
    for name, grad in want_grads.items():
        np.testing.assert_allclose(got[name].grad.numpy(), grad, rtol=RTOL, atol=ATOL, err_msg=name)


def test_parallel_load_reads_each_rank_its_own_slice(hf_folder: Any) -> None:
    ref, folder = hf_folder
    model = from_pretrained(folder, data=2, tensor=2)
    q = model.model.layers[0].self_attn.q_proj.weight  # column parallel: rows split over the tensor axis
    assert sbpflow.sbp.format_nd(q.sbp) == "(B, S(0))"
    full = ref.model.layers[0].self_attn.q_proj.weight.detach()
    for rank, shard in q._shards.items():  # ranks (d, t) on the 2 x 2 mesh hold rows t*16 .. t*16+16
        t = rank % 2
        np.testing.assert_array_equal(shard.numpy(), full[16 * t:16 * (t + 1)].numpy())
        assert shard.untyped_storage().nbytes() == 16 * 32 * 4  # its own slice, not a view of the whole


def test_shifted_positions_match_transformers(hf_folder: Any) -> None:
    ref, folder = hf_folder
    ids, targets = _batch()
    positions = np.arange(5, 5 + ids.shape[1])
    want_logits, _, _ = _reference(ref, ids, targets, positions)
    logits, _ = _run(from_pretrained(folder, tensor=2), ids, targets, positions)
    np.testing.assert_allclose(logits.numpy(), want_logits, rtol=RTOL, atol=ATOL)


def test_sequence_split_gets_the_angles_of_its_positions(hf_folder: Any) -> None:
    """ids split on the sequence over 2 ranks: each shard's rotary rows are those of its global positions."""
    ref, folder = hf_folder
    ids, targets = _batch()
    want_logits, want_loss, want_grads = _reference(ref, ids, targets)
    model = from_pretrained(folder)
    placement = sbpflow.placement("cpu", [0, 1])
    model.to_global(placement, broadcast)
    x = sbpflow.tensor(ids, placement=placement, sbp=split(1))
    y = sbpflow.tensor(targets, placement=placement, sbp=split(1))
    logits, loss = model(x, y)
    loss.backward()
    np.testing.assert_allclose(logits.numpy(), want_logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(loss.numpy()), want_loss, rtol=RTOL)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), want_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_save_pretrained_round_trips_through_transformers(hf_folder: Any, tmp_path: Path) -> None:
    ref, folder = hf_folder
    ids, targets = _batch()
    model = from_pretrained(folder, tensor=2)
    model.save_pretrained(tmp_path)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert back.config.tie_word_embeddings == ref.config.tie_word_embeddings
    assert back.config.num_key_value_heads == ref.config.num_key_value_heads
    assert back.config.rope_parameters == ref.config.rope_parameters
    want = ref.state_dict()
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), want[name].numpy(), err_msg=name)
    np.testing.assert_allclose(_reference(back, ids, targets)[0], _reference(ref, ids, targets)[0], rtol=0, atol=0)


def test_sharded_index_folder_loads(tmp_path: Path) -> None:
    ref = _hf_model(**VARIANTS["llama3_gqa"])
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids, targets = _batch()
    logits, _ = _run(from_pretrained(tmp_path, tensor=2), ids, targets)
    np.testing.assert_allclose(logits.numpy(), _reference(ref, ids, targets)[0], rtol=RTOL, atol=ATOL)


def test_adamw_training_under_dp2_tp2_matches_one_device(hf_folder: Any) -> None:
    _, folder = hf_folder
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 64, size=(4, 9)) for _ in range(3)]
    results = []
    for parallel in ({}, {"data": 2, "tensor": 2}):
        model = from_pretrained(folder, **parallel)
        opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for tokens in batches:
            opt.zero_grad()
            _, loss = _run(model, tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            losses.append(float(loss.numpy()))
        results.append((losses, {n: p.numpy() for n, p in model.named_parameters()}))
    (losses, params), (ref_losses, ref_params) = results[1], results[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for name, value in ref_params.items():  # AdamW moves an about-zero gradient lr-sized on rounding noise
        np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=3 * 1e-2 * 0.05, err_msg=name)


def test_bad_folders_and_degrees_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SbpflowError, match="config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(SbpflowError, match="model_type 'llama' and 'mixtral'.*'bert'"):
        from_pretrained(tmp_path)
    model = Llama(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(SbpflowError, match="tensor=4 must divide num_key_value_heads=2"):
        parallelize(model, tensor=4)
    assert model.strategy is None and not model.model.layers[0].self_attn.q_proj.weight.is_global
    ref = _hf_model(num_key_value_heads=2)
    ref.save_pretrained(tmp_path / "ok")
    config = (tmp_path / "ok" / "config.json").read_text().replace('"intermediate_size": 48', '"intermediate_size": 40')
    (tmp_path / "ok" / "config.json").write_text(config)
    with pytest.raises(SbpflowError, match=r"checkpoint tensor model\.layers\.0\.mlp\.\w+\.weight has shape .*48.*40"):
        from_pretrained(tmp_path / "ok")


def test_compiled_dp2_tp2_training_matches_eager(hf_folder: Any) -> None:
    (losses, params), (ref_losses, ref_params) = (train(hf_folder[1], {"data": 2, "tensor": 2}, compiled)
                                                  for compiled in (True, False))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=1e-4, err_msg=name)


def test_compiled_pp2_1f1b_training_matches_one_device(hf_folder: Any) -> None:
    """pp2 in graph mode, 1F1B over 2 micro-batches, against one device's eager full-batch steps."""
    (losses, params), (ref_losses, ref_params) = (
        train(hf_folder[1], {"pipeline": 2}, True, micro_batches=2, schedule="1f1b"), train(hf_folder[1], {}, False))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=1e-4, err_msg=name)


def test_sbpflow_save_and_load_reshard_training_state(hf_folder: Any, tmp_path: Path) -> None:
    """sbpflow.save under dp2 x tp2 and sbpflow.load into a pp2 model: the same parameters and AdamW moments."""
    ref, folder = hf_folder
    model = from_pretrained(folder, data=2, tensor=2)
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)
    ids, targets = _batch()
    _, loss = _run(model, ids, targets)
    loss.backward()
    opt.step()
    sbpflow.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt")
    other = from_pretrained(folder, pipeline=2)
    other_opt = sbpflow.optim.AdamW(other.parameters(), lr=1e-2)
    _, loss = _run(other, targets, ids)
    loss.backward()
    other_opt.step()  # other parameters and moments (another batch), to be overwritten
    state = {"model": other.state_dict(), "optim": other_opt.state_dict()}
    sbpflow.load(state, tmp_path / "ckpt")
    other.load_state_dict(state["model"])
    other_opt.load_state_dict(state["optim"])
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        np.testing.assert_array_equal(q.numpy(), p.numpy(), err_msg=name)
    for m, o in ((model, opt), (other, other_opt)):  # one more step: the loaded moments must match too
        o.zero_grad()
        _, loss = _run(m, ids, targets)
        loss.backward()
        o.step()
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
