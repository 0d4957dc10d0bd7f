"""The modules, initialisers, conversions, LR schedules and optimizers that ported training files use (issue 32),
against torch: weights copied from the torch module, forward and gradients compared, local and on meshes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import PLACEMENTS, B, randn
from sbpflow import nn, optim
from sbpflow import sbp as S
from sbpflow.optim import lr_scheduler as LR

from .test_nn import compare
from .test_optim import LAYOUTS, _run

S0, S1 = S.split(0), S.split(1)


# -- activations, Unflatten, losses -----------------------------------------------------------------------------


@pytest.mark.parametrize("pname", [None, "2"])
def test_activation_and_shape_modules_against_torch(pname: str | None) -> None:
    p = PLACEMENTS[pname] if pname else None
    x = randn(4, 6)
    cases = [(nn.LeakyReLU(0.1), torch.nn.LeakyReLU(0.1)), (nn.Sigmoid(), torch.nn.Sigmoid()),
             (nn.Softmax(dim=1), torch.nn.Softmax(dim=1)), (nn.Unflatten(1, (2, 3)), torch.nn.Unflatten(1, (2, 3)))]
    for ours, theirs in cases:
        theirs.zero_grad()
        out, flog, _ = compare(ours, theirs, [x], p, [(S0,)] if p else None)
        if p is not None:
            assert out.sbp == (S0,) and flog.counts() == {}


def test_losses_against_torch() -> None:
    logits, target = randn(6, 5), torch.tensor([0, 4, 2, 2, 1, 3])
    logp = torch.log_softmax(logits, 1)
    for kw in [{}, {"reduction": "sum"}, {"weight": torch.rand(5)}]:
        ours_kw = {k: sbpflow.tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        compare(nn.NLLLoss(**ours_kw), torch.nn.NLLLoss(**kw), [logp, target])
    y = (randn(6, 5, seed=1) > 0).float()
    compare(nn.BCEWithLogitsLoss(), torch.nn.BCEWithLogitsLoss(), [logits, y], PLACEMENTS["2"], [(S0,), (S0,)])
    pw = torch.rand(5) + 0.5
    compare(nn.BCEWithLogitsLoss(pos_weight=sbpflow.tensor(pw)), torch.nn.BCEWithLogitsLoss(pos_weight=pw),
            [logits, y])


# -- GroupNorm (channel splits), Conv1d --------------------------------------------------------------------------


@pytest.mark.parametrize("pname,sbp", [(None, None), ("2", (S0,)), ("2", (S1,)), ("3", (S1,)), ("2x2", (S0, S1))])
def test_group_norm_reduces_across_a_channel_split(pname: str | None, sbp: Any) -> None:
    torch.manual_seed(0)
    theirs = torch.nn.GroupNorm(3, 6)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    p = PLACEMENTS[pname] if pname else None
    out, _, _ = compare(nn.GroupNorm(3, 6), theirs, [randn(4, 6, 5, 3) * 3 + 1], p, [sbp] if p else None)
    if p is not None:
        assert tuple(out.shape) == (4, 6, 5, 3)


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 1}, {"groups": 2, "dilation": 2}])
def test_conv1d_against_torch(kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    theirs = torch.nn.Conv1d(4, 6, 3, **kwargs)
    x = randn(2, 4, 9)
    compare(nn.Conv1d(4, 6, 3, **kwargs), theirs, [x])
    theirs.zero_grad()
    out, flog, _ = compare(nn.Conv1d(4, 6, 3, **kwargs), theirs, [x], PLACEMENTS["2"], [(S0,)])
    assert out.sbp == (S0,) and flog.counts() == {}  # data parallel: each rank convolves its samples


# -- ParameterList, initialisers, Module.to ----------------------------------------------------------------------


def test_parameter_list_registers_its_parameters() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scales = nn.ParameterList([nn.Parameter(sbpflow.ones(3)) for _ in range(2)])

        def forward(self, x: sbpflow.Tensor) -> sbpflow.Tensor:
            for s in self.scales:
                x = x * s
            return x

    m = Scaled()
    assert [n for n, _ in m.named_parameters()] == ["scales.0", "scales.1"] and len(m.scales) == 2
    m(sbpflow.ones(2, 3)).sum().backward()
    assert all(p.grad is not None for p in m.scales)
    m.to_global(PLACEMENTS["2"])
    assert m.scales[1].placement == PLACEMENTS["2"]


@pytest.mark.parametrize("pname,sbp", [(None, None), ("2", (S0,)), ("2", (B,))])
def test_trunc_normal_and_kaiming_normal_draw_torchs_distribution(pname: str | None, sbp: Any) -> None:
    p = PLACEMENTS[pname] if pname else None
    w = nn.Parameter(sbpflow.zeros(200, 300, placement=p, sbp=sbp))
    nn.init.trunc_normal_(w, mean=0.5, std=2.0, a=-1.0, b=3.0)
    values = torch.as_tensor(w.numpy())
    assert values.min() >= -1.0 and values.max() <= 3.0
    # the moments of N(0.5, 2²) cut to [-1, 3], from scipy's truncnorm: mean 0.8041, std 1.1195 (rounded)
    ref = torch.empty(200, 300)
    torch.nn.init.trunc_normal_(ref, mean=0.5, std=2.0, a=-1.0, b=3.0)
    assert abs(values.mean() - ref.mean()) < 0.03 and abs(values.std() - ref.std()) < 0.03
    if p is not None:
        assert w.sbp == sbp and all(t.shape == w.to_local().shape for t in w.local_tensors().values())
    nn.init.kaiming_normal_(w, mode="fan_out", nonlinearity="relu")
    std = torch.as_tensor(w.numpy()).std().item()
    assert abs(std - math.sqrt(2.0 / 200)) < 0.005


def test_module_to_dtype_and_device_keeps_parameters_and_layouts() -> None:
    m = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    m.to_global(PLACEMENTS["2"])
    weight = m[0].weight
    m.half()
    assert m[0].weight is weight and weight.dtype == torch.float16 and weight.sbp == (B,)
    m.float().to("cpu")
    assert weight.dtype == torch.float32
    m.to(torch.device("cpu"), dtype=torch.float64)
    x = sbpflow.randn(2, 4, dtype=torch.float64, placement=PLACEMENTS["2"], sbp=S0)
    assert m(x).dtype == torch.float64
    with pytest.raises(sbpflow.SbpflowError, match="cannot move a global tensor.*to_global"):
        m.to("meta")
    assert weight.dtype == torch.float64  # a refused call changed nothing


# -- LR schedules and optimizers against torch ---------------------------------------------------------------------

SCHEDULES = [
    (lambda o: LR.StepLR(o, 3, gamma=0.5), lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5)),
    (lambda o: LR.MultiStepLR(o, [2, 5, 6], 0.3), lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 5, 6], 0.3)),
    (lambda o: LR.ExponentialLR(o, 0.9), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9)),
    (lambda o: LR.LambdaLR(o, lambda s: 1 / (s + 1)),
     lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1))),
    (lambda o: LR.OneCycleLR(o, 1.0, total_steps=10),
     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=10)),
    (lambda o: LR.OneCycleLR(o, [1.0, 0.5], epochs=2, steps_per_epoch=5, anneal_strategy="linear", three_phase=True),
     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, [1.0, 0.5], epochs=2, steps_per_epoch=5,
                                                   anneal_strategy="linear", three_phase=True)),
]


@pytest.mark.parametrize("index", range(len(SCHEDULES)))
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_lr_schedules_match_torch(index: int, kind: str) -> None:
    ours_make, theirs_make = SCHEDULES[index]
    p, q = nn.Parameter(sbpflow.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    r, t = nn.Parameter(sbpflow.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    if kind == "sgd":
        opt = optim.SGD([{"params": [p]}, {"params": [r], "lr": 0.2}], lr=0.1, momentum=0.9)
        ref = torch.optim.SGD([{"params": [q]}, {"params": [t], "lr": 0.2}], lr=0.1, momentum=0.9)
    else:
        opt = optim.Adam([{"params": [p]}, {"params": [r], "lr": 0.2}], lr=0.1)
        ref = torch.optim.Adam([{"params": [q]}, {"params": [t], "lr": 0.2}], lr=0.1)
    ours, theirs = ours_make(opt), theirs_make(ref)
    for _ in range(9):
        np.testing.assert_allclose(ours.get_last_lr(), theirs.get_last_lr(), rtol=1e-12)
        for g, h in zip(opt.param_groups, ref.param_groups, strict=True):
            for key in ("momentum", "betas"):
                if key in h:
                    np.testing.assert_allclose(g[key], h[key], rtol=1e-12)
        ref.step()
        ours.step()
        theirs.step()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kwargs", [{"lr": 0.01}, {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1},
                                    {"lr": 0.02, "alpha": 0.9, "momentum": 0.5, "maximize": True}],
                         ids=["plain", "centred", "momentum"])
def test_rmsprop_matches_torch(layout: str, kwargs: dict[str, Any]) -> None:
    _run(lambda ps: optim.RMSprop(ps, **kwargs), lambda ps: torch.optim.RMSprop(ps, **kwargs), layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kwargs", [{"lr": 0.1}, {"lr": 0.1, "lr_decay": 0.1, "weight_decay": 0.05,
                                                  "initial_accumulator_value": 0.5}],
                         ids=["plain", "decay"])
def test_adagrad_matches_torch(layout: str, kwargs: dict[str, Any]) -> None:
    _run(lambda ps: optim.Adagrad(ps, **kwargs), lambda ps: torch.optim.Adagrad(ps, **kwargs), layout)


# -- MultiheadAttention, ConvTranspose2d, LSTM ---------------------------------------------------------------------


class _FirstOut(nn.Module):
    """The module's first output (the harness compares one tensor; attention and LSTM return tuples)."""

    def __init__(self, inner: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.inner, self.kwargs = inner, kwargs

    def forward(self, *xs: Any) -> Any:
        return self.inner(*xs, **self.kwargs)[0]


class _TorchFirstOut(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.inner, self.kwargs = inner, kwargs

    def forward(self, *xs: Any) -> Any:
        return self.inner(*xs, **self.kwargs)[0]


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_against_torch(batch_first: bool) -> None:
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)
    x = randn(3, 5, 8) if batch_first else randn(5, 3, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    compare(_FirstOut(nn.MultiheadAttention(8, 2, batch_first=batch_first)), _TorchFirstOut(theirs), [x, x, x])
    theirs.zero_grad()
    batch = (S0,) if batch_first else (S1,)
    out, flog, _ = compare(_FirstOut(nn.MultiheadAttention(8, 2, batch_first=batch_first), need_weights=False),
                           _TorchFirstOut(theirs, need_weights=False), [x, x, x], PLACEMENTS["2"], [batch] * 3)
    assert out.sbp == batch and flog.counts() == {}  # per shard: the batch split runs without communication
    ours = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    ours.load_state_dict(theirs.state_dict())
    for kw in [{"attn_mask": mask}, {"is_causal": True, "attn_mask": mask}, {"average_attn_weights": False}]:
        got = ours(*(sbpflow.tensor(x),) * 3, **{k: sbpflow.tensor(v) if isinstance(v, torch.Tensor) else v
                                                for k, v in kw.items()})
        want = theirs(x, x, x, **kw)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g.numpy(), w.detach().numpy(), rtol=1e-5, atol=1e-6)
    pad = torch.tensor([[False] * 4 + [True]] * 3)
    got = ours(*(sbpflow.tensor(x),) * 3, key_padding_mask=sbpflow.tensor(pad))
    np.testing.assert_allclose(got[0].numpy(), theirs(x, x, x, key_padding_mask=pad)[0].detach().numpy(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 1, "output_padding": 1}, {"groups": 2}])
def test_conv_transpose2d_against_torch(kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    theirs = torch.nn.ConvTranspose2d(4, 6, 3, **kwargs)
    x = randn(2, 4, 5, 5)
    compare(nn.ConvTranspose2d(4, 6, 3, **kwargs), theirs, [x])
    theirs.zero_grad()
    out, flog, _ = compare(nn.ConvTranspose2d(4, 6, 3, **kwargs), theirs, [x], PLACEMENTS["2"], [(S0,)])
    assert out.sbp == (S0,) and flog.counts() == {}
    if not kwargs.get("groups"):  # input channels with the weight's rows: a partial sum, reduced once
        theirs.zero_grad()
        out, _, _ = compare(nn.ConvTranspose2d(4, 6, 3, **kwargs), theirs, [x], PLACEMENTS["2"], [(S1,)],
                            param_sbps={"weight": (S0,)})


@pytest.mark.parametrize("kwargs", [{}, {"num_layers": 2, "bidirectional": True, "batch_first": True}])
def test_lstm_against_torch_and_per_shard_under_a_batch_split(kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    theirs = torch.nn.LSTM(5, 4, **kwargs)
    x = randn(3, 6, 5)
    compare(_FirstOut(nn.LSTM(5, 4, **kwargs)), _TorchFirstOut(theirs), [x])
    theirs.zero_grad()
    batch = (S0,) if kwargs.get("batch_first") else (S1,)
    out, flog, _ = compare(_FirstOut(nn.LSTM(5, 4, **kwargs)), _TorchFirstOut(theirs), [x], PLACEMENTS["2"], [batch])
    assert out.sbp == batch and flog.counts() == {}
    ours = nn.LSTM(5, 4, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    layers, batch_size = (4, 3) if kwargs else (1, 6)  # (layers x directions, batch): x is (N, L, in) batch first
    h0 = randn(layers, batch_size, 4)
    c0 = randn(*h0.shape, seed=1)
    got = ours(sbpflow.tensor(x), (sbpflow.tensor(h0), sbpflow.tensor(c0)))
    want = theirs(x, (h0, c0))
    np.testing.assert_allclose(got[0].numpy(), want[0].detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1][1].numpy(), want[1][1].detach().numpy(), rtol=1e-5, atol=1e-6)


def test_lstm_refuses_layouts_other_than_a_batch_split() -> None:
    lstm = nn.LSTM(5, 4).to_global(PLACEMENTS["2"])
    x = sbpflow.tensor(randn(3, 6, 5), placement=PLACEMENTS["2"], sbp=S.split(2))
    with pytest.raises(sbpflow.SbpError, match=r"LSTM runs per shard under batch splits only.*\(S\(2\)\)"):
        lstm(x)
    nn.module.relayout_(lstm.weight_hh_l0, PLACEMENTS["2"], S0)
    with pytest.raises(sbpflow.SbpError, match="parameter shape \\[16, 4\\]"):
        lstm(sbpflow.tensor(randn(3, 6, 5), placement=PLACEMENTS["2"], sbp=S1))
