"""Dispatch reuses a boxed copy across consumers, and never a stale one."""

from __future__ import annotations

import numpy as np

import sbpflow
from sbpflow import nn
from sbpflow import sbp as S

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


def test_parameters_are_never_served_from_a_cache() -> None:
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
    key_models = {id(m) for m in sbpflow.ops.registry._cost_models.values()}
    assert id(slow_links) in key_models
