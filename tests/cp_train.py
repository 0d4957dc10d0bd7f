"""A few AdamW steps of a small GPT or Llama on one device or under dp x cp (context parallelism), for the sim
and proc tiers: ids and targets split on the batch over mesh axis 0 and on the sequence over axis 1, parameters
broadcast, attention run as a ring (sbpflow.ops.ring_attention); or laid out by ``sbpflow.parallelize``."""

from __future__ import annotations

from typing import Any

import numpy as np

import sbpflow
from sbpflow.comm import CommLog, record
from sbpflow.models.gpt import GPT, GPTConfig
from sbpflow.models.llama import Llama, LlamaConfig
from sbpflow.sbp import broadcast, split

VOCAB = 50
SEQ = 11  # uneven over cp = 2: shards of 6 and 5 tokens


def make(kind: str) -> Any:
    sbpflow.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0))
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2))


class _Step(sbpflow.nn.Graph):
    def __init__(self, model: Any, opt: Any, selection: str) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.sbp_selection = selection

    def build(self, ids: Any, targets: Any) -> Any:
        _, loss = self.model(ids, targets)
        loss.backward()
        return loss


def train(kind: str, mesh: list[list[int]] | None, graph: bool = False, steps: int = 3,
          selection: str = "ilp", sequence: Any = split(1)) -> tuple[list[float], dict[str, np.ndarray], CommLog]:
    """Losses, final parameters and the first step's collectives; ``mesh`` None: one device, local tensors;
    ``selection``: nn.Graph's ``sbp_selection``; ``sequence``: the SBP of ids and targets on the cp axis."""
    model = make(kind)
    placement = None if mesh is None else sbpflow.placement("cpu", mesh)
    if placement is not None:
        model.to_global(placement, (broadcast, broadcast))
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)
    step = _Step(model, opt, selection) if graph else None
    rng = np.random.default_rng(0)
    losses, first = [], CommLog()
    for i in range(steps):
        tokens = rng.integers(0, VOCAB, size=(4, SEQ + 1))
        ids, targets = (_place(t, placement, sequence) for t in (tokens[:, :-1], tokens[:, 1:]))
        with record() as log:
            if step is not None:
                loss = step(ids, targets)
            else:
                opt.zero_grad()
                _, loss = model(ids, targets)
                loss.backward()
                opt.step()
        first = log if i == 0 else first
        losses.append(float(loss.numpy()))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}, first


def _place(value: np.ndarray, placement: Any, sequence: Any) -> Any:
    if placement is None:
        return sbpflow.tensor(value)
    return sbpflow.tensor(value, placement=placement, sbp=(split(0), sequence))  # (data: batch, cp: sequence)


def train_parallelized(kind: str, steps: int = 3, **degrees: int) -> tuple[list[float], dict[str, np.ndarray],
                                                                           CommLog]:
    """:func:`train` (eager) with the layout ``sbpflow.parallelize(model, **degrees)`` makes, inputs placed by the
    strategy."""
    model = make(kind)
    strategy = sbpflow.parallelize(model, **degrees)
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    losses, first = [], CommLog()
    for i in range(steps):
        tokens = rng.integers(0, VOCAB, size=(4, SEQ + 1))
        ids, targets = strategy.shard_inputs(tokens[:, :-1], tokens[:, 1:])
        with record() as log:
            opt.zero_grad()
            _, loss = model(ids, targets)
            loss.backward()
            opt.step()
        first = log if i == 0 else first
        losses.append(float(loss.numpy()))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}, first
