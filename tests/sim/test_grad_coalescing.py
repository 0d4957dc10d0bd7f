"""``coalesce_grad_reductions``: the partial gradients of broadcast leaves reduced by one flat all-reduce.

Values must equal the per-leaf reductions exactly (the same sums, concatenated),
and the collectives drop to one all-reduce per (placement, dtype) group.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import PLACEMENTS
from sbpflow import sbp as S
from sbpflow.autograd import coalesce_grad_reductions
from sbpflow.comm import record
from sbpflow.demo.train_gpt import build, random_batches
from sbpflow.models.gpt import GPTConfig

B, P = S.broadcast, S.partial_sum


def _grad(t: Any) -> np.ndarray:
    assert t.grad is not None
    return np.asarray(t.grad.numpy())


def _sbp(t: Any) -> Any:
    assert t.grad is not None
    return t.grad.sbp


def _mlp_grads(placement: Any, coalesce: bool, batch: int = 7) -> tuple[dict[str, np.ndarray], dict[str, int], Any]:
    """A 2-layer MLP with broadcast weights on split data; its gradients, backward collectives and grad SBPs."""
    nd = placement.ndim
    g = torch.Generator().manual_seed(0)
    x = sbpflow.tensor(torch.randn(batch, 5, generator=g), placement=placement, sbp=(S.split(0),) * nd)
    weights = {
        "w1": torch.randn(5, 7, generator=g), "b1": torch.randn(7, generator=g),
        "w2": torch.randn(7, 3, generator=g),
    }
    params = {k: sbpflow.tensor(v, placement=placement, sbp=(B,) * nd, requires_grad=True) for k, v in weights.items()}
    loss = ((((x @ params["w1"]) + params["b1"]).relu() @ params["w2"]) ** 2).sum()
    with record() as log, coalesce_grad_reductions(coalesce):
        loss.backward()
    grads = {k: _grad(p) for k, p in params.items()}
    return grads, log.counts(), {k: _sbp(p) for k, p in params.items()}


@pytest.mark.parametrize("name", ["2", "3", "2x2"])
def test_mlp_gradients_equal_per_leaf_reductions_with_one_all_reduce(name: str) -> None:
    placement = PLACEMENTS[name]
    want, per_leaf, _ = _mlp_grads(placement, coalesce=False)
    got, coalesced, sbps = _mlp_grads(placement, coalesce=True)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # one leaf's plan (all-reduce; on the 2x2 mesh reduce-scatter, all-reduce, all-gather per group) once, not 3x
    assert per_leaf == {kind: 3 * n for kind, n in coalesced.items()}
    assert sum(coalesced.values()) == (1 if placement.ndim == 1 else 6)
    assert all(sbp == (B,) * placement.ndim for sbp in sbps.values())


def test_local_tensors_are_untouched() -> None:
    w = sbpflow.tensor(torch.ones(3), requires_grad=True)
    with record() as log, coalesce_grad_reductions():
        (w * 2).sum().backward()
    assert log.counts() == {}
    np.testing.assert_array_equal(_grad(w), [2.0, 2.0, 2.0])


def _mixed_leaves(coalesce: bool) -> tuple[dict[str, np.ndarray], Counter[tuple[str, tuple[int, ...]]], Any]:
    p2, p3 = PLACEMENTS["2"], PLACEMENTS["3"]
    x2 = sbpflow.tensor(torch.arange(5.0).reshape(5, 1), placement=p2, sbp=S.split(0))
    x3 = sbpflow.tensor(torch.arange(7.0).reshape(7, 1), placement=p3, sbp=S.split(0))
    leaves = {
        "a": sbpflow.tensor(torch.ones(2), placement=p2, sbp=B, requires_grad=True),
        "b": sbpflow.tensor(torch.ones(3), placement=p2, sbp=B, requires_grad=True),
        "c": sbpflow.tensor(torch.ones(4), placement=p3, sbp=B, requires_grad=True),  # alone on its placement
        "d": sbpflow.tensor(torch.ones(5, 2), placement=p2, sbp=S.split(0), requires_grad=True),  # no reduction
        "d64": sbpflow.tensor(torch.ones(2, dtype=torch.float64), placement=p2, sbp=B, requires_grad=True),
    }
    on_3 = (x3 * leaves["c"]).sum().to_global(placement=p2, sbp=B)  # its gradient goes back to cpu:[0, 1, 2]
    loss = ((x2 * leaves["a"]).sum() + (x2 * leaves["b"]).sum() + on_3 + (leaves["d"] * x2).sum()
            + (x2.to(torch.float64) * leaves["d64"]).sum().float())
    with record() as log, coalesce_grad_reductions(coalesce):
        loss.backward()
    return ({k: _grad(t) for k, t in leaves.items()}, Counter((e.kind, e.ranks) for e in log.events),
            {k: _sbp(t) for k, t in leaves.items()})


def test_groups_by_placement_and_dtype_and_leaves_others_alone() -> None:
    want, per_leaf, _ = _mixed_leaves(False)
    got, coalesced, sbps = _mixed_leaves(True)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    np.testing.assert_array_equal(got["a"], [10.0, 10.0])
    np.testing.assert_array_equal(got["c"], [21.0] * 4)
    # a and b share one all-reduce; c (3 ranks) and d64 (float64) keep theirs; d's gradient is S(0) already
    assert per_leaf - coalesced == Counter({("all_reduce", (0, 1)): 1}) and not coalesced - per_leaf
    assert sbps["d"] == (S.split(0),) and all(sbps[k] == (B,) for k in ("a", "b", "c", "d64"))


def test_gradients_accumulate_into_existing_grads() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(torch.arange(5.0).reshape(5, 1), placement=p, sbp=S.split(0))
    a = sbpflow.tensor(torch.ones(2), placement=p, sbp=B, requires_grad=True)
    b = sbpflow.tensor(torch.ones(3), placement=p, sbp=B, requires_grad=True)
    for _ in range(2):
        with coalesce_grad_reductions():
            ((x * a).sum() + (x * b).sum()).backward()
    np.testing.assert_array_equal(_grad(a), [20.0, 20.0])
    np.testing.assert_array_equal(_grad(b), [20.0] * 3)


def test_gpt_data_parallel_step_reduces_every_gradient_in_one_all_reduce() -> None:
    config = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    ids, targets = next(random_batches(config.vocab_size, 1, 6, 8))
    grads, counts = [], []
    for coalesce in (False, True):
        trainer = build(config, "dp=3")
        ids_t, targets_t = trainer.inputs(ids, targets)
        _, loss = trainer.model(ids_t, targets_t)
        with record() as log, coalesce_grad_reductions(coalesce):
            loss.backward()
        counts.append(log.counts())
        grads.append({n: _grad(p) for n, p in trainer.model.named_parameters()})
    n_params = len(grads[0])
    assert counts == [{"all_reduce": n_params}, {"all_reduce": 1}]
    for name, want in grads[0].items():
        np.testing.assert_array_equal(grads[1][name], want, err_msg=name)


def test_mode_is_scoped() -> None:
    from sbpflow.autograd import _mode

    assert not _mode.coalesce
    with coalesce_grad_reductions():
        assert _mode.coalesce
        with coalesce_grad_reductions(False):
            assert not _mode.coalesce
        assert _mode.coalesce
    assert not _mode.coalesce
