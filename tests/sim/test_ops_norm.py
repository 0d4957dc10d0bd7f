"""Normalization ops against torch: softmax, log_softmax, layer_norm, rms_norm, batch_norm, dropout.

Inputs get random valid SBPs (batch splits, splits of the normalized dim, B, uneven sizes) on 1, 2, 3
ranks and a 2x2 mesh; the harness compares forward values, input gradients and leaf-gradient layouts.
The collectives are asserted where the SBP rules promise them (fused paths: none; split statistics:
all-reduces of small tensors only).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import sbpflow
import sbpflow.ops.functional as F
from harness import DEVICE, PLACEMENTS, B, all_reduce_payloads, check, randn, random_sbp
from sbpflow import boxing
from sbpflow import random as sbp_random
from sbpflow import sbp as S
from sbpflow.comm import record
from sbpflow.errors import DTypeError, OpError, ShapeError

PNAMES = ["1", "2", "3", "2x2"]
SEEDS = range(5)


def _nd(p: sbpflow.Placement, *sbps: object) -> tuple[object, ...]:
    """An n-D SBP: the given entries for the first mesh axes, B for the rest."""
    return (tuple(sbps) + (B,) * p.ndim)[: p.ndim]


# -- softmax and log_softmax ---------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_random_sbp(pname: str, seed: int, name: str) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    shape = rng.choice([(7, 5), (3, 5, 2), (5,)])
    dim = rng.randrange(-len(shape), len(shape))
    ours, theirs = getattr(F, name), getattr(torch, name)
    check(lambda x: ours(x, dim), lambda x: theirs(x, dim), [randn(*shape, seed=seed)], p,
          [random_sbp(shape, p, rng, partial=True)])


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layer_norm", "rms_norm", "batch_norm"])
def test_local_tensors(name: str) -> None:
    """Tensors without a placement run the fused kernels on one device."""
    x = randn(6, 5)
    if name in ("softmax", "log_softmax"):
        check(lambda a: getattr(F, name)(a, 1), lambda a: getattr(torch, name)(a, 1), [x], None)
    elif name == "batch_norm":
        check(lambda a: F.batch_norm(a, None, None, training=True),
              lambda a: TF.batch_norm(a, None, None, training=True), [x], None)
    else:
        check(lambda a, w: getattr(F, name)(a, (5,), w), lambda a, w: getattr(TF, name)(a, (5,), w),
              [x, randn(5, seed=1)], None)


def test_softmax_methods_are_bound() -> None:
    x = randn(3, 4)
    check(lambda a: a.softmax(1) + a.log_softmax(0), lambda a: a.softmax(1) + a.log_softmax(0), [x],
          PLACEMENTS["2"], [S.split(0)])


@pytest.mark.parametrize("pname", PNAMES)
def test_softmax_over_unsplit_dim_is_fused_without_comm(pname: str) -> None:
    p = PLACEMENTS[pname]
    r = check(lambda x: F.softmax(x, -1), lambda x: torch.softmax(x, -1), [randn(7, 5)], p, [_nd(p, S.split(0))])
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}
    assert r.out.sbp == _nd(p, S.split(0))


def _tiny_latency() -> boxing.CostModel:
    """A cost model where latency is negligible, so moving bytes decides (row statistics beat a gather)."""
    return boxing.CostModel().with_link(DEVICE, "intra", 1e-9, 1 / 5e9)


def _plan_time(shape: tuple[int, ...], p: sbpflow.Placement, src: tuple[object, ...], dst: tuple[object, ...]) -> float:
    return boxing.plan(shape, torch.float32, boxing.Layout(p, src), boxing.Layout(p, dst)).time


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_split_dim_takes_the_gather_when_latency_dominates(name: str) -> None:
    p = PLACEMENTS["2"]
    # two all-reduces of a (4, 1) statistic cost more latency than one all-gather of the (4, 6) input
    assert 2 * _plan_time((4, 1), p, (S.partial_max,), (B,)) > _plan_time((4, 6), p, (S.split(1),), (B,))
    r = check(lambda x: getattr(F, name)(x, 1), lambda x: getattr(torch, name)(x, 1), [randn(4, 6)], p,
              [S.split(1)])
    assert r.forward_log.counts() == {"all_gather": 1}
    assert r.out.sbp == (B,)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_split_dim_takes_partial_statistics_when_bytes_dominate(name: str) -> None:
    p = PLACEMENTS["2"]
    with boxing.cost_model(_tiny_latency()):
        assert 2 * _plan_time((4, 1), p, (S.partial_max,), (B,)) < _plan_time((4, 6), p, (S.split(1),), (B,))
        r = check(lambda x: getattr(F, name)(x, 1), lambda x: getattr(torch, name)(x, 1), [randn(4, 6)], p,
                  [S.split(1)])
    # max and sum of exp: one all-reduce of a (4, 1) float32 statistic each; the input never moves
    assert r.forward_log.counts() == {"all_reduce": 2}
    assert all(e.bytes == 2 * (2 - 1) * 4 * 4 for e in r.forward_log.events)  # ring all-reduce, 16 B tensor
    assert r.out.sbp == (S.split(1),)
    # backward with a B upstream grad: softmax reduces one (4, 1) statistic (sum of dy * y over the split
    # dim); log_softmax needs sum(dy), which is local for a B dy
    assert r.backward_log.counts() == ({"all_reduce": 1} if name == "softmax" else {})


@pytest.mark.parametrize("pname", ["3", "2x2"])
@pytest.mark.parametrize("shape", [(6, 7), (5, 2), (8, 64)])
def test_split_dim_path_follows_the_planner_on_uneven_splits(pname: str, shape: tuple[int, int]) -> None:
    """Classes 7 or 2 on 3 ranks (2: an empty shard): the cheaper path per the planner runs, exactly."""
    p = PLACEMENTS[pname]
    sbp = _nd(p, S.split(1), S.split(0))
    stat_src = tuple(S.partial_max if s == S.split(1) else s for s in sbp)
    unsplit = tuple(B if s == S.split(1) else s for s in sbp)
    with boxing.cost_model(_tiny_latency()):
        stat = boxing.plan((shape[0], 1), torch.float32, boxing.Layout(p, stat_src), boxing.Layout(p, unsplit))
        gather = boxing.plan(shape, torch.float32, boxing.Layout(p, sbp), boxing.Layout(p, unsplit))
        r = check(lambda x: F.log_softmax(x, 1), lambda x: torch.log_softmax(x, 1), [randn(*shape)], p, [sbp])
    expected, out_sbp = ((stat, 2), sbp) if 2 * stat.time < gather.time else ((gather, 1), unsplit)
    # (a step on one axis of a 2x2 mesh runs once per group, so compare kinds and bytes, not event counts)
    assert set(r.forward_log.kinds()) == set(expected[0].collectives())
    assert r.forward_log.total_bytes() == expected[1] * expected[0].bytes
    assert r.out.sbp == out_sbp


def test_softmax_rejects_integer_input() -> None:
    x = sbpflow.tensor([[1, 2]], placement=PLACEMENTS["2"], sbp=B)
    with pytest.raises(DTypeError, match="softmax"):
        F.softmax(x, 1)


# -- layer_norm and rms_norm ---------------------------------------------------------------------


def _layer_norm_case(rng: random.Random, p: sbpflow.Placement, seed: int) -> tuple[list, list, int]:  # type: ignore[type-arg]
    shape = rng.choice([(7, 5), (3, 4, 5), (2, 3, 7)])
    k = rng.choice([1, 2]) if len(shape) == 3 else 1
    norm = shape[len(shape) - k:]
    values = [randn(*shape, seed=seed), randn(*norm, seed=seed + 1), randn(*norm, seed=seed + 2)]
    sbps = [random_sbp(shape, p, rng), random_sbp(norm, p, rng), random_sbp(norm, p, rng)]
    return values, sbps, k


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", SEEDS)
def test_layer_norm_random_sbp(pname: str, seed: int) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    values, sbps, k = _layer_norm_case(rng, p, seed)
    norm = tuple(values[1].shape)
    check(lambda x, w, b: F.layer_norm(x, norm, w, b), lambda x, w, b: TF.layer_norm(x, norm, w, b),
          values, p, sbps)


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", SEEDS)
def test_rms_norm_random_sbp(pname: str, seed: int) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    values, sbps, k = _layer_norm_case(rng, p, seed)
    norm = tuple(values[1].shape)
    eps = rng.choice([None, 1e-3])
    check(lambda x, w: F.rms_norm(x, norm, w, eps), lambda x, w: TF.rms_norm(x, norm, w, eps),
          values[:2], p, sbps[:2])


@pytest.mark.parametrize("pname", PNAMES)
def test_layer_norm_batch_split_is_local(pname: str) -> None:
    p = PLACEMENTS[pname]
    r = check(lambda x, w, b: F.layer_norm(x, (5,), w, b), lambda x, w, b: TF.layer_norm(x, (5,), w, b),
              [randn(7, 5), randn(5, seed=1), randn(5, seed=2)], p, [_nd(p, S.split(0)), _nd(p, B), _nd(p, B)])
    assert r.forward_log.counts() == {}
    assert r.out.sbp == _nd(p, S.split(0))
    if p.size > 1:  # weight and bias grads are P(sum) per shard: one bucket (DDP), one call per mesh-axis group
        assert all_reduce_payloads(r.backward_log) == [4 * (5 + 5)] * (p.size // p.hierarchy[0])
        assert set(r.backward_log.counts()) == {"all_reduce"}


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("features", [6, 5])
def test_norm_feature_split_reduces_statistics_only(name: str, features: int) -> None:
    p = PLACEMENTS["2"]
    params = [randn(features, seed=1), randn(features, seed=2)][: 2 if name == "layer_norm" else 1]
    ours, theirs = getattr(F, name), getattr(TF, name)
    r = check(lambda x, *ps: ours(x, (features,), *ps), lambda x, *ps: theirs(x, (features,), *ps),
              [randn(4, features)] + params, p, [S.split(1)] + [S.split(0)] * len(params))
    # layer_norm: mean and variance; rms_norm: mean square. (4, 1) float32 statistics only (16 B, ring
    # all-reduce on 2 ranks: each receives 2 * (2 - 1) / 2 of it)
    stats = 2 if name == "layer_norm" else 1
    assert r.forward_log.counts() == {"all_reduce": stats}
    assert r.forward_log.total_bytes() == stats * 2 * 16
    assert r.out.sbp == (S.split(1),)


def test_norm_errors_name_the_op_and_shapes() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(randn(3, 4), placement=p, sbp=S.split(0))
    with pytest.raises(ShapeError, match=r"layer_norm: normalized_shape \[5\].*shape \[3, 4\]"):
        F.layer_norm(x, (5,))
    with pytest.raises(ShapeError, match=r"rms_norm: normalized_shape \[2, 4\]"):
        F.rms_norm(x, [2, 4])
    w = sbpflow.tensor(randn(3), placement=p, sbp=B)
    with pytest.raises(ShapeError, match=r"layer_norm: weight must have shape normalized_shape \[4\]"):
        F.layer_norm(x, 4, w)


# -- batch_norm ------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("shape", [(7, 3), (7, 3, 2, 3)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_matches_torch(pname: str, shape: tuple[int, ...], training: bool) -> None:
    p = PLACEMENTS[pname]
    rng = random.Random(len(shape))
    c = shape[1]
    stats = (randn(c, seed=5), randn(c, seed=6).abs() + 0.5)
    ours_stats = [sbpflow.tensor(s, placement=p, sbp=_nd(p, B)) for s in stats]
    theirs_stats = [s.clone() for s in stats]
    check(lambda x, w, b: F.batch_norm(x, *ours_stats, w, b, training=training, momentum=0.2),
          lambda x, w, b: TF.batch_norm(x, *theirs_stats, w, b, training=training, momentum=0.2),
          [randn(*shape), randn(c, seed=1), randn(c, seed=2)], p,
          [random_sbp(shape, p, rng), random_sbp((c,), p, rng), _nd(p, B)])
    for o, t in zip(ours_stats, theirs_stats, strict=True):
        np.testing.assert_allclose(o.numpy(), t.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(7, 3), (7, 3, 2, 2)])
def test_sync_batch_norm_running_stats_over_steps(shape: tuple[int, ...]) -> None:
    """Batch 7 split over 3 ranks: statistics and running stats equal one device, step after step."""
    p = PLACEMENTS["3"]
    c = shape[1]
    rm, rv = sbpflow.zeros(c, placement=p, sbp=B), sbpflow.ones(c, placement=p, sbp=B)
    trm, trv = torch.zeros(c), torch.ones(c)
    for step in range(3):
        value = randn(*shape, seed=10 + step) * (step + 1) + step
        x = sbpflow.tensor(value, placement=p, sbp=S.split(0))
        with record() as log:
            y = F.batch_norm(x, rm, rv, training=True)
        expected = TF.batch_norm(value, trm, trv, training=True)
        np.testing.assert_allclose(y.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)
        assert y.sbp == (S.split(0),)
        # mean and variance over the split batch: (1, C, 1...) statistics reduced by boxing, x never moves
        assert set(log.counts()) <= {"all_reduce", "reduce_scatter", "send_recv"}
        assert log.total_bytes() <= 2 * 2 * 3 * 4 * c
    np.testing.assert_allclose(rm.numpy(), trm.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv.numpy(), trv.numpy(), rtol=1e-5, atol=1e-6)


def test_batch_norm_errors() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(randn(4, 3), placement=p, sbp=S.split(0))
    with pytest.raises(ShapeError, match=r"batch_norm: running_mean must have shape \(3,\)"):
        F.batch_norm(x, sbpflow.zeros(4, placement=p, sbp=B), None, training=True)
    with pytest.raises(OpError, match="batch_norm: evaluation"):
        F.batch_norm(x, None, None, training=False)


# -- dropout ---------------------------------------------------------------------------------


def _reference_mask(shape: tuple[int, ...], p: float, seed: int = 0) -> torch.Tensor:
    """The logical keep-mask the first random call after ``manual_seed(seed)`` draws."""
    sbpflow.manual_seed(seed)
    key = sbp_random.next_key()
    u = sbp_random.fill(key, shape, tuple((0, n) for n in shape), "uniform", torch.float32, torch.device("cpu"))
    sbpflow.manual_seed(seed)
    return (u >= p).float()


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", range(4))
def test_dropout_random_sbp(pname: str, seed: int) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    shape = rng.choice([(7, 5), (3, 5, 2)])
    mask = _reference_mask(shape, 0.3)
    r = check(lambda x: F.dropout(x, 0.3), lambda x: x * mask / 0.7, [randn(*shape, seed=seed)], p,
              [random_sbp(shape, p, rng, partial=True)])
    assert r.forward_log.counts() == {}  # the mask is drawn per shard: nothing moves


def test_dropout_mask_is_independent_of_sbp_and_placement() -> None:
    value = randn(9, 6) + 3.0  # no zeros of its own
    layouts = [(None, None), (PLACEMENTS["1"], B), (PLACEMENTS["2"], S.split(0)), (PLACEMENTS["3"], S.split(1)),
               (PLACEMENTS["2x2"], (S.split(1), S.split(0))), (PLACEMENTS["2x2"], (B, S.split(1)))]
    masks = []
    for placement, sbp in layouts:
        sbpflow.manual_seed(7)
        x = sbpflow.tensor(value, placement=placement, sbp=sbp)
        masks.append(F.dropout(x, 0.5).numpy() != 0)
    for m in masks[1:]:
        np.testing.assert_array_equal(m, masks[0])
    assert 0 < masks[0].sum() < masks[0].size


def test_dropout_keeps_about_one_minus_p_and_grad_uses_the_mask() -> None:
    p = PLACEMENTS["3"]
    x = sbpflow.ones(200, 101, placement=p, sbp=S.split(1), requires_grad=True)
    y = F.dropout(x, 0.25)
    kept = y.numpy() != 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(y.numpy()[kept], 1 / 0.75, rtol=1e-6)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy() != 0, kept)
    # a second call draws a new mask
    assert (F.dropout(x.detach(), 0.25).numpy() != 0).tolist() != kept.tolist()


def test_dropout_identity_cases_and_errors() -> None:
    x = sbpflow.tensor(randn(3, 4), placement=PLACEMENTS["2"], sbp=S.split(0))
    assert F.dropout(x, 0.0) is x
    assert F.dropout(x, 0.5, training=False) is x
    assert float(np.abs(F.dropout(x, 1.0).numpy()).sum()) == 0.0
    with pytest.raises(OpError, match="dropout: p must be in"):
        F.dropout(x, 1.5)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", [True, False])
def test_norm_backward_uses_saved_statistics(monkeypatch: pytest.MonkeyPatch, name: str, affine: bool) -> None:
    """Backward calls the forward kernel no second time: it works from the saved mean/rstd (issue 14)."""
    from sbpflow.ops import normalization as N

    fused = N._layer_norm_fused if name == "layer_norm" else N._rms_norm_fused
    calls = []
    kernel = fused.kernel
    monkeypatch.setattr(fused, "kernel", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    params = [randn(5, seed=1), randn(5, seed=2)][: 2 if name == "layer_norm" else 1] if affine else []
    ours, theirs = getattr(F, name), getattr(TF, name)
    r = check(lambda x, *ps: ours(x, (5,), *ps), lambda x, *ps: theirs(x, (5,), *ps),
              [randn(4, 3, 5, seed=0)] + params, PLACEMENTS["2"], [S.split(0)] + [B] * len(params))
    assert len(calls) == 2  # the forward on each of the two ranks, never again in backward
    assert all_reduce_payloads(r.backward_log) == ([4 * 5 * len(params)] if affine else [])  # one bucket
