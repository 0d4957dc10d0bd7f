"""Random training programs and random layouts: nn.Graph on the layout against one device in eager mode.

A program is a chain of small blocks over a hidden state of width ``D`` (linear + activation, a residual, a norm,
two branches that rejoin, a layer applied twice: tied weights), an optional embedding of ids added to the input,
a head, and a loss by sum or by mean (cross-entropy or squared error), returned with the logits. A layout puts it
on 1-4 virtual ranks: data parallel, a tensor axis whose Linear weights take random SBPs, a 2x2 mesh, or two
pipeline stages on disjoint placements, where the forward moves the hidden state and the labels with
``to_global`` as users write it. Micro-batches 1-4, schedules, ZeRO 0-3, fused segments and both executors are
drawn too, and the model may change between the two steps (a weight frozen, eval()).

The oracle is the same program on one rank in eager mode (initialisation is placement-independent, so both start
from the same weights): every output of both steps and every parameter after them, rtol 1e-4.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import sbpflow
import sbpflow.nn.functional as F
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.graph.pipeline import PipelineWarning
from sbpflow.nn.graph import GraphRecompileWarning

BLOCKS = ("linear_relu", "linear_tanh", "residual", "norm", "branch", "twice", "gelu")
LOSSES = ("ce_mean", "ce_sum", "mse_mean", "mse_sum")
LAYOUTS = ("one", "dp2", "dp4", "tp2", "dp2xtp2", "pp2", "pp2xdp2")
LR, STEPS, VOCAB = 0.1, 2, 7


@dataclass(frozen=True)
class Program:
    width: int
    classes: int
    batch: int
    blocks: tuple[str, ...]
    embedding: bool
    loss: str
    layout: str
    micro_batches: int
    weight_sbps: tuple[int, ...]  # per Linear, on a tensor axis: 0 B, 1 S(0), 2 S(1)
    labels_on_last: bool  # pipeline: labels given on the last stage, else moved there in build()
    schedule: str
    zero: int
    fused: bool
    executor: str
    change: str  # between the steps: "none", "freeze" (a weight's requires_grad_(False)), "eval"

    def __str__(self) -> str:
        return (f"{'+'.join(self.blocks)}{' +emb' if self.embedding else ''} -> {self.loss}; D={self.width} "
                f"C={self.classes} B={self.batch}; {self.layout} m={self.micro_batches} {self.schedule} "
                f"zero{self.zero} {'fused' if self.fused else 'unfused'} {self.executor}; sbps {self.weight_sbps} "
                f"labels {'last' if self.labels_on_last else 'first'}; change {self.change}")


def draw(rng: random.Random) -> Program:
    """One program and layout; every choice from ``rng``."""
    layout = rng.choice(LAYOUTS)
    dp = {"dp2": 2, "dp4": 4, "dp2xtp2": 2, "pp2xdp2": 2}.get(layout, 1)
    blocks = tuple(rng.choice(BLOCKS) for _ in range(rng.randint(1, 4)))
    if layout.startswith("pp") and len(blocks) < 2:
        blocks = blocks + (rng.choice(BLOCKS),)
    m = rng.choice((1, 2, 4))
    batch = dp * m * rng.choice((1, 2))
    linears = sum(2 if b == "branch" else 1 for b in blocks if b not in ("norm", "gelu")) + 1
    return Program(
        width=rng.choice((4, 6, 8)), classes=rng.choice((3, 5)), batch=batch, blocks=blocks,
        embedding=rng.random() < 0.3, loss=rng.choice(LOSSES), layout=layout, micro_batches=m,
        weight_sbps=tuple(rng.randrange(3) for _ in range(linears)), labels_on_last=rng.random() < 0.5,
        schedule=rng.choice(("1f1b", "gpipe")), zero=rng.choice((0, 1, 2, 3)) if dp > 1 and not layout.startswith("pp")
        else 0, fused=rng.random() < 0.7, executor=rng.choice(("actors", "actors", "inorder")),
        change=rng.choice(("none", "none", "freeze", "eval")))


# -- the model --------------------------------------------------------------------------------------------------


def _placements(prog: Program) -> tuple[Any, Any, Any]:
    """(first stage's placement, last stage's, the SBP of a batch-split activation on them)."""
    if prog.layout == "one":
        p = sbpflow.placement("cpu", [0])
        return p, p, (S.split(0),)
    if prog.layout in ("dp2", "dp4"):
        p = sbpflow.placement("cpu", list(range(2 if prog.layout == "dp2" else 4)))
        return p, p, (S.split(0),)
    if prog.layout == "tp2":
        p = sbpflow.placement("cpu", [0, 1])
        return p, p, (S.broadcast,)
    if prog.layout == "dp2xtp2":
        p = sbpflow.placement("cpu", [[0, 1], [2, 3]])
        return p, p, (S.split(0), S.broadcast)
    if prog.layout == "pp2":
        return sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1]), (S.split(0),)
    return sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [2, 3]), (S.split(0),)


def _weight_sbp(prog: Program, k: int, placement: Any) -> Any:
    """Linear k's SBP: broadcast, except on a tensor axis, where the program drew B, S(0) or S(1)."""
    if prog.layout not in ("tp2", "dp2xtp2"):
        return (S.broadcast,) * placement.ndim
    pick = prog.weight_sbps[k % len(prog.weight_sbps)]
    tp = (S.broadcast, S.split(0), S.split(1))[pick]
    bias = S.split(0) if pick == 1 else S.broadcast  # a column-split weight (rows are outputs) splits its bias too
    nd = (lambda s: (S.broadcast, s)) if placement.ndim == 2 else (lambda s: (s,))
    return {"weight": nd(tp), "bias": nd(bias)}


class Net(nn.Module):
    """The program's blocks; with two stages the first half of the blocks is on the first placement."""

    def __init__(self, prog: Program, p0: Any, p1: Any, act: Any) -> None:
        super().__init__()
        self.prog, self.p1, self.act = prog, p1, act
        d, n, count = prog.width, len(prog.blocks), 0
        self.cut = n // 2 if p0 != p1 else n
        layers: list[nn.Module] = []
        for i, kind in enumerate(prog.blocks):
            p = p0 if i < self.cut else p1
            if kind == "norm":
                layers.append(nn.LayerNorm(d, placement=p, sbp=(S.broadcast,) * p.ndim))
            elif kind == "gelu":
                layers.append(nn.Identity())
            else:
                width = 2 if kind == "branch" else 1
                mods = [nn.Linear(d, d, placement=p, sbp=_weight_sbp(prog, count + j, p)) for j in range(width)]
                count += width
                layers.append(mods[0] if width == 1 else nn.ModuleList(mods))
        self.layers = nn.ModuleList(layers)
        self.emb = nn.Embedding(VOCAB, d, placement=p0, sbp=(S.broadcast,) * p0.ndim) if prog.embedding else None
        self.head = nn.Linear(d, prog.classes, placement=p1, sbp=_weight_sbp(prog, count, p1))
        self.drop = nn.Dropout(0.0)

    def forward(self, x: Any, ids: Any) -> Any:
        h = x if self.emb is None else x + self.emb(ids)
        for i, (kind, layer) in enumerate(zip(self.prog.blocks, self.layers, strict=True)):
            if i == self.cut and self.cut < len(self.prog.blocks):
                h = h.to_global(self.p1, self.act)
            h = _block(kind, layer, h)
        if self.cut == len(self.prog.blocks) and self.p1 != self.layers_placement():
            h = h.to_global(self.p1, self.act)
        return self.head(self.drop(h))

    def layers_placement(self) -> Any:
        return self.head.weight.placement


def _block(kind: str, layer: Any, h: Any) -> Any:
    if kind == "linear_relu":
        return layer(h).relu()
    if kind == "linear_tanh":
        return layer(h).tanh()
    if kind == "residual":
        return h + layer(h)
    if kind == "norm":
        return layer(h)
    if kind == "gelu":
        return F.gelu(h)
    if kind == "branch":
        return layer[0](h).relu() + layer[1](h)
    return layer(layer(h).relu())  # "twice": one weight used by two layers


def loss_of(prog: Program, logits: Any, y: Any) -> Any:
    kind, reduction = prog.loss.split("_")
    if kind == "ce":
        return F.cross_entropy(logits, y, reduction=reduction)
    return F.mse_loss(logits, (logits.detach() * 0.5).tanh(), reduction=reduction)


# -- running ----------------------------------------------------------------------------------------------------


def data(prog: Program, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(prog.batch, prog.width, generator=gen), torch.randint(0, VOCAB, (prog.batch,), generator=gen),
             torch.randint(0, prog.classes, (prog.batch,), generator=gen)) for _ in range(STEPS)]


def _change(prog: Program, model: Net) -> None:
    if prog.change == "freeze":
        model.head.weight.requires_grad_(False)
    elif prog.change == "eval":
        model.eval()


def run_eager(prog: Program, seed: int) -> tuple[list[list[np.ndarray]], dict[str, np.ndarray]]:
    """The oracle: one rank, eager, full batch."""
    sbpflow.manual_seed(0)
    p = sbpflow.placement("cpu", [0])
    one = Program(**{**prog.__dict__, "layout": "one"})
    model = Net(one, p, p, (S.split(0),))
    opt = sbpflow.optim.SGD(model.parameters(), lr=LR)
    outs = []
    for step, (x, ids, y) in enumerate(data(prog, seed)):
        if step == 1:
            _change(prog, model)
        args = [sbpflow.tensor(t, placement=p, sbp=S.split(0)) for t in (x, ids, y)]
        opt.zero_grad()
        logits = model(args[0], args[1])
        loss = loss_of(prog, logits, args[2])
        loss.backward()
        opt.step()
        outs.append([loss.numpy(), logits.numpy()])
    return outs, _values(model)


def run_graph(prog: Program, seed: int) -> tuple[list[list[np.ndarray]], dict[str, np.ndarray]]:
    """The program compiled by nn.Graph on its layout."""
    sbpflow.manual_seed(0)
    p0, p1, act = _placements(prog)
    model = Net(prog, p0, p1, act)
    opt = sbpflow.optim.SGD(model.parameters(), lr=LR)

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(prog.micro_batches)
            self.config.set_executor(prog.executor)
            self.config.enable_fused_segments(prog.fused)
            if prog.layout.startswith("pp"):
                self.config.set_pipeline_schedule(prog.schedule)
            if prog.zero:
                self.config.enable_zero(prog.zero, min_shard_numel=1)

        def build(self, x: Any, ids: Any, y: Any) -> Any:
            logits = self.model(x, ids)
            loss = loss_of(prog, logits, y.to_global(p1, act))
            loss.backward()
            return loss, logits

    step_fn, outs = Step(), []
    label_placement = p1 if prog.labels_on_last else p0
    for step, (x, ids, y) in enumerate(data(prog, seed)):
        if step == 1:
            _change(prog, model)
        args = [sbpflow.tensor(t, placement=p0, sbp=act) for t in (x, ids)]
        args.append(sbpflow.tensor(y, placement=label_placement, sbp=act))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outs.append([o.numpy() for o in step_fn(*args)])
        recompiled = any(issubclass(w.category, GraphRecompileWarning) for w in seen)
        # the model changed: the compiled step must see it (and say so); else it must not compile again
        assert recompiled == (step == 1 and prog.change != "none"), f"{prog}: step {step} recompiled={recompiled}"
        for w in seen:  # a pipeline of fewer micro-batches than stages is warned of, and allowed
            if not issubclass(w.category, (GraphRecompileWarning, PipelineWarning)):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return outs, _values(model)


def _values(model: Net) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy() for name, p in model.named_parameters()}


def check(prog: Program, seed: int = 1) -> None:
    """The graph's outputs and parameters equal the eager oracle's (rtol 1e-4, atol 1e-5)."""
    want, got = run_eager(prog, seed), run_graph(prog, seed)
    for step, (outs, wants) in enumerate(zip(got[0], want[0], strict=True)):
        for k, (o, w) in enumerate(zip(outs, wants, strict=True)):
            np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-5, err_msg=f"{prog}: step {step} output {k}")
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-4, atol=1e-5, err_msg=f"{prog}: {name}")
