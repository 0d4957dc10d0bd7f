"""The planner's memory prediction against the compiled step's own peak (issue 25: memory under a cap).

Models the project did not write (a residual MLP, a BatchNorm CNN, a causal language model) and the shipped ViT,
planned for 4 virtual ranks under dp4, ZeRO-1, tp2 x dp2 and pp2 x dp2: the predicted bytes on the fullest device
are at least the compiler's ``plan.peak_bytes`` and at most ``MARGIN`` times it (over 30 plans the compiled peak
is 0.60-0.98 of the prediction, one under it: docs/benchmarks.md, "Memory predictions against compiled peaks"). And
ZeRO-1, which shards only the update, selects the plain step's layouts: a BatchNorm CNN gathers no more
activations under it, and peaks lower.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.autoparallel.apply import _lay_out_inputs, plan_model
from sim.test_auto_parallel_any import BatchNormCNN, Step, _bn_cnn, _causal_lm, _mlp, _vit

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::sbpflow.graph.pipeline.PipelineWarning")]

MARGIN = 1.7  # the prediction is at most this many times the compiled peak (0.60 of it at worst, a pp2 ViT)
PLANS = {"dp4": {"tp": 1, "pp": 1, "dp": 4, "zero": 0}, "zero1": {"tp": 1, "pp": 1, "dp": 4, "zero": 1},
         "tp2 dp2": {"tp": 2, "pp": 1, "dp": 2, "zero": 0}, "pp2 dp2": {"tp": 1, "pp": 2, "dp": 2, "zero": 0}}
FAMILIES = {"mlp": _mlp, "bn_cnn": _bn_cnn, "causal_lm": _causal_lm, "vit": _vit}
# the SBP selection of the causal LM's tp2 x dp2 step gathers its qkv output gradient over the tensor axis, a copy
# the planner's per-rank working set (split by tp, as its activations) does not price: 55.4 kB against 51.6 kB
GATHERED = pytest.mark.xfail(strict=True, reason="the selection gathers a tensor-parallel gradient in backward")
CASES = [("mlp", "dp4"), ("mlp", "zero1"), ("mlp", "tp2 dp2"), ("mlp", "pp2 dp2"), ("bn_cnn", "dp4"),
         ("bn_cnn", "zero1"), ("bn_cnn", "pp2 dp2"), ("causal_lm", "dp4"),
         pytest.param("causal_lm", "tp2 dp2", marks=GATHERED), ("vit", "tp2 dp2"), ("vit", "pp2 dp2")]


def _planned_step(family: str, plan: str) -> tuple[Any, Any]:
    """The auto plan of ``family`` restricted to ``plan``'s mesh and ZeRO stage, after one compiled step."""
    want = PLANS[plan]
    sbpflow.manual_seed(0)
    model, loss, batch = FAMILIES[family]()
    step = Step(model, loss)
    x, y = (sbpflow.tensor(t) for t in batch(torch.Generator().manual_seed(1)))
    chosen = plan_model(step, (x, y), 4, only=lambda k: all(getattr(k, a) == v for a, v in want.items())
                        and k.recompute == "none" and k.cp == 1)
    step.config.set_plan(chosen)
    step(x, y)
    return step, chosen


@pytest.mark.parametrize("family,plan", CASES)
def test_the_predicted_peak_bounds_the_compiled_peak(family: str, plan: str) -> None:
    step, chosen = _planned_step(family, plan)
    compiled = max(step._last.plan.peak_bytes.values())
    predicted = chosen.memory_per_device
    assert compiled <= predicted <= MARGIN * compiled, (chosen.knobs, compiled, chosen.memory)


def _hand_dp4(zero: int) -> dict[str, Any]:
    """A BatchNorm CNN laid out by hand on dp4 (its selection not capped by a plan), ZeRO ``zero``."""
    sbpflow.manual_seed(0)
    model, loss, batch = _bn_cnn()
    assert isinstance(model, BatchNormCNN)
    strategy = sbpflow.parallelize(model, data=4)
    step = Step(model, loss)
    if zero:
        step.config.enable_zero(stage=zero)
    args = _lay_out_inputs(strategy, tuple(sbpflow.tensor(t) for t in batch(torch.Generator().manual_seed(1))))
    loss_value = float(step(*args).numpy())
    plan = step._last.plan
    micro = [n.name.split(" for ")[-1] for n in plan.nodes
             if n.kind == "boxing" and n.is_comm and n.phase == "micro" and 0 in n.ranks]
    return {"peak": max(plan.peak_bytes.values()), "micro": sorted(micro), "loss": loss_value,
            "kept": step._compiled().report.selection.kept_bytes}


def test_zero1_selects_the_plain_steps_layouts_and_peaks_lower() -> None:
    """ZeRO-1's forward and backward are the plain step's: its selection is theirs (no BatchNorm statistics
    gathered where plain data parallelism gathers none), and only the update is sharded, so its peak is lower."""
    plain, zero1 = _hand_dp4(0), _hand_dp4(1)
    assert zero1["micro"] == plain["micro"] and zero1["kept"] == plain["kept"]
    assert not any(name.startswith(("mean", "sum")) for name in zero1["micro"])
    assert zero1["peak"] < plain["peak"]
    assert zero1["loss"] == pytest.approx(plain["loss"], rel=1e-5)
