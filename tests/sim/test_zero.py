"""ZeRO stages 1-3 as SBP: same training as plain data parallel, the layouts, collectives and memory they promise."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow
from harness import PLACEMENTS, B, MeanSquareStep
from sbpflow import nn, optim
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend, record
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.errors import SbpflowError
from sbpflow.models.gpt import GPTConfig
from sbpflow.optim.zero import GATHERED
from sbpflow.runtime.memory import dry_run

CONFIG = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
STEPS = 4
# As in test_gpt_equivalence: the key bias has a zero true gradient, so AdamW moves it by lr-sized steps on
# rounding noise, which differs with the order of fp32 sums (reduce-scatter vs all-reduce): an absolute slack of
# 0.1% of lr x steps for parameters. Losses and every other entry agree to rtol 1e-5.
ATOL = 1e-5 * STEPS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _train(spec: str, stage: int | None, steps: int = STEPS, batch: int = 8) -> tuple[list[float], dict[str, Any], Any]:
    trainer = build(CONFIG, spec, seed=0)
    if stage is not None:
        optim.zero(trainer.optimizer, stage, model=trainer.model)
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, steps, batch, 16,
                                                                              seed=1)]
    return losses, parameter_values(trainer), trainer


@pytest.fixture(scope="module")
def plain_dp() -> tuple[list[float], dict[str, Any], Any]:
    return _train("dp=2", None)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt_training_equals_plain_data_parallel(stage: int, plain_dp: Any) -> None:
    losses, params, trainer = _train("dp=2", stage)
    np.testing.assert_allclose(losses, plain_dp[0], rtol=1e-5)
    for name, value in plain_dp[1].items():
        np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=ATOL, err_msg=name)
    weight = trainer.model.h[0].mlp.c_fc.weight  # (256, 64): sharded; its bias (256,) too; ln_1 (64,) is tiny
    ln = trainer.model.h[0].ln_1.weight
    state = trainer.optimizer.state[weight]
    assert state["exp_avg"].sbp == (S.split(0), B)
    assert trainer.optimizer.state[ln]["exp_avg"].sbp == (B, B)  # 32 elements a shard: below the minimum
    assert weight.grad.sbp == ((B, B) if stage == 1 else (S.split(0), B))
    assert weight.sbp == ((S.split(0), B) if stage == 3 else (B, B))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_d_mesh_shards_only_the_data_axis(stage: int) -> None:
    want = _train("dp=2,tp=2", None, steps=2)
    losses, params, trainer = _train("dp=2,tp=2", stage, steps=2)
    np.testing.assert_allclose(losses, want[0], rtol=1e-5)
    for name, value in want[1].items():
        np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=ATOL, err_msg=name)
    for p in trainer.model.parameters():
        tensor_axis = trainer.optimizer.state[p]["exp_avg"].sbp[1]
        assert tensor_axis == p.sbp[1]  # tensor-parallel layout untouched
    c_fc = trainer.model.h[0].mlp.c_fc.weight  # column parallel: S(0) on the tensor axis, then S(0) on data too
    assert trainer.optimizer.state[c_fc]["exp_avg"].sbp == (S.split(0), S.split(0))


def _linear_step(stage: int, placement: Any, rows: int = 6) -> tuple[Any, Any, Any]:
    sbpflow.manual_seed(0)
    lin = nn.Linear(5, 7).to_global(placement, B)  # 7 rows over 2 or 3 ranks: uneven
    opt = optim.zero(optim.Adam(lin.parameters(), lr=0.1), stage, model=lin, min_shard_numel=1)
    x = sbpflow.randn(rows, 5, placement=placement, sbp=S.split(0))
    with record() as fwd:
        y = lin(x)
    with record() as bwd:
        y.square().sum().backward()
    with record() as step:
        opt.step()
    return fwd.counts(), bwd.counts(), step.counts()


@pytest.mark.parametrize("stage, want", [
    (1, ({}, {"all_reduce": 1}, {"all_gather": 2})),  # DDP's one bucket for both gradients
    (2, ({}, {"reduce_scatter": 2}, {"all_gather": 2})),
    (3, ({"all_gather": 2}, {"all_gather": 2, "reduce_scatter": 2}, {})),
])
def test_collectives_per_stage(stage: int, want: Any) -> None:
    """Stage 1: DDP's (bucketed) all-reduce, then the updated slices gathered; stage 2: reduce-scatter instead; stage 3:
    gathered before forward, gathered again in backward, no gather after the step."""
    assert _linear_step(stage, PLACEMENTS["3"]) == want


def test_stage3_gathered_copy_is_freed_between_forward_and_backward() -> None:
    p2 = PLACEMENTS["2"]
    sbpflow.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)).to_global(p2, B)
    opt = optim.zero(optim.SGD(model.parameters(), lr=0.1), 3, model=model, min_shard_numel=1)
    plan = opt._zero
    x = sbpflow.randn(4, 8, placement=p2, sbp=S.split(0))
    loss = model(x).sum()
    assert plan.gathered_bytes == 0  # every unit freed its whole weights when its forward ended
    largest = max(4 * (m.weight.numel() + m.bias.numel()) for m in model)
    assert plan.peak_gathered_bytes == largest  # one layer at a time
    loss.backward()
    assert plan.gathered_bytes == 0 and plan.peak_gathered_bytes == largest
    assert all(p.grad.sbp == (S.split(0),) for p in model.parameters())


def test_stage3_matches_plain_model_gradients_under_uneven_shards() -> None:
    p3 = PLACEMENTS["3"]
    sbpflow.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).to_global(p3, B)
    sbpflow.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).to_global(p3, B)
    optim.zero(optim.SGD(model.parameters(), lr=0.1), 3, model=model, min_shard_numel=1)
    x = sbpflow.randn(5, 5, placement=p3, sbp=S.split(0))
    ref(x).square().sum().backward()
    model(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_memory_per_rank_follows_the_formulas() -> None:
    """fp32 Adam with every parameter sharded: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N bytes (Ψ elements, N = 2)."""
    p2 = PLACEMENTS["2"]
    n = 2
    for stage, (whole, sharded) in {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}.items():
        sbpflow.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)).to_global(p2, B)
        psi = sum(p.numel() for p in model.parameters())
        opt = optim.Adam(model.parameters(), lr=0.1)
        if stage:
            optim.zero(opt, stage, model=model, min_shard_numel=1)
        model(sbpflow.randn(4, 32, placement=p2, sbp=S.split(0))).sum().backward()
        opt.step()
        assert sum(optim.memory_per_rank(opt).values()) == whole * psi + sharded * psi // n, stage


def test_errors() -> None:
    w = nn.Parameter(sbpflow.zeros(4, placement=PLACEMENTS["2"], sbp=B))
    with pytest.raises(SbpflowError, match="must be 1, 2 or 3"):
        optim.zero(optim.SGD([w], lr=0.1), 4)
    with pytest.raises(SbpflowError, match="needs model="):
        optim.zero(optim.SGD([w], lr=0.1), 3)
    with pytest.raises(SbpflowError, match="names no mesh axis"):
        optim.zero(optim.SGD([w], lr=0.1), 1, axis=1)


def _train_graph(spec: str, stage: int, steps: int = STEPS) -> tuple[list[float], dict[str, Any], Any]:
    trainer = build(CONFIG, spec, seed=0, graph=True)
    trainer.graph.config.enable_zero(stage)
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, steps, 8, 16,
                                                                              seed=1)]
    return losses, parameter_values(trainer), trainer


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_graph_zero_equals_plain_data_parallel(stage: int, plain_dp: Any) -> None:
    """config.enable_zero(stage): the SBPs are constraints of the traced step; the compiled plan then holds the
    reduce-scatters (stage 2 and 3) and all-gathers (after the update for 1 and 2, before use for 3)."""
    losses, params, trainer = _train_graph("dp=2", stage)
    np.testing.assert_allclose(losses, plain_dp[0], rtol=1e-5)
    for name, value in plain_dp[1].items():
        np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=ATOL, err_msg=name)
    plan, logical = trainer.graph.plan, trainer.graph.logical
    sharded = len(trainer.optimizer._zero.sharded)
    updates = [n for n in logical.nodes if n.name.startswith("adam_update")]  # fused: params, grads, m, v
    updated = [sbp for n in updates for sbp in n.in_sbps[:len(n.inputs) // 4]]
    assert sum(sbp == (S.split(0), B) for sbp in updated) == sharded  # each update on its S(0) slice
    gathers = [n for n in plan.collectives(0) if n.boxing.steps[0].kind == "all_gather"
               and n.phase == ("post" if stage < 3 else "micro")]
    if stage < 3:  # updated slices back into B: one flat all-gather per bucket of them (graph.gather_bucket)
        unshards = [n for n in plan.nodes if n.op == "bucket_unshard" and 0 in n.ranks and n.phase == "post"]
        assert len(gathers) == len(unshards) == 1 and len(unshards[0].outputs) == sharded
    else:
        assert len(gathers) >= sharded  # gathered before use
    if stage == 3:  # gathered again in backward, each behind a control edge on the unit's incoming gradient
        again = [n for n in gathers if n.control]
        assert len(again) >= 2 * trainer.model.config.n_layer and len(gathers) >= sharded + len(again)
        _assert_gpt_window(trainer)
    accumulated = [logical.value(n.outputs[0]).sbp for n in logical.of_kind("accumulate")]
    split_grads = sum(sbp == (S.split(0), B) for sbp in accumulated)
    assert split_grads == (sharded if stage >= 2 else 0)  # stage 2 and 3: gradients S(0) where they are summed
    state = trainer.optimizer.state[trainer.model.h[0].mlp.c_fc.weight]
    assert state["exp_avg"].sbp == (S.split(0), B)


def test_graph_zero1_gathers_one_by_one_without_buckets(plain_dp: Any) -> None:
    """config.gather_buckets = False: each updated shard is all-gathered alone (as before the pass), to the same
    numbers as the bucketed step (the default, above) and plain data parallelism."""
    trainer = build(CONFIG, "dp=2", seed=0, graph=True)
    trainer.graph.config.enable_zero(1)
    trainer.graph.config.gather_buckets = False
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, STEPS, 8, 16, seed=1)]
    np.testing.assert_allclose(losses, plain_dp[0], rtol=1e-5)
    gathers = [n for n in trainer.graph.plan.collectives(0) if n.boxing.steps[0].kind == "all_gather"
               and n.phase == "post"]
    assert len(gathers) == len(trainer.optimizer._zero.sharded)
    assert not [n for n in trainer.graph.plan.nodes if n.op == "bucket_unshard"]


def _assert_gpt_window(trainer: Any) -> None:
    """The default window (prefetch=1): the model's own gathered parameters (embeddings) plus two blocks."""
    zero = trainer.optimizer._zero
    blocks = {id(p) for block in trainer.model.h for p in block.parameters()}

    def gathered_bytes(params: Any) -> int:  # whole, per rank
        return sum(4 * p.numel() for p in params if id(p) in zero.sharded)

    root = gathered_bytes(p for p in trainer.model.parameters() if id(p) not in blocks)
    block = gathered_bytes(trainer.model.h[0].parameters())
    want = root + 2 * block
    assert dry_run(trainer.graph.plan, SimulatedBackend()).watch_peak[GATHERED] == {0: want, 1: want}
    runtime = trainer.graph._compiled().executor.stats.watch_peak[GATHERED]
    assert all(0 < runtime[r] <= want for r in (0, 1))


def test_stage3_with_checkpointed_blocks_equals_plain_data_parallel(plain_dp: Any) -> None:
    """A checkpointed unit keeps no gathered copy for backward: its recomputation reads the shards again."""
    from sbpflow.utils import checkpoint_module

    trainer = build(CONFIG, "dp=2", seed=0)
    optim.zero(trainer.optimizer, 3, model=trainer.model)
    for block in trainer.model.h:
        checkpoint_module(block)
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, STEPS, 8, 16,
                                                                              seed=1)]
    np.testing.assert_allclose(losses, plain_dp[0], rtol=1e-5)
    params = parameter_values(trainer)
    for name, value in plain_dp[1].items():
        np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=ATOL, err_msg=name)
    assert trainer.optimizer._zero.gathered_bytes == 0


# -- stage 3 in nn.Graph: gathered copies freed after use, gathered again in backward, prefetched in a window --


LAYERS, WIDTH = 4, 16


def _seq_graph(window: int | None, steps: int = 3, executor: str = "actors") -> tuple[list[float], list[Any], Any]:
    """Four equal Linear layers on dp=2, trained by a compiled step: plain (window None) or ZeRO-3."""
    p2 = PLACEMENTS["2"]
    sbpflow.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to_global(p2, B)
    step = MeanSquareStep(model, optim.Adam(model.parameters(), lr=0.01))
    step.config.set_executor(executor)
    if window is not None:
        step.config.enable_zero(3, prefetch=window, min_shard_numel=1)
        # the traced layouts, where every layer reads its gathered copies: the selection may compute a layer from
        # its shards instead (column-parallel on the sharded weight), which leaves that layer no gather to window
        step.config.set_sbp_selection("greedy")
    sbpflow.manual_seed(1)
    xs = [sbpflow.randn(8, WIDTH, placement=p2, sbp=S.split(0)) for _ in range(steps)]
    losses = [float(step(x).numpy()) for x in xs]
    return losses, [p.numpy() for p in model.parameters()], step


@pytest.fixture(scope="module")
def seq_plain() -> tuple[list[float], list[Any], Any]:
    return _seq_graph(None)


def _forward_positions(step: Any) -> list[tuple[list[int], list[int]]]:
    """Per unit, in forward order: plan positions of its forward gather nodes and of the compute nodes reading
    the gathered values (the comm stream issues in plan order)."""
    plan, logical = step.plan, step.logical
    pos = {n.id: i for i, n in enumerate(plan.nodes)}
    producer = plan.producers()
    watched = set(plan.watch[GATHERED])
    out = []
    for e in (e for e in logical.gathers if not e.backward):
        readers = [n for n in plan.nodes if n.kind == "compute" and n.logical is not None
                   and set(logical.nodes[n.logical].inputs) & set(e.values)]
        gathers = {producer[b] for n in readers for b in n.inputs if b in watched}
        out.append((sorted(pos[g] for g in gathers), sorted(pos[n.id] for n in readers)))
    return out


@pytest.mark.parametrize("window", [0, 1, 2])
def test_graph_stage3_prefetch_window_bounds_gathered_bytes(window: int, seq_plain: Any) -> None:
    """enable_zero(3, prefetch=w): numbers of plain data parallel; layer k + 1's gather sits before layer k's
    compute in plan order (w >= 1) or after all of it (w = 0); at most w + 1 layers hold gathered copies, in the
    memory plan (exactly: it plays plan order) and in the actor runtime's count of a real step (a bound)."""
    losses, params, step = _seq_graph(window)
    np.testing.assert_allclose(losses, seq_plain[0], rtol=1e-5)
    for got, want in zip(params, seq_plain[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    layer_bytes = 4 * (WIDTH * WIDTH + WIDTH) // 2  # one layer's weight and bias, whole, per rank
    runtime_peak = step._compiled().executor.stats.watch_peak[GATHERED]
    planned_peak = dry_run(step.plan, SimulatedBackend()).watch_peak[GATHERED]
    want = min(window + 1, LAYERS) * layer_bytes * 2
    assert planned_peak == {0: want, 1: want}
    assert all(0 < runtime_peak[r] <= want for r in (0, 1))
    units = _forward_positions(step)
    assert len(units) == LAYERS
    for (_, this_reads), (next_gathers, _) in zip(units, units[1:], strict=False):
        if window == 0:
            assert min(next_gathers) > max(this_reads)  # one layer at a time
        else:
            assert max(next_gathers) < min(this_reads)  # issued before layer k computes
    # weights and biases in forward; in backward the weights for input gradients (layer 0 needs none)
    _assert_freed_after_use_and_gathered_again(step, LAYERS * 2, LAYERS - 1)


def _assert_freed_after_use_and_gathered_again(step: Any, forward: int, backward: int) -> None:
    """Every gathered copy made before the backward starts is read only before it (freed after its forward
    use); the backward reads copies gathered again after it started."""
    from sbpflow.graph.compile import seed_buffers

    plan = step.plan
    pos = {n.id: i for i, n in enumerate(plan.nodes)}
    producer = plan.producers()
    start = min(pos[n.id] for n in plan.nodes if set(n.inputs) & set(seed_buffers(plan, step.logical)))
    made_before = [b for b in plan.watch[GATHERED] if pos[producer[b]] < start]
    made_after = [b for b in plan.watch[GATHERED] if pos[producer[b]] > start]
    assert (len(made_before), len(made_after)) == (forward, backward)
    assert all(pos[c] < start for b in made_before for c in plan.registers[b].consumers)
    assert all(pos[c] > start for b in made_after for c in plan.registers[b].consumers)


def test_graph_stage3_prefetch_is_checked() -> None:
    with pytest.raises(SbpflowError, match="prefetch"):
        step = MeanSquareStep(nn.Linear(2, 2), optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
        step.config.enable_zero(3, prefetch=-1)


# -- mixed precision as the ZeRO paper counts it: bf16 parameters and gradients, fp32 master weights ---------


def _mixed_step(stage: int, steps: int = 3, master: bool = True) -> tuple[Any, Any, int]:
    import torch

    p2 = PLACEMENTS["2"]
    sbpflow.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)).to_global(p2, B)
    psi = sum(p.numel() for p in model.parameters())
    opt = optim.Adam(model.parameters(), lr=0.01)
    if stage:
        optim.zero(opt, stage, model=model, min_shard_numel=1)
    if master:
        sbpflow.amp.master_weights(opt, torch.bfloat16)
    sbpflow.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        with sbpflow.autocast(dtype=torch.bfloat16):
            loss = model(sbpflow.randn(4, 32, placement=p2, sbp=S.split(0))).float().square().mean()
        loss.backward()
        opt.step()
    return model, opt, psi


def test_master_weights_memory_follows_the_mixed_precision_formulas() -> None:
    """bf16 parameters and gradients, fp32 master weights and Adam moments (K = 12): 16Ψ, 4Ψ + 12Ψ/N,
    2Ψ + 14Ψ/N, 16Ψ/N bytes (Ψ elements, N = 2); every stage trains the same bf16 parameters and fp32 masters."""
    import torch

    n = 2
    plain, plain_opt, _ = _mixed_step(0)
    fp32, _, _ = _mixed_step(0, master=False)  # fp32 parameters under autocast: bf16 gradients round more
    for p, q in zip(plain.parameters(), fp32.parameters(), strict=True):
        want = q.numpy()
        np.testing.assert_allclose(plain_opt.state[p]["master"].numpy(), want, rtol=1.6e-2,
                                   atol=1.6e-2 * float(np.abs(want).max()))
    for stage, (whole, sharded) in {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}.items():
        model, opt, psi = _mixed_step(stage)
        assert sum(optim.memory_per_rank(opt).values()) == whole * psi + sharded * psi // n, stage
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16
            assert opt.state[p]["master"].dtype == torch.float32
            np.testing.assert_array_equal(p.float().numpy(), q.float().numpy())
            np.testing.assert_allclose(opt.state[p]["master"].numpy(), plain_opt.state[q]["master"].numpy(),
                                       rtol=1e-5, atol=1e-7)


def test_master_weights_refuse_a_compiled_step() -> None:
    import torch

    p2 = PLACEMENTS["2"]
    model = nn.Sequential(nn.Linear(4, 4)).to_global(p2, B)
    opt = sbpflow.amp.master_weights(optim.Adam(model.parameters(), lr=0.1), torch.bfloat16)
    step = MeanSquareStep(model, opt)
    step.config.enable_amp(torch.bfloat16)
    with pytest.raises(SbpflowError, match="master weights"):
        step(sbpflow.randn(2, 4, placement=p2, sbp=S.split(0)))
    with pytest.raises(SbpflowError, match="bfloat16 or torch.float16"):
        sbpflow.amp.master_weights(opt, torch.float64)


def test_master_weights_checkpoint_keeps_fp32_state(tmp_path: Any) -> None:
    """A fresh optimizer lists its moments like the fp32 masters (state_dict before any step), and a checkpoint
    of a ZeRO-1 run loads into a plain one with fp32 masters and moments, exactly."""
    import torch

    model, opt, _ = _mixed_step(1)
    sbpflow.save({"model": model.state_dict(), "optim": opt.state_dict()}, str(tmp_path / "c"))
    fresh, fresh_opt, _ = _mixed_step(0, steps=0)
    state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    assert all(v.dtype == torch.float32 for s in state["optim"]["state"].values() for v in s.values()
               if isinstance(v, sbpflow.Tensor))
    sbpflow.load(state, str(tmp_path / "c"))
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        assert p.dtype == torch.bfloat16
        np.testing.assert_array_equal(p.float().numpy(), q.float().numpy())
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert fresh_opt.state[p][key].dtype == torch.float32
            np.testing.assert_array_equal(fresh_opt.state[p][key].numpy(), opt.state[q][key].numpy())
        assert fresh_opt.state[p]["step"] == opt.state[q]["step"] == 3
