"""OneFlow's documentation examples (global tensor, SBP, 2-D SBP, data parallel, pipeline, ZeRO, activation
checkpointing, nn.Graph), retold in our own words with ``import sbpflow as flow`` and "cpu", on virtual ranks.

On virtual ranks one process holds every rank, so ``to_local()`` gives the lowest rank's shard (what OneFlow's
rank 0 prints); ``tests/proc/test_oneflow_docs_proc.py`` runs the same habits on ``sbpflow launch -n 2``.
Each training example is held to the same model trained eagerly on one device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow as flow
from sbpflow import nn

B, S0 = flow.sbp.broadcast, flow.sbp.split(0)


def test_global_tensor_basics_as_the_cookbook_shows_them() -> None:
    placement = flow.placement(type="cpu", ranks=[0, 1])
    x = flow.randn(4, 5, placement=placement, sbp=flow.sbp.split(dim=0))
    assert tuple(x.to_local().shape) == (2, 5) and tuple(x.numpy().shape) == (4, 5)
    np.testing.assert_array_equal(x.to_local().numpy(), x.numpy()[:2])  # rank 0's shard
    local = flow.randn(2, 5)
    glob = local.to_global(placement=placement, sbp=flow.sbp.split(0), check_meta=False)
    assert tuple(glob.shape) == (4, 5)  # each rank's (2, 5) is a slice of the (4, 5) global tensor
    as_b = glob.to_global(placement=placement, sbp=flow.sbp.broadcast())
    np.testing.assert_array_equal(as_b.to_local().numpy(), glob.numpy())
    w = flow.randn(5, 8, placement=placement, sbp=flow.sbp.broadcast)
    y = flow.matmul(x, w)
    assert y.sbp == (S0,) and y.placement == placement
    np.testing.assert_allclose(y.numpy(), x.numpy() @ w.numpy(), rtol=1e-5)


def test_the_names_oneflow_scripts_reach_for() -> None:
    a = flow.Tensor([[1, 2], [3, 4]])
    assert a.dtype == flow.float32 and a.is_local and a.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert flow.device("cpu").type == "cpu" and flow.env.get_rank() == 0 and flow.env.get_world_size() == 1
    assert flow.cuda.is_available() == torch.cuda.is_available()
    assert flow.placement.all("cpu") == flow.placement("cpu", [0])  # one process: rank 0 alone
    assert flow.sbp.broadcast() == flow.sbp.broadcast and flow.sbp.partial_sum() == flow.sbp.partial_sum
    assert {flow.float16, flow.bfloat16, flow.int64, flow.int32, flow.bool} == {
        torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool}
    placement = flow.placement("cpu", [0, 1])
    tree = flow.utils.global_view.to_global({"x": a, "n": 3, "pair": (a, a)}, placement=placement, sbp=B)
    assert tree["n"] == 3 and tree["pair"][1].placement == placement and not tree["x"].is_local
    back = flow.utils.global_view.to_local(tree)
    assert back["x"].is_local and back["x"].tolist() == a.tolist()


def test_two_d_sbp_model_forward() -> None:
    placement = flow.placement("cpu", ranks=[[0, 1], [2, 3]])
    a = flow.Tensor([[1, 2], [3, 4]]).to_global(placement=placement, sbp=(B, S0))
    # each rank's (2, 2) is its shard: split along mesh axis 1 makes the global value (4, 2), rows repeated
    assert tuple(a.shape) == (4, 2) and tuple(a.to_local().shape) == (2, 2)
    assert a.tolist() == [[1.0, 2.0], [3.0, 4.0], [1.0, 2.0], [3.0, 4.0]]
    torch_model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    model.load_state_dict(torch_model.state_dict())
    model = model.to_global(placement=placement, sbp=(B, B))
    x = flow.randn(1, 2, 8)
    pred = model(x.to_global(placement=placement, sbp=(B, S0)))  # global (2, 2, 8): both axis-1 ranks' (1, 2, 8)
    local = torch.as_tensor(x.numpy())
    expected = torch_model(torch.cat([local, local])).detach().numpy()
    np.testing.assert_allclose(pred.numpy(), expected, rtol=1e-5, atol=1e-6)


def _torch_twin(model: nn.Module, layers: list[torch.nn.Module]) -> torch.nn.Sequential:
    twin = torch.nn.Sequential(*layers)
    twin.load_state_dict({k: torch.as_tensor(v.numpy()) for k, v in model.state_dict().items()})
    return twin


def _torch_losses(twin: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> list[float]:
    opt = torch.optim.SGD(twin.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(twin(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _batches(n: int, features: int = 16, classes: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, features, generator=g), torch.randint(0, classes, (8,), generator=g)) for _ in range(n)]


def test_data_parallel_training_with_global_tensors() -> None:
    placement = flow.placement("cpu", [0, 1])
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    twin = _torch_twin(model, [torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)])
    model = model.to_global(placement=placement, sbp=B)
    opt = flow.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for x, y in _batches(3):
        loss = loss_fn(model(flow.tensor(x).to_global(placement=placement, sbp=S0)),
                       flow.tensor(y).to_global(placement=placement, sbp=S0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(losses, _torch_losses(twin, _batches(3), 0.1), rtol=1e-5)


def test_ddp_wrapper_on_one_process_is_the_model_itself() -> None:
    model = nn.Sequential(nn.Linear(16, 4))
    twin = _torch_twin(model, [torch.nn.Linear(16, 4)])
    ddp = flow.nn.parallel.DistributedDataParallel(model)
    opt = flow.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for x, y in _batches(3):
        loss = nn.CrossEntropyLoss()(ddp(flow.tensor(x)), flow.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(losses, _torch_losses(twin, _batches(3), 0.1), rtol=1e-5)
    with pytest.raises(flow.SbpError, match="wraps a local model"):
        flow.nn.parallel.DistributedDataParallel(nn.Linear(2, 2).to_global(flow.placement("cpu", [0, 1])))


class _Graph(flow.nn.Graph):
    def __init__(self, model: nn.Module, opt: flow.optim.Optimizer) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(opt)

    def build(self, x: flow.Tensor, y: flow.Tensor) -> flow.Tensor:
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_as_the_cookbook_enables_it(stage: int) -> None:
    placement = flow.placement("cpu", ranks=[0, 1])
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    twin = _torch_twin(model, [torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)])
    model = model.to_global(placement=placement, sbp=B)
    graph = _Graph(model, flow.optim.SGD(model.parameters(), lr=0.1))
    graph.config.enable_zero(True, stage=stage)
    losses = [graph(flow.tensor(x).to_global(placement=placement, sbp=S0),
                    flow.tensor(y).to_global(placement=placement, sbp=S0)).item() for x, y in _batches(3)]
    np.testing.assert_allclose(losses, _torch_losses(twin, _batches(3), 0.1), rtol=1e-5)
    assert graph.config.zero_stage == stage


def test_graph_of_a_local_model_on_local_tensors_with_checkpointing() -> None:
    part1, part2 = nn.Sequential(nn.Linear(16, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    twin.load_state_dict({k: torch.as_tensor(v.numpy()) for k, v in nn.Sequential(*part1, *part2).state_dict().items()})
    device = "cuda" if flow.cuda.is_available() else "cpu"
    part1, part2 = part1.to(device), part2.to(device)
    model = nn.Sequential(part1, part2)

    class Checkpointed(_Graph):
        def __init__(self) -> None:
            super().__init__(model, flow.optim.SGD([{"params": part1.parameters()}, {"params": part2.parameters()}],
                                                   lr=0.1))
            part1.to(nn.graph.GraphModule).activation_checkpointing = True
            part2.to(nn.graph.GraphModule).activation_checkpointing = True

    graph = Checkpointed()
    losses = []
    for x, y in _batches(3):
        loss = graph(flow.tensor(x).to(device), flow.tensor(y).to(device))
        assert loss.is_local  # local inputs, local outputs
        losses.append(loss.item())
    np.testing.assert_allclose(losses, _torch_losses(twin, _batches(3), 0.1), rtol=1e-5)
    assert part1.config.activation_checkpointing and part1[0].weight.to_local().shape == (8, 16)


def test_amp_and_checkpointing_together_in_a_local_graph() -> None:
    """enable_amp(True) as OneFlow spells it (bf16 here); the checkpointed recomputation casts as its forward."""
    losses = {}
    for checkpointed in (False, True):
        flow.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        graph = _Graph(model, flow.optim.SGD(model.parameters(), lr=0.1))
        graph.config.enable_amp(True)
        model[0].to(nn.graph.GraphModule).activation_checkpointing = checkpointed
        losses[checkpointed] = [graph(flow.tensor(x), flow.tensor(y)).item() for x, y in _batches(3)]
        assert graph.config.amp_dtype == torch.bfloat16
    assert losses[True] == losses[False]


def test_pipeline_stages_set_as_oneflow_sets_them() -> None:
    p0, p1 = flow.placement("cpu", [0]), flow.placement("cpu", [1])
    stage0, stage1 = nn.Sequential(nn.Linear(16, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    twin.load_state_dict({k: torch.as_tensor(v.numpy())
                          for k, v in nn.Sequential(*stage0, *stage1).state_dict().items()})

    class TwoStages(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stage0, self.stage1 = stage0, stage1

        def forward(self, x: flow.Tensor) -> flow.Tensor:
            return self.stage1(self.stage0(x).to_global(placement=p1, sbp=[B]))

    model = TwoStages()

    class Pipeline(_Graph):
        def __init__(self) -> None:
            super().__init__(model, flow.optim.SGD(model.parameters(), lr=0.1))
            self.model.stage0.to(nn.graph.GraphModule).set_stage(stage_id=0, placement=p0)
            self.model.stage1.to(nn.graph.GraphModule).set_stage(stage_id=1, placement=p1)
            self.config.set_gradient_accumulation_steps(2)

        def build(self, x: flow.Tensor, y: flow.Tensor) -> flow.Tensor:
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    graph = Pipeline()
    assert stage0[0].weight.placement == p0 and stage1[0].weight.placement == p1
    assert stage1.config.stage_id == 1
    losses = [graph(flow.tensor(x).to_global(placement=p0, sbp=[B]), flow.tensor(y).to_global(placement=p1, sbp=[B]))
              for x, y in _batches(3)]  # the labels go where the last stage is, as OneFlow's pipeline example does
    ref = _torch_losses(twin, _batches(3), 0.1)
    # the graph returns each micro-batch's loss; their mean is the full batch's (equal halves of a mean loss)
    np.testing.assert_allclose([float(np.mean(loss.numpy())) for loss in losses], ref, rtol=1e-5)


def test_save_and_load_as_the_cookbook_does(tmp_path: object) -> None:
    """flow.save(model.state_dict(), path); state = flow.load(path); model.load_state_dict(state)."""
    placement = flow.placement("cpu", [0, 1])
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to_global(placement=placement, sbp=B)
    model(flow.randn(6, 4, placement=placement, sbp=S0))  # running statistics move off their start
    flow.save(model.state_dict(), f"{tmp_path}/model")
    state = flow.load(f"{tmp_path}/model")
    assert list(state) == list(model.state_dict()) and all(t.is_local for t in state.values())
    fresh = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    fresh.load_state_dict(state)
    for (name, ours), theirs in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=name)
    nested = {"layers": [flow.ones(2), {"step": 3}], "lr": 0.5}
    flow.save(nested, f"{tmp_path}/nested")
    back = flow.load(f"{tmp_path}/nested")
    assert back["layers"][0].tolist() == [1.0, 1.0] and back["layers"][1] == {"step": 3} and back["lr"] == 0.5
    torch.save({"w": torch.arange(3.0)}, f"{tmp_path}/plain.pt")  # a torch file loads the same way
    assert flow.load(f"{tmp_path}/plain.pt")["w"].tolist() == [0.0, 1.0, 2.0]
