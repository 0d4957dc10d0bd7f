"""A data-parallel MLP step compiled with nn.Graph; `sbpflow graph examples/graph_mlp.py` shows its plan."""

import sbpflow
from sbpflow import nn, sbp

placement = sbpflow.placement("cpu", [0, 1])
sbpflow.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64, placement=placement, sbp=sbp.broadcast), nn.ReLU(),
                      nn.Linear(64, 4, placement=placement, sbp=sbp.broadcast))
opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)


class TrainStep(nn.Graph):
    def __init__(self) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt, clip_grad_max_norm=1.0)

    def build(self, x: sbpflow.Tensor, y: sbpflow.Tensor) -> sbpflow.Tensor:
        loss = (self.model(x) - y).square().mean()
        loss.backward()
        return loss


step = TrainStep()
x = sbpflow.randn(64, 16, placement=placement, sbp=sbp.split(0))
y = sbpflow.randn(64, 4, placement=placement, sbp=sbp.split(0))
for i in range(5):
    sbpflow.print0(f"step {i}: loss {step(x, y).item():.6f}")
