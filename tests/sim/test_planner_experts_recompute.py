"""The graph planner's expert axis and per-block recompute (issue 25 §1): an ep plan of a MoE model (shipped, and one
a user builds from ``nn.MoE``) lays the model out by ``parallelize(expert=)`` and trains as one device; a memory
cap that only expert splitting meets gets ep > 1; a cap between no recompute and full recompute gets a plan that
recomputes some blocks only, fits by the compiler's own peak and trains as one device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow.autoparallel.apply import plan_model
from sbpflow.autoparallel.graph_model import read_graph
from sbpflow.autoparallel.graph_plan import Plan
from sbpflow.autoparallel.graph_search import Cluster, Knobs, _coll, _Context, candidates
from sbpflow.autoparallel.graph_search import predict as graph_predict
from sbpflow.autoparallel.profiles import get_profile
from sbpflow.errors import PlanError
from sbpflow.models.moe import Mixtral, MixtralConfig
from sbpflow.nn import functional as F
from sbpflow.nn.moe import StackedExperts
from sbpflow.nn.trace_step import trace_training_step

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::sbpflow.graph.pipeline.PipelineWarning")]

Factory = Callable[[], tuple[nn.Module, Callable[..., Any], Callable[[torch.Generator], tuple[Any, Any]]]]


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


class UserMoE(nn.Module):
    """A user's classifier with two residual nn.MoE layers (and one shared expert in the second)."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList([nn.MoE(width, 12, num_experts=experts, top_k=2, shared_experts=s)
                                     for s in (0, 1)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: Any, y: Any) -> Any:
        x = self.inp(x)
        for moe in self.layers:
            x = x + moe(x)
        return F.cross_entropy(self.head(x), y)


def _user_moe() -> Any:
    return (UserMoE(), lambda m, x, y: m(x, y),
            lambda g: (torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)))


def _mixtral() -> Any:
    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           output_router_logits=True, router_aux_loss_coef=0.1)
    return (Mixtral(config), lambda m, x, y: m(x, y)[1],
            lambda g: tuple(torch.randint(0, 32, (4, 8), generator=g) for _ in range(2)))


def _train(factory: Factory, plan: Plan | None, steps: int = 2) -> tuple[list[float], Step]:
    sbpflow.manual_seed(0)
    model, loss, batch = factory()
    step = Step(model, loss)
    if plan is not None:
        step.config.set_plan(plan)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = batch(g)
        losses.append(float(step(sbpflow.tensor(x), sbpflow.tensor(y)).numpy()))
    return losses, step


def _plan(factory: Factory, devices: int, only: Callable[[Any], bool] | None = None,
          memory_per_device: float | None = None) -> Plan:
    """The plan of the factory's model (left as it was) on its first batch."""
    sbpflow.manual_seed(0)
    model, loss, batch = factory()
    x, y = batch(torch.Generator().manual_seed(1))
    return plan_model(Step(model, loss), (sbpflow.tensor(x), sbpflow.tensor(y)), devices, "cpu",
                      memory_per_device=memory_per_device, only=only)


# -- the expert axis -------------------------------------------------------------------------------


def test_the_experts_are_read_off_the_router_ops() -> None:
    """Every routed expert's weights, not the router's or the shared expert's; one routed bytes figure per router:
    its tokens times k."""
    with sbpflow.meta_init():
        model = UserMoE()
        x, y = sbpflow.randn(16, 8), sbpflow.zeros(16, dtype=torch.int64)
    read = read_graph(trace_training_step(model, (x, y)), "traced")
    experts = read.experts
    assert experts is not None and experts.count == 4
    names = sorted(read.param_names[v].removeprefix("model.") for v in experts.params)
    assert names == sorted(f"layers.{i}.experts.{e}.{w}.weight" for i in range(2) for e in range(4)
                           for w in ("w1", "w2", "w3"))
    assert sorted(experts.routed_bytes[experts.routed_bytes > 0]) == [16 * 8 * 4 * 2] * 2  # fp32 tokens, k = 2


def test_ep_splits_the_experts_state_and_prices_their_exchange() -> None:
    """dp4: at ep2 a rank holds half of every expert's weights, computes twice its dense share of the experts'
    work (its 2 experts on the 4 data ranks' tokens) and sends 4 all-to-alls of its routed rows per router."""
    with sbpflow.meta_init():
        model = UserMoE()
        x, y = sbpflow.randn(16, 8), sbpflow.zeros(16, dtype=torch.int64)
    read = read_graph(trace_training_step(model, (x, y)), "traced")
    cluster = Cluster(4, get_profile("cpu"), 4)
    ctx = _Context(read, cluster, 16)
    whole, split = (graph_predict(ctx, Knobs(1, 1, 4, 4, ep=e)) for e in (1, 2))
    expert_bytes = 4.0 * 2 * 4 * 3 * 8 * 12  # fp32, 2 layers x 4 experts x 3 (8 x 12) weights
    assert whole.memory["weights"] - split.memory["weights"] == pytest.approx(expert_bytes / 2)
    assert split.breakdown["compute"] > whole.breakdown["compute"]
    rows = 4 * 8 * 4 * 2  # a rank's 4 tokens of 8 fp32 features, k = 2
    # 2 routers; rank 0's peer holding the other experts is rank 2 (groups are data rows {0, 1} and {2, 3})
    exchange = 2 * 4 * _coll("all_to_all", (0, 2), rows * 2, cluster=cluster)
    assert split.breakdown["ep_comm"] == pytest.approx(exchange)
    # ZeRO-1 shards the optimizer state over all 4 data ranks, an expert's over its group's 2
    adam = 8.0  # fp32 Adam: two moments
    non_expert = read.param_count - expert_bytes / 4
    zero = graph_predict(ctx, Knobs(1, 1, 4, 4, zero=1, ep=2))
    assert zero.memory["optimizer"] == pytest.approx(adam * (non_expert / 4 + expert_bytes / 4 / 2 / 2))


def test_ep_equal_to_dp_prices_routed_rows_only() -> None:
    """dp4: at ep4 parallelize stacks the experts over the data axis, so a rank runs its experts on the rows routed
    to them only, k/E = 1/2 of its dense share of the experts' work (the traced step's: every expert on every
    token) and of what they keep; at ep2 (per placement) twice that share. The exchange is priced alike."""
    with sbpflow.meta_init():
        model = UserMoE()
        x, y = sbpflow.randn(16, 8), sbpflow.zeros(16, dtype=torch.int64)
    read = read_graph(trace_training_step(model, (x, y)), "traced")
    assert read.experts is not None and read.experts.routed_share == 2 / 4
    cluster = Cluster(4, get_profile("cpu"), 4)
    ctx = _Context(read, cluster, 16)
    whole, two, four = (graph_predict(ctx, Knobs(1, 1, 4, 4, ep=e)) for e in (1, 2, 4))
    dense = whole.breakdown["compute"] - four.breakdown["compute"]  # half the dense experts' work, saved
    assert dense > 0 and two.breakdown["compute"] - whole.breakdown["compute"] == pytest.approx(2 * dense)
    assert four.memory["activations"] < whole.memory["activations"] < two.memory["activations"]
    assert four.breakdown["ep_comm"] > 0


def test_a_model_without_a_router_has_no_expert_axis() -> None:
    with sbpflow.meta_init():
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        x = sbpflow.randn(4, 8)
    read = read_graph(trace_training_step(model, (x,)), "traced")
    assert read.experts is None
    assert {k.ep for k in _candidates(read, 4, 4)} == {1}


def _candidates(read: Any, devices: int, batch: int) -> list[Any]:
    return candidates(read, Cluster(devices, get_profile("cpu"), devices), batch)


@pytest.mark.parametrize("factory", [_user_moe, _mixtral], ids=["user", "mixtral"])
def test_an_ep2_plan_trains_as_one_device(factory: Factory) -> None:
    """dp4 x ep2: each expert group spans two data ranks. The plan holds half the experts' state per rank, pays
    the exchange (ep_comm), and parallelize(expert=2) lays it out."""
    plan = _plan(factory, 4, only=lambda k: k.ep == 2 and k.tp == 1 and k.pp == 1)
    assert (plan.knobs.dp, plan.knobs.ep) == (4, 2) and plan.parallelize_kwargs()["expert"] == 2
    assert plan.breakdown["ep_comm"] > 0 and "ep_comm" in plan.cli_json()["breakdown"]
    assert plan.cli_json()["ep"] == 2 and Plan.from_json(plan.to_json()) == plan
    want, _ = _train(factory, None)
    got, step = _train(factory, plan)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    moe = next(m for m in step.model.modules() if isinstance(m, nn.MoE))
    assert [len(e.w1.weight.placement.flat_ranks) for e in moe.experts] == [2, 2, 2, 2]


def test_an_ep2_plan_with_zero_trains_as_one_device() -> None:
    plan = _plan(_user_moe, 4, only=lambda k: k.ep == 2 and k.zero == 1 and k.tp == 1 and k.pp == 1)
    assert (plan.knobs.ep, plan.knobs.zero) == (2, 1)
    want, _ = _train(_user_moe, None)
    got, _ = _train(_user_moe, plan)
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_a_cap_that_only_expert_splitting_meets_picks_ep() -> None:
    """On the data-parallel plans (no tp, pp or ZeRO), a cap below the replicated plan's memory but above the ep4
    plan's: the search splits the experts, and the plan still trains as one device."""
    data_only = lambda k: k.tp == 1 and k.pp == 1 and k.zero == 0  # noqa: E731
    free = _plan(_user_moe, 4, only=lambda k: data_only(k) and k.ep == 1)
    split = _plan(_user_moe, 4, only=lambda k: data_only(k) and k.ep == 4)
    assert split.memory_per_device < free.memory_per_device
    cap = (split.memory_per_device + free.memory_per_device) / 2
    plan = _plan(_user_moe, 4, only=data_only, memory_per_device=cap)
    assert plan.knobs.ep > 1 and plan.memory_per_device <= cap
    assert all(" ep" in r["plan"] for r in plan.runners_up)  # every plan that fits splits the experts
    want, _ = _train(_user_moe, None)
    got, step = _train(_user_moe, plan)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    if plan.knobs.ep == plan.knobs.dp:  # stacked experts, which the graph's optimizer (made before) now updates
        moe = next(m for m in step.model.modules() if isinstance(m, nn.MoE))
        assert isinstance(moe.experts, StackedExperts)
        assert any(p is moe.experts.w1 for g in step._optimizers[0].optimizer.param_groups for p in g["params"])


# -- recompute per block ---------------------------------------------------------------------------


class Chain(nn.Module):
    """A block whose activations outweigh its parameters: a wide chain of tanh between two Linears."""

    def __init__(self, width: int, hidden: int, links: int) -> None:
        super().__init__()
        self.up, self.down, self.links = nn.Linear(width, hidden), nn.Linear(hidden, width), links

    def forward(self, x: Any) -> Any:
        h = self.up(x)  # (B, hidden)
        for _ in range(self.links):
            h = F.tanh(h)
        return x + self.down(h)


class ChainNet(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Chain(16, 128, 8) for _ in range(depth)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: Any, y: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x), y)


def _chain_net() -> Any:
    return (ChainNet(), lambda m, x, y: m(x, y),
            lambda g: (torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)))


def test_a_cap_between_none_and_full_recomputes_some_blocks_and_fits_by_the_compiled_peak() -> None:
    """One device, one micro-batch: only recompute can save memory. Half-way between the plan that keeps every
    activation and the one that recomputes every block, the search recomputes the first blocks only: it costs less
    time than recomputing all, fits the cap by the compiler's own peak, and trains as one device."""
    one = lambda k: k.micro_batch == 32  # noqa: E731
    keep = _plan(_chain_net, 1, only=lambda k: one(k) and k.recompute == "none")
    full = _plan(_chain_net, 1, only=lambda k: one(k) and k.recompute == "full")
    cap = (keep.memory_per_device + full.memory_per_device) / 2
    plan = _plan(_chain_net, 1, only=one, memory_per_device=cap)
    modes = plan.knobs.block_recompute
    assert "full" in modes and "none" in modes and modes == tuple(sorted(modes))  # the first blocks, full
    assert plan.memory_per_device <= cap and keep.step_time < plan.step_time < full.step_time
    recomputed = plan.recomputed_blocks()
    assert recomputed == [f"blocks.{i}" for i in range(modes.count("full"))]
    assert plan.cli_json()["block_recompute"] == list(modes) and Plan.from_json(plan.to_json()) == plan
    want, _ = _train(_chain_net, None, 3)
    got, step = _train(_chain_net, plan, 3)
    assert [b.config.activation_checkpointing for b in step.model.blocks] == [m == "full" for m in modes]
    assert max(step._last.plan.peak_bytes.values()) <= cap
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_plans_that_recompute_some_blocks_pass_the_callers_filter() -> None:
    """A caller that runs no recompute (eager training's filter) gets no plan recomputing some blocks: under a cap
    only those meet, the search says nothing fits."""
    one = lambda k: k.micro_batch == 32  # noqa: E731
    keep = _plan(_chain_net, 1, only=lambda k: one(k) and k.recompute == "none")
    full = _plan(_chain_net, 1, only=lambda k: one(k) and k.recompute == "full")
    cap = (keep.memory_per_device + full.memory_per_device) / 2
    with pytest.raises(PlanError, match="would fit it"):
        _plan(_chain_net, 1, only=lambda k: one(k) and k.recompute == "none", memory_per_device=cap)


def test_plans_that_run_the_traced_step_recompute_as_nn_graph_can() -> None:
    """nn.Graph recomputes by checkpointing whole modules: a plan that runs the traced step is offered none and
    full only; a what-if (mixed precision, for accelerators) also selective."""
    with sbpflow.meta_init():
        model = ChainNet()
        x, y = sbpflow.randn(32, 16), sbpflow.zeros(32, dtype=torch.int64)
    g = trace_training_step(model, (x, y))
    traced, mixed = (read_graph(g, precision) for precision in ("traced", "mixed"))
    assert {k.recompute for k in _candidates(traced, 2, 32)} == {"none", "full"}
    assert {k.recompute for k in _candidates(mixed, 2, 32)} == {"none", "selective", "full"}


def test_a_plan_recomputing_blocks_the_model_lacks_raises_before_anything_moves() -> None:
    plan = _plan(_chain_net, 1, only=lambda k: k.micro_batch == 32 and k.recompute == "none")
    plan = replace(plan, knobs=replace(plan.knobs, recompute="full", block_recompute=("full", "none")))
    sbpflow.manual_seed(0)
    model, loss, batch = _chain_net()
    step = Step(model, loss)
    step.config.set_plan(plan)
    x, y = batch(torch.Generator().manual_seed(1))
    with pytest.raises(PlanError, match="names 4 blocks .* for 2 choices"):
        step(sbpflow.tensor(x), sbpflow.tensor(y))
    assert not any(p.is_global for p in model.parameters())
    assert not any(b.config.activation_checkpointing for b in model.blocks)
