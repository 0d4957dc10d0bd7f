"""Random training programs and random layouts: nn.Graph on the layout against one device in eager mode.

A program is a chain of blocks over a hidden state of shape (batch, width): Linear (+ ReLU or tanh), a residual,
LayerNorm, RMSNorm, one-head attention, a Conv2d, GeLU, tanh, reductions over the features (centering, a sum as a
gate, a softmax gate), two branches that rejoin, one Linear applied twice, a weight tied to the first Linear block's
(maybe on another stage), an embedding of ids, the input read again on a later stage, and a transformer block
over two tokens split on the sequence, S(1) (sequence parallel). An optional embedding of
ids is added to the input; the head is a Linear or the embedding's weight (tied). The loss is a cross-entropy, a
squared error or both, by sum or by mean, returned with the logits and, when drawn, the per-row losses.

A layout puts it on 1-8 virtual ranks: data parallel (2, 3 or 4 ranks: uneven splits), a tensor axis, a 2x2 mesh,
or a pipeline of 2 or 3 disjoint placements (2x2 meshes too), visited twice by the interleaved schedule; the forward
moves the hidden state, the ids, the input and the labels with ``to_global`` as users write it. Every parameter's SBP
is drawn per mesh axis (B, S(0), S(1)): the selection must box away from the bad ones. Also drawn: micro-batches 1-4,
the pipeline schedule, ZeRO 0-3, SGD (with momentum), Adam or AdamW, bf16 amp, activation checkpointing of blocks,
fused segments, both executors, and a change of the model between the two steps (a weight frozen, one frozen at
the first step and trained from the second, eval()), which must recompile with a warning.

The oracle is the same program on one rank in eager mode (initialisation is placement-independent, so both start
from the same weights): every output of both steps, every parameter and every optimizer state after them, rtol
1e-4 (bf16 amp: see :class:`Oracle`).
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

import sbpflow
import sbpflow.nn.functional as F
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.errors import SbpflowError
from sbpflow.graph.pipeline import PipelineWarning
from sbpflow.nn.graph import GraphRecompileWarning

BLOCKS = ("linear", "linear_relu", "linear_tanh", "residual", "layernorm", "rmsnorm", "branch", "twice", "gelu",
          "tanh", "center", "softmax_gate", "sum_scale", "attention", "conv", "embed", "input_residual", "tied",
          "sequence")
LOSSES = ("ce_mean", "ce_sum", "mse_mean", "mse_sum", "ce_mean+mse_sum")
# layout -> the ranks of each pipeline placement; a layout in TENSOR_AXIS holds the batch broadcast over its last axis
LAYOUTS: dict[str, tuple[Any, ...]] = {
    "one": ([0],),
    "dp2": ([0, 1],),
    "dp3": ([0, 1, 2],),  # uneven splits
    "dp4": ([0, 1, 2, 3],),
    "tp2": ([0, 1],),
    "dp2xtp2": ([[0, 1], [2, 3]],),
    "pp2": ([0], [1]),
    "pp3": ([0], [1], [2]),
    "pp2xdp2": ([0, 1], [2, 3]),
    "pp2_uneven": ([0, 1, 2], [3]),  # stages of different data-parallel sizes
    "pp2x2x2": ([[0, 1], [2, 3]], [[4, 5], [6, 7]]),  # disjoint 2-D meshes
}
TENSOR_AXIS = ("tp2",)  # the batch is broadcast on these layouts (dp2xtp2 splits it on axis 0 only)
SCHEDULES = ("1f1b", "gpipe", "zero_bubble", "interleaved_1f1b")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
CHANGES = ("none", "freeze", "unfreeze", "eval")
PARAMETERED = set(BLOCKS) - {"gelu", "tanh", "center", "sum_scale", "input_residual"}
INTERLEAVED_VISITS = 2  # interleaved_1f1b: the forward visits the placements this many times
LR, STEPS, VOCAB = 0.1, 2, 7
SBP_CODES = (S.broadcast, S.split(0), S.split(1))  # a parameter's SBP per mesh axis, as drawn: 0 B, 1 S(0), 2 S(1)


@dataclass(frozen=True)
class Program:
    """One random training program and the layout it runs on (plain data: its repr rebuilds it)."""

    width: int  # features of the hidden state: 4, 8 or 12 (attention: 2 tokens of width/2 features)
    classes: int  # of the head; VOCAB when the head is the embedding's weight
    batch: int
    blocks: tuple[str, ...]
    embedding: bool  # an embedding of ids added to the input
    loss: str
    layout: str
    micro_batches: int
    weight_sbps: tuple[tuple[int, ...], ...]  # per block, then the head: each mesh axis's SBP code (SBP_CODES)
    labels_on_last: bool  # pipeline: labels given on the last stage, else moved there in build()
    schedule: str
    zero: int
    fused: bool
    executor: str
    change: str  # between the steps: "none", "freeze", "unfreeze" (frozen at step 0 only), "eval"
    stages: tuple[int, ...] = ()  # each block's visit of the pipeline's placements (non-decreasing); () all on 0
    head: str = "linear"  # or "tied": the logits are h @ emb.weight.T
    optimizer: str = "sgd"
    amp: bool = False  # bf16 autocast
    checkpoint: tuple[int, ...] = ()  # blocks traced as activation-checkpointed modules
    rows: bool = False  # the per-row cross-entropy is an output too
    # ReLU blocks use ReLU; without kinks, GeLU (drawn under amp: a bf16 rounding, of a tensor-parallel partial sum
    # or of weights a step moved, takes a pre-activation near 0 across the kink, and a gradient by a whole term)
    kinks: bool = True

    def __str__(self) -> str:
        return repr(self)


def draw(rng: random.Random, max_ranks: int = 8) -> Program:
    """One program and layout; every choice from ``rng``, on layouts of at most ``max_ranks`` ranks."""
    layout = rng.choice([name for name, ps in LAYOUTS.items() if max(_flat(ps)) < max_ranks])
    placements = LAYOUTS[layout]
    schedule = rng.choice(SCHEDULES) if len(placements) > 1 else "1f1b"
    visits = len(placements) * (INTERLEAVED_VISITS if schedule == "interleaved_1f1b" else 1)
    n_blocks = max(rng.randint(1, 5), visits)
    # every visit gets a block, in order; the others fall where they are drawn
    stages = tuple(sorted(list(range(visits)) + [rng.randrange(visits) for _ in range(n_blocks - visits)]))
    blocks = tuple(rng.choice(BLOCKS) for _ in range(n_blocks))
    ndim = 2 if isinstance(placements[0][0], list) else 1
    m = rng.choice([k for k in (1, 2, 3, 4) if schedule != "interleaved_1f1b" or k % len(placements) == 0])
    # every rank's rows of the batch divide by m (the runtime refuses other batches by name)
    batch = rng.choice([b for b in range(4, 17) if (b <= 8 or m > 1) and all(
        rows % m == 0 for ranks in placements for rows in _rows_per_rank(b, ranks, layout))])
    head = rng.choice(("linear", "linear", "tied"))
    change = rng.choice(("none", "none") + CHANGES[1:])
    if change in ("freeze", "unfreeze") and head == "tied" and not set(blocks) & PARAMETERED:
        change = "eval"  # the embedding is the only parameter: frozen, the loss needs no backward (eager refuses)
    amp = rng.random() < 0.2
    return Program(
        width=rng.choice((4, 8, 12)), classes=VOCAB if head == "tied" else rng.choice((3, 5)), batch=batch,
        blocks=blocks, embedding=rng.random() < 0.3, loss=rng.choice(LOSSES), layout=layout, micro_batches=m,
        weight_sbps=tuple(tuple(rng.randrange(3) for _ in range(ndim)) for _ in range(n_blocks + 1)),
        labels_on_last=rng.random() < 0.5, schedule=schedule,
        zero=rng.choice((0, 1, 2, 3)) if any(len(_flat(r)) > 1 for r in placements) else 0,
        fused=rng.random() < 0.7, executor=rng.choice(("actors", "actors", "inorder")),
        change=change, stages=stages, head=head,
        optimizer=rng.choice(OPTIMIZERS), amp=amp, kinks=not amp,
        checkpoint=tuple(i for i in range(n_blocks) if rng.random() < 0.25), rows=rng.random() < 0.3)


def _rows_per_rank(batch: int, ranks: Any, layout: str) -> list[int]:
    """The rows each rank of the data axis holds of S(0) (the first ranks one more when uneven)."""
    if layout in TENSOR_AXIS:
        return [batch]
    n = len(ranks)
    return [batch // n + (1 if r < batch % n else 0) for r in range(n)]


def _flat(ranks: Any) -> list[int]:
    return [r for row in ranks for r in _flat(row)] if isinstance(ranks, (list, tuple)) else [ranks]


# -- the model --------------------------------------------------------------------------------------------------


def placements_of(prog: Program, one_device: bool = False) -> list[Any]:
    """The placement of each visit of the forward (interleaved: the placements again, in order)."""
    visits = 1 + max(prog.stages, default=0)
    if one_device:
        return [sbpflow.placement("cpu", [0])] * visits
    ranks = LAYOUTS[prog.layout]
    return [sbpflow.placement("cpu", ranks[v % len(ranks)]) for v in range(visits)]


def data_sbp(prog: Program, placement: Any, broadcast: bool = False) -> Any:
    """Activations and inputs: split on the batch over the first (data) axis, broadcast over a second axis."""
    first = S.broadcast if broadcast or prog.layout in TENSOR_AXIS else S.split(0)
    return (first, S.broadcast) if placement.ndim > 1 else (first,)


def _param_sbp(prog: Program, k: int, shape: tuple[int, ...], placement: Any) -> Any:
    """Parameter holder k's drawn SBP per mesh axis; a split of a dim the parameter lacks is B."""
    codes = prog.weight_sbps[k % len(prog.weight_sbps)]
    sbps = [SBP_CODES[c] if c == 0 or c - 1 < len(shape) else S.broadcast for c in codes]
    return tuple(sbps[: placement.ndim]) + (S.broadcast,) * (placement.ndim - len(sbps))


def _weight_and_bias(prog: Program, k: int, shape: tuple[int, ...], placement: Any) -> Any:
    """A layer's SBPs; a column-split weight (rows are outputs) splits its bias too."""
    return {"weight": _param_sbp(prog, k, shape, placement), "bias": _param_sbp(prog, k, shape[:1], placement)}


class Net(nn.Module):
    """The program's blocks over a (batch, width) hidden state; block i runs on ``placements[stages[i]]``."""

    def __init__(self, prog: Program, placements: list[Any]) -> None:
        super().__init__()
        self.prog, self.placements = prog, placements
        w, p0 = prog.width, placements[0]
        self.stage_of = prog.stages or (0,) * len(prog.blocks)
        self.layers = nn.ModuleList([self._layer(i, kind, placements[self.stage_of[i]])
                                     for i, kind in enumerate(prog.blocks)])
        self.tie_source = next((i for i, kind in enumerate(prog.blocks) if hasattr(self.layers[i], "lin")), None)
        if prog.embedding or prog.head == "tied":
            self.emb = nn.Embedding(VOCAB, w, placement=p0, sbp=(S.broadcast,) * p0.ndim)
        last = placements[self.stage_of[-1]]
        if prog.head == "linear":
            self.head = nn.Linear(w, prog.classes, placement=last,
                                  sbp=_weight_and_bias(prog, len(prog.blocks), (prog.classes, w), last))
        self.drop = nn.Dropout(0.0)

    def _layer(self, i: int, kind: str, p: Any) -> nn.Module:
        prog, w, layer = self.prog, self.prog.width, nn.Module()
        if kind in ("linear", "linear_relu", "linear_tanh", "residual", "twice", "softmax_gate", "attention", "tied"):
            layer.lin = nn.Linear(w, w, placement=p, sbp=_weight_and_bias(prog, i, (w, w), p))
        elif kind == "branch":
            layer.a = nn.Linear(w, w, placement=p, sbp=_weight_and_bias(prog, i, (w, w), p))
            layer.b = nn.Linear(w, w, bias=False, placement=p, sbp=(S.broadcast,) * p.ndim)
        elif kind == "layernorm":
            layer.norm = nn.LayerNorm(w, placement=p, sbp=_weight_and_bias(prog, i, (w,), p))
        elif kind == "rmsnorm":
            layer.norm = nn.RMSNorm(w, eps=1e-5, placement=p, sbp=_param_sbp(prog, i, (w,), p))
        elif kind == "conv":
            layer.conv = nn.Conv2d(1, 2, (1, 3), padding=(0, 1), placement=p,
                                   sbp=_weight_and_bias(prog, i, (2, 1, 1, 3), p))
        elif kind == "embed":
            layer.emb = nn.Embedding(VOCAB, w, placement=p, sbp=_param_sbp(prog, i, (VOCAB, w), p))
        elif kind == "sequence":  # over (B, 2 tokens, w)
            layer.seq_norm = nn.LayerNorm(w, placement=p, sbp=_weight_and_bias(prog, i, (w,), p))
            layer.seq_lin = nn.Linear(w, w, placement=p, sbp=_weight_and_bias(prog, i, (w, w), p))
        return layer

    def forward(self, x: Any, ids: Any) -> Any:
        stage, h = 0, x if not self.prog.embedding else x + self.emb(ids)
        for i, kind in enumerate(self.prog.blocks):
            if self.stage_of[i] != stage:
                stage = self.stage_of[i]
                h = h.to_global(self.placements[stage], data_sbp(self.prog, self.placements[stage]))
            h = self._block(i, kind, h, x, ids)
        return self.logits(self.drop(h))

    def _block(self, i: int, kind: str, h: Any, x: Any, ids: Any) -> Any:
        layer, p, w = self.layers[i], self.placements[self.stage_of[i]], self.prog.width
        if kind in ("linear", "linear_relu", "linear_tanh"):
            out = layer.lin(h)
            return self._relu(out) if kind == "linear_relu" else out.tanh() if kind == "linear_tanh" else out
        if kind == "residual":
            return h + self._relu(layer.lin(h))
        if kind in ("layernorm", "rmsnorm"):
            return layer.norm(h)
        if kind == "branch":  # two branches that rejoin
            return self._relu(layer.a(h)) + layer.b(h).tanh()
        if kind == "twice":  # one weight used by two layers
            return layer.lin(self._relu(layer.lin(h)))
        if kind == "gelu":
            return F.gelu(h)
        if kind == "tanh":
            return h.tanh() * 2.0
        if kind == "center":  # a reduction over the features
            return h - h.mean(-1, keepdim=True)
        if kind == "softmax_gate":
            return h * F.softmax(layer.lin(h), -1)
        if kind == "sum_scale":  # a reduction over the features, as a gate
            return h * F.sigmoid(h.sum(-1, keepdim=True))
        if kind == "attention":  # one head over 2 tokens of w/2 features: (B, 1, 2, w/2), global
            # (one token would make q's gradient exactly 0 in theory, rounding noise in practice)
            q = layer.lin(h).reshape(h.shape[0], 1, 2, w // 2)
            kv = h.reshape(h.shape[0], 1, 2, w // 2)
            return h + F.scaled_dot_product_attention(q, kv, kv).reshape(h.shape[0], w)
        if kind == "conv":  # (B, 1, 1, w) -> (B, 2, 1, w): two channels summed back
            return layer.conv(h.reshape(h.shape[0], 1, 1, w)).sum(1).reshape(h.shape[0], w)
        if kind == "embed":  # ids read on this block's stage
            return h + layer.emb(ids.to_global(p, data_sbp(self.prog, p)))
        if kind == "input_residual":  # the input, read again on this block's stage
            return h + x.to_global(p, data_sbp(self.prog, p))
        if kind == "sequence":  # a transformer block under sequence parallel: tokens split S(1)
            return self._sequence(layer, h, p)
        # "tied": the first Linear block's weight (maybe on another stage), this block's bias
        source = self.layers[self.tie_source if self.tie_source is not None else i].lin.weight
        weight = source if source.placement == p else source.to_global(p, data_sbp(self.prog, p, broadcast=True))
        return F.linear(h, weight, layer.lin.bias)

    def _relu(self, t: Any) -> Any:
        """ReLU, or GeLU in a program without kinks (see Program.kinks)."""
        return t.relu() if self.prog.kinks else F.gelu(t)

    def _sequence(self, layer: nn.Module, h: Any, p: Any) -> Any:
        """Two tokens of h's width, (B, T=2, w) global, split on the tokens over the last mesh axis (2-D: the batch
        on the first): the token-wise norm and MLP run on each rank's tokens, attention reads them all, and the sum
        over the tokens is a partial sum. (w/2 channels would make the norm's over 2 values: ill-conditioned.)"""
        batch, w = h.shape[0], self.prog.width
        seq_sbp = (S.split(0), S.split(1)) if p.ndim > 1 else (S.split(1),)
        t = F.stack([h, h.tanh()], dim=1).to_global(p, seq_sbp)  # (B, T, w)
        t = t + F.gelu(layer.seq_lin(layer.seq_norm(t)))
        q = t.reshape(batch, 1, 2, w)  # (B, 1 head, T, w)
        t = t + F.scaled_dot_product_attention(q, q, q).reshape(batch, 2, w)
        return t.sum(1) * 0.5  # (B, w)

    def logits(self, h: Any) -> Any:
        if self.prog.head == "linear":
            return self.head(h)
        p, weight = h.placement, self.emb.weight
        return F.linear(h, weight if weight.placement == p else weight.to_global(p, data_sbp(self.prog, p, True)))


def loss_of(prog: Program, logits: Any, y: Any) -> Any:
    parts = []
    for term in prog.loss.split("+"):
        kind, reduction = term.split("_")
        if kind == "ce":
            parts.append(F.cross_entropy(logits, y, reduction=reduction))
        else:
            # tanh bounds the gradient: a squared error of raw logits grows with them, and two steps took
            # weights to 240, where float32 rounding of the first step grows past any tolerance by the second
            parts.append(F.mse_loss(logits.tanh(), (logits.detach() * 0.5).tanh(), reduction=reduction))
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def outputs_of(prog: Program, logits: Any, y: Any) -> list[Any]:
    """(loss, logits) and, when drawn, the per-row cross-entropy (joined by cat over the micro-batches)."""
    rows = [F.cross_entropy(logits, y, reduction="none")] if prog.rows else []
    return [loss_of(prog, logits, y), logits, *rows]


# -- running ----------------------------------------------------------------------------------------------------


def data(prog: Program, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(prog.batch, prog.width, generator=gen), torch.randint(0, VOCAB, (prog.batch,), generator=gen),
             torch.randint(0, prog.classes, (prog.batch,), generator=gen)) for _ in range(STEPS)]


def _optimizer(prog: Program, params: Any) -> Any:
    # a sum loss's gradient is batch times a mean's: lr / batch keeps its two steps from diverging (a loss of
    # 900 then 3e6, where float32 rounding of the first step grows past any tolerance by the second)
    lr = LR / prog.batch if "sum" in prog.loss else LR
    if prog.optimizer == "sgd":
        return sbpflow.optim.SGD(params, lr=lr)
    if prog.optimizer == "sgd_momentum":
        return sbpflow.optim.SGD(params, lr=lr, momentum=0.9, dampening=0.1)
    # Adam moves a weight by lr * g / (|g| + eps) (about), whose slope in g is at most lr / eps: a gradient's
    # rounding (summed in another order over micro-batches and ranks) grows by that much. lr / eps = 1 keeps it
    # within the oracle's tolerance; a wrong step count or moment still moves weights by about lr = 0.01. Under
    # bf16 amp a gradient is off by ~1 % of its scale, which lr / eps = 1 passed whole into a small weight (the
    # sign of a near-0 gradient flipped: 0.0125 on a bias of 0.1, and those programs pass in fp32): 0.1 there.
    cls = sbpflow.optim.Adam if prog.optimizer == "adam" else sbpflow.optim.AdamW
    return cls(params, lr=0.01, eps=1e-1 if prog.amp else 1e-2)


def _frozen(model: Net) -> Any:
    """The weight a "freeze"/"unfreeze" program freezes: the middle one."""
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    return weights[len(weights) // 2]


def _start(prog: Program, model: Net) -> None:
    if prog.change == "unfreeze":
        _frozen(model).requires_grad_(False)


def _change(prog: Program, model: Net) -> None:
    """What the program does to the model between its steps (the compiled step must follow it)."""
    if prog.change == "freeze":
        _frozen(model).requires_grad_(False)
    elif prog.change == "unfreeze":
        _frozen(model).requires_grad_(True)
    elif prog.change == "eval":
        model.eval()


def _numpy(t: Any) -> np.ndarray:
    t = t.detach()
    if t.is_global and len(t.placement.flat_ranks) > 1:  # every rank's value, on one placement
        t = t.to_global(sbpflow.placement("cpu", sorted(t.placement.flat_ranks)), S.broadcast)
    return t.float().numpy().copy()  # a snapshot: the step updates parameters and states in place


Values = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]  # parameters, optimizer states (tensors and counts)
Result = tuple[list[list[np.ndarray]], list[Values]]  # each step's outputs, the values after each step


def _values(model: Net, opt: Any) -> Values:
    """Every parameter, and every optimizer state (tensors and step counts) of the parameters it has stepped."""
    params, state = {}, {}
    for name, p in model.named_parameters():
        params[name] = _numpy(p)
        for key, value in (opt.state[p] if p in opt.state else {}).items():
            if isinstance(value, sbpflow.Tensor):
                state[f"{name}.{key}"] = _numpy(value)
            elif isinstance(value, (int, float)):
                state[f"{name}.{key}"] = np.asarray(value, dtype=np.float64)
    return params, state


def _load(model: Net, opt: Any, values: Values) -> None:
    """Writes another run's parameters and optimizer states (those this run has too) into one rank's model."""
    params, state = values
    with sbpflow.no_grad():
        for name, p in model.named_parameters():
            _write(p, params[name])
            for key, old in (opt.state[p] if p in opt.state else {}).items():
                if isinstance(old, sbpflow.Tensor):
                    _write(old, state[f"{name}.{key}"])
                elif isinstance(old, (int, float)):
                    opt.state[p][key] = type(old)(state[f"{name}.{key}"].item())


def _write(t: Any, value: np.ndarray) -> None:
    for shard in t.local_tensors().values():  # one rank: the whole tensor
        shard.copy_(torch.from_numpy(value).to(shard.dtype))


def run_eager(prog: Program, seed: int, shadow: list[Values] | None = None) -> Result:
    """The oracle: one rank, eager, full batch, plain steps; with ``shadow`` (another run's values after each
    step), each step after the first starts from that run's values after the step before."""
    sbpflow.manual_seed(0)
    model = Net(prog, placements_of(prog, one_device=True))
    p = model.placements[0]
    _start(prog, model)
    opt = _optimizer(prog, model.parameters())
    outs, values = [], []
    for step, (x, ids, y) in enumerate(data(prog, seed)):
        if step == 1:
            _change(prog, model)
        if step and shadow is not None:
            _load(model, opt, shadow[step - 1])
        args = [sbpflow.tensor(t, placement=p, sbp=S.split(0)) for t in (x, ids, y)]
        opt.zero_grad()
        with sbpflow.autocast(torch.bfloat16, enabled=prog.amp):
            results = outputs_of(prog, model(args[0], args[1]), args[2])
        results[0].backward()
        opt.step()
        outs.append([_numpy(o) for o in results])
        values.append(_values(model, opt))
    return outs, values


def run_graph(prog: Program, seed: int) -> Result:
    """The program compiled by nn.Graph on its layout."""
    sbpflow.manual_seed(0)
    placements = placements_of(prog)
    model = Net(prog, placements)
    p0, last = placements[0], placements[-1]
    _start(prog, model)
    opt = _optimizer(prog, model.parameters())

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(prog.micro_batches)
            self.config.set_executor(prog.executor)
            self.config.enable_fused_segments(prog.fused)
            if len(LAYOUTS[prog.layout]) > 1:
                self.config.set_pipeline_schedule(prog.schedule)
            if prog.zero:
                self.config.enable_zero(prog.zero, min_shard_numel=1)
            if prog.amp:
                self.config.enable_amp(torch.bfloat16)

        def build(self, x: Any, ids: Any, y: Any) -> Any:
            logits = self.model(x, ids)
            results = outputs_of(prog, logits, y.to_global(last, data_sbp(prog, last)))
            results[0].backward()
            return tuple(results)

    step_fn, outs, values = Step(), [], []
    for i in prog.checkpoint:
        model.layers[i].config.activation_checkpointing = True
    label_placement = last if prog.labels_on_last else p0
    for step, (x, ids, y) in enumerate(data(prog, seed)):
        if step == 1:
            _change(prog, model)
        args = [sbpflow.tensor(t, placement=p0, sbp=data_sbp(prog, p0)) for t in (x, ids)]
        args.append(sbpflow.tensor(y, placement=label_placement, sbp=data_sbp(prog, label_placement)))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outs.append([_numpy(o) for o in step_fn(*args)])
        recompiled = any(issubclass(w.category, GraphRecompileWarning) for w in seen)
        # the model changed: the compiled step must see it (and say so); else it must not compile again
        assert recompiled == (step == 1 and prog.change != "none"), f"{prog}: step {step} recompiled={recompiled}"
        for w in seen:  # a pipeline of fewer micro-batches than stages is warned of, and allowed
            if not issubclass(w.category, (GraphRecompileWarning, PipelineWarning)):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        values.append(_values(model, opt))
    return outs, values


# Reviewed limitations: errors that name a real limit of the program, not a bug (class, part of the message, why)
ALLOWED = [(SbpflowError, "must hold the same blocks of rows as input 0",
            "a per-row output (or the labels) on a stage of another data-parallel size than input 0's cannot hold "
            "input 0's row blocks of each micro-batch; the error names the tensor and says to give it input 0's "
            "split")]


def allowed(error: Exception) -> bool:
    return any(isinstance(error, cls) and text in str(error) for cls, text, _ in ALLOWED)


RTOL, ATOL = 1e-4, 1e-5
AMP_FACTOR = 3.0  # under bf16 amp: |graph - eager| <= 3 x eager's own distance to fp32 (see Oracle)
AMP_ROUNDINGS = 8 * 2.0**-8  # ... or 8 bf16 roundings (unit roundoff 2^-8) of the tensor's largest value


@dataclass
class Oracle:
    """What the compiled program must give: the eager run, and under bf16 amp the same program's eager fp32 run.

    bf16 rounds every op's output to 8 bits of mantissa, so two correct bf16 runs that split the batch, fuse or
    reduce in another order differ by about as much as either differs from fp32 (measured in docs/testing.md:
    the compiled run is rarely more than ~2x as far from fp32 as eager is). A tensor may differ from eager's by
    AMP_FACTOR times eager's own bf16 error on it (|g - e| <= |g - f| + |e - f| <= (2 + 1) |e - f|), or by 8
    bf16 roundings of its largest value (3 %), where eager's errors happened to cancel (a loss summed over rows,
    a bias gradient summed over 192 bf16 values).

    Under amp both eager runs start each step after the first from the compiled run's values after the step
    before (``run_eager(shadow=...)``), so each step is judged alone. Run on, two bf16 trajectories part at a
    ReLU: weights 6e-5 apart (one step's rounding) round to bf16 weights one ulp apart, which moves a
    pre-activation near 0 (-0.0007) across it, and the next gradient by one row's whole term (seed 32410: 0.10
    on an Adam moment, against 0.012 between eager and fp32; ``test_regressions.py``)."""

    eager: Result
    fp32: Result | None = None

    def slack(self, kind: int, name: Any) -> float:
        """How far a correct bf16 run may be from eager's on one tensor (0 without amp)."""
        if self.fp32 is None:
            return 0.0
        e, f = _entry(self.eager, kind, name), _entry(self.fp32, kind, name)
        if not e.size:
            return 0.0
        return max(AMP_FACTOR * float(np.abs(e - f).max()), AMP_ROUNDINGS * self._scale(kind, name, f))

    def _scale(self, kind: int, name: Any, f: np.ndarray) -> float:
        """An optimizer state's scale is its kind's across the model (all exp_avg): a gradient that is 0 in theory
        (a bias whose output a later centering removes) is bf16 noise, judged against the model's gradients."""
        if kind != 2 or self.fp32 is None:
            return float(np.abs(f).max())
        state = self.fp32[1][name[0]][1]  # after the same step
        kind_of = name[1].rsplit(".", 1)[-1]
        return max(float(np.abs(v).max()) for k, v in state.items() if k.endswith(kind_of) and v.size)


def _entry(result: Result, kind: int, name: Any) -> np.ndarray:
    """Output ``(step, k)`` (kind 0), or parameter (1) or optimizer state (2) ``(step, name)`` after that step."""
    step, key = name
    return result[0][step][key] if kind == 0 else result[1][step][kind - 1][key]


def run_oracle(prog: Program, seed: int, got: Result) -> Oracle:
    """The oracle of ``got``, a compiled run of ``prog`` (under amp the eager runs follow its steps: Oracle)."""
    if not prog.amp:
        return Oracle(run_eager(prog, seed))
    return Oracle(run_eager(prog, seed, shadow=got[1]), run_eager(replace(prog, amp=False), seed, shadow=got[1]))


def _assert_close(got: np.ndarray, want: np.ndarray, slack: float, what: str) -> None:
    """Elementwise within RTOL of the element, or of the tensor's largest element: a float32 sum's rounding scales
    with its largest terms, so an element near 0 of a tensor whose others are 60 is only as exact as they are."""
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL + RTOL * scale + slack, err_msg=what)


def compare(got: Result, oracle: Oracle, prog: Program, where: str = "") -> None:
    """Every output of each step, and every parameter and optimizer state the oracle has after each step."""
    want = oracle.eager
    for step, (outs, wants) in enumerate(zip(got[0], want[0], strict=True)):
        for k, (o, w) in enumerate(zip(outs, wants, strict=True)):
            _assert_close(o, w, oracle.slack(0, (step, k)), f"{prog}{where}: step {step} output {k}")
    for step, ((params, state), (want_params, want_state)) in enumerate(zip(got[1], want[1], strict=True)):
        assert params.keys() == want_params.keys()
        for name in want_params:
            _assert_close(params[name], want_params[name], oracle.slack(1, (step, name)),
                          f"{prog}{where}: {name} after step {step}")
        for name in want_state:  # the compiled step makes every parameter's state at once: zeros for unstepped ones
            _assert_close(state[name], want_state[name], oracle.slack(2, (step, name)),
                          f"{prog}{where}: optimizer state {name} after step {step}")


def check(prog: Program, seed: int = 1) -> bool:
    """The graph's outputs, parameters and optimizer state equal the eager oracle's. False: the graph refused the
    program with an allowed error (:data:`ALLOWED`)."""
    try:
        got = run_graph(prog, seed)
    except SbpflowError as error:
        if allowed(error):
            return False
        raise
    compare(got, run_oracle(prog, seed, got), prog)
    return True

