"""``sbpflow.auto_parallel`` on virtual ranks: the plan it finds is laid out on the model, trains like one
device, and follows the memory limit (a device too small for the weights forces model parallelism)."""

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


def test_applied_plan_matches_the_search_and_one_device():
    rng = np.random.default_rng(0)
    ids, targets = rng.integers(0, 64, (8, 16)), rng.integers(0, 64, (8, 16))
    want = _loss(_model(), ids, targets)
    model = _model()
    auto = sbpflow.auto_parallel(model, devices=4, batch=8)
    plan = auto.prediction.plan
    assert (auto.strategy.data, auto.strategy.tensor, auto.strategy.pipeline) == (plan.dp, plan.tp, plan.pp)
    assert model.strategy is auto.strategy and plan.zero == 0 and plan.recompute == "none"
    assert auto.micro_batches == 1 and plan.dp * plan.micro_batch == 8  # eager: one micro-batch per step
    graph_plan = sbpflow.auto_parallel(_model(), devices=4, batch=8, micro_batches=None)
    assert graph_plan.micro_batches * graph_plan.prediction.plan.dp * graph_plan.prediction.plan.micro_batch == 8
    assert str(plan) in auto.explain()
    assert _loss(model, ids, targets) == pytest.approx(want, rel=1e-5)


def test_small_devices_force_model_parallelism():
    """4 blocks of 64-wide layers hold about 0.2M parameters, 3.4 MB with Adam: a 2 MB device cannot hold them
    whole, so the plan splits the weights (tensor or pipeline parallel) instead of replicating them."""
    tiny = replace(get_profile("cpu"), memory_bytes=2e6)
    model = _model()
    auto = sbpflow.auto_parallel(model, devices=4, batch=8, profile=tiny)
    plan = auto.prediction.plan
    assert plan.tp * plan.pp > 1 and auto.prediction.fits
    placed_apart = [p for p in model.parameters()
                    if any(isinstance(s, Split) for s in p.sbp) or p.placement != auto.strategy.stages[0]]
    assert placed_apart


def test_uneven_stage_cuts_are_applied():
    model = _model()
    strategy = parallelize(model, pipeline=(1, 3))
    assert strategy.pipeline == 2 and strategy.block_stage == (0, 1, 1, 1)
    with pytest.raises(SbpflowError, match="blocks per stage"):
        parallelize(_model(), pipeline=(2, 3))


def test_only_gpts_are_planned():
    with pytest.raises(PlanError, match="GPT"):
        sbpflow.auto_parallel(sbpflow.nn.Linear(4, 4), devices=2, batch=4)


@pytest.mark.filterwarnings("ignore::sbpflow.graph.pipeline.PipelineWarning")  # its plan may pick pp with m=1
def test_graph_with_auto_parallel_trains_like_one_device():
    """nn.Graph plans its GPT at the first call (micro-batches included) and then trains as one device does."""
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
    tiny = replace(get_profile("cpu"), memory_bytes=2e6)  # forces a model-parallel plan (see above)
    step.config.enable_auto_parallel(devices=4, profile=tiny)
    got = [scalar(step(ids, targets), model.strategy) for ids, targets in batches]
    plan = step.auto_plan.prediction.plan
    assert plan.tp * plan.pp > 1 and step.config.micro_batches == step.auto_plan.micro_batches
    np.testing.assert_allclose(got, want, rtol=1e-4)
    with pytest.raises(SbpflowError, match="devices"):
        step.config.enable_auto_parallel(devices=0)
