"""sbpflow.autocast and GradScaler against torch.autocast and torch.amp.GradScaler on the same model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import PLACEMENTS, B, LossStep
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.amp import FP32, LOWER
from sbpflow.errors import SbpflowError
from sbpflow.ops.schema import REGISTRY

D, H, V, N = 32, 64, 10, 16
# torch.testing's default rtol for bf16 (1.6e-2) and fp16 (1e-3); the absolute slack is that rtol times the
# largest reference entry, since entries near zero carry the low dtype's absolute rounding of the whole sum.
RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}


class TorchMlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = torch.nn.Linear(D, H), torch.nn.LayerNorm(H), torch.nn.Linear(H, V)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.ln(self.fc1(x)))
        return torch.nn.functional.cross_entropy(self.fc2(h), y)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(D, H), nn.LayerNorm(H), nn.Linear(H, V)

    def forward(self, x: Any, y: Any) -> Any:
        h = nn.functional.gelu(self.ln(self.fc1(x)))
        return nn.functional.cross_entropy(self.fc2(h), y)


def _twins(seed: int = 0) -> tuple[Mlp, TorchMlp, Any, Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    ref = TorchMlp()
    ours = Mlp()
    ours.load_state_dict({k: v.detach().clone() for k, v in ref.state_dict().items()})
    ours.to_global(PLACEMENTS["2"], B)
    x, y = torch.randn(N, D), torch.randint(0, V, (N,))
    xs = sbpflow.tensor(x, placement=PLACEMENTS["2"], sbp=S.split(0))
    ys = sbpflow.tensor(y, placement=PLACEMENTS["2"], sbp=S.split(0))
    return ours, ref, xs, ys, x, y


def _close(got: np.ndarray, want: np.ndarray, dtype: torch.dtype, what: str) -> None:
    rtol = RTOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()), err_msg=what)


def test_bf16_data_parallel_agrees_with_torch_autocast() -> None:
    ours, ref, xs, ys, x, y = _twins()
    with sbpflow.autocast(dtype=torch.bfloat16):
        hidden = ours.fc1(xs)
        loss = ours(xs, ys)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = ref(x, y)
    assert hidden.dtype == torch.bfloat16 and loss.dtype == torch.float32  # matmul low, loss fp32
    loss.backward()
    ref_loss.backward()
    _close(np.array(loss.item()), np.array(ref_loss.item()), torch.bfloat16, "loss")
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32  # master weights and grads stay fp32
        _close(p.grad.numpy(), q.grad.numpy(), torch.bfloat16, name)
    fp32_loss = TorchMlp.forward(ref, x, y).item()
    assert abs(loss.item() - ref_loss.item()) < abs(fp32_loss - ref_loss.item()) + 1e-3  # really low precision
    assert loss.item() != pytest.approx(fp32_loss, rel=1e-6)


def test_policy_lists_name_registered_ops_and_backward_keeps_forward_dtypes() -> None:
    assert LOWER <= set(REGISTRY) and FP32 <= set(REGISTRY)
    w = nn.Parameter(sbpflow.randn(4, 4))
    with sbpflow.autocast(dtype=torch.bfloat16):
        out = sbpflow.randn(3, 4) @ w
        out.float().sum().backward()  # backward inside the block: the matmul's gradient stays bf16, cast to fp32
    assert out.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    with sbpflow.autocast(dtype=torch.bfloat16), sbpflow.autocast(enabled=False):
        assert (sbpflow.randn(3, 4) @ w).dtype == torch.float32


def test_fp16_grad_scaler_skips_overflow_steps_like_torch() -> None:
    ours, ref, xs, ys, x, y = _twins(seed=1)
    opt = sbpflow.optim.SGD(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    # 2**24 overflows fp16 gradients (max 65504): the first steps are skipped and the scale backs off
    scaler = sbpflow.GradScaler(init_scale=2.0**24, growth_interval=3)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)
    scales, ref_scales = [], []
    for _ in range(8):
        opt.zero_grad()
        ref_opt.zero_grad()
        with sbpflow.autocast(dtype=torch.float16):
            loss = ours(xs, ys)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = ref(x, y)
        scaler.scale(loss).backward()
        ref_scaler.scale(ref_loss).backward()
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
        scales.append(scaler.get_scale())
        ref_scales.append(ref_scaler.get_scale())
    assert scales == ref_scales
    assert scales[0] < 2.0**24 and max(scales[3:]) > min(scales)  # backed off, then grew after clean steps
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        _close(p.numpy(), q.detach().numpy(), torch.float16, name)


def test_skipped_step_leaves_parameters_unchanged() -> None:
    w = nn.Parameter(sbpflow.ones(3, placement=PLACEMENTS["2"], sbp=S.split(0)))
    opt, scaler = sbpflow.optim.SGD([w], lr=1.0), sbpflow.GradScaler(init_scale=4.0)
    w.grad = sbpflow.tensor([1.0, float("inf"), 1.0], placement=PLACEMENTS["2"], sbp=S.split(0))
    scaler.step(opt)
    scaler.update()
    assert w.tolist() == [1.0, 1.0, 1.0] and scaler.get_scale() == 2.0


def test_errors() -> None:
    with pytest.raises(SbpflowError, match="takes torch.bfloat16 or torch.float16"):
        with sbpflow.autocast(dtype=torch.float64):
            pass
    scaler = sbpflow.GradScaler()
    opt = sbpflow.optim.SGD([nn.Parameter(sbpflow.ones(2))], lr=0.1)
    scaler.unscale_(opt)
    with pytest.raises(SbpflowError, match="already called"):
        scaler.unscale_(opt)
    from sbpflow.nn.graph import GraphConfig

    with pytest.raises(SbpflowError, match="loss_scaler"):
        GraphConfig().enable_amp(torch.float16, loss_scaler=2.0)
    config = GraphConfig()
    config.enable_amp(torch.float16)
    assert isinstance(config.loss_scaler, sbpflow.GradScaler)  # fp16: a scaler by default (bf16: none)


def _compiled_run(amp: bool, grad_comm: Any = None, rows: int = 64) -> tuple[float, list[np.ndarray], Any]:
    torch.manual_seed(2)
    ref = TorchMlp()
    model = Mlp()
    model.load_state_dict({k: v.detach().clone() for k, v in ref.state_dict().items()})
    model.to_global(PLACEMENTS["2"], B)
    step = LossStep(model, sbpflow.optim.SGD(model.parameters(), lr=0.1))
    step.config.set_sbp_selection("greedy")  # eager's choices: DDP's gradient all-reduces (the ILP may gather x)
    if amp:
        step.config.enable_amp(torch.bfloat16, grad_comm_dtype=grad_comm)
    x, y = torch.randn(rows, D), torch.randint(0, V, (rows,))
    xs = sbpflow.tensor(x, placement=PLACEMENTS["2"], sbp=S.split(0))
    ys = sbpflow.tensor(y, placement=PLACEMENTS["2"], sbp=S.split(0))
    loss = step(xs, ys).item()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        ref_loss = ref(x, y)
    ref_loss.backward()
    with torch.no_grad():
        for q in ref.parameters():
            q -= 0.1 * q.grad
    _close(np.array(loss), np.array(ref_loss.item()), torch.bfloat16, "loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        _close(p.numpy(), q.detach().numpy(), torch.bfloat16, name)
    return loss, [p.numpy() for p in model.parameters()], step


def _gradient_reduce_bytes(step: Any) -> int:
    return sum(s.bytes_per_rank for n in step.plan.collectives(0) for s in n.boxing.steps
               if s.kind in ("all_reduce", "reduce_scatter") and n.phase == "micro")


def test_graph_enable_amp_agrees_with_torch_autocast_and_halves_gradient_bytes() -> None:
    loss, _, step = _compiled_run(True)
    casts = [n for n in step.logical.nodes if n.name == "cast"]
    assert casts and any(step.logical.value(n.outputs[0]).dtype == torch.bfloat16 for n in casts)
    _, _, half = _compiled_run(True, grad_comm=torch.bfloat16)
    full_bytes, half_bytes = _gradient_reduce_bytes(step), _gradient_reduce_bytes(half)
    loss_bytes = 4  # the loss mean's fp32 scalar all-reduce: not a gradient, stays fp32
    assert full_bytes > 1000 and (half_bytes - loss_bytes) * 2 == full_bytes - loss_bytes


INIT_SCALE = 2.0**12  # 64x below where this model's fp16 gradients overflow: only the forced steps overflow
FORCED = (3, 6)


def _scaled_graph_run(x_steps: list[torch.Tensor], y: torch.Tensor, graph: bool,
                      zero: int = 0) -> tuple[list[float], Any, Any]:
    """Adam steps of the Mlp under fp16 with a dynamic loss scale: compiled (the scaler inside the step) or eager."""
    torch.manual_seed(3)
    ref = TorchMlp()
    model = Mlp()
    model.load_state_dict({k: v.detach().clone() for k, v in ref.state_dict().items()})
    model.to_global(PLACEMENTS["2"], B)
    opt = sbpflow.optim.Adam(model.parameters(), lr=1e-2)
    scaler = sbpflow.GradScaler(init_scale=INIT_SCALE, growth_interval=2)
    ys = sbpflow.tensor(y, placement=PLACEMENTS["2"], sbp=S.split(0))
    step = LossStep(model, opt)
    step.config.set_sbp_selection("greedy")  # eager's layouts, so fp16 sums run in eager's order
    step.config.enable_amp(torch.float16, loss_scaler=scaler)
    if zero:
        step.config.enable_zero(zero, min_shard_numel=1)
    scales = []
    for x in x_steps:
        xs = sbpflow.tensor(x, placement=PLACEMENTS["2"], sbp=S.split(0))
        if graph:
            step(xs, ys)
        else:
            opt.zero_grad()
            with sbpflow.autocast(dtype=torch.float16):
                loss = model(xs, ys)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        scales.append(scaler.get_scale())
    return scales, model, (opt, step)


def _torch_scaled_run(x_steps: list[torch.Tensor], y: torch.Tensor) -> tuple[list[float], Any, Any]:
    torch.manual_seed(3)
    ref = TorchMlp()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    scales = []
    for x in x_steps:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, ref, opt


def test_graph_fp16_loss_scaler_follows_torch_grad_scaler() -> None:
    """enable_amp(float16, loss_scaler=...): the scale sequence and skipped steps of torch.amp.GradScaler (step 6
    3 and 6 are forced to overflow by an input beyond fp16's range), Adam's step count not advanced on skipped steps,
    and parameters equal to eager sbpflow with its GradScaler."""
    torch.manual_seed(4)
    xs = [torch.randn(N, D) for _ in range(9)]
    for k in FORCED:
        xs[k][0, 0] = 1e6  # inf in fp16: the loss and every gradient are NaN at this step
    y = torch.randint(0, V, (N,))
    want_scales, ref, ref_opt = _torch_scaled_run(xs, y)
    scales, model, (opt, step) = _scaled_graph_run(xs, y, graph=True)
    eager_scales, eager, (eager_opt, _) = _scaled_graph_run(xs, y, graph=False)
    assert scales == want_scales == eager_scales
    backed_off = [k for k, (a, b) in enumerate(zip([INIT_SCALE, *scales], scales, strict=False)) if b < a]
    assert backed_off == list(FORCED) and max(scales) > INIT_SCALE  # backed off on overflow, grew otherwise
    skipped = len(backed_off)
    ref_steps = int(ref_opt.state[next(iter(ref.parameters()))]["step"])
    assert ref_steps == len(xs) - skipped
    for p in model.parameters():
        assert opt.state[p]["step"] == ref_steps
    # Adam's normalised steps on near-zero fp16 gradients amplify torch-vs-sbpflow rounding, so parameters are
    # compared with eager sbpflow (same kernels, same layouts); the scales and step counts with torch
    for (name, p), e in zip(model.named_parameters(), eager.parameters(), strict=True):
        np.testing.assert_allclose(p.numpy(), e.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    found = [n for n in step.logical.nodes if n.kind == "output" and n.name == "amp.found_inf"]
    assert len(found) == 1 and step.logical.nodes[-1].kind in ("assign", "output")
    wheres = [n for n in step.logical.nodes if n.name == "where" and n.phase == "post"]
    assert len(wheres) >= 3 * len(list(model.parameters()))  # each parameter, exp_avg, exp_avg_sq kept on overflow


def test_graph_loss_scaler_under_zero2_checks_sharded_gradients_in_one_reduction() -> None:
    """ZeRO-2's gradients are S(0): the non-finite counts of all of them add up as one partial sum, reduced once."""
    torch.manual_seed(4)
    xs = [torch.randn(N, D) for _ in range(4)]
    xs[2][0, 0] = 1e6
    y = torch.randint(0, V, (N,))
    plain, model, _ = _scaled_graph_run(xs, y, graph=True)
    scales, sharded, (_, step) = _scaled_graph_run(xs, y, graph=True, zero=2)
    assert scales == plain and scales[2] == scales[1] / 2
    for (name, p), q in zip(sharded.named_parameters(), model.parameters(), strict=True):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    scalar_reductions = [n for n in step.plan.collectives(0) if n.phase == "post"
                         and n.boxing.steps[0].kind == "all_reduce" and step.plan.bufs[n.outputs[0]].shape == ()]
    assert len(scalar_reductions) == 1


def test_promoted_op_gradients_take_each_input_dtype_like_torch() -> None:
    """bf16 * fp32 promotes to fp32; backward gives each input its own dtype's gradient, as torch does (an fp32
    gradient reaching a bf16 matmul's backward would fail there)."""
    torch.manual_seed(0)
    a, b, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8), torch.randn(8, 3, dtype=torch.bfloat16)
    ours = [sbpflow.tensor(t, placement=PLACEMENTS["2"], sbp=B, requires_grad=True) for t in (a, b, w)]
    ref = [t.clone().requires_grad_() for t in (a, b, w)]
    ((ours[0] * ours[1]).to(torch.bfloat16) @ ours[2]).float().sum().backward()
    ((ref[0] * ref[1]).to(torch.bfloat16) @ ref[2]).float().sum().backward()
    for got, want in zip(ours, ref, strict=True):
        assert got.grad.dtype == want.grad.dtype
        np.testing.assert_allclose(got.grad.float().numpy(), want.grad.float().numpy(), rtol=1.6e-2, atol=1e-2)


class _TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H).to_global(PLACEMENTS["1"], B)
        self.fc2 = nn.Linear(H, V).to_global(sbpflow.placement("cpu", [1]), B)

    def forward(self, x: Any) -> Any:
        h = nn.functional.gelu(self.fc1(x)).to_global(placement=self.fc2.weight.placement, sbp=B)
        return self.fc2(h).float().square().mean()


def test_graph_fp16_loss_scaler_on_a_pipeline() -> None:
    """fp16 with the scaler inside a 2-stage pipeline (2 micro-batches): the scale lives on stage 0, the overflow
    flag reaches stage 1's updates; a step forced to overflow leaves both stages' parameters and moments alone,
    and the others equal the same steps without loss scaling (fp16 tolerance)."""
    torch.manual_seed(5)
    xs = [torch.randn(N, D) for _ in range(3)]
    xs[1][0, 0] = 1e6
    runs = {}
    for scaled in (True, False):
        sbpflow.manual_seed(0)
        model = _TwoStages()
        opt = sbpflow.optim.Adam(model.parameters(), lr=1e-2)
        step = LossStep(model, opt)
        step.config.set_gradient_accumulation_steps(2)
        scaler = sbpflow.GradScaler(init_scale=2.0**10, growth_interval=1)
        step.config.enable_amp(torch.float16, loss_scaler=scaler if scaled else None)
        scales, params = [], []
        for x in (xs if scaled else xs[:1] + xs[2:]):
            step(sbpflow.tensor(x, placement=PLACEMENTS["1"], sbp=B))
            scales.append(scaler.get_scale())
            params.append([p.numpy().copy() for p in model.parameters()])
        runs[scaled] = (scales, params, [opt.state[p]["step"] for p in model.parameters()])
        assert step.plan.pipeline is not None and len(step.plan.pipeline.stages) == 2
    scales, params, steps = runs[True]
    assert scales == [2.0**11, 2.0**10, 2.0**11] and steps == [2, 2, 2, 2]
    for p, q in zip(params[1], params[0], strict=True):
        np.testing.assert_array_equal(p, q)  # the overflowed step changed nothing, on either stage
    for got, want in zip(params[2], runs[False][1][1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))
