"""Meta tensors (sbpflow.meta_init) and nn.Graph.compile_only: compiling a model without its weights' memory.

A meta model compiled metadata-only must give exactly what the same model with real weights compiles to: the
same logical graph, the same chosen SBPs, the same program for every rank and the same predicted memory. Meta
tensors hold no data (a model of many GB logically builds in a few MB), and reading or running one fails with
sbpflow's own error naming the tensor.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn, sbp
from sbpflow.demo.train_gpt import build
from sbpflow.errors import MetaTensorError
from sbpflow.graph.physical import PhysicalPlan
from sbpflow.models.gpt import GPT, GPTConfig, parallelize

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

P2 = sbpflow.placement("cpu", [0, 1])
SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.1)


def _batch(cfg: GPTConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(batch, cfg.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _program(plan: PhysicalPlan, rank: int) -> list[tuple[Any, ...]]:
    """Rank ``rank``'s program, every field that says what it runs and where (buffers with their layouts)."""
    out = []
    for n in plan.for_rank(rank):
        bufs = tuple(str(plan.bufs[b]) for b in n.inputs + n.outputs)
        steps = tuple(str(s) for s in n.boxing.steps) if n.boxing is not None else ()
        out.append((n.id, n.kind, n.name, bufs, n.ranks, n.phase, n.stream, n.op, n.args, n.attrs, n.in_sbps,
                    n.out_sbps, n.control, n.control_lead, steps, n.mode))
    return out


def _compile_both(cfg: GPTConfig, spec: str, batch: int, m: int) -> tuple[Any, Any]:
    """The GPT's training step compiled from real weights (the normal path) and from a meta model."""
    ids, targets = _batch(cfg, batch)
    real = build(cfg, spec, graph=True, micro_batches=m, executor="inorder")
    real_compiled = real.graph._compile(real.inputs(ids, targets))
    with sbpflow.meta_init():
        meta = build(cfg, spec, graph=True, micro_batches=m, executor="inorder")
        inputs = meta.inputs(ids, targets)
    assert all(p.is_meta for p in meta.model.parameters()) and all(t.is_meta for t in inputs)
    return real_compiled, meta.graph.compile_only(*inputs)


def test_meta_compile_equals_the_real_path() -> None:
    """The scale benchmark's compile (benchmarks/compile_scale.py: 96 layers, TP8 x PP16 x DP8) scaled down to
    4 layers on TP2 x PP2 x DP2 with 2 micro-batches, against the normal path on real weights."""
    real, meta = _compile_both(SMALL, "dp=2,tp=2,pp=2", 4, 2)
    assert meta.logical.format() == real.logical.format()  # the same nodes and the same chosen SBPs
    assert [n.in_sbps for n in meta.logical.nodes] == [n.in_sbps for n in real.logical.nodes]
    assert meta.plan.world == real.plan.world and len(meta.plan.world) == 8
    for rank in real.plan.world:
        assert _program(meta.plan, rank) == _program(real.plan, rank), rank
    assert meta.plan.peak_bytes == real.plan.peak_bytes and len(meta.plan.rank_classes()) == 2  # one per stage
    assert meta.report.selection.chosen_cost == real.report.selection.chosen_cost  # type: ignore[union-attr]
    # the meta plan's variables hold no data, yet the real plan's did
    assert all(t.is_meta for t in meta.variables.values())
    assert not any(t.is_meta for t in real.variables.values())


def test_meta_model_of_gigabytes_builds_in_megabytes() -> None:
    cfg = GPTConfig(vocab_size=51200, block_size=2048, n_layer=8, n_head=32, n_embd=4096)
    tracemalloc.start()
    try:
        with sbpflow.meta_init():
            model = GPT(cfg)
        strategy = parallelize(model, data=2, tensor=4, pipeline=2)
        opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-3)
        opt.init_state()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    logical_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert logical_bytes > 6e9  # 1.8 billion fp32 parameters, three times over with AdamW's state
    assert peak < 20e6, peak
    q = model.h[7].attn.q.weight
    assert q.is_meta and q.placement == strategy.stages[1] and q.sbp == (sbp.broadcast, sbp.split(0))
    state = opt.state[q]
    assert state["exp_avg"].is_meta and state["exp_avg"].sbp == q.sbp


def test_reading_a_meta_tensor_names_it() -> None:
    with sbpflow.meta_init():
        layer = nn.Linear(6, 4, placement=P2, sbp=sbp.split(0))
    w = layer.weight
    assert w.is_meta and repr(w).startswith("Parameter containing:\nMetaTensor(shape [4, 6] float32 on cpu:[0, 1]")
    for read in (w.numpy, w.tolist, w.local_tensors, lambda: w.to_local()):
        with pytest.raises(MetaTensorError, match=r"shape \[4, 6\] float32 on cpu:\[0, 1\] sbp \(S\(0\)\)"):
            read()
    with pytest.raises(MetaTensorError, match=r"shape \[\] float32 on cpu:\[0, 1\] sbp \(P\(sum\)\)"):
        float(w.sum())
    with pytest.raises(MetaTensorError, match="meta_init"), sbpflow.no_grad():
        sbpflow.zeros(4, 6, placement=P2, sbp=sbp.split(0)).copy_(w)


def test_eager_ops_on_meta_tensors_give_metadata_and_the_eager_sbp() -> None:
    x = sbpflow.meta_tensor(8, 6, placement=P2, sbp=sbp.split(0))
    with sbpflow.meta_init():
        layer = nn.Linear(6, 4, placement=P2, sbp=sbp.broadcast)
        local = sbpflow.randn(3, 5)
    y = layer(x).relu().sum(dim=1)
    assert y.is_meta and list(y.shape) == [8] and y.sbp == (sbp.split(0),)
    assert local.is_meta and not local.is_global and list((local @ local.T).shape) == [3, 3]
    moved = y.to_global(sbp=sbp.broadcast)
    assert moved.is_meta and moved.sbp == (sbp.broadcast,)
    with pytest.raises(MetaTensorError, match="depends on the data"):
        sbpflow.masked_select(y, y > 0)


def test_running_a_meta_graph_is_refused_naming_the_variable() -> None:
    with sbpflow.meta_init():
        layer = nn.Linear(6, 3, placement=P2, sbp=sbp.broadcast)

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer
            self.add_optimizer(sbpflow.optim.SGD(layer.parameters(), lr=0.1))

        def build(self, x: Any) -> Any:
            loss = self.layer(x).square().mean()
            loss.backward()
            return loss

    step = Step()
    x = sbpflow.meta_tensor(8, 6, placement=P2, sbp=sbp.split(0))
    compiled = step.compile_only(x)
    assert [n.name for n in compiled.logical.nodes if n.kind == "assign"] == ["layer.weight", "layer.bias"]
    assert "matmul" in step.explain() or "linear" in step.explain()
    real_x = sbpflow.randn(8, 6, placement=P2, sbp=sbp.split(0))
    with pytest.raises(MetaTensorError, match=r"variable 'layer.weight' of a meta tensor \(shape \[3, 6\]"):
        step(real_x)
    with pytest.raises(MetaTensorError, match=r"input 0 of a meta tensor \(shape \[8, 6\] float32"):
        step(x)
    assert torch.Size([8, 6]) == x.shape


def test_memory_plan_by_rank_class_equals_every_rank_played() -> None:
    """The memory plan plays one rank per class (same nodes, same bytes; one class per stage above); playing
    every rank gives the same peaks also with uneven shards (a vocabulary of 63 over tp=4: every rank its own)."""
    from sbpflow.comm.simulated import SimulatedBackend
    from sbpflow.runtime.memory import dry_run

    cfg = GPTConfig(vocab_size=63, block_size=6, n_layer=2, n_head=4, n_embd=12, dropout=0.0)
    trainer = build(cfg, "tp=4,pp=2", graph=True, micro_batches=2, executor="inorder")
    ids = np.zeros((2, 6), dtype=np.int64)
    plan = trainer.graph._compile(trainer.inputs(ids, ids)).plan
    classes = plan.rank_classes()
    assert len(classes) == 8
    assert sorted(r for members in classes.values() for r in members) == list(range(8))
    assert plan.peak_bytes == dry_run(plan, SimulatedBackend()).peak_bytes
