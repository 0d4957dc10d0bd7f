"""``sbpflow.auto_parallel`` on virtual ranks: the GPT takes the generic path (its traced training step, planned
and laid out by ``sbpflow.parallelize``) like any model; the plan trains like one device and follows the memory
limit (a device too small for the weights forces model parallelism)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import sbpflow
from sbpflow.autoparallel import get_profile
from sbpflow.errors import PlanError, SbpflowError
from sbpflow.models.gpt import GPT, GPTConfig, parallelize
from sbpflow.sbp import Split

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=64)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _loss(model: GPT, ids: np.ndarray, targets: np.ndarray) -> float:
    if model.strategy is None:
        _, loss = model(sbpflow.tensor(ids), sbpflow.tensor(targets))
    else:
        _, loss = model(*model.strategy.shard_inputs(ids, targets))
        if model.strategy.pipeline > 1:
            loss = loss.to_global(placement=model.strategy.everywhere, sbp=sbpflow.sbp.broadcast)
    return float(loss.numpy())


def _model() -> GPT:
    sbpflow.manual_seed(0)
    return GPT(CONFIG)


def _inputs(ids: np.ndarray, targets: np.ndarray) -> tuple[sbpflow.Tensor, sbpflow.Tensor]:
    return sbpflow.tensor(ids), sbpflow.tensor(targets)


def test_applied_plan_matches_the_search_and_one_device():
    rng = np.random.default_rng(0)
    ids, targets = rng.integers(0, 64, (8, 16)), rng.integers(0, 64, (8, 16))
    want = _loss(_model(), ids, targets)
    model = _model()
    auto = sbpflow.auto_parallel(model, _inputs(ids, targets), devices=4)
    k = auto.plan.knobs
    assert (auto.strategy.data, auto.strategy.tensor, auto.strategy.pipeline) == (k.dp, k.tp, k.pp)
    assert model.strategy is auto.strategy and k.zero == 0 and k.recompute == "none"
    assert auto.micro_batches == 1 and k.dp * k.micro_batch == 8  # eager: one micro-batch per step
    free = sbpflow.auto_parallel(_model(), _inputs(ids, targets), devices=4, micro_batches=None)
    assert free.micro_batches * free.plan.knobs.dp * free.plan.knobs.micro_batch == 8
    assert str(k) in auto.explain()
    assert _loss(model, ids, targets) == pytest.approx(want, rel=1e-5)


def test_small_devices_force_model_parallelism():
    """4 blocks of 64-wide layers hold about 0.2M parameters, 3.4 MB with Adam: a 2 MB device cannot hold them
    whole, so the plan splits the weights (tensor or pipeline parallel) instead of replicating them; the plan
    laid out still computes one device's loss."""
    rng = np.random.default_rng(2)
    ids, targets = rng.integers(0, 64, (8, 16)), rng.integers(0, 64, (8, 16))
    want = _loss(_model(), ids, targets)
    tiny = replace(get_profile("cpu"), memory_bytes=2e6)
    model = _model()
    auto = sbpflow.auto_parallel(model, _inputs(ids, targets), devices=4, profile=tiny)
    k = auto.plan.knobs
    assert k.tp * k.pp > 1 and auto.plan.memory_per_device <= auto.plan.usable_memory
    placed_apart = [p for p in model.parameters()
                    if any(isinstance(s, Split) for s in p.sbp) or p.placement != auto.strategy.stages[0]]
    assert placed_apart
    assert _loss(model, ids, targets) == pytest.approx(want, rel=1e-5)


def test_a_model_sbpflow_did_not_write_trains_as_one_device():
    """Eager training of a user's model under sbpflow.auto_parallel: plain local batches, one device's losses."""

    class Residual(sbpflow.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = sbpflow.nn.Linear(32, 32)

        def forward(self, x: sbpflow.Tensor) -> sbpflow.Tensor:
            return x + sbpflow.nn.functional.relu(self.layer(x))

    class Net(sbpflow.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = sbpflow.nn.Linear(8, 32)
            self.layers = sbpflow.nn.ModuleList([Residual() for _ in range(4)])
            self.out = sbpflow.nn.Linear(32, 4)

        def forward(self, x: sbpflow.Tensor, y: sbpflow.Tensor) -> sbpflow.Tensor:
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return sbpflow.nn.functional.cross_entropy(self.out(x), y)

    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((8, 8)).astype(np.float32), rng.integers(0, 4, (8,))) for _ in range(2)]

    def train(model: Net) -> list[float]:
        opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = model(sbpflow.tensor(x), sbpflow.tensor(y))
            loss.backward()
            opt.step()
            if loss.is_global:
                loss = loss.to_global(placement=model.strategy.everywhere, sbp=sbpflow.sbp.broadcast)
            losses.append(float(loss.numpy()))
        return losses

    sbpflow.manual_seed(0)
    want = train(Net())
    sbpflow.manual_seed(0)
    model = Net()
    auto = sbpflow.auto_parallel(model, _inputs(*batches[0]), devices=4)
    assert auto.strategy.world_size == 4
    np.testing.assert_allclose(train(model), want, rtol=1e-4)


def test_uneven_stage_cuts_are_applied():
    model = _model()
    strategy = parallelize(model, pipeline=(1, 3))
    assert strategy.pipeline == 2 and strategy.block_stage == (0, 1, 1, 1)
    with pytest.raises(SbpflowError, match="blocks per stage"):
        parallelize(_model(), pipeline=(2, 3))


def test_only_modules_are_planned():
    with pytest.raises(PlanError, match="sbpflow.nn.Module, but got object"):
        sbpflow.auto_parallel(object(), (sbpflow.randn(4, 4),), devices=2)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::sbpflow.graph.pipeline.PipelineWarning")  # its plan may pick pp with m=1
def test_graph_with_auto_parallel_trains_like_one_device():
    """nn.Graph plans its GPT from the traced step at the first call (micro-batches included), as any model's,
    and then trains as one device does."""
    from sbpflow.demo.train_gpt import TrainStep, scalar

    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, 64, (8, 16)), rng.integers(0, 64, (8, 16))) for _ in range(2)]
    want = []
    reference = _model()
    opt = sbpflow.optim.AdamW(reference.parameters(), lr=1e-2)
    for ids, targets in batches:
        opt.zero_grad()
        _, loss = reference(sbpflow.tensor(ids), sbpflow.tensor(targets))
        loss.backward()
        opt.step()
        want.append(float(loss.numpy()))
    model = _model()
    step = TrainStep(model, sbpflow.optim.AdamW(model.parameters(), lr=1e-2), clip=None)
    tiny = replace(get_profile("cpu"), memory_bytes=2e6)  # forces a sharded plan (see above): ZeRO, tp or pp
    step.config.enable_auto_parallel(devices=4, profile=tiny)
    got = [scalar(step(ids, targets), model.strategy) for ids, targets in batches]
    k = step.auto_plan.knobs
    assert (k.tp * k.pp > 1 or k.zero > 0) and step.config.micro_batches == step.auto_plan.micro_batches
    np.testing.assert_allclose(got, want, rtol=1e-4)
    with pytest.raises(SbpflowError, match="devices"):
        step.config.enable_auto_parallel(devices=0)
