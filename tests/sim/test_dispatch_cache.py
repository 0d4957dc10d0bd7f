"""Dispatch reuses a boxed copy across consumers and steps (a parameter's slice too, issue 14), never a stale one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from harness import PLACEMENTS, B, randn
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.comm import record

P2 = sbpflow.placement("cpu", [0, 1])


def test_one_gather_serves_every_consumer() -> None:
    x = sbpflow.randn(6, 4, placement=P2, sbp=S.split(0)) * 1.0  # an op output: conversions are cached
    ws = [sbpflow.randn(4, 40, placement=P2, sbp=S.split(1)) for _ in range(3)]
    with sbpflow.comm.record() as log:
        outs = [x @ w for w in ws]  # gathering the small x beats gathering w: B x S(1) -> S(1), three times
    assert log.counts() == {"all_gather": 1}
    for o, w in zip(outs, ws, strict=True):
        np.testing.assert_allclose(o.numpy(), x.numpy() @ w.numpy(), rtol=1e-5)


def test_in_place_update_invalidates_the_copy() -> None:
    x = sbpflow.randn(6, 4, placement=P2, sbp=S.split(0)) * 1.0
    w = sbpflow.randn(4, 40, placement=P2, sbp=S.split(1))
    first = (x @ w).numpy()
    with sbpflow.no_grad():
        x.mul_(2.0)
    with sbpflow.comm.record() as log:
        second = x @ w
    assert log.counts() == {"all_gather": 1}  # x gathered again: the cached copy is stale
    np.testing.assert_allclose(second.numpy(), 2 * first, rtol=1e-5)


def test_parameters_updated_in_place_are_never_served_stale() -> None:
    lin = nn.Linear(4, 3)
    lin.to_global(P2, S.broadcast)
    x = sbpflow.randn(5, 4, placement=P2, sbp=S.split(1))  # needs the weight split: a free local slice
    before = lin(x).numpy()
    with sbpflow.no_grad():
        for p in lin.parameters():
            p.mul_(0.5)
    after = lin(x).numpy()
    np.testing.assert_allclose(after, 0.5 * before, rtol=1e-5, atol=1e-6)


def test_cost_model_in_force_keys_the_decision() -> None:
    x = sbpflow.randn(64, 64, placement=P2, sbp=S.split(1)) * 1.0
    w = sbpflow.randn(64, 64, placement=P2, sbp=S.split(1))
    default = x @ w  # needs one operand moved; the choice depends on alpha and beta
    slow_links = sbpflow.boxing.get_cost_model().with_link("cpu", "intra", alpha=1.0, beta=1e-15)
    with sbpflow.boxing.cost_model(slow_links):
        again = x @ w
    np.testing.assert_allclose(again.numpy(), default.numpy(), rtol=1e-5)
    key_models = {id(m) for m in sbpflow.ops.dispatch._cost_models.values()}
    assert id(slow_links) in key_models


def _count_executes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    inner = sbpflow.boxing.execute

    def counting(plan: object, shards: object, *rest: object) -> object:
        calls.append(1)
        return inner(plan, shards, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(sbpflow.boxing, "execute", counting)
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
