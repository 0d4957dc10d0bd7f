"""The central promise: a GPT trained under any strategy matches one device, step for step.

A 2-layer GPT (width 64, 4 heads, vocabulary 100, sequence 16) trains 10 AdamW
steps with dropout 0.1 and gradient clipping, on one device (local tensors, no
placement) and under data, tensor and pipeline parallelism on virtual devices.
Losses and final parameters must agree. The collectives of one step are
checked too: they are exactly the ones Megatron and DDP would issue by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow
from harness import all_reduce_payloads
from sbpflow.autograd import coalesce_grad_reductions
from sbpflow.comm import CommLog
from sbpflow.demo.train_gpt import PhaseLog, build, random_batches, train_gpt
from sbpflow.models.gpt import GPT, GPTConfig, parallelize, parse_strategy, split_blocks, stage_placements
from sbpflow.sbp import broadcast, split

CONFIG = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
STEPS = 10
RTOL = 1e-4
# Parameters get an absolute slack of 0.1% of the most AdamW can move them in 10 steps (10 x lr): AdamW
# divides by the gradient's running RMS, so an entry whose gradient is about zero (the key bias has a zero
# true gradient: softmax ignores a shift shared by a row of scores) takes lr-sized steps on rounding noise,
# which differs with the order of fp32 sums. The gradients themselves are compared tightly, before AdamW.
ATOL = 1e-5
GRAD_ATOL = 1e-7
N_PARAMS = 4 + 16 * CONFIG.n_layer  # wte, wpe, ln_f (2) + per block: 2 LayerNorms, q, k, v, c_proj, c_fc, proj
C = CONFIG.n_embd
N_NUMEL = (CONFIG.vocab_size + CONFIG.block_size) * C + 2 * C + CONFIG.n_layer * (4 * C + 4 * (C * C + C)
                                                                               + 2 * 4 * C * C + 5 * C)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def single_device() -> tuple[list[float], dict[str, np.ndarray]]:
    return train_gpt(None, STEPS, config=CONFIG, batch_size=8)


def _assert_same_training(got: tuple[list[float], dict[str, np.ndarray]],
                          want: tuple[list[float], dict[str, np.ndarray]]) -> None:
    losses, params = got
    ref_losses, ref_params = want
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert sorted(params) == sorted(ref_params)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("spec", ["dp=4", "tp=2", "pp=2", "dp=2,tp=2", "dp=2,tp=2,pp=2"])
def test_training_matches_single_device(spec: str, single_device: Any) -> None:
    _assert_same_training(train_gpt(spec, STEPS, config=CONFIG, batch_size=8), single_device)


def test_uneven_data_parallel_matches_single_device() -> None:
    want = train_gpt(None, STEPS, config=CONFIG, batch_size=7)
    _assert_same_training(train_gpt("dp=3", STEPS, config=CONFIG, batch_size=7), want)


def test_every_parameter_trains(single_device: Any) -> None:
    _, params = single_device
    fresh = build(CONFIG, None).model
    moved = [n for n, p in fresh.named_parameters() if not np.allclose(p.numpy(), params[n], rtol=0, atol=1e-7)]
    assert len(moved) == N_PARAMS


@pytest.mark.parametrize(("spec", "batch"), [("dp=2,tp=2,pp=2", 8), ("dp=3", 7)])
def test_first_gradients_match_single_device(spec: str, batch: int) -> None:
    """Gradients themselves, before AdamW (which would hide a uniform scale error, e.g. summing over ranks)."""
    ids, targets = next(random_batches(CONFIG.vocab_size, 1, batch, 16))
    grads = []
    for strategy in (None, spec):
        trainer = build(CONFIG, strategy)
        ids_t, targets_t = trainer.inputs(ids, targets)
        _, loss = trainer.model(ids_t, targets_t)
        loss.backward()
        grads.append({n: p.grad.numpy() for n, p in trainer.model.named_parameters()})
    for name, want in grads[0].items():
        np.testing.assert_allclose(grads[1][name], want, rtol=RTOL, atol=GRAD_ATOL, err_msg=name)


# -- the layout Megatron asks for ----------------------------------------------------------------


def test_parallelize_lays_out_parameters_megatron_style() -> None:
    sbpflow.manual_seed(0)
    model = GPT(CONFIG)
    before = {n: p.numpy() for n, p in model.named_parameters()}
    ids_before = {n: id(p) for n, p in model.named_parameters()}
    strategy = parallelize(model, data=2, tensor=2, pipeline=2)
    sbps = {n: s for n, (_, s, _) in strategy.params.items()}
    assert sbps["wte.weight"] == (broadcast, split(0))  # vocabulary parallel
    assert sbps["wpe.weight"] == (broadcast, broadcast)
    for i in range(CONFIG.n_layer):
        for proj in ("q", "k", "v"):
            assert sbps[f"h.{i}.attn.{proj}.weight"] == sbps[f"h.{i}.attn.{proj}.bias"] == (broadcast, split(0))
        assert sbps[f"h.{i}.mlp.c_fc.weight"] == (broadcast, split(0))
        assert sbps[f"h.{i}.attn.c_proj.weight"] == sbps[f"h.{i}.mlp.c_proj.weight"] == (broadcast, split(1))
        assert sbps[f"h.{i}.attn.c_proj.bias"] == sbps[f"h.{i}.ln_1.weight"] == (broadcast, broadcast)
    stages = {n: s for n, (s, _, _) in strategy.params.items()}
    assert stages["wte.weight"] == stages["h.0.ln_1.weight"] == 0
    assert stages["h.1.ln_1.weight"] == stages["ln_f.weight"] == 1
    assert [p.placement for p in model.ln_f.parameters()] == [strategy.stages[1]] * 2
    for n, p in model.named_parameters():  # same objects, same logical values
        assert id(p) == ids_before[n] and p.is_leaf and p.requires_grad
        np.testing.assert_array_equal(p.numpy(), before[n])
    table = strategy.describe()
    assert "h.0.attn.c_proj.weight" in table and "(B, S(1))" in table and "stage 1: cpu:[[4, 5], [6, 7]]" in table


def test_stage_layout_helpers() -> None:
    assert [p.hierarchy for p in stage_placements(2, 2, 2)] == [(2, 2), (2, 2)]
    assert stage_placements(2, 2, 2)[1].flat_ranks == (4, 5, 6, 7)
    assert split_blocks(4, 2) == (0, 0, 1, 1) and split_blocks(3, 3) == (0, 1, 2)
    assert parse_strategy("dp=2, tp=2") == {"data": 2, "tensor": 2, "pipeline": 1}
    assert parse_strategy(None) == {"data": 1, "tensor": 1, "pipeline": 1}


def test_bad_strategies_raise_sbpflow_errors() -> None:
    model = GPT(CONFIG)
    with pytest.raises(sbpflow.SbpflowError, match="tensor=3 must divide n_head=4"):
        parallelize(model, tensor=3)
    with pytest.raises(sbpflow.SbpflowError, match="pipeline=3 with virtual=1 stages per placement needs at least 3 "):
        parallelize(model, pipeline=3)
    with pytest.raises(sbpflow.SbpflowError, match="strategy keys are dp, tp and pp"):
        parse_strategy("xp=2")
    with pytest.raises(sbpflow.SbpflowError, match="look like 'dp=2'"):
        parse_strategy("dp2")


# -- the collectives of one step ------------------------------------------------------------------


def _one_step_phases(spec: str, coalesce: bool = True) -> PhaseLog:
    """The collectives of the second training step, each tagged with where it ran ("forward ln_f", "backward"
    ...); ``coalesce=False`` opts out of bucketed gradient reductions."""
    trainer = build(CONFIG, spec)
    batches = random_batches(CONFIG.vocab_size, 2, 8, 16)
    trainer.step(*next(batches))
    phases = PhaseLog(trainer.model)
    with phases.recording(), coalesce_grad_reductions(coalesce):
        trainer.step(*next(batches), phases)
    return phases


def _one_step_log(spec: str, coalesce: bool = True) -> dict[str, dict[str, int]]:
    """Collective counts of the second training step by where they ran ("forward ln_f", "backward" ...)."""
    phases = _one_step_phases(spec, coalesce)
    out: dict[str, dict[str, int]] = {}
    for i, event in enumerate(phases.log.events):
        where = out.setdefault(phases.where.get(i, "other"), {})
        where[event.kind] = where.get(event.kind, 0) + 1
    return out


def _phase(counts: dict[str, dict[str, int]], phase: str) -> dict[str, int]:
    total: dict[str, int] = {}
    for where, kinds in counts.items():
        if where.split(" ")[0] == phase:
            for kind, n in kinds.items():
                total[kind] = total.get(kind, 0) + n
    return total


def test_data_parallel_step_reduces_gradients_in_ddp_buckets() -> None:
    phases = _one_step_phases("dp=4")
    backward = CommLog([e for i, e in enumerate(phases.log.events) if phases.where.get(i) == "backward"])
    # every gradient once, all in one bucket: the model's 420 KiB fit DDP's first bucket (1 MiB)
    assert all_reduce_payloads(backward) == [4 * N_NUMEL]
    counts = _one_step_log("dp=4")
    assert "clip_grad_norm" not in counts and "optimizer" not in counts  # gradients are B by then
    assert all(kinds == {"all_reduce": 1} for where, kinds in counts.items() if where != "backward")  # the loss


def test_data_parallel_step_opting_out_of_buckets_all_reduces_each_gradient_once() -> None:
    counts = _one_step_log("dp=4", coalesce=False)
    assert _phase(counts, "backward") == {"all_reduce": N_PARAMS}  # one per parameter gradient


@pytest.mark.usefixtures("native_collectives")  # gloo's target runs reduce-scatter as an all-reduce: no SP there
def test_tensor_parallel_step_reduces_each_partial_sum_once_where_the_layernorm_needs_it() -> None:
    counts = _one_step_log("tp=2")
    # The vocab-parallel embedding and the two row-parallel c_proj layers of each block give partial
    # sums; each is reduced once, by the LayerNorm that reads it. The planner picks reduce-scatter
    # (LayerNorm runs on a split of the rows) over all-reduce: Megatron with sequence parallelism.
    reduced_at = {w: k for w, k in counts.items() if w.startswith("forward") and w.endswith(("ln_1", "ln_2", "ln_f"))}
    assert sum(k.get("reduce_scatter", 0) for k in reduced_at.values()) == 1 + 2 * CONFIG.n_layer
    assert all(set(k) == {"reduce_scatter"} for k in reduced_at.values())
    assert "all_reduce" not in _phase(counts, "forward")
    assert "optimizer" not in counts


def test_tensor_parallel_step_on_the_cpu_target_reduces_each_partial_sum_once_by_an_all_reduce() -> None:
    # The same partial sums on the default target (gloo: a reduce-scatter is an all-reduce, so sequence
    # parallelism buys nothing): each is all-reduced once, by the LayerNorm that reads it, as on processes.
    counts = _one_step_log("tp=2")
    reduced_at = {w: k for w, k in counts.items() if w.startswith("forward") and w.endswith(("ln_1", "ln_2", "ln_f"))}
    assert sum(k.get("all_reduce", 0) for k in reduced_at.values()) == 1 + 2 * CONFIG.n_layer
    assert all(set(k) == {"all_reduce"} for k in reduced_at.values())
    assert not {"reduce_scatter", "all_gather", "all_to_all"} & set(_phase(counts, "forward"))


def test_pipeline_step_sends_activations_between_stages() -> None:
    counts = _one_step_log("pp=2")
    # forward: the activation after block 0 and the tied embedding go to stage 1; backward: their gradients
    assert _phase(counts, "forward") == {"send_recv": 2}
    assert _phase(counts, "backward") == {"send_recv": 2}
