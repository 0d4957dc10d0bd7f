"""Checkpoints of a training GPT: saved under dp2 x tp2, loaded under tp4, pp2 and one device; bit-exact resume.

Values cross a checkpoint unchanged, so loaded parameters and optimizer
moments equal the saved ones exactly, whatever the strategy. The next step
then matches the uninterrupted run: exactly under the same strategy (resume),
within the strategy-equivalence tolerance under another one (float sums in
another order).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow
from sbpflow.demo.resume import resume_training, save_training
from sbpflow.demo.train_gpt import Trainer, build, parameter_values, random_batches
from sbpflow.models.gpt import GPTConfig
from sbpflow.optim.lr_scheduler import WarmupCosine

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
BATCH, SEQ, LR = 8, 8, 1e-2
RTOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return list(random_batches(CONFIG.vocab_size, steps, BATCH, SEQ, seed=1))


def optimizer_values(trainer: Trainer) -> dict[str, np.ndarray]:
    """Each parameter's AdamW moments and step count by parameter name, as logical values."""
    out = {}
    for name, p in trainer.model.named_parameters():
        state = trainer.optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            if trainer.strategy is not None and trainer.strategy.pipeline > 1:
                value = value.to_global(placement=trainer.strategy.everywhere, sbp=sbpflow.sbp.broadcast)
            out[f"{name}.{key}"] = value.numpy().copy()  # numpy() may share a broadcast shard's memory
        out[f"{name}.step"] = np.array(state["step"])
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> dict[str, Any]:
    """A dp2 x tp2 run saved after 3 steps, with its values then and its loss on step 4."""
    trainer = build(CONFIG, "dp=2,tp=2", lr=LR)
    batches = _batches(4)
    for ids, targets in batches[:3]:
        trainer.step(ids, targets)
    path = str(tmp_path_factory.mktemp("gpt") / "step-3")
    save_training(path, trainer, None, 3)
    params = {name: value.copy() for name, value in parameter_values(trainer).items()}
    values = {"params": params, "optim": optimizer_values(trainer)}
    return {"path": path, **values, "next_loss": trainer.step(*batches[3])}


@pytest.mark.parametrize("spec", ["tp=4", "pp=2", "single", "dp=4"])
def test_dp2_tp2_checkpoint_loads_under_another_strategy(spec: str, saved: dict[str, Any]) -> None:
    fresh = build(CONFIG, spec, seed=7, lr=0.5)  # another init and lr: both must come from the checkpoint
    sbpflow.manual_seed(123)
    assert resume_training(saved["path"], fresh, None) == 3
    for name, value in saved["params"].items():
        np.testing.assert_array_equal(parameter_values(fresh)[name], value, err_msg=name)
    for name, value in saved["optim"].items():
        np.testing.assert_array_equal(optimizer_values(fresh)[name], value, err_msg=name)
    assert fresh.optimizer.param_groups[0]["lr"] == LR
    loss = fresh.step(*_batches(4)[3])
    np.testing.assert_allclose(loss, saved["next_loss"], rtol=RTOL)


def _run(steps: int, *, path: str, save_at: int | None = None, resume: bool = False,
         spec: str = "dp=2,tp=2") -> tuple[list[float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Trains to ``steps`` with a warmup-cosine schedule; saves after ``save_at`` steps, or resumes from ``path``."""
    trainer = build(CONFIG, spec, seed=5 if resume else 0, lr=LR)
    schedule = WarmupCosine(trainer.optimizer, warmup_steps=3, total_steps=10)
    start = 0
    if resume:
        sbpflow.manual_seed(99)  # a new process starts from another random stream: the checkpoint restores it
        start = resume_training(path, trainer, schedule)
    losses = []
    for step, (ids, targets) in enumerate(_batches(steps)):
        if step < start:  # the batch stream's position is a count of batches drawn
            continue
        losses.append(trainer.step(ids, targets))
        schedule.step()
        if save_at == step + 1:
            save_training(path, trainer, schedule, step + 1)
    return losses, parameter_values(trainer), optimizer_values(trainer)


@pytest.mark.parametrize("spec", ["dp=2,tp=2", "single"])
def test_resume_is_bit_exact(spec: str, tmp_path: Any) -> None:
    path = str(tmp_path / "step-5")
    full_losses, full_params, full_optim = _run(10, path=str(tmp_path / "unused"), spec=spec)
    first, _, _ = _run(5, path=path, save_at=5, spec=spec)
    second, params, optim = _run(10, path=path, resume=True, spec=spec)
    assert first + second == full_losses  # exactly: same dropout masks, lr, moments and batches
    for name, value in full_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    for name, value in full_optim.items():
        np.testing.assert_array_equal(optim[name], value, err_msg=name)


def _trainer(spec: str, zero: int, seed: int = 0) -> Trainer:
    trainer = build(CONFIG, spec, seed=seed, lr=LR)
    if zero:
        sbpflow.optim.zero(trainer.optimizer, zero, model=trainer.model)
    return trainer


@pytest.mark.parametrize("saved_as, loaded_as", [
    (("dp=2", 3), ("dp=2", 0)),  # ZeRO-3 saved, plain data parallel loads
    (("dp=2", 3), ("single", 0)),  # ... one device loads
    (("dp=2", 0), ("dp=2", 3)),  # plain saved, ZeRO-3 loads
])
def test_zero3_checkpoint_loads_without_zero_and_back(saved_as: tuple[str, int], loaded_as: tuple[str, int],
                                                      tmp_path: Any) -> None:
    """Parameters S(0) at rest (and AdamW moments S(0)) load into B ones and back: the same values, exactly;
    training on matches the run that never switched (within the ZeRO equivalence tolerance, rtol 1e-5; one
    device sums in another order: RTOL)."""
    batches = _batches(5)
    never = _trainer(*saved_as)
    never_losses = [never.step(ids, targets) for ids, targets in batches]
    first = _trainer(*saved_as)
    for ids, targets in batches[:3]:
        first.step(ids, targets)
    path = str(tmp_path / "step-3")
    save_training(path, first, None, 3)
    fresh = _trainer(*loaded_as, seed=7)
    sbpflow.manual_seed(123)
    assert resume_training(path, fresh, None) == 3
    for name, value in parameter_values(first).items():
        np.testing.assert_array_equal(parameter_values(fresh)[name], value, err_msg=name)
    for name, value in optimizer_values(first).items():
        np.testing.assert_array_equal(optimizer_values(fresh)[name], value, err_msg=name)
    weight = fresh.model.h[0].mlp.c_fc.weight
    sharded = weight.is_global and weight.sbp[0] == sbpflow.sbp.split(0)
    assert sharded == (loaded_as[1] == 3)  # the loader's layout, not the saver's
    losses = [fresh.step(ids, targets) for ids, targets in batches[3:]]
    rtol = 1e-5 if loaded_as[0] == saved_as[0] else RTOL
    np.testing.assert_allclose(losses, never_losses[3:], rtol=rtol)
    for name, value in parameter_values(never).items():
        np.testing.assert_allclose(parameter_values(fresh)[name], value, rtol=rtol, atol=1e-5 * 2, err_msg=name)
