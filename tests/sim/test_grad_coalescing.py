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


@pytest.mark.usefixtures("native_collectives")  # the 2x2 mesh's hierarchical plan reduce-scatters first
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


def test_mode_is_on_by_default_and_scoped() -> None:
    from sbpflow.autograd import _mode

    assert _mode.coalesce  # DDP-style buckets are the default (issue 14)
    with coalesce_grad_reductions(False):  # the opt-out
        assert not _mode.coalesce
        with coalesce_grad_reductions():
            assert _mode.coalesce
        assert not _mode.coalesce
    assert _mode.coalesce


def test_default_backward_reduces_in_buckets_and_the_opt_out_per_leaf() -> None:
    placement = PLACEMENTS["2"]
    g = torch.Generator().manual_seed(0)
    x = sbpflow.tensor(torch.randn(6, 5, generator=g), placement=placement, sbp=S.split(0))
    counts = []
    for opt_out in (False, True):
        w1, w2 = (sbpflow.tensor(torch.randn(5, 5, generator=g), placement=placement, sbp=B, requires_grad=True)
                  for _ in range(2))
        loss = ((x @ w1).relu() @ w2).sum()
        with record() as log:
            if opt_out:
                with coalesce_grad_reductions(False):
                    loss.backward()
            else:
                loss.backward()
        counts.append(log.counts())
    assert counts == [{"all_reduce": 1}, {"all_reduce": 2}]


# ----------------------------------------------------------------------------- buckets issued during backward

SIZES = {"w2": 7 * 3, "b1": 7, "w1": 5 * 7}  # floats; backward makes w2's gradient final first, then b1's, then w1's


def _bucketed_mlp(placement: Any, x_sbp: Any, cap_mb: float | None) -> tuple[dict[str, np.ndarray], list[Any], Any]:
    """The MLP of _mlp_grads with data ``x_sbp``; cap None: the per-leaf mode. Also the events and grad SBPs."""
    g = torch.Generator().manual_seed(0)
    x = sbpflow.tensor(torch.randn(7, 5, generator=g), placement=placement, sbp=x_sbp)
    weights = {"w1": torch.randn(5, 7, generator=g), "b1": torch.randn(7, generator=g),
               "w2": torch.randn(7, 3, generator=g)}
    nd = placement.ndim
    params = {k: sbpflow.tensor(v, placement=placement, sbp=(B,) * nd, requires_grad=True) for k, v in weights.items()}
    loss = ((((x @ params["w1"]) + params["b1"]).relu() @ params["w2"]) ** 2).sum()
    with record() as log, coalesce_grad_reductions(cap_mb is not None, bucket_cap_mb=cap_mb or 25.0):
        loss.backward()
    return {k: _grad(p) for k, p in params.items()}, log.events, {k: _sbp(p) for k, p in params.items()}


def _all_reduce_bytes(n_floats: int, group_size: int) -> int:
    return 2 * (group_size - 1) * 4 * n_floats


@pytest.mark.parametrize("name, x_sbp, group_size, n_groups", [
    ("2", (S.split(0),), 2, 1), ("3", (S.split(0),), 3, 1),
    ("2x2", (S.split(0), B), 2, 2),  # gradients (P, B): one all-reduce per axis-0 group
])
def test_small_cap_makes_several_buckets_in_backward_order(name: str, x_sbp: Any, group_size: int,
                                                           n_groups: int) -> None:
    placement = PLACEMENTS[name]
    want, per_leaf, _ = _bucketed_mlp(placement, x_sbp, None)
    cap_mb = 100 / 2**20  # w2 (84 B) alone stays open, w2 + b1 (112 B) fills a bucket; w1 (140 B) is left for the end
    got, events, sbps = _bucketed_mlp(placement, x_sbp, cap_mb)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert [e.kind for e in per_leaf] == ["all_reduce"] * (3 * n_groups)
    assert [e.kind for e in events] == ["all_reduce"] * (2 * n_groups)
    buckets = [SIZES["w2"] + SIZES["b1"], SIZES["w1"]]
    assert [e.bytes for e in events] == [_all_reduce_bytes(n, group_size) for n in buckets for _ in range(n_groups)]
    assert sorted({e.ranks for e in events}) == sorted(placement.axis_groups(0))
    assert all(sbp == (B,) * placement.ndim for sbp in sbps.values())


@pytest.mark.parametrize("cap_mb, buckets", [
    (1e-9, [["w2"], ["b1"], ["w1"]]),  # every gradient fills a bucket by itself
    (25.0, [["w2", "b1", "w1"]]),  # DDP's default: everything in one bucket, issued at the end
])
def test_bucket_count_and_order_follow_the_cap(cap_mb: float, buckets: list[list[str]]) -> None:
    placement = PLACEMENTS["2"]
    want, _, _ = _bucketed_mlp(placement, (S.split(0),), None)
    got, events, _ = _bucketed_mlp(placement, (S.split(0),), cap_mb)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert [(e.kind, e.ranks, e.bytes) for e in events] == [
        ("all_reduce", (0, 1), _all_reduce_bytes(sum(SIZES[k] for k in b), 2)) for b in buckets]


def test_a_full_bucket_is_issued_while_backward_still_runs() -> None:
    """With a tiny cap, w2's all-reduce is issued before backward reaches w1 (seen from a hook on w1)."""
    placement = PLACEMENTS["2"]
    g = torch.Generator().manual_seed(0)
    x = sbpflow.tensor(torch.randn(5, 4, generator=g), placement=placement, sbp=S.split(0))
    w1 = sbpflow.tensor(torch.randn(4, 6, generator=g), placement=placement, sbp=B, requires_grad=True)
    w2 = sbpflow.tensor(torch.randn(6, 2, generator=g), placement=placement, sbp=B, requires_grad=True)
    seen: list[list[str]] = []
    logs: list[Any] = []
    w1.register_hook(lambda grad: seen.append(logs[-1].kinds()))
    for cap_mb in (1e-9, 25.0):
        with record() as log, coalesce_grad_reductions(bucket_cap_mb=cap_mb):
            logs.append(log)
            ((x @ w1).tanh() @ w2).sum().backward()
    # tiny cap: w2's bucket was out when w1's gradient arrived; 25 MB: one bucket for both, issued after the last node
    assert seen == [["all_reduce"], []]
    assert [log.counts() for log in logs] == [{"all_reduce": 2}, {"all_reduce": 1}]


def test_leaf_used_twice_waits_for_its_last_use() -> None:
    """w feeds two nodes: its bucket takes the sum of both contributions, not the first alone."""
    placement = PLACEMENTS["2"]
    x = sbpflow.tensor(torch.arange(10.0).reshape(5, 2), placement=placement, sbp=S.split(0))
    w = sbpflow.tensor(torch.ones(2), placement=placement, sbp=B, requires_grad=True)
    v = sbpflow.tensor(torch.ones(2), placement=placement, sbp=B, requires_grad=True)
    with record() as log, coalesce_grad_reductions(bucket_cap_mb=1e-9):
        ((x * w).sum() + ((x * w) * v).sum() + (w * w).sum()).backward()
    np.testing.assert_array_equal(_grad(w), [2 * 20.0 + 2, 2 * 25.0 + 2])
    np.testing.assert_array_equal(_grad(v), [20.0, 25.0])
    assert log.counts() == {"all_reduce": 2}


def test_first_bucket_is_small_as_in_ddp() -> None:
    """Default cap (25 MiB): the first bucket is issued once it holds 1 MiB, the rest go together at the end."""
    placement = PLACEMENTS["2"]
    n = 160_000  # floats: 640 kB per gradient, so two of them pass 1 MiB
    x = sbpflow.tensor(torch.ones(2, n), placement=placement, sbp=S.split(0))
    leaves = [sbpflow.tensor(torch.ones(n), placement=placement, sbp=B, requires_grad=True) for _ in range(4)]
    with record() as log, coalesce_grad_reductions():
        sum(((x * w).sum() for w in leaves[1:]), (x * leaves[0]).sum()).backward()
    assert [e.bytes for e in log.events] == [_all_reduce_bytes(2 * n, 2)] * 2
    for w in leaves:
        np.testing.assert_array_equal(_grad(w), np.full(n, 2.0))


def test_bucket_cap_must_be_positive() -> None:
    with pytest.raises(sbpflow.errors.AutogradError, match="bucket_cap_mb"):
        with coalesce_grad_reductions(bucket_cap_mb=0):
            pass


def _tensor_parallel_mlp(coalesce: bool) -> tuple[dict[str, np.ndarray], Counter[tuple[str, tuple[int, ...]]], Any]:
    """A Megatron MLP on a (data, tensor) 2x2 mesh: w1 and b1 split on their 7 outputs (shards of 4 and 3), w2 on
    its inputs, b2 broadcast; x split on the batch over data."""
    placement = PLACEMENTS["2x2"]
    g = torch.Generator().manual_seed(0)
    x = sbpflow.tensor(torch.randn(6, 5, generator=g), placement=placement, sbp=(S.split(0), B))
    layouts = {"w1": ((5, 7), S.split(1)), "b1": ((7,), S.split(0)), "w2": ((7, 3), S.split(0)), "b2": ((3,), B)}
    params = {k: sbpflow.tensor(torch.randn(*shape, generator=g), placement=placement, sbp=(B, tp),
                                requires_grad=True) for k, (shape, tp) in layouts.items()}
    y = ((x @ params["w1"]) + params["b1"]).relu() @ params["w2"]
    loss = ((y + params["b2"]) ** 2).sum()
    with record() as log, coalesce_grad_reductions(coalesce):
        loss.backward()
    return ({k: _grad(p) for k, p in params.items()}, Counter((e.kind, e.ranks) for e in log.events),
            {k: (_sbp(p), p.sbp) for k, p in params.items()})


def test_tensor_parallel_weights_join_their_data_axis_bucket() -> None:
    """Gradients partial on the data axis and split like their weights on the tensor axis are reduced together:
    each rank ravels its shards (4 or 3 columns: the groups' buffers differ in length), one all-reduce per data
    group instead of one per weight; the values are the per-leaf reductions'."""
    want, per_leaf, _ = _tensor_parallel_mlp(False)
    got, coalesced, sbps = _tensor_parallel_mlp(True)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert all(grad_sbp == leaf_sbp for grad_sbp, leaf_sbp in sbps.values())
    data_groups = [("all_reduce", (0, 2)), ("all_reduce", (1, 3))]
    assert [per_leaf[g] for g in data_groups] == [4, 4] and [coalesced[g] for g in data_groups] == [1, 1]
    tensor_groups = [k for k in per_leaf if k not in data_groups]
    assert {k: coalesced[k] for k in tensor_groups} == {k: per_leaf[k] for k in tensor_groups}  # activations: kept
