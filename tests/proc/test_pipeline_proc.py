"""Pipeline schedules on 4 gloo processes (one stage or a stage's share per process): one device's numbers,
and on every process the activation bound of its stage, read from its own runtime's register counters."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.graph.pipeline import activation_peaks
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=32, dropout=0.0)
STEPS = 2
BATCH = 16
SCHEDULES = ("1f1b", "gpipe", "zero_bubble", "interleaved_1f1b")  # interleaved: 2 stages per placement
# every schedule at pp=2 and pp=4 with 4 and 8 micro-batches (pp=2 leaves processes 2 and 3 idle), and stages of
# two data-parallel ranks
CASES = [(f"pp={p}", m, schedule) for schedule in SCHEDULES for p in (2, 4) for m in (4, 8)]
CASES += [("dp=2,pp=2", 4, "1f1b"), ("dp=2,pp=2", 4, "interleaved_1f1b")]
RTOL, ATOL = 1e-5, 4e-5  # gloo sums in its own order; AdamW turns that noise on about-zero gradients into lr steps
TIMEOUT = 300.0


def _config(spec: str | None, schedule: str | None) -> GPTConfig:
    """One block per stage at least: interleaved pp=4 has 8 stages."""
    stages = int(spec.split("pp=")[1]) * (2 if schedule == "interleaved_1f1b" else 1) if spec else 1
    return dataclasses.replace(CONFIG, n_layer=max(CONFIG.n_layer, stages))


def _train(spec: str | None, m: int = 1, schedule: str | None = None,
           config: GPTConfig = CONFIG) -> tuple[list[float], dict[str, Any], Any]:
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    trainer = build(config, spec, graph=spec is not None, micro_batches=m, schedule=schedule, virtual_stages=virtual)
    losses = [trainer.step(ids, targets)
              for ids, targets in random_batches(CONFIG.vocab_size, STEPS, BATCH, CONFIG.block_size, seed=1)]
    return losses, parameter_values(trainer), trainer


def pipeline_job() -> dict[str, Any]:
    """Every case on this process: its losses and parameters, and the activation peaks of its own stages (one per
    placement, or v under interleaved 1F1B)."""
    torch.set_num_threads(1)
    rank = sbpflow.rank()
    out: dict[str, Any] = {"rank": rank, "train": {}, "peaks": {}, "bounds": {}, "threaded": {}}
    for case in CASES:
        losses, params, trainer = _train(*case, config=_config(case[0], case[2]))
        compiled = trainer.graph._compiled()
        pipe = compiled.plan.pipeline
        placement = next((s for s, ranks in enumerate(pipe.stages) if rank in ranks), None)  # None: rank not used
        out["train"][case] = (losses, params)
        out["threaded"][case] = compiled.executor.threaded
        if placement is not None:
            mine = range(placement, pipe.schedule.virtual_stages, len(pipe.stages))
            peaks = activation_peaks(pipe, compiled.executor.stats.peak_slots)
            out["peaks"][case] = tuple(peaks[s] for s in mine)
            out["bounds"][case] = tuple(pipe.schedule.bounds[s] for s in mine)
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_ranks(pipeline_job, 4, timeout=TIMEOUT)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_schedules_match_one_device(per_rank: list[dict[str, Any]]) -> None:
    wanted = {case: _train(None, config=_config(case[0], case[2]))[:2] for case in CASES}
    for out in per_rank:
        assert list(out["train"]) == CASES
        for case, (losses, params) in out["train"].items():
            want_losses, want_params = wanted[case]
            np.testing.assert_allclose(losses, want_losses, rtol=RTOL, err_msg=f"{case} rank {out['rank']}")
            for name, value in want_params.items():
                np.testing.assert_allclose(params[name], value, rtol=RTOL, atol=ATOL,
                                           err_msg=f"{case} {name} rank {out['rank']}")


def test_each_process_holds_its_stages_bound(per_rank: list[dict[str, Any]]) -> None:
    """1F1B: stage s of p holds p - s micro-batches of activations; GPipe: m (pp=2 leaves ranks 2 and 3 idle);
    zero bubble: p on every stage; interleaved (p = 2, v = 2, m = 4): virtual stages 0..3 hold 4, 3, 2, 1
    (Megatron's order: placement 0 runs 2 (p - 1) + (v - 1) p = 4 warm-up forwards)."""
    expected = {("pp=4", 4, "1f1b"): [(4,), (3,), (2,), (1,)], ("pp=2", 4, "gpipe"): [(4,), (4,), None, None],
                ("dp=2,pp=2", 4, "1f1b"): [(2,), (2,), (1,), (1,)],
                ("pp=4", 4, "zero_bubble"): [(4,), (4,), (4,), (4,)],
                ("dp=2,pp=2", 4, "interleaved_1f1b"): [(4, 2), (4, 2), (3, 1), (3, 1)]}
    for case, by_rank in expected.items():
        assert [out["bounds"].get(case) for out in per_rank] == by_rank, case
        peaks = [out["peaks"].get(case) for out in per_rank]
        if case[2] == "zero_bubble":  # a W may run early when the next F is late: at most the bound
            assert all(got[0] <= bound[0] for got, bound in zip(peaks, by_rank, strict=True)), (case, peaks)
        else:
            assert peaks == by_rank, case
    for case in CASES:  # and every case holds the bounds its schedule states, on each process of a stage
        for out in per_rank:
            got, bound = out["peaks"].get(case), out["bounds"].get(case)
            assert (got is None) == (bound is None), (case, out["rank"])
            if got is None:
                continue
            if case[2] == "zero_bubble":
                assert all(g <= b for g, b in zip(got, bound, strict=True)), (case, out["rank"], got, bound)
            else:
                assert got == bound, (case, out["rank"], got, bound)



def test_every_schedule_runs_each_process_on_one_thread(per_rank: list[dict[str, Any]]) -> None:
    """Send/recv of cpu activations is issued in flight (gloo's threads move the bytes), and so are the data-parallel
    all-reduces and the all-gathers: no collective blocks, so no process needs a thread per comm stream."""
    for out in per_rank:
        assert out["threaded"] == dict.fromkeys(CASES, False), out["rank"]
