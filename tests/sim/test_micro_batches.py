"""Micro-batches under nn.Graph, on virtual ranks: a split of the batch over time.

A residual MLP moves its input (the residual), ids (for an embedding on the second stage) and its labels across
stages with ``to_global``; with m micro-batches each of them must be cut per micro-batch wherever it is read
(pp2 with 4 micro-batches used to send the labels whole: "expected index [8, 1] to be no larger than self [2, 5]").
Every loss, every output (the loss, per-row losses joined by cat, the logits) and every parameter after 2 SGD steps
equals one device's full-batch numbers in plain torch, for sum and mean losses, with m = 1, 2, 4, on one rank, dp2,
pp2 and pp2 x dp2; ``average=True`` gives OneFlow's averaged accumulation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from micro_programs import LAYOUTS, LOSSES, assert_matches, batches, build_graph, train_graph, train_torch
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.errors import SbpflowError
from sbpflow.graph.micro import MicroBatchError

# pp2 with one micro-batch warns of its bubble: that case is here for its numbers
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::sbpflow.graph.pipeline.PipelineWarning")]

_TORCH: dict[tuple[str, float], Any] = {}


def _torch(loss: str, scale: float = 1.0) -> Any:
    if (loss, scale) not in _TORCH:
        _TORCH[(loss, scale)] = train_torch(loss, scale)
    return _TORCH[(loss, scale)]


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("loss", LOSSES)
def test_a_step_with_micro_batches_is_the_full_batch_step(loss: str, layout: str, m: int) -> None:
    assert_matches(train_graph(layout, m, loss), _torch(loss), what=f"{loss} {layout} m={m}")


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("loss", ["sum", "mean"])
def test_average_accumulates_as_oneflow(loss: str, m: int) -> None:
    """A sum loss steps as ``loss / m`` on the full batch and returns that (OneFlow's graph); a mean loss of equal
    micro-batches is the same either way. Per-row outputs are still concatenated."""
    want = _torch(loss, 1.0 / m if loss == "sum" else 1.0)
    for layout in ("one", "pp2xdp2"):
        assert_matches(train_graph(layout, m, loss, average=True), want, what=f"{loss} {layout} m={m}")


def test_the_reference_executor_agrees() -> None:
    assert_matches(train_graph("pp2", 4, "sum", executor="inorder"), _torch("sum"))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_per_row_outputs_keep_the_batch_order_under_zero(zero: int) -> None:
    """Per-row outputs are pinned to the inputs' blocks of rows: under ZeRO-2 the selection once chose B logits on
    dp2, whose micro-batch pieces then joined as rows 0, 1, 4, 5, 2, 3, 6, 7."""
    assert_matches(train_graph("dp2", 2, "padded", zero=zero), _torch("padded"), what=f"zero {zero}")


@pytest.mark.parametrize("layout", ["dp2", "pp2xdp2"])
def test_labels_broadcast_beside_split_data_make_the_same_micro_batches(layout: str) -> None:
    """Labels given B while the data is S(0): micro-batch k must hold the same rows of both (chunk k of each data
    shard), so the labels take the data's split of dim 0 at the call (a local slice): the step is torch's."""
    got = train_graph(layout, 2, "sum", label_sbp=S.broadcast)
    assert_matches(got, _torch("sum"), what=layout)


def test_an_input_that_cannot_hold_the_first_inputs_rows_is_refused() -> None:
    """Data S(0) on 2 ranks and labels on 1 rank: no SBP of the labels' placement holds the data's two blocks of rows
    as its shards, so micro-batches would pair rows wrongly; the call is refused before anything runs."""
    graph, model = build_graph("pp2xdp2", 2)
    before = {name: p.numpy().copy() for name, p in model.named_parameters()}
    x, ids, y = batches()[0]
    p0 = sbpflow.placement("cpu", [0, 1])
    args = [sbpflow.tensor(t, placement=p0, sbp=S.split(0)) for t in (x, ids)]
    with pytest.raises(SbpflowError, match=r"input 2 .* has no SBP on its placement"):
        graph(*args, sbpflow.tensor(y, placement=sbpflow.placement("cpu", [2]), sbp=S.broadcast))
    assert graph._last is None
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.numpy(), before[name])


@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
@pytest.mark.parametrize("loss", ["sum", "padded"])
def test_every_schedule_has_the_full_batch_step(schedule: str, loss: str) -> None:
    assert_matches(train_graph("pp2xdp2", 4, loss, schedule=schedule), _torch(loss), what=schedule)


def test_the_pipeline_cuts_an_input_read_only_on_the_second_stage() -> None:
    """The labels are read on stage 1 alone: their micro-batches are unpacked on stage 0 and sent one by one, never
    sent whole as a step constant (a tied weight) is. Only the loss's count of kept labels reads them whole, once,
    before the micro-batches."""
    graph, _ = build_graph("pp2", 4)
    p0 = sbpflow.placement("cpu", [0])
    graph(sbpflow.ones(8, 4, placement=p0, sbp=S.split(0)),
          *[sbpflow.zeros(8, dtype=torch.int64, placement=p0, sbp=S.split(0)) for _ in range(2)])
    plan = graph.plan
    inputs = {n.outputs[0]: n.name for n in plan.nodes if n.kind == "input"}
    assert sorted({n.name for n in plan.nodes if n.kind == "unpack"}) == sorted(set(inputs.values()))
    for n in plan.nodes:
        if n.phase == "micro" and n.kind != "unpack":
            assert not set(n.inputs) & set(inputs), n.label()
    whole = [n for n in plan.nodes if n.phase == "pre" and set(n.inputs) & set(inputs)]
    assert [inputs[b] for n in whole for b in n.inputs] == ["input2"]  # the labels, for their count


def test_dropout_keys_do_not_depend_on_the_pipeline() -> None:
    """Keys are drawn per micro-batch (as eager mode draws them, micro-batch after micro-batch), the same on
    whichever stage the dropout runs: pp2 equals one rank, pp2 x dp2 equals dp2 (whose micro-batches are the same
    rows: each rank's chunk k)."""
    assert_matches(train_graph("pp2", 4, "sum", dropout=0.3), train_graph("one", 4, "sum", dropout=0.3),
                   rtol=1e-5, atol=1e-6)
    assert_matches(train_graph("pp2xdp2", 2, "mean", dropout=0.3), train_graph("dp2", 2, "mean", dropout=0.3),
                   rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- what cannot be exact


def _step(m: int, loss_fn: Any, average: bool = False,
          labels: list[int] | None = None) -> tuple[nn.Graph, tuple[Any, ...]]:
    """A linear model's step on dp2 with ``loss_fn(model, x, *labels)``; returns the graph and its arguments."""
    p = sbpflow.placement("cpu", [0, 1])
    model = nn.Linear(4, 3, placement=p, sbp=S.broadcast)
    opt = sbpflow.optim.SGD(model.parameters(), lr=LR_SMALL)

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(m, average=average)

        def build(self, x: Any, *rest: Any) -> Any:
            loss = loss_fn(self.model, x, *rest)
            loss.backward()
            return loss

    x = sbpflow.tensor([[0.1 * (i + j) for j in range(4)] for i in range(8)], placement=p, sbp=S.split(0))
    rest = () if labels is None else (sbpflow.tensor(labels, placement=p, sbp=S.split(0)),)
    return Step(), (x, *rest)


LR_SMALL = 0.05


def _sqrt_of_sum(model: Any, x: Any) -> Any:
    return model(x).square().sum().sqrt()


def _sum_plus_mean(model: Any, x: Any) -> Any:
    y = model(x).square()
    return y.sum() + y.mean()


def _ratio_of_sums(model: Any, x: Any) -> Any:
    y = model(x)
    return y.sum() / y.abs().sum()  # both sums depend on the model: no whole-step value before the micro-batches


@pytest.mark.parametrize(("loss_fn", "op", "why"), [(_sqrt_of_sum, "sqrt", "not linear"),
                                                    (_sum_plus_mean, "add", "different scales"),
                                                    (_ratio_of_sums, "div", "not linear")])
def test_a_loss_with_no_exact_micro_batch_form_is_refused_by_name(loss_fn: Any, op: str, why: str) -> None:
    graph, args = _step(2, loss_fn)
    with pytest.raises(MicroBatchError, match=f"op '{op}' cannot be computed exactly per micro-batch.*{why}"):
        graph(*args)
    assert graph._last is None  # nothing compiled, nothing ran
    for m, average in ((1, False), (2, True)):  # one micro-batch is the batch; averaging is a convention
        graph, args = _step(m, loss_fn, average)
        graph(*args)


def test_a_mean_loss_plus_a_weight_penalty_is_exact() -> None:
    """A mean (P/m) plus a term of the weights alone (B, the same in each micro-batch) joins exactly: the penalty
    counts once per step, as on the full batch."""
    def loss_fn(model: Any, x: Any) -> Any:
        return model(x).square().mean() + model.weight.square().sum() * 0.1

    graph, (x,) = _step(4, loss_fn)
    w0, b0 = (torch.tensor(t.numpy(), requires_grad=True) for t in (graph.model.weight, graph.model.bias))
    got = graph(x).numpy()
    xt = torch.tensor(x.numpy())
    want = (xt @ w0.T + b0).square().mean() + w0.square().sum() * 0.1
    want.backward()
    np.testing.assert_allclose(got, want.item(), rtol=1e-5)
    assert w0.grad is not None
    np.testing.assert_allclose(graph.model.weight.numpy(), (w0 - LR_SMALL * w0.grad).detach().numpy(), rtol=1e-5,
                               atol=1e-6)


def test_gradient_accumulation_steps_are_checked() -> None:
    config = nn.GraphConfig()
    for bad in (0, 1.5, True):
        with pytest.raises(SbpflowError, match="int >= 1"):
            config.set_gradient_accumulation_steps(bad)  # type: ignore[arg-type]
    with pytest.raises(SbpflowError, match="average=.*bool"):
        config.set_gradient_accumulation_steps(2, average=1)  # type: ignore[arg-type]
    assert (config.micro_batches, config.average_micro_batches) == (1, False)


def test_a_gpt_with_padded_targets_steps_as_the_full_batch() -> None:
    """nanoGPT's loss reshapes the targets to (B*T,) and divides by the kept ones: with padding (-100) spread
    unevenly over 4 micro-batches on dp2 x pp2, the count is the whole step's (traced again before the
    micro-batches), and losses and parameters are one device's full-batch ones."""
    from sbpflow.demo.train_gpt import build, parameter_values, random_batches
    from sbpflow.models.gpt import GPTConfig

    config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    runs = []
    for spec, m in ((None, 1), ("dp=2,pp=2", 4)):
        trainer = build(config, spec, graph=spec is not None, micro_batches=m)
        losses = []
        for i, (ids, targets) in enumerate(random_batches(64, 2, 8, 8, seed=1)):
            targets = np.array(targets)
            targets[:3 + i, 2:] = -100  # micro-batches of 2 rows: 2, 1, 0, 0 rows padded (3, 1, 0, 0 next step)
            losses.append(trainer.step(ids, targets))
        runs.append((losses, parameter_values(trainer)))
    (want_losses, want), (losses, got) = runs
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=2e-6, err_msg=name)


def test_class_weights_with_uneven_padding_are_exact() -> None:
    """A weighted mean divides by the kept targets' weights, picked from the class weights expanded to the rows:
    the whole step's count expands them to the batch's rows (m copies of equal rows), so micro-batches of unequal
    weight still give torch's full-batch loss and step."""
    p = sbpflow.placement("cpu", [0, 1])
    class_weight = [0.5, 1.0, 2.0]
    labels = [0, -100, 2, 1, -100, -100, 2, 0]  # rank 0 holds rows 0-3, rank 1 rows 4-7; micro-batch k: their row k

    def loss_fn(model: Any, x: Any, y: Any) -> Any:
        weight = sbpflow.tensor(class_weight, placement=p, sbp=S.broadcast)
        return nn.functional.cross_entropy(model(x), y, weight=weight)

    graph, (x, y) = _step(4, loss_fn, labels=labels)
    w0, b0 = (torch.tensor(t.numpy(), requires_grad=True) for t in (graph.model.weight, graph.model.bias))
    got = graph(x, y).numpy()
    logits = torch.tensor(x.numpy()) @ w0.T + b0
    want = torch.nn.functional.cross_entropy(logits, torch.tensor(labels), weight=torch.tensor(class_weight))
    want.backward()
    np.testing.assert_allclose(got, want.item(), rtol=1e-5)
    assert w0.grad is not None
    np.testing.assert_allclose(graph.model.weight.numpy(), (w0 - LR_SMALL * w0.grad).detach().numpy(), rtol=1e-5,
                               atol=1e-6)


def test_a_scaled_fp16_sum_loss_steps_as_its_full_batch() -> None:
    """The loss scale multiplies each micro-batch's seed (1 for a sum loss, not 1/m): with 4 micro-batches an fp16
    step under a GradScaler moves the weights and the scale as one micro-batch does (fp16 tolerance)."""
    runs = []
    for m in (1, 4):
        sbpflow.manual_seed(0)
        graph, (x,) = _step(m, lambda model, x: model(x).square().sum())
        graph.config.enable_amp(torch.float16, loss_scaler=sbpflow.GradScaler(init_scale=2.0**10, growth_interval=1))
        losses = [float(graph(x).numpy()) for _ in range(2)]
        runs.append((losses, graph.model.weight.numpy().copy(), graph.config.loss_scaler.get_scale()))
    (losses, weight, scale), (want_losses, want_weight, want_scale) = runs[1], runs[0]
    np.testing.assert_allclose(losses, want_losses, rtol=2e-3)
    np.testing.assert_allclose(weight, want_weight, rtol=2e-3, atol=1e-3)
    assert scale == want_scale == 2.0**12
