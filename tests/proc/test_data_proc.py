"""DataLoader on 2 real processes (gloo): each reads only its rank's rows under S(0) and the whole batch under B,
the shuffled order is the same on both, and Graph.iterate trains exactly as on virtual ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procrun import run_ranks

import sbpflow
from sbpflow import sbp as S
from sbpflow.runtime.trace import load, trace_path
from sbpflow.utils.data import DataLoader
from sim.test_data_loader import Rows, make_step


def reads_under(sbp_name: str) -> dict[str, Any]:
    """Two epochs of 3 batches of 4 rows; what this process read, and the orders it computed."""
    p = sbpflow.placement("cpu", [0, 1])
    ds = Rows(12)
    loader = DataLoader(ds, 4, shuffle=True, seed=11, placement=p, sbp=S.parse(sbp_name), prefetch=2)
    shards = [b[0].to_local()[:, 0].tolist() for b in loader.batches(steps=6)]
    return {"reads": ds.reads, "orders": [loader.order(e).tolist() for e in (0, 1)], "shards": shards}


def job() -> dict[str, Any]:
    """Both tests' work in one job of 2 processes (a launch costs seconds)."""
    return {"S(0)": reads_under("S(0)"), "B": reads_under("B"), "train": train(6)}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    trace = tmp_path_factory.mktemp("data") / "trace.json"
    return run_ranks(job, 2, env={"SBPFLOW_TRACE": str(trace)}, timeout=150), trace


def test_each_process_reads_only_its_ranks_rows_and_both_shuffle_alike(two_processes: Any) -> None:
    per_rank, _ = two_processes
    split, bcast = [r["S(0)"] for r in per_rank], [r["B"] for r in per_rank]
    assert split[0]["orders"] == split[1]["orders"] == bcast[0]["orders"]
    orders = split[0]["orders"]
    ds = Rows(12)
    for rank in (0, 1):
        want = [i for epoch in orders for b in range(3) for i in epoch[4 * b + 2 * rank:4 * b + 2 * rank + 2]]
        assert split[rank]["reads"] == want  # rows 2r, 2r+1 of every batch, nothing else
        assert split[rank]["shards"] == [ds.x[want[2 * k:2 * k + 2], 0].tolist() for k in range(6)]
        assert bcast[rank]["reads"] == [i for epoch in orders for i in epoch]  # B: the whole batch
    assert sorted(split[0]["reads"] + split[1]["reads"]) == sorted(bcast[0]["reads"])


def train(steps: int) -> dict[str, Any]:
    p = sbpflow.placement("cpu", [0, 1])
    graph, model = make_step(p)
    loader = DataLoader(Rows(20), 4, shuffle=True, seed=2, placement=p, prefetch=2)
    losses = [float(loss.numpy()) for loss in graph.iterate(loader, steps=steps)]
    return {"losses": losses, "params": [t.numpy()
                                         for t in model.parameters()], "position": loader.state_dict()}


def test_graph_iterate_on_two_processes_equals_virtual_ranks(two_processes: Any) -> None:
    per_rank, trace = two_processes
    expected = train(6)
    for got in [r["train"] for r in per_rank]:
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-6)
        for a, b in zip(got["params"], expected["params"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert got["position"] == expected["position"]
    for rank in (0, 1):  # each process's timeline has the loader's lane, one load span per batch
        events = load(trace_path(str(trace), rank, 2))
        lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        loads = [e for e in events if e.get("ph") == "X" and lanes[e["tid"]] == "cpu/source:loader"]
        assert len(loads) == 6 and all(e["cat"] == "load" for e in loads)
