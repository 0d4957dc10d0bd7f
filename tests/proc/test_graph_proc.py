"""nn.Graph on real processes (gloo): the same numbers, the same plan and the same collectives as virtual ranks.

Each process compiles only what it runs, yet every process and the one-process simulation build the same
physical plan (the plan depends on the target's cost model, never on the backend that executes it). The
compiled GPT trains under data, tensor and pipeline parallelism, with gradient accumulation too, on the
actor runtime, and must match the same strategy on virtual ranks (rtol 1e-5) and eager mode.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from sbpflow.demo.train_gpt import build, random_batches, train_gpt
from sbpflow.graph.explain import collective_counts
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
STEPS = 3
BATCH = 8
SPECS = {2: [("dp=2", 1), ("tp=2", 1), ("dp=2", 4), ("pp=2", 2)], 4: [("dp=2,tp=2", 1), ("pp=2", 1), ("dp=2,pp=2", 2)]}
INORDER = ("pp=2", 2)  # also run on the in-order executor: processes run only their own stage's nodes
RTOL, ATOL = 1e-5, 4e-5  # gloo sums in its own order; AdamW turns that noise on about-zero gradients into lr steps
TIMEOUT = 240.0


def _plan_of(spec: str, m: int) -> tuple[list[tuple[Any, ...]], dict[int, dict[str, int]]]:
    """The physical plan as data (every rank's nodes) and the collectives each rank issues per step."""
    trainer = build(CONFIG, spec, graph=True, micro_batches=m)
    trainer.step(*next(random_batches(CONFIG.vocab_size, 1, BATCH, CONFIG.block_size)))
    plan = trainer.graph.plan
    nodes = [(n.kind, n.name, n.ranks, n.phase, n.stream, n.inputs, n.outputs) for n in plan.nodes]
    return nodes, {r: dict(collective_counts(plan, r)) for r in plan.world}


def graph_job(world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": sbpflow.rank(), "train": {}, "plan": {}}
    for spec, m in SPECS[world]:
        out["train"][(spec, m)] = train_gpt(spec, STEPS, config=CONFIG, batch_size=BATCH, graph=True,
                                            micro_batches=m)
        out["plan"][(spec, m)] = _plan_of(spec, m)
    if INORDER in SPECS[world]:
        out["inorder"] = train_gpt(INORDER[0], STEPS, config=CONFIG, batch_size=BATCH, graph=True,
                                   micro_batches=INORDER[1], executor="inorder")
    return out


@pytest.fixture(scope="module", params=[2, 4])
def run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    world = request.param
    return world, run_ranks(graph_job, world, args=(world,), timeout=TIMEOUT), graph_job(world)


pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::sbpflow.graph.pipeline.PipelineWarning")]  # pp=2 with m=1 on purpose


def test_same_numbers_as_virtual_ranks(run: Any) -> None:
    world, per_rank, simulated = run
    for out in per_rank:  # the in-order executor: each process runs only its own stage's nodes, same numbers
        if "inorder" in out:
            assert out["inorder"][0] == out["train"][INORDER][0]
    for key, (losses, params) in simulated["train"].items():
        for out in per_rank:
            got_losses, got_params = out["train"][key]
            np.testing.assert_allclose(got_losses, losses, rtol=RTOL, err_msg=f"{key} rank {out['rank']}")
            for name, value in params.items():
                np.testing.assert_allclose(got_params[name], value, rtol=RTOL, atol=ATOL,
                                           err_msg=f"{key} {name} rank {out['rank']}")


def test_same_plan_and_collectives_as_virtual_ranks(run: Any) -> None:
    """A laptop run predicts the cluster run: identical physical plans, identical per-rank collectives."""
    world, per_rank, simulated = run
    for key, (nodes, counts) in simulated["plan"].items():
        assert any(counts.values()), key
        for out in per_rank:
            got_nodes, got_counts = out["plan"][key]
            first = next((i for i, (a, b) in enumerate(zip(got_nodes, nodes, strict=False)) if a != b), None)
            assert got_nodes == nodes, (f"{key}: rank {out['rank']} compiled another plan ({len(got_nodes)} vs "
                                        f"{len(nodes)} nodes); first difference at {first}: "
                                        f"{got_nodes[first] if first is not None else ''} vs "
                                        f"{nodes[first] if first is not None else ''}")
            assert got_counts == counts, key


def test_graph_matches_eager_on_processes(run: Any) -> None:
    world, per_rank, _ = run
    spec, m = SPECS[world][0]
    eager = train_gpt(spec, STEPS, config=CONFIG, batch_size=BATCH)
    losses, _ = per_rank[0]["train"][(spec, m)]
    np.testing.assert_allclose(losses, eager[0], rtol=1e-5)
