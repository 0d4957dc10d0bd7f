"""Attention, convolution and pooling against torch, with the collectives each layout needs."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as TF

import sbpflow
from harness import PLACEMENTS, PSUM, B, all_reduce_payloads, check, randn, random_sbp
from sbpflow import sbp as S
from sbpflow.ops import functional as F

PNAMES = ["1", "2", "3", "2x2"]


def _nd(p: sbpflow.Placement, s: object) -> tuple:
    return (s,) * p.ndim


def _all_reduces(counts: dict[str, int]) -> int:
    """All-reduces in a comm log, counting the planner's reduce-scatter + all-gather form as one."""
    assert set(counts) <= {"all_reduce", "reduce_scatter", "all_gather"}, counts
    assert counts.get("reduce_scatter", 0) == counts.get("all_gather", 0), counts
    return counts.get("all_reduce", 0) + counts.get("reduce_scatter", 0)


def _g(value: torch.Tensor, sbp: object = B, pname: str = "2") -> sbpflow.Tensor:
    return sbpflow.tensor(value, placement=PLACEMENTS[pname], sbp=sbp)


# -- scaled_dot_product_attention ------------------------------------------------------------------


def _qkv(b: int = 3, h: int = 2, tq: int = 5, tk: int = 5, d: int = 4, seed: int = 0) -> list[torch.Tensor]:
    return [randn(b, h, tq, d, seed=seed), randn(b, h, tk, d, seed=seed + 1), randn(b, h, tk, d, seed=seed + 2)]


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_random_sbps(pname: str, seed: int, causal: bool) -> None:
    p, rng = PLACEMENTS[pname], random.Random(seed)
    values = _qkv(tk=5 if causal else 7, seed=seed)
    sbps = [random_sbp(v.shape, p, rng) for v in values]
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
          lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=causal), values, p, sbps)


@pytest.mark.parametrize("pname", ["2", "3", "2x2"])
@pytest.mark.parametrize("dim", [0, 1])
def test_sdpa_batch_or_head_split_needs_no_comm(pname: str, dim: int) -> None:
    p = PLACEMENTS[pname]
    sbp = _nd(p, S.split(dim)) if p.ndim == 1 else (S.split(0), S.split(1))
    r = check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
              lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True), _qkv(), p, [sbp] * 3)
    assert r.out.sbp == sbp
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}


@pytest.mark.parametrize("pname", ["2", "3"])
def test_sdpa_query_row_split_shifts_the_causal_mask(pname: str) -> None:
    p = PLACEMENTS[pname]
    values = _qkv(b=2, tq=7, tk=7)
    r = check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
              lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3), values, p,
              [S.split(2), B, B])
    assert r.out.sbp == (S.split(2),)
    assert r.forward_log.counts() == {}
    # dk and dv sum over the query rows: partial gradients of B leaves, reduced in one bucket
    assert all_reduce_payloads(r.backward_log) == [2 * 4 * values[1].numel()]
    assert r.backward_log.counts() == {"all_reduce": 1}


def test_sdpa_partial_v_stays_partial() -> None:
    p = PLACEMENTS["2"]
    r = check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
              lambda q, k, v: TF.scaled_dot_product_attention(q, k, v), _qkv(), p, [B, B, PSUM])
    assert r.out.sbp == (PSUM,)
    assert r.forward_log.counts() == {}


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_masks_follow_splits(pname: str, kind: str) -> None:
    p, rng = PLACEMENTS[pname], random.Random(kind)
    gen = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(5, 6, generator=gen) > 0.3
        mask[:, 0] = True  # no fully masked row (torch gives NaN there)
    else:
        mask = randn(3, 1, 5, 6, seed=9)
    values = _qkv(tk=6) + [mask]
    for _ in range(2):
        sbps = [random_sbp(v.shape, p, rng) for v in values]
        check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
              lambda q, k, v, m: TF.scaled_dot_product_attention(q, k, v, attn_mask=m), values, p, sbps,
              grad=[True, True, True, False])


def test_sdpa_batch_split_with_batched_mask_needs_no_comm() -> None:
    p = PLACEMENTS["3"]
    values = _qkv(b=5) + [randn(5, 1, 5, 5, seed=4)]
    r = check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
              lambda q, k, v, m: TF.scaled_dot_product_attention(q, k, v, attn_mask=m), values, p,
              [S.split(0)] * 4, grad=[True, True, True, False])
    assert r.forward_log.counts() == {}


def test_sdpa_empty_batch_shards() -> None:
    p = PLACEMENTS["3"]  # one sample on three ranks: two shards are empty
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
          lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True), _qkv(b=1), p, [S.split(0)] * 3)


def test_sdpa_errors() -> None:
    q, k = _g(randn(2, 2, 5, 4), S.split(1)), _g(randn(2, 2, 5, 3))
    with pytest.raises(sbpflow.ShapeError, match=r"'scaled_dot_product_attention'.*head dim 4.*head dim 3.*S\(1\)"):
        F.scaled_dot_product_attention(q, k, k)
    with pytest.raises(sbpflow.OpError, match=r"dropout_p=0 only"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(sbpflow.OpError, match=r"not both"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=_g(torch.ones(5, 5, dtype=torch.bool)), is_causal=True)
    with pytest.raises(sbpflow.ShapeError, match=r"'scaled_dot_product_attention'.*\[4, 5\].* are not broadcastable"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=_g(torch.ones(4, 5, dtype=torch.bool)))


# -- conv2d ----------------------------------------------------------------------------------------

CONVS = [
    dict(stride=1, padding=1, dilation=1, groups=1),
    dict(stride=2, padding=0, dilation=1, groups=1),
    dict(stride=(1, 2), padding=(2, 1), dilation=(2, 1), groups=1),
    dict(stride=1, padding="same", dilation=1, groups=2),
]


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("attrs", CONVS, ids=repr)
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_random_sbps(pname: str, attrs: dict, bias: bool) -> None:
    p, rng = PLACEMENTS[pname], random.Random(repr(attrs) + str(bias))
    groups = attrs["groups"]
    values = [randn(3, 4, 6, 5), randn(6, 4 // groups, 3, 3, seed=1)] + ([randn(6, seed=2)] if bias else [])
    sbps = [random_sbp(v.shape, p, rng, partial=True) for v in values]
    check(lambda *a: F.conv2d(*a, **attrs), lambda *a: TF.conv2d(*a, **attrs), values, p, sbps)


def _conv_loss(lib: object):  # type: ignore[no-untyped-def]
    """sum(conv(x)^2): the gradient reaching conv2d is then batch-split, as in training."""

    def loss(*args: object) -> object:
        out = lib.conv2d(*args, padding=1)  # type: ignore[attr-defined]
        return (out * out).sum()

    return loss


@pytest.mark.parametrize("pname", ["2", "3"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_batch_split_reduces_weight_grads_in_one_bucket(pname: str, bias: bool) -> None:
    p = PLACEMENTS[pname]
    values = [randn(5, 3, 6, 6), randn(4, 3, 3, 3, seed=1)] + ([randn(4, seed=2)] if bias else [])
    r = check(_conv_loss(F), _conv_loss(torch), values, p, [S.split(0)] + [B] * (len(values) - 1))
    assert r.forward_log.counts() == {}  # the loss stays a partial sum
    assert r.backward_log.counts() == {"all_reduce": 1}  # weight (and bias) share one flat bucket, as in DDP
    assert all_reduce_payloads(r.backward_log) == [4 * sum(v.numel() for v in values[1:])]


def test_conv2d_batch_split_on_a_mesh_needs_no_forward_comm() -> None:
    p = PLACEMENTS["2x2"]
    r = check(lambda x, w: F.conv2d(x, w), lambda x, w: TF.conv2d(x, w), [randn(5, 3, 5, 5), randn(4, 3, 3, 3)], p,
              [(S.split(0), S.split(0)), (B, B)])
    assert r.out.sbp == (S.split(0), S.split(0))
    assert r.forward_log.counts() == {}


def test_conv2d_output_channel_split() -> None:
    p = PLACEMENTS["3"]
    values = [randn(2, 3, 5, 5), randn(5, 3, 3, 3, seed=1), randn(5, seed=2)]
    r = check(lambda *a: F.conv2d(*a), lambda *a: TF.conv2d(*a), values, p, [B, S.split(0), S.split(0)])
    assert r.out.sbp == (S.split(1),)
    assert r.forward_log.counts() == {}


def test_conv2d_input_channel_split_gives_partial_sum() -> None:
    p = PLACEMENTS["2"]
    values = [randn(2, 5, 4, 4), randn(3, 5, 3, 3, seed=1), randn(3, seed=2)]
    r = check(lambda *a: F.conv2d(*a), lambda *a: TF.conv2d(*a), values, p, [S.split(1), S.split(1), PSUM])
    assert r.out.sbp == (PSUM,)
    assert r.forward_log.counts() == {}


def test_conv2d_errors() -> None:
    x = _g(randn(2, 3, 5, 5), S.split(0))
    with pytest.raises(sbpflow.ShapeError, match=r"'conv2d'.*3 channels.*weight \[4, 2, 3, 3\].*S\(0\)"):
        F.conv2d(x, _g(randn(4, 2, 3, 3)))
    with pytest.raises(sbpflow.ShapeError, match=r"'conv2d'.*input \(N, C, H, W\)"):
        F.conv2d(_g(randn(3, 5, 5)), _g(randn(4, 3, 3, 3)))
    with pytest.raises(sbpflow.ShapeError, match=r"'conv2d'.*bias of shape \[4\]"):
        F.conv2d(x, _g(randn(4, 3, 3, 3)), _g(randn(3)))
    with pytest.raises(sbpflow.ShapeError, match=r"conv2d cannot take input \[2, 3, 5, 5\]"):
        F.conv2d(x, _g(randn(4, 3, 7, 7)))


# -- pooling ---------------------------------------------------------------------------------------

POOLS = [
    ("max", dict(kernel_size=2)),
    ("max", dict(kernel_size=3, stride=2, padding=1)),
    ("avg", dict(kernel_size=(2, 3), stride=1)),
    ("avg", dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
    ("adaptive", dict(output_size=1)),
    ("adaptive", dict(output_size=(3, None))),
]


def _pool(kind: str, attrs: dict, lib: object) -> object:
    name = {"max": "max_pool2d", "avg": "avg_pool2d", "adaptive": "adaptive_avg_pool2d"}[kind]
    fn = getattr(lib, name)
    return lambda x: fn(x, **attrs)


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize(("kind", "attrs"), POOLS, ids=repr)
def test_pool_random_sbps(pname: str, kind: str, attrs: dict) -> None:
    p, rng = PLACEMENTS[pname], random.Random(kind + repr(attrs))
    x = randn(3, 5, 7, 6)
    for _ in range(2):
        sbp = random_sbp(x.shape, p, rng, partial=kind != "max")
        check(_pool(kind, attrs, F), _pool(kind, attrs, TF), [x], p, [sbp])


@pytest.mark.parametrize("pname", ["2", "3", "2x2"])
@pytest.mark.parametrize(("kind", "attrs"), POOLS[::2], ids=repr)
def test_pool_batch_and_channel_splits_need_no_comm(pname: str, kind: str, attrs: dict) -> None:
    p = PLACEMENTS[pname]
    sbp = (S.split(1),) if p.ndim == 1 else (S.split(0), S.split(1))
    r = check(_pool(kind, attrs, F), _pool(kind, attrs, TF), [randn(2, 5, 6, 6)], p, [sbp])
    assert r.out.sbp == sbp
    assert r.forward_log.counts() == {}
    assert r.backward_log.counts() == {}


def test_max_pool_passes_partial_max_and_avg_pool_partial_sum() -> None:
    p = PLACEMENTS["2"]
    r = check(_pool("max", dict(kernel_size=2), F), _pool("max", dict(kernel_size=2), TF), [randn(2, 3, 4, 4)], p,
              [S.partial_max], grad=False)
    assert r.out.sbp == (S.partial_max,)
    assert r.forward_log.counts() == {}
    r = check(_pool("avg", dict(kernel_size=2), F), _pool("avg", dict(kernel_size=2), TF), [randn(2, 3, 4, 4)], p,
              [PSUM])
    assert r.out.sbp == (PSUM,)
    assert r.forward_log.counts() == {}


def test_pool_errors() -> None:
    with pytest.raises(sbpflow.ShapeError, match=r"'max_pool2d'.*\(N, C, H, W\) or \(C, H, W\).*\[4, 4\]"):
        F.max_pool2d(_g(randn(4, 4)), 2)
    with pytest.raises(sbpflow.ShapeError, match=r"'avg_pool2d'.*cannot take input \[1, 1, 2, 2\]"):
        F.avg_pool2d(_g(randn(1, 1, 2, 2), S.split(1)), 3)
    with pytest.raises(sbpflow.ShapeError, match=r"output_size as a positive int"):
        F.adaptive_avg_pool2d(_g(randn(1, 1, 2, 2)), 0)


@pytest.mark.parametrize("sbps", [[B, B, B], [S.split(2), B, B], [S.split(0)] * 3])
def test_sdpa_backward_runs_no_second_forward(monkeypatch: pytest.MonkeyPatch, sbps: list) -> None:  # type: ignore[type-arg]
    """Backward is torch's flash backward from the saved logsumexp: no attention forward runs in it (issue 14)."""
    from sbpflow.ops import attention as A

    def no_recompute(*args: object, **kwargs: object) -> None:
        raise AssertionError("attention recomputed in backward")

    forwards = []
    kernel = A._sdpa.kernel
    monkeypatch.setattr(A._sdpa, "kernel", lambda *a, **k: forwards.append(1) or kernel(*a, **k))
    monkeypatch.setattr(A, "_local_sdpa", no_recompute)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
          lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True), _qkv(tq=6, tk=6),
          PLACEMENTS["2"], sbps)
    assert len(forwards) == 1  # one call for both ranks (a communicating kernel), in forward only
