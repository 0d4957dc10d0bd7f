"""Programs for micro-batch tests, shared by virtual ranks (tests/sim) and gloo processes (tests/proc).

A residual MLP whose forward moves data across stages as users write it (OneFlow's pipeline examples do the
same): the input goes to the second stage as a residual, ids for an embedding that lives there, and the labels
for the loss. ``train_graph`` runs it under ``nn.Graph`` with m micro-batches on a layout; ``train_torch`` is one
device's full-batch numbers in plain torch from the same initial weights (SGD, 2 steps).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import sbpflow
import sbpflow.nn.functional as F
from sbpflow import nn
from sbpflow import sbp as S

BATCH, FEATURES, HIDDEN, CLASSES, VOCAB = 8, 4, 6, 5, 10
LR, STEPS = 0.1, 2
LAYOUTS = {  # name -> (first stage's ranks, second stage's ranks)
    "one": ([0], [0]),
    "dp2": ([0, 1], [0, 1]),
    "pp2": ([0], [1]),
    "pp2xdp2": ([0, 1], [2, 3]),
}
# cross-entropy by mean and by sum; "padded": by mean over the kept targets, with rows of -100 (torch's
# ignore_index) spread unevenly over the micro-batches; a squared error by mean and by sum
LOSSES = ("mean", "sum", "padded", "mse_mean", "mse_sum")
PARAMS = ("l1.weight", "l1.bias", "emb.weight", "l2.weight", "l2.bias", "head.weight", "head.bias")


class ResidualMLP(nn.Module):
    """Stage 0: l1; stage 1: the residual of the input, an embedding of ids, l2 and the head."""

    def __init__(self, p0: sbpflow.Placement, p1: sbpflow.Placement, dropout: float = 0.0) -> None:
        super().__init__()
        self.p1, self.dropout = p1, dropout
        self.l1 = nn.Linear(FEATURES, FEATURES, placement=p0, sbp=S.broadcast)
        self.emb = nn.Embedding(VOCAB, FEATURES, placement=p1, sbp=S.broadcast)
        self.l2 = nn.Linear(FEATURES, HIDDEN, placement=p1, sbp=S.broadcast)
        self.head = nn.Linear(HIDDEN, CLASSES, placement=p1, sbp=S.broadcast)

    def forward(self, x: Any, ids: Any) -> Any:
        h = self.l1(x).relu().to_global(self.p1, S.split(0))
        h = h + x.to_global(self.p1, S.split(0)) + self.emb(ids.to_global(self.p1, S.split(0)))
        h = self.l2(h).relu()
        if self.dropout:
            h = F.dropout(h, self.dropout, training=True)
        return self.head(h)


def _loss(kind: str, logits: Any, y: Any, f: Any) -> Any:
    """The loss by its reduction over the batch: cross-entropy or a squared error, by mean or by sum."""
    if kind in ("mean", "sum", "padded"):
        return f.cross_entropy(logits, y, reduction="sum" if kind == "sum" else "mean")
    return f.mse_loss(logits, logits.detach() * 0.5, reduction=kind.split("_")[1])


def batches(padded: bool = False, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Inputs, ids and labels of each step; ``padded``: labels -100 on rows 0-2 of step 0 and rows 5 of step 1."""
    gen = torch.Generator().manual_seed(seed)
    out = [(torch.randn(BATCH, FEATURES, generator=gen), torch.randint(0, VOCAB, (BATCH,), generator=gen),
            torch.randint(0, CLASSES, (BATCH,), generator=gen)) for _ in range(STEPS)]
    if padded:
        out[0][2][:3] = -100
        out[1][2][5] = -100
    return out


def _placements(layout: str) -> tuple[sbpflow.Placement, sbpflow.Placement]:
    first, second = LAYOUTS[layout]
    return sbpflow.placement("cpu", first), sbpflow.placement("cpu", second)


def build_graph(layout: str, m: int, loss: str = "mean", average: bool = False, dropout: float = 0.0,
                executor: str = "actors", schedule: str = "1f1b", zero: int = 0) -> tuple[nn.Graph, ResidualMLP]:
    sbpflow.manual_seed(0)
    p0, p1 = _placements(layout)
    model = ResidualMLP(p0, p1, dropout)
    opt = sbpflow.optim.SGD(model.parameters(), lr=LR)

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(m, average=average)
            self.config.executor = executor
            self.config.set_pipeline_schedule(schedule)
            if zero:
                self.config.enable_zero(zero, min_shard_numel=1)

        def build(self, x: Any, ids: Any, y: Any) -> Any:
            logits = self.model(x, ids)
            labels = y.to_global(p1, S.split(0))
            rows = F.cross_entropy(logits, labels, reduction="none")  # per-row losses: joined by cat
            value = _loss(loss, logits, labels, F)
            value.backward()
            return value, rows, logits

    return Step(), model


def train_graph(layout: str, m: int, loss: str = "mean", average: bool = False, dropout: float = 0.0,
                executor: str = "actors", schedule: str = "1f1b", zero: int = 0,
                label_sbp: Any = None) -> tuple[list[list[np.ndarray]], dict[str, Any]]:
    """Per step the outputs (loss, per-row losses, logits), and the parameters after the steps; ``label_sbp``: the
    labels' SBP (default S(0), as the other inputs)."""
    graph, model = build_graph(layout, m, loss, average, dropout, executor, schedule, zero)
    p0 = _placements(layout)[0]
    outs = []
    for x, ids, y in batches(loss == "padded"):
        args = [sbpflow.tensor(t, placement=p0, sbp=S.split(0)) for t in (x, ids)]
        args.append(sbpflow.tensor(y, placement=p0, sbp=S.split(0) if label_sbp is None else label_sbp))
        outs.append([o.numpy() for o in graph(*args)])
    return outs, parameter_values(model)


def parameter_values(model: ResidualMLP) -> dict[str, np.ndarray]:
    everywhere = sbpflow.placement("cpu", sorted({r for p in model.parameters() for r in p.placement.flat_ranks}))
    return {name: p.detach().to_global(everywhere, S.broadcast).numpy() for name, p in model.named_parameters()}


def initial_values() -> dict[str, np.ndarray]:
    """The initial weights every layout starts from (initialization is placement-independent)."""
    sbpflow.manual_seed(0)
    p = sbpflow.placement("cpu", [0])
    return {name: v.detach().numpy() for name, v in ResidualMLP(p, p).named_parameters()}


def train_torch(loss: str = "mean", scale: float = 1.0) -> tuple[list[list[np.ndarray]], dict[str, np.ndarray]]:
    """One device, full batch, plain torch; ``scale`` multiplies the loss before backward and in the returned
    value (OneFlow's averaged accumulation of a sum loss steps as ``loss / m``)."""
    w = {name: torch.tensor(v, requires_grad=True) for name, v in initial_values().items()}
    tf = torch.nn.functional
    outs = []
    for x, ids, y in batches(loss == "padded"):
        h = tf.relu(x @ w["l1.weight"].T + w["l1.bias"])
        h = h + x + w["emb.weight"][ids]
        h = tf.relu(h @ w["l2.weight"].T + w["l2.bias"])
        logits = h @ w["head.weight"].T + w["head.bias"]
        rows = tf.cross_entropy(logits, y, reduction="none")
        value = _loss(loss, logits, y, tf) * scale
        for t in w.values():
            t.grad = None
        value.backward()
        with torch.no_grad():
            for t in w.values():
                t -= LR * t.grad  # type: ignore[operator]
        outs.append([value.detach().numpy(), rows.detach().numpy(), logits.detach().numpy()])
    return outs, {name: t.detach().numpy() for name, t in w.items()}


def assert_matches(got: Any, want: Any, rtol: float = 1e-4, atol: float = 1e-5, what: str = "") -> None:
    """Every output of every step and every parameter after them."""
    for step, (outs, wants) in enumerate(zip(got[0], want[0], strict=True)):
        for k, (o, w) in enumerate(zip(outs, wants, strict=True)):
            np.testing.assert_allclose(o, w, rtol=rtol, atol=atol, err_msg=f"{what} step {step} output {k}")
    for name in PARAMS:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=rtol, atol=atol, err_msg=f"{what} {name}")
