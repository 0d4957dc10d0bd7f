"""sbpflow.nn against torch.nn: every layer local and global (weights copied with load_state_dict),
the Module API, initialisation, and parallel plans with the collectives they cause."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import DEVICE, PLACEMENTS, PSUM, B, randn
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.comm import CommLog, record
from sbpflow.errors import AutogradError, SbpError, SbpflowError, ShapeError
from sbpflow.nn.parallel import (
    ColwiseParallel,
    DataParallelInput,
    Replicate,
    RowwiseParallel,
    VocabParallelEmbedding,
    apply_plan,
)

P1, P2, P3, P22 = PLACEMENTS["1"], PLACEMENTS["2"], PLACEMENTS["3"], PLACEMENTS["2x2"]


def _np(t: Any) -> np.ndarray:
    return t.numpy() if isinstance(t, sbpflow.Tensor) else t.detach().numpy()


def compare(ours: nn.Module, theirs: torch.nn.Module, inputs: Sequence[torch.Tensor], placement: Any = None,
            in_sbps: Sequence[Any] | None = None, param_sbps: dict[str, Any] | None = None,
            rtol: float = 1e-4, atol: float = 1e-5) -> tuple[Any, CommLog, CommLog]:
    """Loads ``theirs``' weights into ``ours``, lays it out, and compares forward, input and parameter grads."""
    ours.load_state_dict(theirs.state_dict())
    if placement is not None:
        ours.to_global(placement)
        for name, p in ours.named_parameters():
            if param_sbps and name in param_sbps:
                nn.module.relayout_(p, placement, param_sbps[name])
    in_sbps = list(in_sbps) if in_sbps is not None else [(B,) * placement.ndim if placement else None] * len(inputs)
    needs = [v.dtype.is_floating_point for v in inputs]
    xs = [sbpflow.tensor(v, placement=placement, sbp=s, requires_grad=n) for v, s, n in zip(inputs, in_sbps, needs,
                                                                                         strict=True)]
    refs = [v.clone().requires_grad_(n) for v, n in zip(inputs, needs, strict=True)]
    with record() as flog:
        out = ours(*xs)
    ref = theirs(*refs)
    assert tuple(out.shape) == tuple(ref.shape)
    np.testing.assert_allclose(out.numpy(), _np(ref), rtol=rtol, atol=atol)
    upstream = randn(*ref.shape, seed=7) if ref.ndim else torch.tensor(0.7)
    with record() as blog:
        out.backward(sbpflow.tensor(upstream, placement=placement, sbp=(B,) * placement.ndim if placement else None))
    ref.backward(upstream)
    for x, r in zip(xs, refs, strict=True):
        if r.grad is not None:
            np.testing.assert_allclose(x.grad.numpy(), r.grad.numpy(), rtol=rtol, atol=atol)
    torch_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"no grad for {name}"
        if placement is not None:
            assert p.grad.placement == p.placement and p.grad.sbp == p.sbp, f"{name} grad layout"
        np.testing.assert_allclose(p.grad.numpy(), torch_params[name].grad.numpy(), rtol=rtol, atol=atol)
    return out, flog, blog


# -- Linear ---------------------------------------------------------------------------------------------------

LINEAR_LAYOUTS = {
    "local": (None, None, None),
    "1": (P1, [(B,)], None),
    "2-colwise": (P2, [(B,)], {"weight": (S.split(0),), "bias": (S.split(0),)}),
    "3-rowwise-uneven": (P3, [(S.split(1),)], {"weight": (S.split(1),), "bias": (B,)}),
    "3-data": (P3, [(S.split(0),)], None),
    "2x2-dp-tp": (P22, [(S.split(0), B)], {"weight": (B, S.split(0)), "bias": (B, S.split(0))}),
}


@pytest.mark.parametrize("layout", list(LINEAR_LAYOUTS))
def test_linear(layout: str) -> None:
    placement, in_sbps, param_sbps = LINEAR_LAYOUTS[layout]
    compare(nn.Linear(7, 5), torch.nn.Linear(7, 5), [randn(5, 7)], placement, in_sbps, param_sbps)


def test_linear_without_bias_on_3d_input() -> None:
    compare(nn.Linear(4, 6, bias=False), torch.nn.Linear(4, 6, bias=False), [randn(2, 3, 4)], P2, [(S.split(1),)])


def test_column_parallel_linear_forward_needs_no_comm() -> None:
    out, flog, blog = compare(nn.Linear(6, 4), torch.nn.Linear(6, 4), [randn(3, 6)], P2, [(B,)],
                              {"weight": (S.split(0),), "bias": (S.split(0),)})
    assert out.sbp == (S.split(1),)
    assert flog.counts() == {}


# -- Embedding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pname,weight_sbp", [(None, None), ("2", (S.split(0),)), ("3", (S.split(1),)),
                                              ("3", (S.split(0),)), ("2x2", (S.split(0), B))])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding(pname: str | None, weight_sbp: Any, padding_idx: int | None) -> None:
    placement = PLACEMENTS[pname] if pname else None
    ids = torch.tensor([[1, 2, 6], [0, 2, 4]])
    ours, theirs = nn.Embedding(7, 5, padding_idx=padding_idx), torch.nn.Embedding(7, 5, padding_idx=padding_idx)
    compare(ours, theirs, [ids], placement, None, {"weight": weight_sbp} if weight_sbp else None)


def test_embedding_init_is_normal_with_zero_padding_row_under_any_layout() -> None:
    sbpflow.manual_seed(3)
    local = nn.Embedding(9, 4, padding_idx=5)
    sbpflow.manual_seed(3)
    split = nn.Embedding(9, 4, padding_idx=5, placement=P3, sbp=S.split(0))
    assert split.weight.sbp == (S.split(0),)
    np.testing.assert_array_equal(local.weight.numpy(), split.weight.numpy())
    assert np.all(local.weight.numpy()[5] == 0) and np.all(local.weight.numpy()[4] != 0)


# -- norms ----------------------------------------------------------------------------------------------------


def _perturb(m: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Random affine parameters, so tests do not pass by ones/zeros alone."""
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(randn(*p.shape, seed=seed + i))
    return m


@pytest.mark.parametrize("pname,x_sbp", [(None, None), ("2", (S.split(0),)), ("3", (S.split(2),)),
                                         ("2x2", (S.split(0), S.split(1)))])
def test_layer_norm(pname: str | None, x_sbp: Any) -> None:
    placement = PLACEMENTS[pname] if pname else None
    compare(nn.LayerNorm(7), _perturb(torch.nn.LayerNorm(7)), [randn(3, 5, 7)], placement, [x_sbp])


def test_layer_norm_two_dims_without_bias() -> None:
    compare(nn.LayerNorm((5, 7), bias=False), _perturb(torch.nn.LayerNorm((5, 7), bias=False)), [randn(3, 5, 7)],
            P2, [(S.split(0),)])


@pytest.mark.parametrize("pname,x_sbp", [(None, None), ("2", (S.split(1),)), ("3", (S.split(1),))])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm(pname: str | None, x_sbp: Any, eps: float | None) -> None:
    placement = PLACEMENTS[pname] if pname else None
    compare(nn.RMSNorm(6, eps=eps), _perturb(torch.nn.RMSNorm(6, eps=eps)), [randn(4, 5, 6)], placement, [x_sbp])


@pytest.mark.parametrize("pname,x_sbp", [(None, None), ("2", (S.split(0),)), ("3", (S.split(0),)),
                                         ("2x2", (S.split(0), S.split(2)))])
def test_batch_norm_2d_train_then_eval(pname: str | None, x_sbp: Any) -> None:
    placement = PLACEMENTS[pname] if pname else None
    ours, theirs = nn.BatchNorm2d(3), _perturb(torch.nn.BatchNorm2d(3))
    compare(ours, theirs, [randn(7, 3, 4, 5)], placement, [x_sbp])
    compare(ours, theirs, [randn(5, 3, 4, 5, seed=2)], placement, [x_sbp])  # a second step of running stats
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        np.testing.assert_allclose(getattr(ours, name).numpy(), getattr(theirs, name).numpy(), rtol=1e-5, atol=1e-6)
    ours.eval()
    theirs.eval()
    compare(ours, theirs, [randn(3, 3, 4, 5, seed=3)], placement, [x_sbp])


def test_batch_norm_1d_cumulative_momentum_and_no_running_stats() -> None:
    ours, theirs = nn.BatchNorm1d(4, momentum=None), _perturb(torch.nn.BatchNorm1d(4, momentum=None))
    for seed in range(3):
        compare(ours, theirs, [randn(6, 4, seed=seed)], P2, [(S.split(0),)])
    np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-5)
    stateless, ref = nn.BatchNorm1d(4, track_running_stats=False), torch.nn.BatchNorm1d(4, track_running_stats=False)
    stateless.eval()
    ref.eval()
    compare(stateless, ref, [randn(5, 4, 3)], P3, [(S.split(0),)])
    with pytest.raises(ShapeError, match="BatchNorm1d needs a 2 or 3-D input"):
        stateless(sbpflow.randn(2, 4, 3, 3))


# -- activations, dropout, flatten, containers -----------------------------------------------------------------


@pytest.mark.parametrize("ours,theirs", [(nn.ReLU(), torch.nn.ReLU()), (nn.SiLU(), torch.nn.SiLU()),
                                         (nn.GELU(), torch.nn.GELU()), (nn.GELU("tanh"), torch.nn.GELU("tanh")),
                                         (nn.Tanh(), torch.nn.Tanh())])
@pytest.mark.parametrize("pname", [None, "3"])
def test_activations(ours: nn.Module, theirs: torch.nn.Module, pname: str | None) -> None:
    placement = PLACEMENTS[pname] if pname else None
    compare(ours, theirs, [randn(5, 4)], placement, [(S.split(0),)] if placement else None)


@pytest.mark.parametrize("pname,x_sbp", [(None, None), ("2", (S.split(0),)), ("3", (S.split(1),))])
def test_flatten(pname: str | None, x_sbp: Any) -> None:
    placement = PLACEMENTS[pname] if pname else None
    compare(nn.Flatten(), torch.nn.Flatten(), [randn(5, 3, 2, 2)], placement, [x_sbp])


def test_dropout_mask_is_layout_independent_and_scaled() -> None:
    x = randn(8, 6)
    sbpflow.manual_seed(11)
    local = nn.Dropout(0.25)(sbpflow.tensor(x, device=DEVICE)).numpy()  # the shards' device: bit for bit
    sbpflow.manual_seed(11)
    split = nn.Dropout(0.25)(sbpflow.tensor(x, placement=P3, sbp=S.split(1))).numpy()
    np.testing.assert_array_equal(local, split)
    kept = local != 0
    np.testing.assert_allclose(local[kept], x.numpy()[kept] / 0.75, rtol=1e-6)
    assert 0.4 < kept.mean() < 0.95
    d = nn.Dropout(0.25)
    d.eval()
    np.testing.assert_array_equal(d(sbpflow.tensor(x)).numpy(), x.numpy())


def test_sequential_module_list_and_dict_match_torch() -> None:
    ours = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.ModuleList([nn.Linear(8, 8), nn.LayerNorm(8)]),
                         nn.ModuleDict({"head": nn.Linear(8, 3)}))
    theirs = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                                 torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)]),
                                 torch.nn.ModuleDict({"head": torch.nn.Linear(8, 3)}))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]
    assert len(ours) == 4 and isinstance(ours[2], nn.ModuleList) and len(ours[2]) == 2 and "head" in ours[3]

    class Net(nn.Module):
        def __init__(self, seq: Any) -> None:
            super().__init__()
            self.seq = seq

        def forward(self, x: Any) -> Any:
            h = self.seq[1](self.seq[0](x))
            h = self.seq[2][1](self.seq[2][0](h))
            return self.seq[3]["head"](h)

    class TorchNet(torch.nn.Module):
        def __init__(self, seq: Any) -> None:
            super().__init__()
            self.seq = seq

        def forward(self, x: Any) -> Any:
            h = self.seq[1](self.seq[0](x))
            h = self.seq[2][1](self.seq[2][0](h))
            return self.seq[3]["head"](h)

    compare(Net(ours), _perturb(TorchNet(theirs)), [randn(5, 4)], P3, [(S.split(0),)])


# -- losses ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pname,logit_sbp,target_sbp", [(None, None, None), ("2", (S.split(0),), (S.split(0),)),
                                                        ("3", (S.split(1),), (B,))])
@pytest.mark.parametrize("kwargs", [{}, {"reduction": "sum", "label_smoothing": 0.1}, {"ignore_index": -1},
                                    {"ignore_index": 1, "label_smoothing": 0.2}])
def test_cross_entropy_loss(pname: str | None, logit_sbp: Any, target_sbp: Any, kwargs: dict[str, Any]) -> None:
    placement = PLACEMENTS[pname] if pname else None
    target = torch.tensor([0, 4, -1, 3, 2, 1, 6]) if kwargs.get("ignore_index") == -1 else torch.tensor([0, 4, 1, 3,
                                                                                                          2, 1, 6])
    compare(nn.CrossEntropyLoss(**kwargs), torch.nn.CrossEntropyLoss(**kwargs), [randn(7, 7), target], placement,
            [logit_sbp, target_sbp])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(reduction: str) -> None:
    compare(nn.MSELoss(reduction), torch.nn.MSELoss(reduction=reduction), [randn(5, 3), randn(5, 3, seed=1)], P3,
            [(S.split(0),), (S.split(0),)])
    with pytest.raises(ValueError, match="MSELoss reduction"):
        nn.MSELoss("avg")


# -- convolution and pooling (ops from ops/conv.py) -------------------------------------------------------------

conv_ready = pytest.mark.skipif(not hasattr(sbpflow.functional, "conv2d"), reason="conv2d op not landed yet")


@conv_ready
@pytest.mark.parametrize("pname,x_sbp", [(None, None), ("2", (S.split(0),)), ("3", (S.split(0),))])
@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 1}, {"padding": 1, "groups": 2, "bias": False}])
def test_conv2d(pname: str | None, x_sbp: Any, kwargs: dict[str, Any]) -> None:
    placement = PLACEMENTS[pname] if pname else None
    compare(nn.Conv2d(4, 6, 3, **kwargs), torch.nn.Conv2d(4, 6, 3, **kwargs), [randn(5, 4, 7, 6)], placement,
            [x_sbp])


@conv_ready
@pytest.mark.parametrize("ours,theirs", [
    (nn.MaxPool2d(2), torch.nn.MaxPool2d(2)),
    (nn.MaxPool2d(3, stride=2, padding=1), torch.nn.MaxPool2d(3, stride=2, padding=1)),
    (nn.AvgPool2d(2), torch.nn.AvgPool2d(2)),
    (nn.AvgPool2d(3, stride=1, padding=1), torch.nn.AvgPool2d(3, stride=1, padding=1)),
    (nn.AdaptiveAvgPool2d(1), torch.nn.AdaptiveAvgPool2d(1)),
    (nn.AdaptiveAvgPool2d((2, 3)), torch.nn.AdaptiveAvgPool2d((2, 3))),
])
@pytest.mark.parametrize("pname", [None, "3"])
def test_pooling(ours: nn.Module, theirs: torch.nn.Module, pname: str | None) -> None:
    placement = PLACEMENTS[pname] if pname else None
    compare(ours, theirs, [randn(5, 3, 6, 6)], placement, [(S.split(0),)] if placement else None)


# -- the Module API -------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", sbpflow.ones(4))
        self.register_buffer("cache", sbpflow.zeros(2), persistent=False)

    def forward(self, x: Any) -> Any:
        return self.norm(self.fc(x)) * self.scale


def test_registration_traversal_and_state_dict() -> None:
    b = Block()
    assert [n for n, _ in b.named_parameters()] == ["fc.weight", "fc.bias", "norm.weight", "norm.bias"]
    assert [n for n, _ in b.named_buffers()] == ["scale", "cache", "norm.running_mean", "norm.running_var",
                                                 "norm.num_batches_tracked"]
    # torch's order: a module's own parameters and buffers, then its children's
    assert list(b.state_dict()) == ["scale", "fc.weight", "fc.bias", "norm.weight", "norm.bias", "norm.running_mean",
                                    "norm.running_var", "norm.num_batches_tracked"]
    assert [type(c).__name__ for c in b.children()] == ["Linear", "BatchNorm1d"]
    assert len(list(b.modules())) == 3
    assert all(isinstance(p, sbpflow.Tensor) and isinstance(p, nn.Parameter) for p in b.parameters())
    b.train(False)
    assert not b.training and not b.fc.training
    b.train()
    assert b.norm.training
    assert "(fc): Linear(in_features=4, out_features=4, bias=True)" in repr(b)
    assert repr(b).startswith("Block(\n")
    del b.cache
    assert "cache" not in dict(b.named_buffers())


def test_shared_parameter_is_listed_once() -> None:
    a = nn.Linear(3, 3)
    seq = nn.Sequential(a, a)
    assert len(list(seq.parameters())) == 2


def test_load_state_dict_keeps_layout_and_accepts_sbpflow_values() -> None:
    ours = nn.Linear(5, 3, placement=P3, sbp={"weight": S.split(1), "bias": B})
    theirs = torch.nn.Linear(5, 3)
    ours.load_state_dict(theirs.state_dict())
    assert ours.weight.sbp == (S.split(1),) and ours.weight.placement == P3 and ours.weight.is_leaf
    np.testing.assert_array_equal(ours.weight.numpy(), theirs.weight.detach().numpy())
    other = nn.Linear(5, 3, placement=P2, sbp=S.split(0))
    other.load_state_dict(ours.state_dict())  # sbpflow values on another placement and SBP
    assert other.weight.sbp == (S.split(0),) and other.weight.placement == P2
    np.testing.assert_array_equal(other.weight.numpy(), theirs.weight.detach().numpy())
    local = nn.Linear(5, 3)
    local.load_state_dict(other.state_dict())
    assert not local.weight.is_global
    np.testing.assert_array_equal(local.bias.numpy(), theirs.bias.detach().numpy())


def test_load_state_dict_errors() -> None:
    lin = nn.Linear(5, 3)
    with pytest.raises(SbpflowError, match=r"missing keys: \['bias'\], unexpected keys: \['extra'\]"):
        lin.load_state_dict({"weight": torch.zeros(3, 5), "extra": torch.zeros(1)})
    result = lin.load_state_dict({"weight": torch.zeros(3, 5)}, strict=False)
    assert result.missing_keys == ["bias"] and np.all(lin.weight.numpy() == 0)
    with pytest.raises(ShapeError, match=r"'weight' has shape \[3, 5\] in the module.*shape \[5, 3\]"):
        lin.load_state_dict({"weight": torch.zeros(5, 3), "bias": torch.zeros(3)})


def test_to_global_keeps_identity_leaves_and_grads() -> None:
    b = Block()
    w = b.fc.weight
    b(sbpflow.randn(6, 4)).sum().backward()
    ref = b.fc.weight.grad.numpy()
    assert b.to_global(P22, (B, B)) is b
    assert b.fc.weight is w and w.is_leaf and w.requires_grad and w.placement == P22
    assert b.norm.running_mean.sbp == (B, B) and b.fc.weight.grad.sbp == (B, B)
    np.testing.assert_allclose(b.fc.weight.grad.numpy(), ref)
    b.zero_grad()
    assert b.fc.weight.grad is None
    b(sbpflow.randn(6, 4, placement=P22, sbp=(S.split(0), B))).sum().backward()
    b.zero_grad(set_to_none=False)
    assert np.all(b.fc.weight.grad.numpy() == 0) and b.fc.weight.grad.sbp == (B, B)


def test_parameter_reassignment_replaces_one_parameter() -> None:
    lin = nn.Linear(4, 6).to_global(P2)
    value = lin.weight.numpy()
    lin.weight = nn.Parameter(lin.weight.to_global(placement=P2, sbp=S.split(0)))
    assert lin.weight.sbp == (S.split(0),) and lin.weight.is_leaf and lin.weight.requires_grad
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    np.testing.assert_array_equal(lin.weight.numpy(), value)
    with pytest.raises(SbpflowError, match="Linear.weight is a parameter"):
        lin.weight = sbpflow.zeros(6, 4)  # a plain tensor is not a parameter
    assert "Parameter containing" in repr(lin.weight)


def test_pre_hook_and_requires_grad() -> None:
    lin = nn.Linear(2, 2)
    remove = lin.register_forward_pre_hook(lambda m, args: (args[0] * 0.0,))
    out = lin(sbpflow.ones(1, 2))
    np.testing.assert_allclose(out.numpy(), lin.bias.numpy()[None], rtol=1e-6)
    remove()
    lin.requires_grad_(False)
    assert not lin.weight.requires_grad


# -- initialisation -------------------------------------------------------------------------------------------


def test_default_init_is_layout_independent() -> None:
    def build(**layout: Any) -> list[np.ndarray]:
        sbpflow.manual_seed(5)
        layers = [nn.Linear(6, 5, **layout), nn.LayerNorm(5, **layout)]
        return [p.numpy() for m in layers for p in m.parameters()]

    local = build()
    layouts = [{"placement": P2, "sbp": S.split(0)}, {"placement": P3, "sbp": {"weight": S.split(0), "bias": B}},
               {"placement": P22, "sbp": (S.split(0), B)}]
    for layout in layouts:
        for a, b in zip(local, build(**layout), strict=True):
            np.testing.assert_array_equal(a, b)


def test_default_init_follows_torch_bounds() -> None:
    lin = nn.Linear(50, 40)
    bound = 1 / math.sqrt(50)
    w = lin.weight.numpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound and abs(w.mean()) < 0.1 * bound
    assert np.abs(lin.bias.numpy()).max() <= bound
    emb = nn.Embedding(200, 50).weight.numpy()
    assert abs(emb.std() - 1.0) < 0.05 and abs(emb.mean()) < 0.05
    norm = nn.LayerNorm(5)
    assert np.all(norm.weight.numpy() == 1) and np.all(norm.bias.numpy() == 0)


@pytest.mark.parametrize("fn,check", [
    (lambda t: nn.init.uniform_(t, -2.0, 3.0), lambda v: v.min() >= -2 and v.max() < 3 and v.max() > 2.5),
    (lambda t: nn.init.normal_(t, 1.0, 0.5), lambda v: abs(v.mean() - 1) < 0.1 and abs(v.std() - 0.5) < 0.05),
    (nn.init.zeros_, lambda v: np.all(v == 0)),
    (nn.init.ones_, lambda v: np.all(v == 1)),
    (nn.init.kaiming_uniform_, lambda v: np.abs(v).max() <= math.sqrt(6 / 30)),
    (nn.init.xavier_uniform_, lambda v: np.abs(v).max() <= math.sqrt(6 / 70)),
])
def test_init_functions_in_place_keep_layout(fn: Any, check: Any) -> None:
    p = nn.Parameter(sbpflow.zeros(40, 30, placement=P3, sbp=S.split(1)))
    shards = p.local_tensors()
    assert fn(p) is p
    assert p.sbp == (S.split(1),) and p.is_leaf and p.requires_grad
    assert all(p.local_tensors()[r] is shards[r] for r in shards), "initialisers write into the existing shards"
    assert check(p.numpy())


# -- parallel plans -------------------------------------------------------------------------------------------


def _mlp() -> tuple[nn.Sequential, torch.nn.Sequential]:
    ours = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
    theirs = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 6))
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize("pname,axis", [("2", 0), ("3", 0), ("2x2", 1)])
def test_megatron_mlp_plan(pname: str, axis: int) -> None:
    placement = PLACEMENTS[pname]
    ours, theirs = _mlp()
    apply_plan(ours, {"0": ColwiseParallel(), "2": RowwiseParallel()}, placement, mesh_axis=axis)
    tp = lambda s: tuple(s if a == axis else B for a in range(placement.ndim))  # noqa: E731
    assert ours[0].weight.sbp == tp(S.split(0)) and ours[0].bias.sbp == tp(S.split(0))
    assert ours[2].weight.sbp == tp(S.split(1)) and ours[2].bias.sbp == tp(B)
    x = randn(5, 6)
    with record() as log:
        out = ours(sbpflow.tensor(x, placement=placement, sbp=(B,) * placement.ndim))
    assert out.sbp == tp(PSUM) and log.counts() == {}  # no comm until someone needs the sum
    np.testing.assert_allclose(out.numpy(), theirs(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    with record() as log:
        out.to_global(sbp=(B,) * placement.ndim)
    assert log.counts() == {"all_reduce": len(placement.axis_groups(axis))}  # one per group along the axis


def test_vocab_parallel_embedding_and_data_parallel_input() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, ids: Any) -> Any:
            return self.head(self.emb(ids))

    m = Model()
    apply_plan(m, {"": DataParallelInput(0), "emb": VocabParallelEmbedding(), "h*": Replicate()}, P3)
    assert m.emb.weight.sbp == (S.split(0),) and m.head.weight.sbp == (B,)
    ids = torch.tensor([[1, 9, 3], [4, 4, 0], [7, 2, 8], [5, 6, 1]])
    out = m(sbpflow.tensor(ids))  # a local batch, cut S(0) by the pre-hook
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict({k[5:]: torch.from_numpy(v.numpy()) for k, v in m.state_dict().items() if "head" in k})
    want = ref(torch.from_numpy(m.emb.weight.numpy())[ids])
    np.testing.assert_allclose(out.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert out.placement == P3


def test_plan_errors_are_sbpflow_errors() -> None:
    ours, _ = _mlp()
    with pytest.raises(SbpError, match=r"pattern 'fc\*' matches no module; the module names are \[\"''\", '0'"):
        apply_plan(ours, {"fc*": ColwiseParallel()}, P2)
    with pytest.raises(SbpError, match="ColwiseParallel applies to Linear, Conv2d and Embedding modules, but 1 is a"):
        apply_plan(ours, {"1": ColwiseParallel()}, P2)
    with pytest.raises(SbpError, match="mesh_axis must be in"):
        apply_plan(ours, {}, P2, mesh_axis=1)
    with pytest.raises(SbpError, match="the style for '0' must be"):
        apply_plan(ours, {"0": "colwise"}, P2)
    dp = nn.Linear(2, 2)
    apply_plan(dp, {"": DataParallelInput()}, P2)
    with pytest.raises(AutogradError, match="DataParallelInput cuts a local input"):
        dp(sbpflow.randn(4, 2, requires_grad=True))


def test_layer_layout_argument_errors() -> None:
    with pytest.raises(SbpError, match="Linear: sbp= needs placement= as well"):
        nn.Linear(2, 2, sbp=S.split(0))
    with pytest.raises(SbpError, match="splits dim 1, but the tensor has only 1 dim"):
        nn.Linear(2, 2, placement=P2, sbp=S.split(1))  # the bias has one dim


def test_nn_functional_reexports_ops() -> None:
    import sbpflow.nn.functional as F

    for name in ("relu", "linear", "softmax", "cross_entropy", "layer_norm", "embedding", "dropout"):
        assert getattr(F, name) is getattr(sbpflow.functional, name)
