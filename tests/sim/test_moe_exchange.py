"""nn.MoE with its experts split over a mesh axis (nn.moe.split_experts) sends tokens to their experts by an
all-to-all whose sizes follow the routing: ep2, ep4, dp2 x ep2 and ep2 x tp2 (Megatron inside each expert), dropless
and with a capacity, equal the same layer on one device (outputs, the input's and every weight's gradient); the
forward's only collectives are the count and row all-to-alls, which move exactly the slot rows routed off-rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import per_expert
from sbpflow import nn
from sbpflow.errors import SbpflowError
from sbpflow.nn.module import relayout_
from sbpflow.nn.moe import split_experts
from sbpflow.sbp import broadcast, split

RTOL, ATOL = 1e-4, 1e-5
HIDDEN, INTER, EXPERTS, K, TOKENS = 8, 12, 4, 2, 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# name -> (mesh ranks, ep axis, Megatron tp axis or None)
LAYOUTS: dict[str, tuple[Any, int, int | None]] = {
    "ep2": ([0, 1], 0, None),
    "ep4": ([0, 1, 2, 3], 0, None),
    "ep4_permuted": ([2, 0, 3, 1], 0, None),  # member j is not rank j: pieces follow the mesh, not rank order
    "dp2xep2": ([[0, 1], [2, 3]], 1, None),
    "ep2xtp2": ([[0, 1], [2, 3]], 0, 1),
}


def _layer(capacity: float | None) -> tuple[nn.MoE, dict[str, np.ndarray]]:
    moe = nn.MoE(HIDDEN, INTER, num_experts=EXPERTS, top_k=K, capacity_factor=capacity)
    rng = np.random.default_rng(0)
    values = {n: 0.5 * rng.standard_normal(tuple(p.shape)).astype(np.float32) for n, p in moe.named_parameters()}
    for name, p in moe.named_parameters():
        p._take_storage(sbpflow.tensor(values[name]))
    return moe, values


def _one_device(capacity: float | None, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    moe, _ = _layer(capacity)
    xs = sbpflow.tensor(x, requires_grad=True)
    out = moe(xs)
    sbpflow.functional.sum(sbpflow.functional.mul(out, sbpflow.tensor(dy))).backward()
    return out.numpy(), xs.grad.numpy(), {n: p.grad.numpy() for n, p in moe.named_parameters()}


def _parallel(layout: str, capacity: float | None) -> tuple[nn.MoE, Any]:
    ranks, axis, tp = LAYOUTS[layout]
    mesh = sbpflow.placement("cpu", ranks)
    moe, _ = _layer(capacity)
    moe.to_global(mesh, (broadcast,) * mesh.ndim)
    if tp is not None:  # Megatron on the tp axis: w1, w3 column-parallel, w2 row-parallel
        for expert in moe.experts:
            for p, dim in ((expert.w1.weight, 0), (expert.w3.weight, 0), (expert.w2.weight, 1)):
                relayout_(p, mesh, tuple(split(dim) if a == tp else broadcast for a in range(mesh.ndim)))
    split_experts(moe, mesh, axis)
    return moe, mesh


def _expected_row_bytes(moe: nn.MoE, mesh: Any, sbp: Any, axis: int, x: np.ndarray) -> int:
    """Bytes of the slot rows that leave their rank: on every rank, each slot of its tokens whose expert's group
    sits at another coordinate of the ep axis (dropless: every slot)."""
    probs = torch.softmax(torch.as_tensor(x) @ torch.as_tensor(moe.gate.weight.numpy()).t(), -1)
    index = torch.topk(probs, K, -1).indices.numpy()
    per = EXPERTS // mesh.hierarchy[axis]
    moved = 0
    for r in mesh.flat_ranks:
        tokens = np.arange(TOKENS)  # the rank's tokens: dim 0 cut on every split axis, in mesh order
        for a, s in enumerate(sbp):
            if s == split(0):
                tokens = np.array_split(tokens, mesh.hierarchy[a])[mesh.coords(r)[a]]
        moved += int(sum((index[i] // per != mesh.coords(r)[axis]).sum() for i in tokens))
    return moved * HIDDEN * 4


@pytest.mark.parametrize("capacity", [None, 0.75], ids=["dropless", "capacity"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exchanged_experts_equal_one_device(layout: str, capacity: float | None) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    dy = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    want_out, want_dx, want_grads = _one_device(capacity, x, dy)

    moe, mesh = _parallel(layout, capacity)
    tp = LAYOUTS[layout][2]
    sbp = tuple(broadcast if a == tp else split(0) for a in range(mesh.ndim))
    xs = sbpflow.tensor(x, placement=mesh, sbp=sbp, requires_grad=True)
    with sbpflow.comm.record() as forward:
        out = moe(xs)
    with sbpflow.comm.record() as backward:
        sbpflow.functional.sum(sbpflow.functional.mul(out, sbpflow.tensor(dy, placement=mesh, sbp=sbp))).backward()
    np.testing.assert_allclose(out.numpy(), want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(xs.grad.numpy(), want_dx, rtol=RTOL, atol=ATOL)
    for name, grad in per_expert(moe, lambda p: p.grad.numpy()).items():
        np.testing.assert_allclose(grad, want_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)

    axis = LAYOUTS[layout][1]
    groups = len(mesh.axis_groups(axis))
    if capacity is not None:  # the queue positions (a cumsum over the split tokens) move the (N, E) hits, no token
        others = [e for e in forward.events if e.kind != "all_to_all"]
        assert all(e.kind != "broadcast" and e.bytes <= 3 * TOKENS * EXPERTS * 4 for e in others), others
        return
    assert forward.counts() == {"all_to_all": 3 * groups}  # counts, rows there, rows back: no broadcast of tokens
    assert backward.counts()["all_to_all"] == 2 * groups  # the slots' gradients there, the rows' back
    if capacity is None:  # the count exchanges come first, one per ep group; then the rows, there and back
        rows = sum(e.bytes for e in forward.events[groups:])
        assert rows == 2 * _expected_row_bytes(moe, mesh, sbp, axis, x)


def test_experts_split_on_their_input_dim_are_refused() -> None:
    moe, mesh = _parallel("ep2xtp2", None)
    w1 = moe.experts.w1  # stacked (E, I, C): S(0) on the ep axis, now its input dim split on the tp axis
    relayout_(w1, w1.placement, (split(0), split(2)))
    xs = sbpflow.tensor(np.ones((TOKENS, HIDDEN), np.float32), placement=mesh, sbp=(split(0), broadcast))
    with pytest.raises(SbpflowError, match=r"must be whole \(B\) or Megatron"):
        moe(xs)


@pytest.mark.parametrize("tokens", [3, TOKENS], ids=["fewer_tokens_than_ranks", "skewed"])
def test_empty_exchanges_equal_one_device(tokens: int) -> None:
    """Every token routed to experts 0 and 1 (member 0 of ep4 gets every row, the others none), and a rank
    without tokens: sizes of zero on both sides of the exchange."""
    rng = np.random.default_rng(2)
    x = np.abs(rng.standard_normal((tokens, HIDDEN))).astype(np.float32)
    dy = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    moe, values = _layer(None)
    gate = np.zeros((EXPERTS, HIDDEN), np.float32)
    gate[:2] = 1.0 + 0.01 * np.arange(2 * HIDDEN, dtype=np.float32).reshape(2, HIDDEN)
    local = sbpflow.tensor(x, requires_grad=True)
    moe.gate.weight._take_storage(sbpflow.tensor(gate))
    want = moe(local)
    sbpflow.functional.sum(sbpflow.functional.mul(want, sbpflow.tensor(dy))).backward()

    par, mesh = _parallel("ep4", None)
    par.gate.weight._take_storage(sbpflow.tensor(gate, placement=mesh, sbp=broadcast))
    xs = sbpflow.tensor(x, placement=mesh, sbp=split(0), requires_grad=True)
    got = par(xs)
    sbpflow.functional.sum(sbpflow.functional.mul(got, sbpflow.tensor(dy, placement=mesh, sbp=split(0)))).backward()
    assert [int(c) for c in par.aux_stats[0].numpy()] == [tokens, tokens, 0, 0]
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(xs.grad.numpy(), local.grad.numpy(), rtol=RTOL, atol=ATOL)
    want_grads = {n: p.grad.numpy() for n, p in moe.named_parameters()}
    for name, grad in per_expert(par, lambda p: p.grad.numpy()).items():
        np.testing.assert_allclose(grad, want_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_exchange_under_autocast_is_close_to_one_device() -> None:
    """Under sbpflow.autocast the router's ops run in bf16 and the exchange in the tokens' dtype: no dtype clash,
    and the numbers agree with one device's autocast to bf16's precision."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    moe, _ = _layer(None)
    local = sbpflow.tensor(x, requires_grad=True)
    with sbpflow.autocast(dtype=torch.bfloat16):
        want = moe(local)
    sbpflow.functional.sum(sbpflow.functional.square(want)).backward()
    par, mesh = _parallel("ep2", None)
    xs = sbpflow.tensor(x, placement=mesh, sbp=split(0), requires_grad=True)
    with sbpflow.autocast(dtype=torch.bfloat16):
        got = par(xs)
    sbpflow.functional.sum(sbpflow.functional.square(got)).backward()
    assert got.dtype == want.dtype
    for ours, theirs in ((got.numpy(), want.numpy()), (xs.grad.numpy(), local.grad.numpy())):
        ours, theirs = ours.astype(np.float32), theirs.astype(np.float32)
        assert np.abs(ours - theirs).max() <= 2e-2 * np.abs(theirs).max()  # bf16 keeps 8 bits of mantissa


def test_a_retained_graph_runs_backward_twice() -> None:
    moe, mesh = _parallel("ep2", None)
    x = np.random.default_rng(4).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    xs = sbpflow.tensor(x, placement=mesh, sbp=split(0), requires_grad=True)
    loss = sbpflow.functional.sum(sbpflow.functional.square(moe(xs)))
    loss.backward(retain_graph=True)
    once = {n: p.grad.numpy().copy() for n, p in moe.named_parameters()}
    assert all(np.abs(g).max() > 0 for g in once.values())  # every expert got tokens
    loss.backward()
    for name, p in moe.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), 2 * once[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_split_experts_refuses_twice_and_unalike_experts_leaving_the_layer_as_it_was() -> None:
    moe, mesh = _parallel("ep2", None)
    with pytest.raises(SbpflowError, match="split already"):
        split_experts(moe, mesh, 0)
    with pytest.raises(SbpflowError, match="place_experts moves Expert modules"):
        nn.moe.place_experts(moe, [mesh] * EXPERTS)
    moe, _ = _layer(None)
    moe.to_global(mesh, broadcast)
    w2 = moe.experts[1].w2.weight
    relayout_(w2, mesh, split(1))  # one expert's w2 split unlike the others'
    before = [(n, p.placement, p.sbp) for n, p in moe.named_parameters()]
    with pytest.raises(SbpflowError, match="stacks expert weights laid out alike"):
        split_experts(moe, mesh, 0)
    assert [(n, p.placement, p.sbp) for n, p in moe.named_parameters()] == before and moe.expert_layout is None
