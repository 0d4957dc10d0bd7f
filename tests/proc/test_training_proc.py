"""Strategy-equivalence training on real processes (gloo on 127.0.0.1), against virtual ranks in one process.

The GPT of tests/sim/test_gpt_equivalence.py trains under data, tensor and
pipeline parallelism and a data x tensor mesh, and the ResNet trains data
parallel (BatchNorm statistics reduced over the shards), one process per rank.
Each real-process run must give the losses and final parameters of the same
strategy on virtual ranks in this process (rtol 1e-5), and those of one device.

The collectives of one training step are checked per process: each process
takes part in exactly the simulated run's collectives whose group holds its
rank, and a data-parallel step all-reduces each parameter gradient once, as
DDP does.

One job per process count runs every case: start-up (interpreter, torch,
gloo rendezvous) costs more than the training itself.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from procrun import run_ranks

import sbpflow
from sbpflow.autograd import coalesce_grad_reductions
from sbpflow.comm import CommEvent, SimulatedBackend, get_backend, record
from sbpflow.demo.train_gpt import PhaseLog, build, random_batches, train_gpt
from sbpflow.models.cnn import train_cnn
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
GPT_STEPS = 4
CNN_STEPS = 3
BATCH = 8
RTOL, ATOL = 1e-5, 1e-7
# Same strategy, other transport: the last bits can differ (gloo's ring sums 4 ranks in its own order). The key
# bias has a zero true gradient (softmax ignores a shift shared by a row of scores), and AdamW, dividing by the
# gradient's RMS, turns rounding noise there into steps of up to lr: it keeps the absolute slack of the
# simulated equivalence tests (1% of the most 4 AdamW steps can move it).
ZERO_GRAD_PARAM, ZERO_GRAD_ATOL = "attn.k.bias", 4e-5
# One device sums in a different order than any split run: the tolerances of the simulated equivalence tests.
SINGLE_RTOL, SINGLE_ATOL = 1e-4, 1e-5
N_PARAMS = 4 + 16 * CONFIG.n_layer  # wte, wpe, ln_f (2) + per block: 2 LayerNorms, q, k, v, c_proj, c_fc, proj

PER_LEAF = "dp=2 per-leaf"  # dp=2 under coalesce_grad_reductions(False): one all-reduce per gradient
GPT_SPECS = {2: ["dp=2", "tp=2", PER_LEAF], 4: ["dp=2,tp=2", "dp=4", "pp=2", "dp=2,pp=2"]}
TIMEOUT = 150.0

Training = tuple[list[float], dict[str, np.ndarray]]


# ----------------------------------------------------------------------------- what every process runs


def step_events(spec: str | None) -> list[tuple[str, str, tuple[int, ...]]]:
    """The collectives of the second GPT step as (where, kind, ranks): where is the phase ("backward") or, in
    forward, the innermost module ("forward ln_1"); the first step also fills caches and optimizer state."""
    trainer = build(CONFIG, spec)
    batches = random_batches(CONFIG.vocab_size, 2, BATCH, CONFIG.block_size)
    trainer.step(*next(batches))
    phases = PhaseLog(trainer.model)
    with phases.recording():
        trainer.step(*next(batches), phases)
    return [(phases.where.get(i, "other"), e.kind, e.ranks) for i, e in enumerate(phases.log.events)]


def cnn_step_events(world: int) -> tuple[list[CommEvent], list[CommEvent]]:
    """The collectives of one data-parallel ResNet step: (forward, backward)."""
    from sbpflow import nn
    from sbpflow.models.cnn import ResNet, _batch, _place

    place = sbpflow.placement("cpu", list(range(world)))
    model = ResNet(channels=4, num_classes=5).to_global(place)
    images, labels = _batch(0, BATCH, 8, 5)
    with record() as forward:
        loss = nn.CrossEntropyLoss()(model(_place(images, place)), _place(labels, place))
    with record() as backward:
        loss.backward()
    return list(forward.events), list(backward.events)


def training_job(world: int) -> dict[str, Any]:
    """Every case of ``world`` ranks; on virtual ranks when run in one process, else this process's view."""
    torch.set_num_threads(1)  # tiny kernels, 2 cores shared by all processes: extra threads only contend
    out: dict[str, Any] = {"rank": sbpflow.rank(), "world": sbpflow.world_size(), "gpt": {}, "steps": {},
                           "cost factors": get_backend().cost_factors()}
    for spec in GPT_SPECS[world]:
        with coalesce_grad_reductions(spec != PER_LEAF):
            strategy = spec.removesuffix(" per-leaf")
            out["gpt"][spec] = train_gpt(strategy, GPT_STEPS, config=CONFIG, batch_size=BATCH)
            out["steps"][spec] = step_events(strategy)
    out["cnn"] = train_cnn(sbpflow.placement("cpu", list(range(world))), CNN_STEPS)
    out["cnn steps"] = cnn_step_events(world)
    return out


# ----------------------------------------------------------------------------- the tests


def simulated_job(world: int) -> dict[str, Any]:
    """The same job on virtual ranks, on the default simulated backend: it costs collectives with the target's
    factors (gloo's reduce-scatter is an all-reduce), so dispatch chooses here what it chooses on processes."""
    sbpflow.distributed.init()
    assert isinstance(get_backend(), SimulatedBackend)
    return training_job(world)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """(world, each process's results, the same job on virtual ranks in this process); one job per world."""
    world = request.param
    per_rank = run_ranks(training_job, world, args=(world,), timeout=TIMEOUT)
    return world, per_rank, simulated_job(world)


@pytest.fixture(scope="module")
def single_device() -> dict[str, Training]:
    return {"gpt": train_gpt(None, GPT_STEPS, config=CONFIG, batch_size=BATCH), "cnn": train_cnn(None, CNN_STEPS)}


def _assert_same(got: Training, want: Training, rtol: float, atol: float, what: str) -> None:
    losses, params = got
    np.testing.assert_allclose(losses, want[0], rtol=rtol, err_msg=f"{what}: losses")
    assert sorted(params) == sorted(want[1]), what
    for name, value in want[1].items():
        slack = max(atol, ZERO_GRAD_ATOL) if name.endswith(ZERO_GRAD_PARAM) else atol
        np.testing.assert_allclose(params[name], value, rtol=rtol, atol=slack, err_msg=f"{what}: {name}")


def _counts(events: list[Any], rank: int | None = None) -> dict[str, dict[str, int]]:
    """{where: {kind: calls}} of step events, keeping those whose group holds ``rank`` (all if None)."""
    out: dict[str, Counter[str]] = {}
    for where, kind, ranks in events:
        if rank is None or rank in ranks:
            out.setdefault(where, Counter())[kind] += 1
    return {where: dict(kinds) for where, kinds in out.items()}


def _phase(counts: dict[str, dict[str, int]], phase: str) -> dict[str, int]:
    total: Counter[str] = Counter()
    for where, kinds in counts.items():
        if where.split(" ")[0] == phase:
            total.update(kinds)
    return dict(total)


@pytest.mark.parametrize("run", [2, 4], indirect=True, ids=["2 processes", "4 processes"])
def test_every_process_ran_its_own_rank_with_the_costs_simulated_here(run: Any) -> None:
    world, per_rank, simulated = run
    assert [(r["rank"], r["world"]) for r in per_rank] == [(r, world) for r in range(world)]
    assert all(r["cost factors"] == simulated["cost factors"] for r in per_rank)


@pytest.mark.parametrize("run", [2, 4], indirect=True, ids=["2 processes", "4 processes"])
def test_gpt_training_matches_virtual_ranks_and_one_device(run: Any, single_device: dict[str, Training]) -> None:
    world, per_rank, simulated = run
    for spec in GPT_SPECS[world]:
        want = simulated["gpt"][spec]
        _assert_same(want, single_device["gpt"], SINGLE_RTOL, SINGLE_ATOL, f"{spec} virtual ranks vs one device")
        for rank, result in enumerate(per_rank):
            _assert_same(result["gpt"][spec], want, RTOL, ATOL, f"{spec}, process {rank}")
    assert single_device["gpt"][0][-1] != single_device["gpt"][0][0]  # it trained


@pytest.mark.parametrize("run", [2, 4], indirect=True, ids=["2 processes", "4 processes"])
def test_cnn_data_parallel_matches_virtual_ranks_and_one_device(run: Any, single_device: dict[str, Training]) -> None:
    _, per_rank, simulated = run
    _assert_same(simulated["cnn"], single_device["cnn"], 1e-4, 1e-6, "ResNet virtual ranks vs one device")
    assert any(name.endswith("running_var") for name in simulated["cnn"][1])  # BN statistics compared too
    for rank, result in enumerate(per_rank):
        _assert_same(result["cnn"], simulated["cnn"], RTOL, ATOL, f"ResNet, process {rank}")


@pytest.mark.parametrize("run", [2, 4], indirect=True, ids=["2 processes", "4 processes"])
def test_each_process_takes_part_in_the_simulated_collectives_of_its_rank(run: Any) -> None:
    world, per_rank, simulated = run
    for spec in GPT_SPECS[world]:
        for rank, result in enumerate(per_rank):
            got = Counter(result["steps"][spec])
            want = Counter(e for e in simulated["steps"][spec] if rank in e[2])
            assert not want - got, f"{spec}, process {rank}: missing {want - got}"
            # Virtual ranks read a scalar where its shards are; a process that holds no shard of it gets it sent
            # (the loss, and the gradient norm that clipping needs on every process), and nothing else is added.
            extra = got - want
            assert all(where in ("other", "clip_grad_norm") and kind in ("broadcast", "send_recv")
                       for where, kind, _ in extra), f"{spec}, process {rank}: {extra}"
            assert not extra or "pp" in spec, f"{spec}, process {rank}: {extra}"
            assert all(rank in ranks for _, _, ranks in result["steps"][spec])  # it records only its own


@pytest.mark.parametrize("run", [2, 4], indirect=True, ids=["2 processes", "4 processes"])
def test_data_parallel_step_reduces_all_gradients_in_one_bucket_on_every_process(run: Any) -> None:
    world, per_rank, _ = run
    spec = f"dp={world}"
    for rank, result in enumerate(per_rank):
        counts = _counts(result["steps"][spec])
        assert _phase(counts, "backward") == {"all_reduce": 1}, rank  # the model fits DDP's first bucket (1 MiB)
        assert "clip_grad_norm" not in counts and "optimizer" not in counts, rank  # gradients are B by then
        # the rest is the loss's mean over the batch shards
        assert all(kinds == {"all_reduce": 1} for where, kinds in counts.items() if where != "backward"), rank
        backward = [ranks for where, _, ranks in result["steps"][spec] if where == "backward"]
        assert set(backward) == {tuple(range(world))}, rank


@pytest.mark.parametrize("run", [2], indirect=True, ids=["2 processes"])
def test_per_leaf_opt_out_all_reduces_each_gradient_once_with_the_same_result(run: Any) -> None:
    world, per_rank, _ = run
    for rank, result in enumerate(per_rank):
        _assert_same(result["gpt"][PER_LEAF], result["gpt"]["dp=2"], RTOL, ATOL, f"per-leaf, process {rank}")
        counts = _counts(result["steps"][PER_LEAF])
        assert _phase(counts, "backward") == {"all_reduce": N_PARAMS}, rank
        assert _counts(result["steps"]["dp=2"]).keys() == counts.keys(), rank  # only backward changed


@pytest.mark.parametrize("run", [2, 4], indirect=True, ids=["2 processes", "4 processes"])
def test_tensor_parallel_step_all_reduces_each_partial_sum_once_where_the_layernorm_needs_it(run: Any) -> None:
    world, per_rank, _ = run
    for spec in (s for s in GPT_SPECS[world] if "tp=2" in s):
        for rank, result in enumerate(per_rank):
            counts = _counts(result["steps"][spec])
            at_norms = {w: k for w, k in counts.items() if w.startswith("forward") and w.endswith(("ln_1", "ln_2",
                                                                                                 "ln_f"))}
            # The vocab-parallel embedding and each block's two row-parallel c_proj give one partial sum each,
            # reduced once by the LayerNorm that reads it. On gloo a reduce-scatter costs an all-reduce, so the
            # planner all-reduces (Megatron without sequence parallelism; virtual ranks reduce-scatter instead).
            assert sum(k.get("all_reduce", 0) for k in at_norms.values()) == 1 + 2 * CONFIG.n_layer, (spec, rank)
            assert all(set(k) == {"all_reduce"} for k in at_norms.values()), (spec, rank)
            assert set(_phase(counts, "forward")) == set(_phase(counts, "backward")) == {"all_reduce"}, (spec, rank)
            assert "optimizer" not in counts, (spec, rank)


@pytest.mark.parametrize("run", [4], indirect=True, ids=["4 processes"])
def test_pipeline_processes_send_only_their_stage_boundary(run: Any) -> None:
    world, per_rank, _ = run
    for rank, result in enumerate(per_rank):
        counts = _counts(result["steps"]["pp=2"])
        if rank < 2:  # stage 0 is rank 0, stage 1 rank 1: activations forward, their gradients back
            assert _phase(counts, "forward") == {"send_recv": 2}, rank
            assert _phase(counts, "backward") == {"send_recv": 2}, rank
        else:  # ranks 2 and 3 hold no stage; they only read the loss and parameters
            assert _phase(counts, "forward") == {} and _phase(counts, "backward") == {}, rank


@pytest.mark.parametrize("run", [2, 4], indirect=True, ids=["2 processes", "4 processes"])
def test_cnn_step_reduces_statistics_and_gradients_on_every_process(run: Any) -> None:
    _, per_rank, _ = run
    from sbpflow import nn
    from sbpflow.models.cnn import ResNet

    model = ResNet(channels=4, num_classes=5)
    batch_norms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    for rank, result in enumerate(per_rank):
        forward, backward = result["cnn steps"]
        kinds = Counter(e.kind for e in forward)
        assert "all_gather" not in kinds, rank
        # mean and variance of every BatchNorm, plus the loss's sample count
        assert kinds["all_reduce"] + kinds["reduce_scatter"] == 2 * batch_norms + 1, rank
        # one bucket of parameter gradients (DDP), and BatchNorm's backward sums dy and dy * x_hat over the batch
        assert Counter(e.kind for e in backward)["all_reduce"] == 1 + 2 * batch_norms, rank
        assert "all_gather" not in Counter(e.kind for e in backward), rank
