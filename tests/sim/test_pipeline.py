"""Pipeline schedules in graph mode, on virtual ranks: one device's numbers, and each schedule's memory bound.

Every schedule, on pp2 and pp4 with 4 and 8 micro-batches and on pp2 x dp2 x tp2, trains a GPT (dropout 0,
AdamW) to one device's full-batch losses and parameters. The runtime's register counters then show how many
micro-batches of activations each stage held at once: p - s under 1F1B, m under GPipe.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from sbpflow.comm import get_backend
from sbpflow.demo.train_gpt import Trainer, build, parameter_values, random_batches, train_gpt
from sbpflow.errors import SbpflowError
from sbpflow.graph.fuse import members
from sbpflow.graph.pipeline import PipelineWarning, activation_peaks
from sbpflow.graph.schedule import make
from sbpflow.models.gpt import GPTConfig
from sbpflow.runtime.board import stream_order
from sbpflow.runtime.memory import dry_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=32, dropout=0.0)
STEPS = 2
BATCH = 16  # divisible by every micro-batch count times the data degree


INTERLEAVED = GPTConfig(vocab_size=64, block_size=8, n_layer=8, n_head=2, n_embd=32, dropout=0.0)  # 2 x 4 stages
_TRAINED: dict[tuple[Any, ...], tuple[list[float], dict[str, Any], Trainer]] = {}


def _train(spec: str | None, m: int = 1, schedule: str | None = None, virtual: int = 1,
           config: GPTConfig = CONFIG) -> tuple[list[float], dict[str, Any], Trainer]:
    """Trains once per arguments in this module (the 3-D compile is the slow part; tests only read the result)."""
    key = (spec, m, schedule, virtual, config.n_layer)
    if key not in _TRAINED:
        _TRAINED[key] = _train_now(spec, m, schedule, virtual, config)
    return _TRAINED[key]


def _train_now(spec: str | None, m: int, schedule: str | None, virtual: int,
               config: GPTConfig) -> tuple[list[float], dict[str, Any], Trainer]:
    trainer = build(config, spec, graph=spec is not None, micro_batches=m, schedule=schedule, virtual_stages=virtual)
    losses = [trainer.step(ids, targets)
              for ids, targets in random_batches(config.vocab_size, STEPS, BATCH, config.block_size, seed=1)]
    return losses, parameter_values(trainer), trainer


@pytest.fixture(scope="module")
def one_device() -> tuple[list[float], dict[str, Any]]:
    losses, params, _ = _train(None)
    return losses, params


def _assert_close(got: tuple[list[float], dict[str, Any]], want: tuple[list[float], dict[str, Any]]) -> None:
    """rtol 1e-5; AdamW turns rounding on about-zero gradients into up to lr-sized steps, hence atol 2e-5."""
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for name, value in want[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=1e-5, atol=2e-5, err_msg=name)


CASES = [(schedule, spec, m) for schedule in ("1f1b", "gpipe") for spec in ("pp=2", "pp=4") for m in (4, 8)]
CASES += [(schedule, "dp=2,tp=2,pp=2", 4) for schedule in ("1f1b", "gpipe", "zero_bubble")]
CASES += [("zero_bubble", "pp=2", 4), ("zero_bubble", "pp=4", 8)]
BOUND = {"1f1b": lambda p, m, s: p - s, "gpipe": lambda p, m, s: m, "zero_bubble": lambda p, m, s: min(p, m)}


@pytest.mark.parametrize(("schedule", "spec", "m"), CASES, ids=[f"{s}-{p}-m{m}" for s, p, m in CASES])
def test_schedule_matches_one_device_and_holds_its_bound(schedule: str, spec: str, m: int, one_device: Any) -> None:
    losses, params, trainer = _train(spec, m, schedule)
    _assert_close((losses, params), one_device)
    compiled = trainer.graph._compiled()
    pipe = compiled.plan.pipeline
    p = len(pipe.stages)
    expected = {s: BOUND[schedule](p, m, s) for s in range(p)}
    assert pipe.schedule.bounds == tuple(expected.values())
    peaks = activation_peaks(pipe, compiled.executor.stats.peak_slots)
    if schedule != "zero_bubble":
        assert peaks == expected
        return
    # zero bubble: a W may run early when its stage's next F has not arrived (timing), so a run holds at most
    # the bound; the runtime's own schedule with instant communication (dry_run) reaches it
    assert all(peaks[s] <= expected[s] for s in expected)
    assert activation_peaks(pipe, dry_run(compiled.plan, get_backend()).peak_slots) == expected


INTERLEAVED_CASES = [pytest.param("pp=2", 4), pytest.param("pp=4", 8),
                     pytest.param("pp=2", 8, marks=pytest.mark.slow), pytest.param("pp=4", 4, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("spec", "m"), INTERLEAVED_CASES)
def test_interleaved_matches_one_device_and_holds_its_bounds(spec: str, m: int) -> None:
    """v = 2 stages per placement (8 blocks: one per stage at pp=4, two at pp=2): one device's numbers; each
    virtual stage held exactly its schedule bound (read off Megatron's order), stage k sat on placement k mod p."""
    want = _train(None, config=INTERLEAVED)
    losses, params, trainer = _train(spec, m, "interleaved_1f1b", 2, INTERLEAVED)
    _assert_close((losses, params), want[:2])
    compiled = trainer.graph._compiled()
    pipe = compiled.plan.pipeline
    p = len(pipe.stages)
    assert pipe.virtual == 2 and pipe.schedule.virtual_stages == 2 * p
    assert activation_peaks(pipe, compiled.executor.stats.peak_slots) == dict(enumerate(pipe.schedule.bounds))
    for node in compiled.plan.nodes:
        if node.kind == "compute" and node.id in pipe.stage_of:
            assert set(node.ranks) <= set(pipe.stages[pipe.stage_of[node.id] % p]), node.label()
    assert _blocks_of_stage(compiled.plan, 2 * p - 1) == ({"7"} if p == 4 else {"6", "7"})
    assert _blocks_of_stage(compiled.plan, p) == ({"4"} if p == 4 else {"4", "5"})


def _blocks_of_stage(plan: Any, stage: int) -> set[str]:
    """The blocks whose weights the compute nodes of a virtual stage read (variables named model.h.<i>...)."""
    pipe, producers = plan.pipeline, plan.producers()
    names = {n.id: n.name for n in plan.nodes if n.kind == "variable"}
    read = {names.get(producers.get(b, -1), "") for n in plan.nodes if n.kind == "compute"
            and pipe.stage_of.get(n.id) == stage and pipe.part_of.get(n.id) == "F" for b in n.inputs}
    return {name.split(".")[2] for name in read if name.startswith("model.h.")}


def test_explain_prints_the_interleaved_grid() -> None:
    _, _, trainer = _train("pp=2", 4, "interleaved_1f1b", 2, INTERLEAVED)
    text = trainer.graph.explain()
    assert "pipeline: 4 stages on 2 placements (stage k on placement k mod 2" in text
    assert "activation registers (micro-batches) stage 0: 4, stage 1: 3, stage 2: 2, stage 3: 1" in text
    assert "placement 0 [0]  F0.0  F1.0  F0.1  F1.1  F2.0  B0.1  F3.0  B1.1" in text


def test_placements_used_again_need_the_interleaved_schedule() -> None:
    with pytest.raises(SbpflowError, match="only interleaved_1f1b runs several stages per placement"):
        _train_now("pp=2", 4, "1f1b", 2, CONFIG)


def test_zero_bubble_splits_weight_gradients_from_the_backward() -> None:
    """W: the weight-gradient nodes (linear_weight_grad, embedding_backward); B: the input-gradient chain the
    previous stage waits for, which the first stage does not have (all its backward is W)."""
    _, _, trainer = _train("pp=4", 8, "zero_bubble")
    plan = trainer.graph.plan
    pipe = plan.pipeline
    parts = [(pipe.part_of[n.id], m) for n in plan.nodes if n.id in pipe.part_of and n.kind == "compute"
             for m in members([n])]  # a fused node has the part of each node it runs
    ops = {(part, m.op) for part, m in parts}
    assert ("W", "linear_weight_grad") in ops and ("W", "embedding_backward") in ops and ("B", "matmul_nd") in ops
    # the tied head's too: it is accumulated on the last stage and sent once after the micro-batches
    # (graph.accumulate), so no weight gradient stays in B
    assert ("B", "linear_weight_grad") not in ops
    assert not any(pipe.stage_of[n] == 0 and part == "B" for n, part in pipe.part_of.items())
    assert any(pipe.stage_of[n] == 1 and part == "B" for n, part in pipe.part_of.items())


def test_zero_bubble_holds_output_gradients_until_their_deferred_weight_gradient() -> None:
    """ZB-H1 runs W k - s after B k on stage s: what B writes for W (output gradients) needs s + 1 slots, or the
    backward would wait for W and the input gradient would go back late."""
    plan = _train("pp=4", 8, "zero_bubble")[2].graph.plan
    pipe, producers = plan.pipeline, plan.producers()
    counts: dict[int, set[int]] = {}
    for b, reg in plan.registers.items():
        writer = producers.get(b)
        if pipe.part_of.get(writer) == "B" and any(pipe.part_of.get(r) == "W" for r in reg.consumers):
            counts.setdefault(pipe.stage_of[writer], set()).add(reg.register_num)
    assert counts == {1: {2}, 2: {3}, 3: {4}}  # stage 0 has no B: its whole backward is W


def test_a_tied_weight_goes_to_the_last_stage_once_per_step() -> None:
    """The head reads the embedding's weight on the last stage: one send before the micro-batches (not one per
    micro-batch), read there by every micro-batch; weights are read straight from their slot (no repeat acts)."""
    plan = _train("pp=4", 4, "1f1b")[2].graph.plan
    producers = plan.producers()
    names = {n.id: n.name for n in plan.nodes}
    moves = [n for n in plan.nodes if n.kind == "boxing" and _placement_of(plan, n.inputs[0]) !=
             _placement_of(plan, n.outputs[0])]
    sent_once = [n for n in moves if n.phase == "pre"]
    assert [names[producers[n.inputs[0]]] for n in sent_once] == ["model.wte.weight"]
    assert _placement_of(plan, sent_once[0].outputs[0]) == plan.pipeline.stages[3]
    assert {n.phase for n in moves} == {"pre", "micro", "post"}
    assert not any(n.kind == "repeat" for n in plan.nodes)


TIED_CASES = [("1f1b", "pp=2", 8), ("1f1b", "pp=4", 8), ("gpipe", "pp=4", 4), ("zero_bubble", "pp=4", 8),
              ("1f1b", "dp=2,tp=2,pp=2", 4)]


@pytest.mark.parametrize(("schedule", "spec", "m"), TIED_CASES, ids=[f"{s}-{p}-m{m}" for s, p, m in TIED_CASES])
def test_a_tied_weights_gradient_goes_back_once_per_step(schedule: str, spec: str, m: int, one_device: Any) -> None:
    """The head's part of the tied weight's gradient is accumulated on the last stage and crosses to the first
    once, after the micro-batches (graph.accumulate), not once per micro-batch; the numbers stay one device's."""
    losses, params, trainer = _train(spec, m, schedule)
    _assert_close((losses, params), one_device)
    plan = trainer.graph.plan
    first, last = plan.pipeline.stages[0], plan.pipeline.stages[-1]
    shape = tuple(CONFIG_WTE)
    back = [n for n in plan.nodes if n.kind == "boxing" and set(_placement_of(plan, n.inputs[0])) <= set(last)
            and set(_placement_of(plan, n.outputs[0])) <= set(first)]
    gradient = [n for n in back if plan.bufs[n.inputs[0]].shape == shape]
    assert [n.phase for n in gradient] == ["post"]
    assert not any(plan.bufs[n.inputs[0]].shape == shape for n in back if n.phase == "micro")


def test_a_tied_weights_gradient_is_one_message_per_step_at_run_time() -> None:
    """Counted on the wire: two pp=4 steps of 8 micro-batches send the tied weight's bytes 4 times (per step: the
    weight to the last stage, its gradient back), where every micro-batch used to send the gradient."""
    from sbpflow.comm import record

    trainer = build(CONFIG, "pp=4", graph=True, micro_batches=8, schedule="1f1b")
    wte = CONFIG.vocab_size * CONFIG.n_embd * 4
    with record() as log:
        for ids, targets in random_batches(CONFIG.vocab_size, STEPS, BATCH, CONFIG.block_size, seed=1):
            trainer.step(ids, targets)
    sends = [e for e in log.events if e.kind == "send_recv" and e.bytes == wte]
    assert len(sends) == 2 * STEPS
    assert {e.ranks for e in sends} == {(0, 3)}


CONFIG_WTE = (CONFIG.vocab_size, CONFIG.n_embd)


def _placement_of(plan: Any, buf: int) -> tuple[int, ...]:
    return tuple(plan.bufs[buf].layout.placement.flat_ranks)


def test_register_counts_follow_the_schedule() -> None:
    """1F1B: activations p - s, cross-stage buffers their stage distance (every micro-batch message goes to the
    next stage: the tied embedding goes 0 -> 3 before the micro-batches, its gradient back after them),
    everything else 1."""
    _, _, trainer = _train("pp=4", 4, "1f1b")  # the run of the equivalence test
    plan = trainer.graph.plan
    pipe = plan.pipeline
    counts = {b: r.register_num for b, r in plan.registers.items()}
    for s, bufs in pipe.activations.items():
        assert bufs and all(counts[b] == max(4 - s, 1) for b in bufs if b not in _cross_stage(plan))
    distances = {abs(_stage(pipe, plan, n.outputs[0]) - _stage(pipe, plan, n.inputs[0]))
                 for n in plan.nodes if n.kind == "boxing" and n.phase == "micro"}
    assert distances == {1}
    held = {b for bufs in pipe.held.values() for b in bufs} | _cross_stage(plan)
    assert {counts[b] for b in counts if b not in held} == {1}


def _cross_stage(plan: Any) -> set[int]:
    pipe = plan.pipeline
    return {b for n in plan.nodes if n.kind == "boxing" and n.phase == "micro"
            and _stage(pipe, plan, n.outputs[0]) != _stage(pipe, plan, n.inputs[0]) for b in n.outputs}


def _stage(pipe: Any, plan: Any, buf: int) -> int:
    first = plan.bufs[buf].layout.placement.flat_ranks[0]
    return next(s for s, ranks in enumerate(pipe.stages) if first in ranks)


def test_communication_streams_issue_in_the_schedules_order() -> None:
    """On a stage's tensor-parallel stream, 1F1B's warm-up forwards come before backward 0."""
    _, _, trainer = _train("dp=2,tp=2,pp=2", 4, "1f1b")
    executor = trainer.graph._compiled().executor
    pipe = trainer.graph.plan.pipeline
    lanes = [w for lane, w in executor._workers.items() if "axis1" in lane and "cpu:[[0, 1], [2, 3]]" in lane]
    assert lanes
    seq = [(pipe.part_of[a.node.id], k) for a, k in stream_order(lanes[0].actors, 4) if a.node.phase == "micro"]
    micro_order = list(dict.fromkeys(seq))
    assert micro_order == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]


def test_explain_prints_the_schedule_grid(capsys: Any) -> None:
    _, _, trainer = _train("pp=2", 4, "1f1b")
    text = trainer.graph.explain()
    assert "pipeline: 2 stages, schedule 1f1b, 4 micro-batches; activation registers (micro-batches) " \
           "stage 0: 2, stage 1: 1" in text
    assert "stage 0 [0]  F0  F1  .   B0  F2  B1  F3  B2  .   B3" in text
    assert "stage 1 [1]  .   F0  B0  F1  B1  F2  B2  F3  B3" in text


def test_fewer_micro_batches_than_stages_warns_and_explains() -> None:
    with pytest.warns(PipelineWarning, match=r"pipeline of 4 stages with only 2 micro-batch\(es\).*idles 60%"):
        got = train_gpt("pp=4", 1, config=CONFIG, batch_size=BATCH, seq_len=8, graph=True, micro_batches=2)
    assert np.isfinite(got[0][0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipelineWarning)
        train_gpt("pp=2", 1, config=CONFIG, batch_size=BATCH, seq_len=8, graph=True, micro_batches=2)


def test_unknown_schedule_name_is_refused() -> None:
    with pytest.raises(SbpflowError, match="pipeline schedule must be one of"):
        build(CONFIG, "pp=2", graph=True, micro_batches=4, schedule="zigzag")


def test_one_stage_plans_have_no_pipeline() -> None:
    _, _, trainer = _train("dp=2", 4)
    assert trainer.graph.plan.pipeline is None
    assert make("1f1b", 1, 4).bounds == (1,)


def test_demo_prints_the_schedule_grid(tmp_path: Any) -> None:
    from sbpflow.demo.train_gpt import main

    lines: list[str] = []
    main(["--graph", "--strategy", "pp=2,dp=2", "--micro-batches", "4", "--steps", "2", "--n-layer", "2",
          "--n-embd", "16", "--sample-length", "4", "--no-tour", "--out", str(tmp_path)], print_fn=lines.append)
    text = "\n".join(lines)
    assert "pipeline: 2 stages, schedule 1f1b, 4 micro-batches" in text
    assert "stage 1 [2, 3]  .   F0  B0  F1  B1  F2  B2  F3  B3" in text
    assert (tmp_path / "timeline.json").exists()


def test_balanced_synthetic_durations_give_each_stage_its_forward_and_backward_time() -> None:
    from sbpflow.graph.pipeline import balanced_durations

    plan = _train("pp=4", 4, "1f1b")[2].graph.plan
    durations = balanced_durations(plan, 0.01, 0.02)
    pipe = plan.pipeline
    for s in range(4):
        for part, total in (("F", 0.01), ("B", 0.02)):
            got = sum(d for nid, d in durations.items() if pipe.stage_of[nid] == s and pipe.part_of[nid] == part)
            assert got == pytest.approx(total)
