"""Activation checkpointing: unchanged gradients, replayed dropout masks, only segment inputs kept."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow
from harness import PLACEMENTS, B
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.comm import record
from sbpflow.demo.train_gpt import build, random_batches
from sbpflow.errors import AutogradError
from sbpflow.models.gpt import GPTConfig
from sbpflow.utils import activation_bytes, checkpoint, checkpoint_module

CONFIG = GPTConfig(vocab_size=100, block_size=16, n_layer=3, n_head=4, n_embd=64, dropout=0.1)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gpt_grads(spec: str, checkpointed: bool) -> tuple[float, dict[str, np.ndarray], int, Any]:
    trainer = build(CONFIG, spec, seed=0)
    if checkpointed:
        for block in trainer.model.h:
            checkpoint_module(block)
    ids, targets = next(iter(random_batches(CONFIG.vocab_size, 1, 8, 16, seed=1)))
    _, loss = trainer.model(*trainer.inputs(ids, targets))
    held = activation_bytes(loss)
    with record() as log:
        loss.backward()
    grads = {name: p.grad.numpy() for name, p in trainer.model.named_parameters()}
    return float(loss.item()), grads, held, log.counts()


@pytest.mark.parametrize("spec", ["dp=2", "dp=2,tp=2"])
def test_gpt_blocks_checkpointed_give_the_same_gradients(spec: str) -> None:
    """Dropout 0.1 everywhere: the recomputed masks must be the first run's for the gradients to agree."""
    loss, grads, held, comms = _gpt_grads(spec, False)
    ck_loss, ck_grads, ck_held, ck_comms = _gpt_grads(spec, True)
    assert ck_loss == loss
    for name, g in grads.items():
        np.testing.assert_allclose(ck_grads[name], g, rtol=1e-6, atol=1e-7, err_msg=name)
    assert ck_held < held / 2
    if spec == "dp=2":
        assert ck_comms == comms  # recomputation adds no collective under data parallel


def test_checkpoint_keeps_only_the_segment_inputs() -> None:
    p2 = PLACEMENTS["2"]
    lin1, lin2 = nn.Linear(8, 32).to_global(p2, B), nn.Linear(32, 8).to_global(p2, B)
    # a computed input (a leaf would count as a parameter); the sum keeps only the layout of what it sums
    x = sbpflow.randn(4, 8, placement=p2, sbp=S.split(0), requires_grad=True) * 2.0

    def segment(t: Any) -> Any:
        return lin2(lin1(t).relu().square()).tanh()

    plain = activation_bytes(segment(x).sum())
    kept = activation_bytes(checkpoint(segment, x).sum())
    x_bytes = 2 * 8 * 4  # rank 0's shard of x: 2 rows of 8 floats
    assert kept == x_bytes  # the segment's input alone
    assert plain > 3 * kept


def test_dropout_masks_replay_and_the_stream_moves_on_as_without_checkpoint() -> None:
    w = nn.Parameter(sbpflow.randn(6, 6))
    x = sbpflow.randn(5, 6, requires_grad=True)

    def fn(t: Any) -> Any:
        return sbpflow.nn.functional.dropout(t @ w, p=0.5, training=True).sum(dim=1)

    grads = []
    for use_checkpoint in (False, True):
        sbpflow.manual_seed(7)
        w.grad, x.grad = None, None
        out = checkpoint(fn, x) if use_checkpoint else fn(x)
        after_forward = sbpflow.random.counter()
        out.square().sum().backward()
        assert sbpflow.random.counter() == after_forward  # the replay drew nothing new
        grads.append((x.grad.numpy(), w.grad.numpy(), out.numpy()))
    for a, b in zip(*grads, strict=True):
        np.testing.assert_array_equal(a, b)


def test_tuple_outputs_and_arguments_without_gradients() -> None:
    w = nn.Parameter(sbpflow.randn(3, 3))
    x = sbpflow.randn(2, 3)  # needs no gradient: w alone makes the node

    def fn(t: Any, scale: float) -> Any:
        y = t @ w
        return y * scale, y.relu()

    a, b = checkpoint(fn, x, 2.0)
    (a.sum() + b.sum()).backward()
    ck = w.grad.numpy()
    w.grad = None
    a, b = fn(x, 2.0)
    (a.sum() + b.sum()).backward()
    np.testing.assert_allclose(ck, w.grad.numpy(), rtol=1e-6)


def test_no_grad_runs_plainly_and_bad_outputs_raise() -> None:
    x = sbpflow.randn(2, 2, requires_grad=True)
    with sbpflow.no_grad():
        assert checkpoint(lambda t: t * 2, x).grad_fn is None
    with pytest.raises(AutogradError, match="checkpoint needs .* to return a tensor"):
        checkpoint(lambda t: {"y": t}, x)


def _graph_run(spec: str, checkpointed: bool, executor: str = "actors") -> tuple[list[float], dict[str, Any], Any]:
    from sbpflow.demo.train_gpt import parameter_values

    trainer = build(CONFIG, spec, seed=0, graph=True, executor=executor)
    for block in trainer.graph.model.h:
        block.config.activation_checkpointing = checkpointed
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, 3, 8, 16, seed=1)]
    return losses, parameter_values(trainer), trainer.graph


@pytest.mark.parametrize("spec", ["dp=2", "dp=2,tp=2"])
def test_graph_activation_checkpointing_clones_forward_into_backward(spec: str) -> None:
    """module.config.activation_checkpointing: same training (dropout masks replayed from the same keys), the
    blocks' forward ops traced a second time in backward behind control edges, and a lower predicted peak."""
    losses, params, plain = _graph_run(spec, False)
    ck_losses, ck_params, graph = _graph_run(spec, True)
    np.testing.assert_allclose(ck_losses, losses, rtol=1e-6)
    # After 3 AdamW steps: as in test_gpt_equivalence, the key bias (zero true gradient) moves by lr-sized steps
    # on rounding noise, which differs with the order of sums the selection picks (the two graphs differ, so their
    # plans may: dp=2,tp=2 all-reduces different partial sums), and AdamW's m / sqrt(v) scales the noise of any
    # small gradient up towards lr (1e-3): one c_fc weight of 16384 moved 1.15e-5 apart. atol 3e-5 is 3% of lr.
    for name, value in params.items():
        np.testing.assert_allclose(ck_params[name], value, rtol=1e-5, atol=3e-5, err_msg=name)
    recomputed = [n for n in graph.logical.nodes if n.control]
    matmuls = sum(n.name in ("linear", "matmul", "matmul_nd") for n in recomputed)
    # q, k, v, attention c_proj and c_fc of every block, once more; the MLP's last projection is not: no gradient
    # reads its output (dropout keeps its key, the residual add nothing), so the compiler drops that clone
    assert matmuls == 5 * CONFIG.n_layer
    assert all(n.control for n in graph.plan.nodes if n.logical in {r.id for r in recomputed})


def test_graph_activation_checkpointing_lowers_the_predicted_peak() -> None:
    """Activations dominating (batch 32, sequence 64): the plan's peak falls by about half (15.5 -> 7.9 MiB)."""
    config = GPTConfig(vocab_size=100, block_size=64, n_layer=3, n_head=4, n_embd=64, dropout=0.1)
    peaks = []
    for checkpointed in (False, True):
        trainer = build(config, "dp=2", seed=0, graph=True)
        for block in trainer.graph.model.h:
            block.config.activation_checkpointing = checkpointed
        trainer.step(*next(iter(random_batches(config.vocab_size, 1, 32, 64, seed=1))))
        peaks.append(max(trainer.graph.plan.peak_bytes.values()))
    assert peaks[1] < 0.6 * peaks[0]


def test_graph_checkpointing_on_the_actor_runtime_equals_in_order() -> None:
    want = _graph_run("dp=2", True, executor="inorder")
    got = _graph_run("dp=2", True)
    assert got[0] == want[0]


def test_parameter_hooks_run_once_per_backward() -> None:
    w = nn.Parameter(sbpflow.ones(3))
    w.register_hook(lambda g: g * 10.0)
    checkpoint(lambda t: (t * w).sum(), sbpflow.ones(3, requires_grad=True)).backward()
    assert w.grad.tolist() == [10.0, 10.0, 10.0]  # scaled once, not by the recomputation's backward too
