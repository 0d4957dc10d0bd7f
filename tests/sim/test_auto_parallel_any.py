"""``config.enable_auto_parallel`` on nn.Graphs of any model (issue 25 §2): a residual MLP stack written here, the
shipped ViT and ResNet-style CNN. The auto plan trains to one device's numbers; ``set_plan`` replays a plan file
without searching; a memory cap gets a sharded plan whose compiled peak fits, and an impossible cap a PlanError
that leaves the model as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
import sbpflow.autoparallel.apply as apply
from sbpflow import nn
from sbpflow.autoparallel.graph_plan import Plan, plan_graph
from sbpflow.errors import PlanError
from sbpflow.nn import functional as F
from sbpflow.nn.trace_step import trace_training_step

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::sbpflow.graph.pipeline.PipelineWarning")]


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Any) -> Any:
        return x + self.down(F.relu(self.up(x)))


class ResidualMLP(nn.Module):
    """A model the project did not ship: an input layer, residual blocks, a classifier."""

    def __init__(self, width: int = 16, depth: int = 4, classes: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Residual(width) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: Any, y: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x), y)


class Step(nn.Graph):
    def __init__(self, model: nn.Module, loss: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.add_optimizer(sbpflow.optim.AdamW(model.parameters(), lr=1e-2))

    def build(self, x: Any, y: Any) -> Any:
        loss = self.loss(self.model, x, y)
        loss.backward()
        return loss


def _mlp(width: int = 16) -> tuple[nn.Module, Callable[..., Any],
                                   Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    return (ResidualMLP(width), lambda m, x, y: m(x, y),
            lambda g: (torch.randn(16, width, generator=g), torch.randint(0, 4, (16,), generator=g)))


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: Any) -> Any:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class BatchNormCNN(nn.Module):
    """A ResNet-like CNN the project did not ship: convolutions, BatchNorm with running statistics, a classifier."""

    def __init__(self, channels: int = 8, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.blocks = nn.ModuleList([ConvBlock(channels) for _ in range(depth)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: Any, y: Any) -> Any:
        x = F.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        x = self.pool(x)  # (B, C, 1, 1)
        return F.cross_entropy(self.fc(sbpflow.reshape(x, (x.shape[0], x.shape[1]))), y)


def _bn_cnn() -> Any:
    return (BatchNormCNN(), lambda m, x, y: m(x, y),
            lambda g: (torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)))


def _wide_mlp() -> Any:
    return _mlp(64)


def _vit() -> Any:
    from sbpflow.models.vit import ViT, ViTConfig

    return (ViT(ViTConfig(image_size=8, patch_size=4, width=16, depth=2, n_head=2)), lambda m, x, y: m(x, y)[1],
            lambda g: (torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)))


def _cnn() -> Any:
    from sbpflow.models.cnn import ResNet

    return (ResNet(channels=4), lambda m, x, y: F.cross_entropy(m(x), y),
            lambda g: (torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)))


def _train(factory: Any, configure: Callable[[Step], None] | None, steps: int) -> tuple[list[float], Step]:
    sbpflow.manual_seed(0)
    model, loss, batch = factory()
    step = Step(model, loss)
    if configure is not None:
        configure(step)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = batch(g)
        losses.append(float(step(sbpflow.tensor(x), sbpflow.tensor(y)).numpy()))
    return losses, step


@pytest.mark.parametrize("factory,steps", [(_mlp, 3), (_vit, 2), (_cnn, 2)], ids=["mlp", "vit", "cnn"])
def test_auto_plan_trains_as_one_device_and_replays_without_searching(factory: Any, steps: int, tmp_path: Any,
                                                                      monkeypatch: Any) -> None:
    want, _ = _train(factory, None, steps)
    got, step = _train(factory, lambda s: s.config.enable_auto_parallel(devices=4), steps)
    plan = step.auto_plan
    assert isinstance(plan, Plan) and plan.knobs.tp * plan.knobs.pp * plan.knobs.dp == 4
    np.testing.assert_allclose(got, want, rtol=1e-4)
    plan.save(tmp_path / "plan.json")

    def no_search(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("set_plan searched again")

    monkeypatch.setattr(apply, "plan_step", no_search)
    again, replayed = _train(factory, lambda s: s.config.set_plan(tmp_path / "plan.json"), steps)
    assert again == got and replayed.auto_plan == plan


@pytest.mark.parametrize("factory", [_mlp, _wide_mlp], ids=["16-wide", "64-wide"])
def test_a_memory_cap_forces_a_sharded_plan_that_fits_by_the_compiled_peak(factory: Any) -> None:
    """The planner's memory of a plan bounds the compiled peak (tests/sim/test_memory_prediction.py), also at 16
    wide, where the step's inputs and backward's working set weigh most."""
    _, free = _train(factory, lambda s: s.config.enable_auto_parallel(devices=4), 1)
    cap = free.auto_plan.memory_per_device * 0.6
    want, _ = _train(factory, None, 2)
    got, step = _train(factory, lambda s: s.config.enable_auto_parallel(devices=4, memory_per_device=cap), 2)
    k = step.auto_plan.knobs
    assert (k.tp, k.pp, k.zero) != (1, 1, 0) and step.auto_plan.memory_per_device <= cap
    assert max(step._last.plan.peak_bytes.values()) <= cap
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_an_impossible_cap_names_the_smallest_memory_and_moves_nothing() -> None:
    sbpflow.manual_seed(0)
    model, loss, batch = _mlp()
    step = Step(model, loss)
    step.config.enable_auto_parallel(devices=4, memory_per_device=1000.0)
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    x, y = batch(torch.Generator().manual_seed(1))
    with pytest.raises(PlanError, match="would fit it"):
        step(sbpflow.tensor(x), sbpflow.tensor(y))
    assert not any(p.is_global for p in model.parameters())
    assert all(np.array_equal(p.numpy(), before[n]) for n, p in model.named_parameters())
    assert len(step._optimizers[0].optimizer.state) == 0


def test_a_model_built_under_meta_init_is_planned_laid_out_and_compiled() -> None:
    """compile_only with auto-parallel: the plan and layout of a model of any size, without memory for its
    weights; the compiled peak is the planner's to compare."""
    with sbpflow.meta_init():
        model = ResidualMLP(width=64)
        x, y = sbpflow.randn(16, 64), sbpflow.zeros(16, dtype=torch.int64)
    step = Step(model, lambda m, a, b: m(a, b))
    step.config.enable_auto_parallel(devices=4)
    compiled = step.compile_only(x, y)
    k = step.auto_plan.knobs
    assert k.dp * k.tp * k.pp == 4 and model.strategy.world_size == 4
    assert all(p.is_meta and p.is_global for p in model.parameters())
    assert len(compiled.plan.peak_bytes) == 4


def test_a_batchnorm_cnn_planned_on_metadata_replays_on_a_real_copy(tmp_path: Any) -> None:
    """BatchNorm builds under meta_init (its step counter included); the plan of the metadata model's traced step
    lays it out with sbpflow.parallelize, and replayed on a real copy it trains as one device does."""
    with sbpflow.meta_init():
        meta = BatchNormCNN()
        x, y = sbpflow.randn(8, 3, 8, 8), sbpflow.zeros(8, dtype=torch.int64)
    assert all(b.is_meta for b in meta.buffers())
    plan = plan_graph(trace_training_step(meta, (x, y)), 4)
    strategy = sbpflow.parallelize(meta, **plan.parallelize_kwargs())
    assert strategy.world_size == 4
    assert all(t.is_meta and t.is_global for t in (*meta.parameters(), *meta.buffers()))
    plan.save(tmp_path / "plan.json")
    want, _ = _train(_bn_cnn, None, 2)
    got, step = _train(_bn_cnn, lambda s: s.config.set_plan(tmp_path / "plan.json"), 2)
    assert step.auto_plan == plan
    np.testing.assert_allclose(got, want, rtol=1e-4)


class CausalLM(nn.Module):
    """A user's small causal language model whose attention goes through scaled_dot_product_attention."""

    def __init__(self, vocab: int = 32, width: int = 16, heads: int = 2, depth: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.ModuleList([nn.Linear(width, 3 * width) for _ in range(depth)])
        self.proj = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: Any, targets: Any) -> Any:
        x = self.embed(ids)
        b, t, c = x.shape
        for qkv, proj in zip(self.qkv, self.proj, strict=True):
            q, k, v = (y.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for y in qkv(x).chunk(3, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + proj(y.transpose(1, 2).reshape(b, t, c))
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t))


def _causal_lm() -> Any:
    return (CausalLM(), lambda m, x, y: m(x, y),
            lambda g: (torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)))


def test_the_planner_searches_context_parallel_and_its_plan_trains_as_one_device(tmp_path: Any) -> None:
    """The cp axis of the graph planner: on a causal attention model it offers plans that split the sequence
    (zigzag over cp ranks), prices the ring's hops and holds a cp-th of the activations; such a plan lays the
    model out by parallelize(context=) and trains as one device."""
    from sbpflow.autoparallel.graph_model import read_graph
    from sbpflow.autoparallel.graph_search import Cluster, Knobs, _Context
    from sbpflow.autoparallel.graph_search import predict as graph_predict
    from sbpflow.autoparallel.profiles import get_profile

    with sbpflow.meta_init():
        meta = CausalLM()
        ids = sbpflow.zeros(4, 8, dtype=torch.int64)
    g = trace_training_step(meta, (ids, ids))
    read = read_graph(g, "traced")
    assert read.seq_len == 8 and (read.kv_bytes > 0).sum() == 2
    ctx = _Context(read, Cluster(4, get_profile("cpu"), 4), 4)
    whole, split = (graph_predict(ctx, Knobs(1, 1, 2, 2, cp=c)) for c in (1, 2))
    assert split.breakdown["cp_comm"] > 0 and "cp_comm" not in whole.breakdown
    assert split.memory["activations"] == pytest.approx(whole.memory["activations"] / 2)
    plan = plan_graph(g, 4, "cpu", precision="traced", only=lambda k: k.cp == 2 and k.tp == 1 and k.pp == 1)
    assert plan.knobs.cp == 2 and plan.knobs.dp == 2 and plan.parallelize_kwargs()["context"] == 2
    plan.save(tmp_path / "plan.json")
    want, _ = _train(_causal_lm, None, 2)
    got, step = _train(_causal_lm, lambda s: s.config.set_plan(tmp_path / "plan.json"), 2)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert step.auto_plan.knobs.cp == 2 and step.model.qkv[0].weight.placement.ndim == 3  # (data, context, tensor)


def test_a_stage_starts_with_a_whole_block_not_the_block_list_that_spans_the_stages() -> None:
    """ResidualMLP's first parameters are its first block's: the block list starts where stage 0 does, but it
    spans both stages, so stage 0 names ``blocks.0``, and the runner-up lines carry no rounding noise."""
    with sbpflow.meta_init():
        meta = ResidualMLP()
        x, y = sbpflow.zeros(16, 16), sbpflow.zeros(16, dtype=torch.int64)
    g = trace_training_step(meta, (x, y))
    plan = plan_graph(g, 2, "cpu", precision="traced", only=lambda k: k.pp == 2)
    assert [s[0] for s in plan.stages] == ["blocks.0", f"blocks.{plan.stages[1][0].split('.')[1]}"]
    assert all("blocks" not in s for s in plan.stages)
    assert all("e-1" not in r["why"] for r in plan.runners_up), [r["why"] for r in plan.runners_up]
