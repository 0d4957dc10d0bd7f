"""``sbpflow.parallelize(expert=data)`` stacks each nn.MoE's experts and splits them S(0) over the data axis, so
tokens travel to their experts by all-to-all (only routed rows move). Mixtral from a tiny transformers checkpoint
(``from_pretrained(folder, data=2, expert=2)``) and a user's nn.MoE model train as one device, eager and compiled
by nn.Graph (rtol 1e-4), whose plan runs the exchange as ``expert_exchange`` nodes; the checkpoint loads into the
stacked slices and saves back to a folder transformers reads. ``expert < data`` keeps each expert on its group's
data rows (:func:`test_fewer_groups_than_data_ranks_keep_experts_on_data_rows`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import per_expert
from sbpflow import nn
from sbpflow._layout import shard_box
from sbpflow.errors import PlanError
from sbpflow.nn import functional as F
from sbpflow.sbp import broadcast, split

RTOL, ATOL = 1e-4, 1e-4
E, K, VOCAB = 4, 2, 64

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class UserMoE(nn.Module):
    """A user's classifier with two residual nn.MoE layers (a shared expert in the second)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList([nn.MoE(width, 12, num_experts=E, top_k=K, shared_experts=s) for s in (0, 1)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: Any, y: Any) -> Any:
        x = self.inp(x)
        for moe in self.layers:
            x = F.add(x, moe(x))
        return None, F.cross_entropy(self.head(x), y)


class Step(nn.Graph):
    def __init__(self, model: Any, opt: Any) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x: Any, y: Any) -> Any:
        _, loss = self.model(x, y)
        loss.backward()
        return loss


def _user_batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((8, 8)).astype(np.float32), rng.integers(0, 4, size=8)


def _lm_batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    tokens = rng.integers(0, VOCAB, size=(4, 9))
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: Any, batch: Any, compiled: bool, steps: int = 3) -> tuple[list[float], dict[str, Any], Any]:
    """AdamW steps; the losses, the parameters by each expert's name, and the nn.Graph (None in eager)."""
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)
    step = Step(model, opt) if compiled else None
    strategy = model.__dict__.get("strategy")
    rng, losses = np.random.default_rng(2), []
    for _ in range(steps):
        x, y = batch(rng)
        xt, yt = strategy.shard_inputs(x, y) if strategy is not None else (sbpflow.tensor(x), sbpflow.tensor(y))
        if step is not None:
            losses.append(step(xt, yt).item())
            continue
        opt.zero_grad()
        _, loss = model(xt, yt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, per_expert(model, lambda p: p.numpy()), step


def _assert_same(got: tuple[list[float], dict[str, Any], Any], want: tuple[list[float], dict[str, Any], Any]) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    assert sorted(got[1]) == sorted(want[1])
    for name, value in want[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def _assert_exchanged(step: Any, layers: int) -> None:
    """The compiled step routes each MoE layer's tokens by one expert_exchange node (and its backward), over every
    rank; no boxing broadcasts the tokens to an expert."""
    plan = step.plan
    computed = [m for n in plan.nodes if n.kind == "compute" for m in dict(n.attrs).get("nodes", (n,))]  # unfused
    for name in ("expert_exchange", "expert_exchange_backward"):
        nodes = [n for n in computed if n.name == name]
        assert len(nodes) == layers and all(len(n.ranks) == 2 for n in nodes), nodes
        assert all(n.in_sbps[3 + name.endswith("backward")][0] == split(0) for n in nodes)  # the experts stay put
    assert not any(n.kind == "boxing" and any(s.kind == "broadcast" for s in n.boxing.steps) for n in plan.nodes)


def _user(parallel: dict[str, int] | None) -> UserMoE:
    sbpflow.manual_seed(0)
    model = UserMoE()
    if parallel:
        sbpflow.parallelize(model, **parallel)
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph"])
def test_user_moe_stacked_over_data_trains_as_one_device(compiled: bool) -> None:
    want = _train(_user(None), _user_batch, False)
    model = _user({"data": 2, "expert": 2})
    w1 = model.layers[0].experts.w1  # stacked (E, I, C), S(0) over the data axis
    assert tuple(w1.shape) == (E, 12, 8) and w1.sbp == (split(0), broadcast)
    assert model.strategy.params["layers.0.experts.w1"] == (0, (split(0), broadcast), (E, 12, 8))
    got = _train(model, _user_batch, compiled)
    _assert_same(got, want)
    if compiled:
        _assert_exchanged(got[2], layers=2)


def test_user_moe_stacked_with_megatron_inside_the_experts() -> None:
    """data=2, tensor=2: the experts over the data axis, each split Megatron-style on the tensor axis."""
    want = _train(_user(None), _user_batch, False)
    model = _user({"data": 2, "tensor": 2, "expert": 2})
    experts = model.layers[0].experts
    assert [w.sbp for w in experts.weights()] == [(split(0), split(1)), (split(0), split(2)), (split(0), split(1))]
    _assert_same(_train(model, _user_batch, False), want)


def test_fewer_groups_than_data_ranks_keep_experts_on_data_rows() -> None:
    """expert=2 over data=4: each expert moves to its group's two data rows (the per-placement path)."""
    model = _user({"data": 4, "expert": 2})
    experts = model.layers[0].experts
    assert isinstance(experts, nn.ModuleList)
    assert [e.w1.weight.placement.flat_ranks for e in experts] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    _assert_same(_train(model, _user_batch, False), _train(_user(None), _user_batch, False))


def test_a_plan_splitting_some_experts_differently_raises_and_changes_nothing() -> None:
    model = _user(None)
    before = [(n, p.is_global, p.numpy().tobytes()) for n, p in model.named_parameters()]
    with pytest.raises(PlanError, match=r"every experts\.\*\.w1 one style"):
        sbpflow.parallelize(model, data=2, tensor=2, expert=2, plan={"layers.*.experts.0.w1": "colwise"})
    assert [(n, p.is_global, p.numpy().tobytes()) for n, p in model.named_parameters()] == before
    assert "strategy" not in model.__dict__


# -- Mixtral from a Hugging Face folder ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: Any) -> tuple[Any, Path]:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                        num_experts_per_tok=K, output_router_logits=True, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).float()
    folder = tmp_path_factory.mktemp("mixtral_expert")
    model.save_pretrained(folder)
    return model, folder


def test_mixtral_loads_into_stacked_slices_and_saves_back(hf_folder: Any, tmp_path: Path) -> None:
    """Each rank holds its two experts' slices of the checkpoint; save_pretrained writes one tensor per expert."""
    from sbpflow.models import from_pretrained

    ref, folder = hf_folder
    model = from_pretrained(folder, data=2, expert=2)
    w1 = model.model.layers[0].block_sparse_moe.experts.w1
    for r in w1.placement.flat_ranks:
        assert shard_box(tuple(w1.shape), w1.placement, w1.sbp, r)[0] == (2 * r, 2 * r + 2)
    values = per_expert(model, lambda p: p.numpy())
    gate_up = ref.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].numpy()  # (E, 2I, C)
    for e in range(E):
        np.testing.assert_array_equal(values[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"],
                                      gate_up[e, :24])
    model.save_pretrained(tmp_path)
    back = type(ref).from_pretrained(tmp_path)
    want = ref.state_dict()
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), want[name].numpy(), err_msg=name)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph"])
def test_mixtral_expert_equals_data_trains_as_one_device(hf_folder: Any, compiled: bool) -> None:
    from sbpflow.models import from_pretrained

    folder = hf_folder[1]
    want = _train(from_pretrained(folder), _lm_batch, False)
    model = from_pretrained(folder, data=2, expert=2)
    assert model.strategy.params["model.layers.1.block_sparse_moe.experts.w2"][1] == (split(0), broadcast)
    got = _train(model, _lm_batch, compiled)
    _assert_same(got, want)
    if compiled:
        _assert_exchanged(got[2], layers=2)
