"""Embedding and loss ops against torch: embedding, cross_entropy, nll_loss, mse_loss.

Random valid SBPs (batch split, class/vocab split, B, uneven sizes such as batch 7 or 5 classes on
2 and 3 ranks) on 1, 2, 3 ranks and a 2x2 mesh; the harness compares forward values, input gradients
and leaf-gradient layouts. The vocab-parallel cases also assert their collectives: the loss all-reduces
(N, 1) statistics only and never gathers the logits; the vocab-parallel embedding's weight gradient
stays split on rows without communication.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import sbpflow
import sbpflow.ops.functional as F
from harness import PLACEMENTS, PSUM, B, check, randn, random_sbp
from sbpflow import boxing
from sbpflow import sbp as S
from sbpflow.errors import DTypeError, OpError, ShapeError

PNAMES = ["1", "2", "3", "2x2"]
SEEDS = range(6)


def _nd(p: sbpflow.Placement, *sbps: object) -> tuple[object, ...]:
    return (tuple(sbps) + (B,) * p.ndim)[: p.ndim]


def _labels(shape: tuple[int, ...], classes: int, seed: int, ignore: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, classes, shape, generator=g)
    if ignore is not None and t.numel() > 1:
        t.view(-1)[:: max(2, t.numel() // 2)] = ignore
    return t


def _batch_sbp(rng: random.Random, p: sbpflow.Placement, x_ndim: int, t_ndim: int) -> tuple[tuple, tuple]:  # type: ignore[type-arg]
    """Random SBPs for (input with class dim 1, target): batch split together, class split, or B."""
    xs, ts = [], []
    for _ in range(p.ndim):
        kind = rng.choice(["batch", "class", "b", "mixed"])
        if kind == "batch":
            xs.append(S.split(0))
            ts.append(S.split(0))
        elif kind == "class":
            xs.append(S.split(1))
            ts.append(B)
        elif kind == "mixed":  # target laid out differently: dispatch boxes it
            xs.append(S.split(x_ndim - 1))
            ts.append(S.split(0) if t_ndim else B)
        else:
            xs.append(B)
            ts.append(B)
    return tuple(xs), tuple(ts)


# -- embedding -------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", SEEDS)
def test_embedding_random_sbp(pname: str, seed: int) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    ids_shape = rng.choice([(7,), (3, 5)])
    vocab, dim = rng.choice([(5, 4), (7, 3)])
    padding_idx = rng.choice([None, 2, -1])
    ids = _labels(ids_shape, vocab, seed)
    w_sbp = tuple(rng.choice([B, S.split(0), S.split(1)]) for _ in range(p.ndim))
    check(lambda i, w: F.embedding(i, w, padding_idx), lambda i, w: TF.embedding(i, w, padding_idx),
          [ids, randn(vocab, dim, seed=seed)], p, [random_sbp(ids_shape, p, rng), w_sbp])


@pytest.mark.parametrize("pname", ["2", "3"])
def test_vocab_parallel_embedding(pname: str) -> None:
    p = PLACEMENTS[pname]
    ids = torch.tensor([[0, 4, 2], [3, 3, 1]])
    r = check(F.embedding, TF.embedding, [ids, randn(5, 3)], p, [B, S.split(0)])
    assert r.out.sbp == (PSUM,)
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}  # each rank index-adds the (B) output grad into its own rows
    assert r.grads[1].sbp == (S.split(0),)


@pytest.mark.parametrize("pname", ["2", "3"])
def test_data_parallel_embedding_weight_grad_is_one_all_reduce(pname: str) -> None:
    p = PLACEMENTS[pname]
    ids = _labels((7, 2), 6, 0)
    r = check(F.embedding, TF.embedding, [ids, randn(6, 4)], p, [S.split(0), B])
    assert r.out.sbp == (S.split(0),)
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {"all_reduce": 1}  # P(sum) weight grad onto the B leaf


def test_embedding_index_out_of_range() -> None:
    p = PLACEMENTS["2"]
    w = sbpflow.tensor(randn(5, 3), placement=p, sbp=S.split(0))
    ids = sbpflow.tensor(torch.tensor([1, 7]), placement=p, sbp=B)
    with pytest.raises(OpError, match=r"embedding: index 7 is out of range for 5 weight rows"):
        F.embedding(ids, w)
    with pytest.raises(DTypeError, match="embedding needs integer ids"):
        F.embedding(sbpflow.tensor(randn(2), placement=p, sbp=B), w)


# -- cross_entropy and nll_loss ----------------------------------------------------------------


def _loss_case(rng: random.Random, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = rng.choice([(7, 5), (6, 4), (3, 5, 2), (5,)])
    classes = shape[0] if len(shape) == 1 else shape[1]
    t_shape = () if len(shape) == 1 else (shape[0],) + shape[2:]
    return randn(*shape, seed=seed), _labels(t_shape, classes, seed + 1, ignore=rng.choice([None, -100]))


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", SEEDS)
def test_cross_entropy_random_sbp(pname: str, seed: int) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    x, t = _loss_case(rng, seed)
    reduction = rng.choice(["mean", "sum", "none"])
    smoothing = rng.choice([0.0, 0.1])
    xs, ts = _batch_sbp(rng, p, x.ndim, t.ndim) if x.ndim > 1 else ((B,) * p.ndim, (B,) * p.ndim)
    check(lambda a, b: F.cross_entropy(a, b, reduction=reduction, label_smoothing=smoothing),
          lambda a, b: TF.cross_entropy(a, b, reduction=reduction, label_smoothing=smoothing),
          [x, t], p, [xs, ts])


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", SEEDS)
def test_nll_loss_random_sbp(pname: str, seed: int) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    x, t = _loss_case(rng, seed)
    reduction = rng.choice(["mean", "sum", "none"])
    xs, ts = _batch_sbp(rng, p, x.ndim, t.ndim) if x.ndim > 1 else ((B,) * p.ndim, (B,) * p.ndim)
    check(lambda a, b: F.nll_loss(a, b, reduction=reduction), lambda a, b: TF.nll_loss(a, b, reduction=reduction),
          [x, t], p, [xs, ts])


@pytest.mark.parametrize("pname", ["2", "3"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_vocab_parallel_cross_entropy_moves_only_row_statistics(pname: str, smoothing: float) -> None:
    p = PLACEMENTS[pname]
    n, classes = 6, 11
    x, t = randn(n, classes), _labels((n,), classes, 3, ignore=-100)
    r = check(lambda a, b: F.cross_entropy(a, b, label_smoothing=smoothing),
              lambda a, b: TF.cross_entropy(a, b, label_smoothing=smoothing), [x, t], p, [S.split(1), B])
    # max and sum of exp over the split classes: two (N, 1) statistics reduced by boxing; picks stay P(sum)
    stat = boxing.plan((n, 1), torch.float32, boxing.Layout(p, (S.partial_max,)), boxing.Layout(p, (B,)))
    assert "all_gather" not in stat.collectives()
    assert r.forward_log.kinds() == stat.collectives() * 2
    assert r.forward_log.total_bytes() == 2 * stat.bytes
    if pname == "2":
        assert r.forward_log.counts() == {"all_reduce": 2}
    assert r.out.sbp == (PSUM,)
    assert r.grads[0].sbp == (S.split(1),)
    # backward: the gradient of the log-sum-exp needs the sum of d(logp) over the split classes, one more
    # (N, 1) statistic; the logits' gradient is built in place on each rank's classes
    assert r.backward_log.kinds() == stat.collectives()
    assert r.backward_log.total_bytes() == stat.bytes


def test_cross_entropy_mean_is_exact_under_uneven_batch_split() -> None:
    """Batch 7 over 3 ranks with ignored targets: sum over ranks / logical count of valid targets."""
    p = PLACEMENTS["3"]
    x, t = randn(7, 5), torch.tensor([0, -100, 4, 2, -100, 1, 3])
    r = check(F.cross_entropy, TF.cross_entropy, [x, t], p, [S.split(0), S.split(0)])
    assert r.out.sbp == (PSUM,)
    # the count of valid targets is the only thing reduced forward: one scalar
    assert r.forward_log.total_bytes() <= 2 * 2 * 4


def test_vocab_parallel_cross_entropy_with_an_empty_class_shard() -> None:
    p = PLACEMENTS["3"]
    x, t = randn(5, 2), torch.tensor([1, 0, -100, 1, 1])
    r = check(lambda a, b: F.cross_entropy(a, b, label_smoothing=0.1),
              lambda a, b: TF.cross_entropy(a, b, label_smoothing=0.1), [x, t], p, [S.split(1), B])
    assert "all_gather" not in r.forward_log.counts()
    assert r.grads[0].sbp == (S.split(1),)


def test_cross_entropy_on_2x2_batch_and_vocab_parallel() -> None:
    p = PLACEMENTS["2x2"]
    x, t = randn(7, 5), _labels((7,), 5, 1, ignore=-100)
    r = check(F.cross_entropy, TF.cross_entropy, [x, t], p, [(S.split(0), S.split(1)), (S.split(0), B)])
    assert "all_gather" not in r.forward_log.counts()
    assert r.grads[0].sbp == (S.split(0), S.split(1))


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", range(4))
def test_cross_entropy_with_class_probabilities(pname: str, seed: int) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    shape = rng.choice([(7, 5), (3, 4, 2), (5,)])
    probs = torch.softmax(randn(*shape, seed=seed + 1), dim=0 if len(shape) == 1 else 1)
    reduction = rng.choice(["mean", "sum", "none"])
    smoothing = rng.choice([0.0, 0.1])
    check(lambda a, b: F.cross_entropy(a, b, reduction=reduction, label_smoothing=smoothing),
          lambda a, b: TF.cross_entropy(a, b, reduction=reduction, label_smoothing=smoothing),
          [randn(*shape, seed=seed), probs], p, [random_sbp(shape, p, rng), random_sbp(shape, p, rng)])


@pytest.mark.parametrize("name", ["cross_entropy", "nll_loss", "mse_loss", "embedding"])
def test_local_tensors(name: str) -> None:
    """Tensors without a placement run the same kernels on one device."""
    x, t = randn(6, 5), _labels((6,), 5, 2, ignore=-100)
    if name == "mse_loss":
        check(F.mse_loss, TF.mse_loss, [x, randn(6, 5, seed=1)], None)
    elif name == "embedding":
        check(lambda i, w: F.embedding(i, w, 1), lambda i, w: TF.embedding(i, w, 1), [t.clamp(0), x], None)
    else:
        check(getattr(F, name), getattr(TF, name), [x, t], None)


def test_cross_entropy_all_targets_ignored_gives_nan_like_torch() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(randn(3, 4), placement=p, sbp=S.split(1))
    t = sbpflow.tensor(torch.full((3,), -100), placement=p, sbp=B)
    assert np.isnan(F.cross_entropy(x, t).item())
    assert F.cross_entropy(x, t, reduction="sum").item() == 0.0


def test_loss_errors() -> None:
    p = PLACEMENTS["3"]
    x = sbpflow.tensor(randn(4, 5), placement=p, sbp=S.split(1))
    bad = sbpflow.tensor(torch.tensor([0, 5, 1, 2]), placement=p, sbp=B)
    with pytest.raises(OpError, match=r"cross_entropy: target label 5 is out of range for 5 classes"):
        F.cross_entropy(x, bad)
    negative = sbpflow.tensor(torch.tensor([0, 1, -3, 2]), placement=p, sbp=S.split(0))
    with pytest.raises(OpError, match=r"nll_loss: target label -3 is out of range for 5 classes"):
        F.nll_loss(x, negative)
    short = sbpflow.tensor(torch.tensor([0, 1, 2]), placement=p, sbp=B)
    with pytest.raises(ShapeError, match=r"cross_entropy: input shape \[4, 5\].*target of shape \[4\].*\[3\]"):
        F.cross_entropy(x, short)
    with pytest.raises(DTypeError, match="nll_loss: target must hold integer class indices"):
        F.nll_loss(x, sbpflow.tensor(randn(4), placement=p, sbp=B))
    with pytest.raises(ShapeError, match=r"cross_entropy: class-probability targets need the input's shape"):
        F.cross_entropy(x, sbpflow.tensor(randn(4), placement=p, sbp=B))
    with pytest.raises(OpError, match="reduction must be"):
        F.nll_loss(x, bad, reduction="avg")
    with pytest.raises(ShapeError, match="mse_loss"):
        F.mse_loss(x, sbpflow.tensor(randn(3), placement=p, sbp=B))


# -- mse_loss --------------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", range(4))
def test_mse_loss_random_sbp(pname: str, seed: int) -> None:
    rng = random.Random(seed)
    p = PLACEMENTS[pname]
    shape = rng.choice([(7, 3), (5,)])
    reduction = rng.choice(["mean", "sum", "none"])
    check(lambda a, b: F.mse_loss(a, b, reduction), lambda a, b: TF.mse_loss(a, b, reduction=reduction),
          [randn(*shape, seed=seed), randn(*shape, seed=seed + 1)], p,
          [random_sbp(shape, p, rng, partial=True), random_sbp(shape, p, rng)])
