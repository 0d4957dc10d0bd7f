"""Conversions a parameter needs on every step are cached (issue 14), and never served stale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from harness import PLACEMENTS, B, randn
from sbpflow import sbp as S
from sbpflow.comm import record
from sbpflow.ops import registry


def _count_executes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    inner = registry.boxing.execute

    def counting(plan: object, shards: object, *rest: object) -> object:
        calls.append(1)
        return inner(plan, shards, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(registry.boxing, "execute", counting)
    return calls


def test_a_broadcast_leaf_is_sliced_once_for_split_data(monkeypatch: pytest.MonkeyPatch) -> None:
    p = PLACEMENTS["2"]
    x, w = randn(4, 3), randn(4, 3, seed=1)
    xs = sbpflow.tensor(x, placement=p, sbp=S.split(0))
    ws = sbpflow.tensor(w, placement=p, sbp=B)
    calls = _count_executes(monkeypatch)
    outs = [xs + ws for _ in range(3)]
    assert len(calls) == 1  # B -> S(0) is a local slice: kept on the leaf
    for out in outs:
        np.testing.assert_allclose(out.numpy(), (x + w).numpy())


def test_an_in_place_update_of_the_leaf_invalidates_its_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    p = PLACEMENTS["2"]
    x, w = randn(4, 3), randn(4, 3, seed=1)
    xs = sbpflow.tensor(x, placement=p, sbp=S.split(0))
    ws = sbpflow.tensor(w, placement=p, sbp=B)
    calls = _count_executes(monkeypatch)
    xs * ws
    for shard in ws.local_tensors().values():  # behind sbpflow's back, as an optimizer's foreach kernel does
        shard.mul_(2.0)
    doubled = xs * ws
    with sbpflow.no_grad():
        ws.add_(1.0)  # sbpflow's own in-place op
    shifted = xs * ws
    assert len(calls) == 3  # each update made the cached slice stale
    np.testing.assert_allclose(doubled.numpy(), (x * w * 2.0).numpy())
    np.testing.assert_allclose(shifted.numpy(), (x * (w * 2.0 + 1.0)).numpy())


def test_an_optimizer_step_invalidates_the_slice() -> None:
    p = PLACEMENTS["2"]
    x, w = randn(4, 3), randn(4, 3, seed=1)
    xs = sbpflow.tensor(x, placement=p, sbp=S.split(0))
    ws = sbpflow.nn.Parameter(sbpflow.tensor(w, placement=p, sbp=B))
    wt = torch.nn.Parameter(w.clone())
    ours, theirs = sbpflow.optim.SGD([ws], lr=0.1), torch.optim.SGD([wt], lr=0.1)
    for _ in range(3):
        (xs * ws).sum().backward()
        (x * wt).sum().backward()
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    np.testing.assert_allclose((xs * ws).numpy(), (x * wt).detach().numpy(), rtol=1e-6)


def test_a_leaf_conversion_with_a_collective_runs_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process alone cannot know its peers' copies are valid: collectives on leaves are never skipped."""
    w = randn(4, 3, seed=1)
    ws = sbpflow.tensor(w, placement=PLACEMENTS["2"], sbp=S.split(1))
    with record() as log:
        outs = [ws.reshape(12) for _ in range(2)]  # S(1) -> S(0) first: an all-to-all each time
    for out in outs:
        np.testing.assert_allclose(out.numpy(), w.reshape(12).numpy())
    assert log.counts() == {"all_to_all": 2}
