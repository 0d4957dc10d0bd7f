"""PyTorch habits (issue 13, section 3): boolean-mask indexing, cross_entropy(weight=...), clone/contiguous/
detach_/.data, module hooks, torch.autocast, and the top-level functions that OneFlow snippets call."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
import sbpflow.ops.functional as F
from harness import PLACEMENTS, PSUM, B, assert_own_memory, check, randn
from partials import check_pieces, pieces
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.comm import record
from sbpflow.ops import REGISTRY, OpDef, Sig
from sbpflow.ops.schema import DYNAMIC, Meta
from sbpflow.runtime.builder import PlanBuilder
from sbpflow.tensor import Tensor

PNAMES = ["1", "2", "3", "2x2"]


# -- x[mask]: a data-dependent op ------------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
@pytest.mark.parametrize("sbp_name", ["B", "S0", "S1"])
def test_mask_indexing_matches_torch(pname: str, sbp_name: str) -> None:
    p = PLACEMENTS[pname]
    sbp = {"B": B, "S0": S.split(0), "S1": S.split(1)}[sbp_name]
    x, m = randn(5, 7), randn(5, 7, seed=1) > 0
    r = check(lambda a, mask: a[mask] * 2.0, lambda a, mask: a[mask] * 2.0, [x, m], p, [(sbp,) * p.ndim, (B,) * p.ndim])
    assert r.out.sbp == (B,) * p.ndim  # the length is data: never split
    rows = m[:, 0]
    r = check(lambda a, mask: a[mask], lambda a, mask: a[mask], [x, rows], p, [(sbp,) * p.ndim, (B,) * p.ndim])
    if sbp_name == "S1":  # a trailing dim stays split: every rank selects the same rows
        assert r.forward_log.counts() == {} and r.out.sbp == (S.split(1),) * p.ndim


def test_mask_indexing_of_partial_pieces_stays_partial() -> None:
    x, m = randn(4, 6), randn(4, 6, seed=1) > 0
    for kind in ("sum", "max", "min"):
        out, log = check_pieces(lambda a, mask: a[mask], lambda a, mask: a[mask], [x, m], "2x2",
                                [(S.Partial(kind), B), (B, B)], seed=2)
        assert log.counts() == {} and out.sbp == (S.Partial(kind), B)


def test_masked_select_broadcasts_and_the_empty_selection() -> None:
    p = PLACEMENTS["2"]
    x, m = randn(3, 4), randn(4, seed=1) > 0
    check(F.masked_select, torch.masked_select, [x, m], p, [S.split(0), B])
    check(lambda a: a[a > 100.0], lambda a: a[a > 100.0], [x], p, [S.split(1)])  # nothing selected: shape (0,)


def test_mask_indexing_is_marked_data_dependent_and_refused_by_tracing() -> None:
    masked = REGISTRY["masked_select"]
    assert masked.data_dependent and not REGISTRY["index_select"].data_dependent
    assert masked.meta(Meta((5, 7), torch.float32), Meta((5,), torch.bool)) == Meta((DYNAMIC, 7), torch.float32)
    assert not Meta((DYNAMIC, 7), torch.float32).is_static
    with pytest.raises(sbpflow.OpError, match="'masked_select' has a data-dependent output shape.*graph mode"):
        masked.check_traceable()
    REGISTRY["matmul"].check_traceable()  # a metadata-shaped op passes
    b = PlanBuilder()
    x = b.input("x", (4, 3), PLACEMENTS["2"], (B,))
    mask = b.input("mask", (4,), PLACEMENTS["2"], (B,))
    with pytest.raises(sbpflow.OpError, match="data-dependent output shape"):
        b.compute("masked_select", x, mask)


def test_a_rule_that_splits_a_data_dependent_dim_is_refused() -> None:
    bad = OpDef("bad_dynamic_split", kernel=lambda x: x[x > 0], meta=lambda x: Meta((DYNAMIC,), x.dtype),
                sbp=lambda x, outs: [Sig((B,), (B,)), Sig((S.split(0),), (S.split(0),))], shard_aware=False,
                save_outputs=False, differentiable=False, mesh_aware=False, data_dependent=True)
    x = sbpflow.tensor(randn(6), placement=PLACEMENTS["2"], sbp=S.split(0))
    with pytest.raises(sbpflow.OpError, match="splits output dim 0, whose size depends on the data"):
        bad(x)


def test_mask_indexing_errors() -> None:
    x = sbpflow.tensor(randn(4, 3), placement=PLACEMENTS["2"], sbp=S.split(0))
    with pytest.raises(sbpflow.ShapeError, match=r"x\[mask\] needs a mask whose shape is the leading part"):
        x[sbpflow.tensor(torch.ones(3, dtype=torch.bool), placement=PLACEMENTS["2"], sbp=B)]
    with pytest.raises(sbpflow.OpError, match=r"bool mask only alone"):
        x[sbpflow.tensor(torch.ones(4, dtype=torch.bool), placement=PLACEMENTS["2"], sbp=B), 0]


# -- cross_entropy(weight=...) ---------------------------------------------------------------------------

CE_CASES = [  # (logits sbp, weight sbp) per mesh: batch split, class split (vocab-parallel), both on a 2-D mesh
    ("2", (S.split(0),), (B,)),
    ("3", (S.split(1),), (S.split(0),)),
    ("3", (S.split(1),), (B,)),
    ("2x2", (S.split(0), S.split(1)), (B, S.split(0))),
]


@pytest.mark.parametrize("pname,x_sbp,w_sbp", CE_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_cross_entropy_with_class_weights(pname: str, x_sbp: tuple, w_sbp: tuple, reduction: str,  # type: ignore[type-arg]
                                          label_smoothing: float) -> None:
    p = PLACEMENTS[pname]
    x, w = randn(6, 5), torch.rand(5, generator=torch.Generator().manual_seed(3)) + 0.1
    t = torch.tensor([0, 4, -100, 2, 2, 1])
    check(lambda a, tt, ww: F.cross_entropy(a, tt, weight=ww, reduction=reduction, label_smoothing=label_smoothing),
          lambda a, tt, ww: torch.nn.functional.cross_entropy(a, tt, weight=ww, reduction=reduction,
                                                              label_smoothing=label_smoothing),
          [x, t, w], p, [x_sbp, (B,) * p.ndim, w_sbp], grad=[True, False, False])


def test_cross_entropy_weight_with_extra_dims_probabilities_and_nll() -> None:
    p = PLACEMENTS["2"]
    x, w = randn(3, 4, 5), torch.rand(4, generator=torch.Generator().manual_seed(1)) + 0.1
    t = torch.randint(0, 4, (3, 5), generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(randn(3, 4, 5, seed=4), dim=1)
    ce = torch.nn.functional.cross_entropy
    check(lambda a, tt, ww: F.cross_entropy(a, tt, ww), lambda a, tt, ww: ce(a, tt, ww), [x, t, w], p,
          [S.split(2), B, B], grad=[True, False, False])
    check(lambda a, pr, ww: F.cross_entropy(a, pr, ww), lambda a, pr, ww: ce(a, pr, ww), [x, probs, w], p,
          [S.split(1), S.split(1), S.split(0)], grad=[True, False, False])
    logp = torch.log_softmax(randn(6, 4), dim=1)
    tt = torch.tensor([0, 3, 3, 1, -100, 2])
    check(lambda a, t_, ww: F.nll_loss(a, t_, weight=ww), lambda a, t_, ww: torch.nn.functional.nll_loss(a, t_, ww),
          [logp, tt, w], p, [S.split(1), B, S.split(0)], grad=[True, False, False])


def test_cross_entropy_loss_module_weight_and_errors() -> None:
    p = PLACEMENTS["2"]
    x, w, t = randn(4, 3), torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0, 1, 2, 1])
    ours = nn.CrossEntropyLoss(weight=sbpflow.tensor(w), label_smoothing=0.1).to_global(p, B)
    theirs = torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1)
    out = ours(sbpflow.tensor(x, placement=p, sbp=S.split(0)), sbpflow.tensor(t, placement=p, sbp=S.split(0)))
    np.testing.assert_allclose(out.item(), theirs(x, t).item(), rtol=1e-5)
    with pytest.raises(sbpflow.ShapeError, match=r"weight needs one entry per class, shape \[3\]"):
        F.cross_entropy(sbpflow.tensor(x), sbpflow.tensor(t), weight=sbpflow.tensor(torch.ones(4)))


# -- clone, contiguous, detach_, .data ------------------------------------------------------------------


@pytest.mark.parametrize("pname", PNAMES)
def test_clone_is_fresh_memory_with_the_same_layout(pname: str) -> None:
    p = PLACEMENTS[pname]
    x = sbpflow.tensor(randn(4, 6), placement=p, sbp=(S.split(1),) * p.ndim)
    y = x.clone()
    assert y.sbp == x.sbp and y is not x
    assert_own_memory(y)
    y.local_tensors()[0].add_(1)
    assert np.array_equal(x.numpy(), randn(4, 6).numpy())  # the original is untouched
    psum = pieces(randn(4, 6), pname, (PSUM,) * p.ndim if p.ndim == 1 else (PSUM, B), seed=1)
    with record() as log:
        c = psum.clone()
    assert log.counts() == {} and c.sbp == psum.sbp


def test_contiguous_returns_self_or_a_row_major_copy() -> None:
    p = PLACEMENTS["2"]
    x = sbpflow.tensor(randn(4, 6), placement=p, sbp=S.split(0))
    assert x.contiguous() is x
    strided = {r: t.t().contiguous().t() for r, t in x.local_tensors().items()}  # same values, column-major
    y = Tensor._from_shards((4, 6), torch.float32, p, x.sbp, strided, requires_grad=True)
    z = y.contiguous()
    assert z is not y and all(t.is_contiguous() for t in z.local_tensors().values())
    assert np.array_equal(z.numpy(), x.numpy())
    z.sum().backward()
    assert np.array_equal(y.grad.numpy(), np.ones((4, 6), dtype=np.float32))


def test_detach_in_place_cuts_the_graph() -> None:
    x = sbpflow.tensor(randn(3, 2), placement=PLACEMENTS["2"], sbp=S.split(0), requires_grad=True)
    y = x * 2.0
    assert y.detach_() is y
    assert y.is_leaf and not y.requires_grad and y.grad_fn is None
    (y * x).sum().backward()  # only the direct use of x reaches it
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * randn(3, 2).numpy())


def test_data_reads_detached_and_writes_keep_identity() -> None:
    p = PLACEMENTS["2"]
    w = sbpflow.tensor(randn(4, 3), placement=p, sbp=S.split(0), requires_grad=True)
    d = w.data
    assert not d.requires_grad and d.grad_fn is None and d.sbp == w.sbp
    d.local_tensors()[0].mul_(0)  # .data shares storage, as in torch
    assert w.numpy()[0].tolist() == [0.0, 0.0, 0.0]
    ident = id(w)
    w.data = sbpflow.tensor(torch.ones(2, 5), placement=p, sbp=B)  # torch allows a new shape and layout
    assert id(w) == ident and w.requires_grad and w.is_leaf and tuple(w.shape) == (2, 5) and w.sbp == (B,)
    (w * 3.0).sum().backward()
    assert w.grad.numpy().tolist() == [[3.0] * 5] * 2


def test_assigning_data_to_a_saved_tensor_raises_at_backward() -> None:
    w = sbpflow.tensor(randn(3), placement=PLACEMENTS["2"], sbp=B, requires_grad=True)
    loss = (w * w).sum()
    w.data = sbpflow.tensor(torch.zeros(3), placement=PLACEMENTS["2"], sbp=B)
    with pytest.raises(sbpflow.AutogradError, match="modified in place after the op used it"):
        loss.backward()
    with pytest.raises(sbpflow.SbpflowError, match="x.data = ... needs an sbpflow Tensor"):
        w.data = torch.zeros(3)  # type: ignore[assignment]


# -- module hooks ---------------------------------------------------------------------------------------


def _pair(seed: int = 0) -> tuple[nn.Linear, torch.nn.Linear]:
    ours = nn.Linear(4, 3)
    theirs = torch.nn.Linear(4, 3)
    with torch.no_grad():
        theirs.weight.copy_(torch.as_tensor(ours.weight.numpy()))
        theirs.bias.copy_(torch.as_tensor(ours.bias.numpy()))
    return ours, theirs


def test_forward_hook_sees_and_replaces_the_output() -> None:
    ours, theirs = _pair()
    x = randn(2, 4)
    calls: list[str] = []
    h1 = ours.register_forward_hook(lambda m, args, out: calls.append("first") or out * 2.0)
    h2 = ours.register_forward_hook(lambda m, args, out: calls.append("prepended"), prepend=True)
    h3 = ours.register_forward_hook(lambda m, args, kwargs, out: calls.append(f"kw {sorted(kwargs)}"),
                                    with_kwargs=True)
    out = ours(sbpflow.tensor(x))
    np.testing.assert_allclose(out.numpy(), theirs(x).detach().numpy() * 2.0, rtol=1e-5, atol=1e-6)
    assert calls == ["prepended", "first", "kw []"]
    for h in (h1, h2, h3):
        h.remove()
    h1.remove()  # removing twice is harmless, as in torch
    np.testing.assert_allclose(ours(sbpflow.tensor(x)).numpy(), theirs(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    with ours.register_forward_hook(lambda m, args, out: out * 0.0):
        assert ours(sbpflow.tensor(x)).numpy().tolist() == [[0.0] * 3] * 2
    assert ours(sbpflow.tensor(x)).numpy().any()


@pytest.mark.parametrize("pname", ["1", "2", "2x2"])
def test_full_backward_hook_gets_torchs_gradients(pname: str) -> None:
    p = PLACEMENTS[pname]
    ours, theirs = _pair()
    ours.to_global(p, (B,) * p.ndim)
    x = randn(6, 4)
    seen: list[tuple] = []  # type: ignore[type-arg]
    expected: list[tuple] = []  # type: ignore[type-arg]
    ours.register_full_backward_hook(lambda m, gi, go: seen.append((gi[0].numpy(), go[0].numpy())))
    theirs.register_full_backward_hook(lambda m, gi, go: expected.append((gi[0].numpy(), go[0].numpy())))
    gx = sbpflow.tensor(x, placement=p, sbp=(S.split(0),) * p.ndim, requires_grad=True)
    (ours(gx) ** 2).sum().backward()
    tx = x.clone().requires_grad_()
    (theirs(tx) ** 2).sum().backward()
    assert len(seen) == len(expected) == 1
    for a, b in zip(seen[0], expected[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.weight.grad.numpy(), theirs.weight.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_full_backward_hook_can_replace_grad_input_and_be_removed() -> None:
    ours, theirs = _pair()
    x = randn(2, 4)
    handle = ours.register_full_backward_hook(lambda m, gi, go: (gi[0] * 10.0,))
    theirs.register_full_backward_hook(lambda m, gi, go: (gi[0] * 10.0,))
    gx, tx = sbpflow.tensor(x, requires_grad=True), x.clone().requires_grad_()
    ours(gx).sum().backward()
    theirs(tx).sum().backward()
    np.testing.assert_allclose(gx.grad.numpy(), tx.grad.numpy(), rtol=1e-5)
    handle.remove()
    gx2 = sbpflow.tensor(x, requires_grad=True)
    ours(gx2).sum().backward()
    np.testing.assert_allclose(gx2.grad.numpy() * 10.0, tx.grad.numpy(), rtol=1e-5)


def test_full_backward_hook_with_inputs_that_need_no_gradient() -> None:
    ours, theirs = _pair()
    x = randn(2, 4)
    seen: list[tuple] = []  # type: ignore[type-arg]
    expected: list[tuple] = []  # type: ignore[type-arg]
    ours.register_full_backward_hook(lambda m, gi, go: seen.append((gi, go[0].numpy())))
    theirs.register_full_backward_hook(lambda m, gi, go: expected.append((gi, go[0].numpy())))
    ours(sbpflow.tensor(x)).sum().backward()
    with pytest.warns(UserWarning, match="Full backward hook is firing"):  # torch's note on this very case
        theirs(x).sum().backward()
    assert seen[0][0] == expected[0][0] == (None,)
    np.testing.assert_allclose(seen[0][1], expected[0][1])
    bad = ours.register_full_backward_hook(lambda m, gi, go: (gi, gi))
    with pytest.raises(sbpflow.AutogradError, match="returned 2 gradients, but the module's forward takes 1"):
        ours(sbpflow.tensor(x)).sum().backward()
    bad.remove()


# -- torch.autocast --------------------------------------------------------------------------------------


def test_torch_autocast_warns_and_leaves_sbpflow_ops_alone() -> None:
    p = PLACEMENTS["2"]
    a, b = randn(4, 5), randn(5, 3, seed=1)
    x, w = sbpflow.tensor(a, placement=p, sbp=S.split(0)), sbpflow.tensor(b, placement=p, sbp=B)
    with pytest.warns(sbpflow.AutocastWarning, match="no effect on sbpflow ops.*sbpflow.autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16  # torch's own ops do change
            y = x @ w
    assert y.dtype == torch.float32 and all(t.dtype == torch.float32 for t in y.local_tensors().values())
    np.testing.assert_allclose(y.numpy(), (a @ b).numpy(), rtol=1e-6, atol=1e-6)
    assert issubclass(sbpflow.AutocastWarning, UserWarning)
    y = x @ w  # no autocast, no warning (warnings are errors in this suite)


# -- top-level functions: OneFlow snippets run with `import sbpflow as flow` -----------------------------


def test_oneflow_matmul_snippets_run_unchanged() -> None:
    flow = sbpflow
    placement = flow.placement(type="cpu", ranks=[0, 1])  # the seeds say "cuda"; this machine has none
    x = flow.randn(4, 5, placement=placement, sbp=flow.sbp.split(dim=0))
    w = flow.randn(5, 8, placement=placement, sbp=flow.sbp.broadcast)
    out = flow.matmul(x, w)
    assert out.shape == (4, 8) and out.sbp == (S.split(0),)
    P0 = flow.placement(type="cpu", ranks=[0])
    P1 = flow.placement(type="cpu", ranks=[1])
    w0 = flow.randn(5, 8, placement=P0, sbp=flow.sbp.broadcast)
    w1 = flow.randn(8, 3, placement=P1, sbp=flow.sbp.broadcast)
    x = flow.randn(4, 5)
    in_stage0 = x.to_global(placement=P0, sbp=flow.sbp.broadcast)
    out_stage0 = flow.matmul(in_stage0, w0)
    in_stage1 = out_stage0.to_global(placement=P1, sbp=flow.sbp.broadcast)
    out_stage1 = flow.matmul(in_stage1, w1)
    assert out_stage1.shape == (4, 3)
    np.testing.assert_allclose(out_stage1.numpy(), x.numpy() @ w0.numpy() @ w1.numpy(), rtol=1e-5, atol=1e-5)


TOP_LEVEL = [  # (name, args builder) checked against torch.<name>
    ("matmul", lambda a, b: (a, b.T)), ("cat", lambda a, b: ([a, b], 1)), ("stack", lambda a, b: ([a, b], 0)),
    ("where", lambda a, b: (a > 0, a, b)), ("softmax", lambda a, b: (a, 1)), ("relu", lambda a, b: (a,)),
    ("sin", lambda a, b: (a,)), ("cumsum", lambda a, b: (a, 0)), ("argmax", lambda a, b: (a, 1)),
    ("masked_fill", lambda a, b: (a, b > 0, 1.5)), ("clone", lambda a, b: (a,)), ("maximum", lambda a, b: (a, b)),
    ("sum", lambda a, b: (a,)), ("transpose", lambda a, b: (a, 0, 1)), ("erf", lambda a, b: (a,)),
    ("any", lambda a, b: (a > 1,)), ("masked_select", lambda a, b: (a, b > 0)), ("log_softmax", lambda a, b: (a, 0)),
    ("layer_norm", lambda a, b: (a, (6,))), ("rms_norm", lambda a, b: (a, (6,))),
    ("unflatten", lambda a, b: (a, 1, (2, 3))),
]


@pytest.mark.parametrize("name,build", TOP_LEVEL, ids=[n for n, _ in TOP_LEVEL])
def test_top_level_functions_match_torch(name: str, build) -> None:  # type: ignore[no-untyped-def]
    p = PLACEMENTS["2"]
    a, b = randn(4, 6), randn(4, 6, seed=1)
    ga = sbpflow.tensor(a, placement=p, sbp=S.split(0))
    gb = sbpflow.tensor(b, placement=p, sbp=B)
    ours = getattr(sbpflow, name)(*build(ga, gb))
    theirs = getattr(torch, name)(*build(a, b))
    assert ours.dtype == theirs.dtype
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)


def test_every_top_level_name_is_exported_and_torch_has_it() -> None:
    missing = [n for n in sbpflow.__all__ if not hasattr(sbpflow, n)]
    assert missing == []
    functions = [n for n in sbpflow.__all__ if callable(getattr(sbpflow, n)) and n.islower()]
    not_in_torch = {n for n in functions if not hasattr(torch, n)}
    # sbpflow's own (placement, explain, auto_parallel, to_global ...) and OneFlow's (cast, to_global) are not torch's
    assert not_in_torch <= {"placement", "explain", "to_global", "cast", "print0", "rank", "world_size", "uniform",
                            "gelu", "silu", "manual_seed", "tensor", "auto_parallel", "meta_init", "meta_tensor",
                            "implicit_broadcast", "parallelize"}, not_in_torch


class _TwoOut(nn.Module):
    def forward(self, a, b):  # type: ignore[no-untyped-def]
        return a * b, a + 1.0


class _TorchTwoOut(torch.nn.Module):
    def forward(self, a, b):  # type: ignore[no-untyped-def]
        return a * b, a + 1.0


def test_full_backward_hook_with_two_inputs_and_a_tuple_output() -> None:
    p = PLACEMENTS["2x2"]
    a, b = randn(4, 3), randn(4, 3, seed=1)
    seen: list[Any] = []
    expected: list[Any] = []
    ours, theirs = _TwoOut(), _TorchTwoOut()
    pre = ours.register_forward_pre_hook(lambda m, args: None)
    ours.register_full_backward_hook(lambda m, gi, go: seen.append([g.numpy() for g in gi + go]))
    theirs.register_full_backward_hook(lambda m, gi, go: expected.append([g.numpy() for g in gi + go]))
    ga = sbpflow.tensor(a, placement=p, sbp=(S.split(0), B), requires_grad=True)
    gb = sbpflow.tensor(b, placement=p, sbp=(B, S.split(1)), requires_grad=True)
    x, y = ours(ga, gb)
    (x * y).sum().backward()
    ta, tb = a.clone().requires_grad_(), b.clone().requires_grad_()
    tx, ty = theirs(ta, tb)
    (tx * ty).sum().backward()
    assert len(seen) == len(expected) == 1 and len(seen[0]) == 4
    for got, want in zip(seen[0], expected[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ga.grad.numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert isinstance(pre, nn.hooks.RemovableHandle)
    pre.remove()
