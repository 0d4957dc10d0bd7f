"""Context parallelism: attention with q, k and v all split on the sequence runs as a ring, and matches torch.

K/V blocks travel the ring by send/recv (c - 1 hops forward; K, V, dK, dV c - 1 hops and dK, dV one more
backward); nothing gathers the whole K or V. GPT and Llama train under dp2 x cp2 as on one device, eagerly and
in nn.Graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import sbpflow
from cp_train import make, train, train_parallelized
from harness import check, randn
from sbpflow import sbp as S
from sbpflow._layout import logical_pieces
from sbpflow.comm.base import nbytes
from sbpflow.errors import PlanError
from sbpflow.ops import functional as F
from sbpflow.ops import ring_attention as ring
from sbpflow.ops.ring_attention import causal_work
from sbpflow.ops.schema import Meta
from sbpflow.placement import Placement

T = S.split(2)  # the sequence dim of (B, H, T, D)


def _qkv(heads: int, kv_heads: int, t: int, dv: int = 6, seed: int = 0) -> list[torch.Tensor]:
    return [randn(2, heads, t, 8, seed=seed), randn(2, kv_heads, t, 8, seed=seed + 1),
            randn(2, kv_heads, t, dv, seed=seed + 2)]


def _sdpa(causal: bool, gqa: bool) -> tuple:
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
            lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa))


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("kv_heads", "t", "dv"), [(4, 12, 8), (2, 11, 6), (1, 7, 8)])  # MHA, GQA, MQA
def test_ring_attention_matches_torch(cp: int, causal: bool, kv_heads: int, t: int, dv: int) -> None:
    """Lengths even and uneven; head dims equal (torch's flash kernel per block) or not (the block's own math)."""
    values = _qkv(4, kv_heads, t, dv)
    r = check(*_sdpa(causal, kv_heads != 4), values, sbpflow.placement("cpu", list(range(cp))), [(T,)] * 3)
    assert r.out.sbp == (T,)
    k, v = values[1], values[2]
    kv_bytes = nbytes(k.shape, k.dtype) + nbytes(v.shape, v.dtype)
    # every step each member passes the block it holds on: the whole K and V move once per step, never gathered
    assert r.forward_log.counts() == {"send_recv": cp - 1}
    assert r.forward_log.total_bytes() == (cp - 1) * kv_bytes
    # K, V cp - 1 hops posted before each step's math, dK, dV after it, then dK, dV home
    assert r.backward_log.counts() == {"send_recv": 2 * cp - 1}
    assert r.backward_log.total_bytes() == (cp - 1) * 2 * kv_bytes + kv_bytes  # fp32 dK, dV travel with them


Z = S.zigzag(2)  # the zigzag split: rank r of c holds chunks r and 2c-1-r of the sequence


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("kv_heads", "t", "dv"), [(4, 16, 8), (2, 11, 6), (1, 7, 8)])  # MHA, GQA, MQA
def test_zigzag_ring_attention_matches_torch(cp: int, causal: bool, kv_heads: int, t: int, dv: int) -> None:
    """q, k, v Z(T): each rank's block is two chunks, each pair of chunks masked in its logical positions; the
    same messages as plain S(T) (the blocks only hold other rows). 7 over 4 ranks leaves a chunk empty."""
    values = _qkv(4, kv_heads, t, dv)
    r = check(*_sdpa(causal, kv_heads != 4), values, sbpflow.placement("cpu", list(range(cp))), [(Z,)] * 3)
    assert r.out.sbp == (Z,) and all(g.sbp == (Z,) for g in r.grads)
    k, v = values[1], values[2]
    kv_bytes = nbytes(k.shape, k.dtype) + nbytes(v.shape, v.dtype)
    assert r.forward_log.counts() == {"send_recv": cp - 1}
    assert r.forward_log.total_bytes() == (cp - 1) * kv_bytes
    assert r.backward_log.counts() == {"send_recv": 2 * cp - 1}


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("layout", [T, Z], ids=["S(T)", "Z(T)"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_blocking_ring_computes_what_the_overlapped_one_does(cp: int, layout: S.SbpParallel,
                                                                 causal: bool) -> None:
    """``overlap=False`` (the benchmark's baseline) posts each hop after the step's math: the same values as the
    overlapped ring, bit for bit, and both equal torch."""
    q, k, v = _qkv(4, 2, 13, dv=8)  # GQA; out has q's shape
    placement = sbpflow.placement("cpu", list(range(cp)))
    sharded = [sbpflow.tensor(t, placement=placement, sbp=(layout,)).local_tensors() for t in (q, k, v)]
    metas = tuple(Meta(tuple(t.shape), t.dtype) for t in (q, k, v))
    lse_meta = Meta(tuple(q.shape[:-1]), torch.float32)
    fwd = ring.contexts(placement, metas, (metas[0], lse_meta), (layout,))
    bwd = ring.contexts(placement, (metas[0], *metas, metas[0], lse_meta), metas, (layout,))
    dy_full = randn(*q.shape, seed=9)
    dy = sbpflow.tensor(dy_full, placement=placement, sbp=(layout,)).local_tensors()
    results = []
    for overlap in (True, False):
        outs = ring.forward(fwd, *sharded, causal, None, overlap=overlap)
        out, lse = ({r: o[i] for r, o in outs.items()} for i in range(2))
        grads = ring.backward(bwd, dy, *sharded, out, lse, causal, None, overlap=overlap)
        results.append([out[r] for r in placement.flat_ranks] + [g for r in placement.flat_ranks for g in grads[r]])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = TF.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    expected.backward(dy_full)
    got = [results[1][:cp], *(results[1][cp + i::3] for i in range(3))]  # out, then dq, dk, dv of every rank
    for shards, want in zip(got, [expected.detach()] + [t.grad for t in leaves], strict=True):
        torch.testing.assert_close(_gathered(shards, placement, layout, want.shape), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_a_zigzag_ring_step_is_one_kernel_call(cp: int) -> None:
    """Under Z(T) and a causal mask every step of every rank is one call: its own two chunks causally in local
    positions, then both chunks against an earlier member's first chunk, or its second chunk against a later
    member's two, unmasked (as torch's ring with its head-tail balance)."""
    placement = sbpflow.placement("cpu", list(range(cp)))
    meta = Meta((1, 2, 16 * cp, 4), torch.float32)
    ctx = ring.contexts(placement, (meta,) * 3, (meta, Meta(meta.shape[:-1], torch.float32)), (Z,))[0]
    kernel = ring._Ring(ctx, 2, k_index=1)
    calls = {(r, step): ring._blocks(kernel, r, step, causal=True) for r in range(cp) for step in range(cp)}
    assert all(len(blocks) == 1 for blocks in calls.values())
    assert all(calls[r, 0][0][4] and all(not calls[r, s][0][4] for s in range(1, cp)) for r in range(cp))


def _gathered(shards: list[torch.Tensor], placement: Placement, layout: S.SbpParallel,
              shape: torch.Size) -> torch.Tensor:
    """The logical tensor from each rank's shard (rank order), zigzag chunks put back in place."""
    whole = torch.empty(shape)
    for r, shard in zip(placement.flat_ranks, shards, strict=True):
        start = 0
        for box in logical_pieces(tuple(shape), placement, (layout,), r):
            lo, hi = box[2]
            whole[:, :, lo:hi] = shard[:, :, start:start + hi - lo]
            start += hi - lo
    return whole


@pytest.mark.parametrize("other", [S.split(0), S.split(1)], ids=["dp x cp", "tp x cp"])
def test_zigzag_ring_attention_on_2d_meshes(other: S.SbpParallel) -> None:
    sbp = (other, Z)
    r = check(*_sdpa(True, False), _qkv(4, 4, 13), sbpflow.placement("cpu", [[0, 1], [2, 3]]), [sbp] * 3)
    assert r.out.sbp == sbp
    assert r.forward_log.counts() == {"send_recv": 1}


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(cp: int) -> None:
    """Per-rank (query, key) pairs under a causal mask: plain S(T) gives rank p p + 1 blocks, Z(T) every rank
    the same work (to the rounding of uneven chunks)."""
    p = sbpflow.placement("cpu", list(range(cp)))
    plain, zigzag = causal_work(4096, p, (S.split(0),)), causal_work(4096, p, (S.zigzag(0),))
    assert max(plain) / (sum(plain) / cp) > 1.3
    assert max(zigzag) / (sum(zigzag) / cp) < 1.01 and min(zigzag) / (sum(zigzag) / cp) > 0.99


@pytest.mark.parametrize(("other", "name"), [(S.split(0), "dp x cp"), (S.split(1), "tp x cp"), (T, "cp x cp")])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_on_2d_meshes(other: S.SbpParallel, name: str, causal: bool) -> None:
    """One ring per coordinate of the other axis (both rings move in one send_recv per step); a sequence split
    over both axes is one ring of four."""
    sbp = (other, T)
    r = check(*_sdpa(causal, False), _qkv(4, 4, 13), sbpflow.placement("cpu", [[0, 1], [2, 3]]), [sbp] * 3)
    assert r.out.sbp == sbp
    steps = 3 if other == T else 1
    assert r.forward_log.counts() == {"send_recv": steps}
    assert r.backward_log.counts() == {"send_recv": 2 * steps + 1}


def test_a_mask_tensor_keeps_the_gathered_keys() -> None:
    """The ring carries no mask columns: with attn_mask, K and V are gathered (the query-row split) instead."""
    q, k, v = _qkv(2, 2, 6, dv=8)  # torch's CPU flash kernel (the per-shard path) wants one head size
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    mask |= torch.eye(6, dtype=torch.bool)
    p = sbpflow.placement("cpu", [0, 1])
    r = check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
              lambda q, k, v, m: TF.scaled_dot_product_attention(q, k, v, attn_mask=m), [q, k, v, mask], p,
              [(T,)] * 3 + [(S.broadcast,)], grad=[True, True, True, False])
    assert "send_recv" not in r.forward_log.counts()


def test_gqa_needs_enable_gqa() -> None:
    q, k, v = (sbpflow.tensor(x) for x in _qkv(4, 2, 5))
    with pytest.raises(sbpflow.ShapeError, match=r"enable_gqa.*q \[2, 4, 5, 8\], k \[2, 2, 5, 8\]"):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(sbpflow.ShapeError, match=r"heads dividing q heads"):
        F.scaled_dot_product_attention(*(sbpflow.tensor(x) for x in _qkv(4, 3, 5)), enable_gqa=True)


@pytest.fixture(scope="module", params=["gpt", "llama"])
def one_device(request: pytest.FixtureRequest) -> tuple[str, tuple]:
    return request.param, train(request.param, None)


@pytest.mark.parametrize("mode", ["eager", "graph-greedy", "graph-ilp"])
def test_dp2_cp2_training_matches_one_device(one_device: tuple[str, tuple], mode: str) -> None:
    kind, (ref_losses, ref_params, _) = one_device
    graph, selection = mode != "eager", mode.removeprefix("graph-") if mode != "eager" else "ilp"
    losses, params, log = train(kind, [[0, 1], [2, 3]], graph=graph, selection=selection)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for name, value in ref_params.items():  # AdamW moves an about-zero gradient lr-sized on rounding noise
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1.5e-3, err_msg=name)
    if mode != "graph-ilp":  # eager's choice: the ring, one message forward and three backward in each of two layers
        assert log.counts()["send_recv"] == 8
    if mode == "eager":
        assert "all_gather" not in log.counts()


@pytest.mark.parametrize("mode", ["eager", "graph-greedy", "graph-ilp"])
def test_dp2_cp2_zigzag_training_matches_one_device(one_device: tuple[str, tuple], mode: str) -> None:
    """ids and targets Z(1) on the cp axis: the zigzag runs through embeddings, norms, matmuls, reshapes and RoPE
    (its broadcast tables sliced to each rank's two chunks) with no boxing, and attention is the zigzag ring. The
    loss's flatten of (B, T) into B*T rows has no zigzag layout: logits and targets go to S(0) by all-to-all, as
    from a plain S(1)."""
    kind, (ref_losses, ref_params, _) = one_device
    graph, selection = mode != "eager", mode.removeprefix("graph-") if mode != "eager" else "ilp"
    losses, params, log = train(kind, [[0, 1], [2, 3]], graph=graph, selection=selection, sequence=S.zigzag(1))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1.5e-3, err_msg=name)
    if mode != "graph-ilp":  # the zigzag ring: one message forward and three backward in each of two layers
        assert log.counts()["send_recv"] == 8
        assert "all_gather" not in log.counts()  # nothing is gathered, not even the loss's rows


@pytest.mark.parametrize("degrees", [{"data": 2, "context": 2}, {"context": 2, "tensor": 2}],
                         ids=["dp2xcp2", "cp2xtp2"])
def test_parallelize_context_matches_one_device(one_device: tuple[str, tuple], degrees: dict[str, int]) -> None:
    """sbpflow.parallelize(model, context=2) knows no model: the (data, context, tensor) mesh, parameters B on
    the context axis, ids and targets Z(1) on it; attention runs as the zigzag ring, heads split over tensor."""
    kind, (ref_losses, ref_params, _) = one_device
    losses, params, log = train_parallelized(kind, **degrees)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1.5e-3, err_msg=name)
    assert log.counts()["send_recv"] >= 8  # the ring: forward and backward of two layers
    if kind == "gpt" and degrees.get("tensor") == 2:
        # per tensor group 13, Megatron's own: 2 layers x (2 row-parallel outputs forward, 2 column-parallel
        # inputs' gradients backward), the vocab-parallel embedding's output and its tied head's input gradient,
        # and the vocab-parallel cross-entropy's max, target logit and sum; per context group 2: one bucket of
        # every weight's gradient, split on tensor or not, and the loss
        assert log.counts()["all_reduce"] == 2 * 13 + 2 * 2


def test_parallelize_context_needs_a_sequence_dim() -> None:
    model = sbpflow.nn.Linear(4, 4)
    sbpflow.parallelize(model, context=2)
    with pytest.raises(PlanError, match=r"context=2\) splits inputs on their sequence \(dim 1\), but an "
                                                 r"input has shape \[4\]"):
        model(sbpflow.randn(4))


class _TrainStep(sbpflow.nn.Graph):
    def __init__(self, model: object) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sbpflow.optim.AdamW(model.parameters(), lr=1e-3))  # type: ignore[attr-defined]
        self.config.sbp_selection = "greedy"

    def build(self, ids: sbpflow.Tensor, targets: sbpflow.Tensor) -> sbpflow.Tensor:
        _, loss = self.model(ids, targets)  # type: ignore[operator]
        loss.backward()
        return loss


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_zigzag_sequence_crosses_the_whole_step_without_boxing(kind: str) -> None:
    """Batch 1, ids and targets Z(1) on 4 ranks, compiled: embeddings, norms, matmuls, RoPE, attention (the
    ring, a node of its own), the loss rows and their gradients all keep the zigzag. The only collectives are
    the gradients' and the loss's all-reduces; the only other boxing cuts broadcast tables (positions, RoPE)
    into each rank's two chunks."""
    placement = sbpflow.placement("cpu", [0, 1, 2, 3])
    with sbpflow.meta_init():
        model = make(kind)
    model.to_global(placement, (S.broadcast,))
    ids = [sbpflow.meta_tensor(1, 16, dtype=torch.int64, placement=placement, sbp=(S.zigzag(1),)) for _ in range(2)]
    plan = _TrainStep(model).compile_only(*ids).plan
    moves = [n.boxing for n in plan.nodes if n.kind == "boxing" and n.boxing is not None and n.boxing.steps]
    assert {s.kind for b in moves for s in b.steps} <= {"all_reduce", "local"}
    assert all(b.dst.sbp == (S.zigzag(0),) for b in moves if b.steps[0].kind == "local")
    node = next(n for n in plan.nodes if n.op == "scaled_dot_product_attention")
    assert node.in_sbps == ((S.zigzag(2),),) * 3


class _Attention(sbpflow.nn.Graph):
    def build(self, q: sbpflow.Tensor, k: sbpflow.Tensor, v: sbpflow.Tensor) -> sbpflow.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(("cp", "t", "chosen"), [(2, 4096, "ring"), (4, 256, "ring"), (4, 4096, "ulysses")])
def test_the_compiler_prices_ring_against_ulysses(cp: int, t: int, chosen: str) -> None:
    """nn.Graph's SBP selection prices the ring's messages (ops.ring_attention.forward_talks) against the
    all-to-alls from sequence to heads (Ulysses: q, k, v S(T) -> S(H), the output back): at four ranks and a
    long sequence the ring's three hops of K and V cost more than four all-to-alls of a quarter each."""
    p = sbpflow.placement("cpu", list(range(cp)))
    args = [sbpflow.meta_tensor(1, 8, t, 64, placement=p, sbp=(T,)) for _ in range(3)]
    plan = _Attention().compile_only(*args).plan
    node = next(n for n in plan.nodes if n.op == "scaled_dot_product_attention")
    comms = sorted(n.boxing.steps[0].kind for n in plan.nodes if n.kind == "boxing" and n.is_comm and n.boxing)
    if chosen == "ring":
        assert node.in_sbps == ((T,),) * 3 and node.stream != "compute" and comms == []
    else:
        assert node.in_sbps == ((S.split(1),),) * 3 and node.stream == "compute"
        assert comms == ["all_to_all"] * 4


class _ZigzagAttention(sbpflow.nn.Graph):
    def build(self, q: sbpflow.Tensor, k: sbpflow.Tensor, v: sbpflow.Tensor) -> sbpflow.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2.0


@pytest.mark.parametrize(("cp", "t", "chosen"), [(2, 4096, "ring"), (4, 256, "ring"), (4, 4096, "ulysses")])
def test_the_compiler_keeps_a_zigzag_or_goes_to_heads(cp: int, t: int, chosen: str) -> None:
    """From Z(T) inputs nn.Graph's selection (ILP) weighs the zigzag ring, the scaling after it kept Z (its zigzag
    twin), against Ulysses, now one all-to-all each way from Z(T) to the heads (no gather)."""
    p = sbpflow.placement("cpu", list(range(cp)))
    args = [sbpflow.meta_tensor(1, 8, t, 64, placement=p, sbp=(Z,)) for _ in range(3)]
    plan = _ZigzagAttention().compile_only(*args).plan
    node = next(n for n in plan.nodes if n.op == "scaled_dot_product_attention")
    comms = sorted(n.boxing.steps[0].kind for n in plan.nodes if n.kind == "boxing" and n.is_comm and n.boxing)
    if chosen == "ring":
        assert node.in_sbps == ((Z,),) * 3 and comms == []
    else:
        assert node.in_sbps == ((S.split(1),),) * 3 and comms == ["all_to_all"] * 4
