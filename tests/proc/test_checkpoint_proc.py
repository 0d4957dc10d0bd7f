"""Checkpoints on real processes (gloo on 127.0.0.1): save on 4, load on 2 or 1 under other strategies, kill a writer.

* A dp2 x tp2 GPT trains 2 steps on 4 processes and saves: each process
  writes only its own rank's file, and the index is the one virtual ranks
  write for the same strategy (the same boxes in the same files).
* 2 processes load it under tp=2, dp=2 and pp=2, and this process under one
  device: parameters and AdamW moments equal the saved values exactly, and each
  process reads exactly the bytes of the shards it holds.
* A save whose second writer is killed (SIGKILL) half-way through its file
  leaves the previous checkpoint whole and loadable.
* A newest checkpoint whose second shard is damaged, which only the second
  process reads: both processes restore the checkpoint before it.
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procrun import PYTHON, REPO, run_command, run_ranks, spawn

import sbpflow
from sbpflow.checkpoint import CheckpointManager, CheckpointWarning, _save, read_index
from sbpflow.checkpoint._fill import target_shards
from sbpflow.checkpoint._tree import leaves
from sbpflow.demo.resume import save_training, training_state
from sbpflow.demo.train_gpt import Trainer, build, parameter_values, random_batches
from sbpflow.models.gpt import GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
TIMEOUT = 150.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def values(trainer: Trainer) -> dict[str, np.ndarray]:
    """Logical parameters and AdamW moments by name, on every process."""
    out = {name: v.copy() for name, v in parameter_values(trainer).items()}
    for name, p in trainer.model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            value = trainer.optimizer.state[p][key]
            if trainer.strategy is not None and trainer.strategy.pipeline > 1:
                value = value.to_global(placement=trainer.strategy.everywhere, sbp=sbpflow.sbp.broadcast)
            out[f"{name}.{key}"] = value.numpy().copy()
    return out


def train_and_save(path: str, steps: int) -> dict[str, Any]:
    """Runs on every process: a dp2 x tp2 GPT, ``steps`` steps, saved at ``path``."""
    trainer = build(CONFIG, "dp=2,tp=2", lr=1e-2)
    for ids, targets in random_batches(CONFIG.vocab_size, steps, 8, 8, seed=1):
        trainer.step(ids, targets)
    report = save_training(path, trainer, None, steps)
    return {"values": values(trainer), "files": report.files}


def load_under(path: str, spec: str) -> dict[str, Any]:
    """Runs on every process: a fresh GPT under ``spec`` filled from ``path``."""
    trainer = build(CONFIG, spec, seed=3, lr=0.5)
    state = training_state(trainer, None, 0)
    state["rng"]["torch"] = state["rng"]["torch"].clone()
    held = sum(s.data.numel() * s.data.element_size() for leaf in leaves(state) if leaf.is_tensor
               for s in target_shards(leaf.value))
    report = sbpflow.load(state, path)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optim"])
    return {"values": values(trainer), "read": report.bytes_read, "held": held, "step": state["step"],
            "lr": trainer.optimizer.param_groups[0]["lr"]}


def load_everything(path: str) -> list[dict[str, Any]]:
    return [load_under(path, spec) for spec in ("tp=2", "dp=2", "pp=2")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp("proc") / "step-2")
    per_rank = run_ranks(train_and_save, 4, args=(path, 2), timeout=TIMEOUT)
    return {"path": path, "per_rank": per_rank}


def test_each_process_writes_its_own_rank_file(saved: dict[str, Any], tmp_path: Path) -> None:
    assert [r["files"] for r in saved["per_rank"]] == [[f"rank-{r:05d}.safetensors"] for r in range(4)]
    sizes = [os.path.getsize(os.path.join(saved["path"], f"rank-{r:05d}.safetensors")) for r in range(4)]
    assert max(sizes) < 1.5 * min(sizes)  # the data-parallel replicas share the writing
    sim = str(tmp_path / "sim")
    train_and_save(sim, 2)  # the same run on virtual ranks
    on_procs, on_sim = read_index(saved["path"]), read_index(sim)
    assert on_procs.entries == on_sim.entries  # same layouts, boxes and files
    assert {n: f.nbytes for n, f in on_procs.files.items()} == {n: f.nbytes for n, f in on_sim.files.items()}


def test_two_processes_and_one_device_load_under_other_strategies(saved: dict[str, Any]) -> None:
    want = saved["per_rank"][0]["values"]
    per_rank = run_ranks(load_everything, 2, args=(saved["path"],), timeout=TIMEOUT)
    for rank, loads in enumerate(per_rank):
        for spec, got in zip(("tp=2", "dp=2", "pp=2"), loads, strict=True):
            assert got["step"] == 2 and got["lr"] == 1e-2
            for name, value in want.items():
                np.testing.assert_array_equal(got["values"][name], value, err_msg=f"{spec} rank {rank} {name}")
            assert got["read"] == got["held"]  # each process reads exactly the bytes of the shards it holds
    assert per_rank[0][0]["read"] < sum(os.path.getsize(f) for f in Path(saved["path"]).glob("*.safetensors"))
    single = load_under(saved["path"], "single")
    for name, value in want.items():
        np.testing.assert_array_equal(single["values"][name], value, err_msg=name)


def save_then_die(path: str) -> None:
    """Runs on 2 processes: a second save over ``path`` in which rank 1 is killed half-way through its file."""
    trainer = build(CONFIG, "tp=2", lr=1e-2)
    save_training(path, trainer, None, 0)
    sbpflow.comm.get_backend().barrier()
    if sbpflow.rank() == 1:
        def die_half_way(f: Any, data: bytes) -> None:
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        _save.write_chunks = die_half_way  # type: ignore[assignment]
    for ids, targets in random_batches(CONFIG.vocab_size, 1, 8, 8, seed=1):
        trainer.step(ids, targets)
    save_training(path, trainer, None, 1)


def test_a_writer_killed_mid_save_leaves_the_last_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    job = spawn(save_then_die, 2, args=(path,), env={"SBPFLOW_TIMEOUT": "30"}, timeout=TIMEOUT)
    assert job.ranks[1].returncode == -signal.SIGKILL, job.report()
    assert job.ranks[0].returncode != 0 and "CommError" in (job.ranks[0].error or ""), job.report()
    partial = Path(path + ".partial")
    half = partial / "rank-00001.safetensors"
    assert half.exists() and 0 < half.stat().st_size  # the kill came mid-file
    state = training_state(build(CONFIG, "single", seed=3), None, 5)
    state["rng"]["torch"] = state["rng"]["torch"].clone()
    sbpflow.load(state, path)  # the first save: complete, verified against its index
    assert state["step"] == 0
    fresh = build(CONFIG, "single", seed=0)
    for name, p in fresh.model.named_parameters():
        np.testing.assert_array_equal(state["model"][name].numpy(), p.numpy(), err_msg=name)


DEMO = ["--n-layer", "1", "--n-embd", "32", "--batch-size", "8", "--block-size", "16", "--no-tour",
        "--sample-length", "8", "--steps", "6", "--checkpoint-every", "3"]


def _demo(*args: str) -> str:
    result = run_command([PYTHON, "-m", "sbpflow.demo", *DEMO, *args], env={"PYTHONPATH": str(REPO / "src")},
                         timeout=TIMEOUT)
    assert result.returncode == 0, result.report()
    return result.stdout


def test_the_demo_resumes_in_a_new_process_bit_for_bit(tmp_path: Path) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _demo("--out", str(full))
    out = _demo("--out", str(resumed), "--resume", str(full / "checkpoints" / "step-00000003"))
    assert "resumed from " in out and "at step 3" in out
    last = "checkpoints/step-00000006/index.json"
    assert (resumed / last).read_text() == (full / last).read_text()  # same bytes, hashes and scalars


def _zero_or_plain(zero: int, seed: int = 0) -> Trainer:
    trainer = build(CONFIG, "dp=2", seed=seed, lr=1e-2)
    if zero:
        sbpflow.optim.zero(trainer.optimizer, zero, model=trainer.model)
    return trainer


def switch_zero(folder: str, saved_zero: int, loaded_zero: int) -> dict[str, Any]:
    """Runs on 2 processes: dp2 under ``saved_zero`` trains 2 steps and saves; a fresh dp2 run under
    ``loaded_zero`` loads it and trains 2 more; a third run never switches (4 steps)."""
    from sbpflow.demo.resume import resume_training

    batches = list(random_batches(CONFIG.vocab_size, 4, 8, 8, seed=1))
    never = _zero_or_plain(saved_zero)
    never_losses = [never.step(ids, targets) for ids, targets in batches]
    first = _zero_or_plain(saved_zero)
    for ids, targets in batches[:2]:
        first.step(ids, targets)
    path = os.path.join(folder, f"zero{saved_zero}")
    save_training(path, first, None, 2)
    fresh = _zero_or_plain(loaded_zero, seed=3)
    sbpflow.manual_seed(123)
    start = resume_training(path, fresh, None)
    loaded = values(fresh)
    losses = [fresh.step(ids, targets) for ids, targets in batches[start:]]
    return {"saved": values(first), "loaded": loaded, "never": never_losses[2:], "losses": losses,
            "never_values": values(never), "values": values(fresh), "path": path}


@pytest.mark.parametrize("saved_zero, loaded_zero", [(3, 0)])  # the way back: tests/sim/test_checkpoint_gpt.py
def test_zero3_checkpoint_loads_without_zero_on_two_processes(saved_zero: int, loaded_zero: int,
                                                              tmp_path: Path) -> None:
    """ZeRO-3 saved on 2 processes (parameters and moments S(0)) loads into plain dp2 (B), exactly; training
    on matches the run that never switched (rtol 1e-5, the ZeRO tolerance); one device loads it too."""
    per_rank = run_ranks(switch_zero, 2, args=(str(tmp_path), saved_zero, loaded_zero), timeout=TIMEOUT)
    for got in per_rank:
        for name, value in got["saved"].items():
            np.testing.assert_array_equal(got["loaded"][name], value, err_msg=name)
        np.testing.assert_allclose(got["losses"], got["never"], rtol=1e-5)
        for name, value in got["never_values"].items():
            np.testing.assert_allclose(got["values"][name], value, rtol=1e-5, atol=2e-5, err_msg=name)
    if saved_zero:
        single = load_under(per_rank[0]["path"], "single")
        for name, value in per_rank[0]["saved"].items():
            np.testing.assert_array_equal(single["values"][name], value, err_msg=name)


def restore_past_a_damaged_shard(folder: str) -> dict[str, Any]:
    """Runs on every process: checkpoints of steps 1 and 2 of an S(0) tensor, step 2's rank-1 file bit-flipped
    (only rank 1 reads it), then a restore on each process."""
    p = sbpflow.placement("cpu", [0, 1])
    manager = CheckpointManager(folder, every=1, async_save=False)
    for step in (1, 2):
        state = {"w": sbpflow.full((8,), float(step), placement=p, sbp=sbpflow.sbp.split(0))}
        manager.save(step, state)
    if sbpflow.rank() == 1:
        shard = os.path.join(manager.path(2), "rank-00001.safetensors")
        with open(shard, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\xff\xff\xff\xff")
    sbpflow.comm.get_backend().barrier()
    state = {"w": sbpflow.zeros(8, placement=p, sbp=sbpflow.sbp.split(0))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        step = manager.restore(state)
    return {"step": step, "w": state["w"].to_local().tolist(), "warnings": [str(w.message) for w in caught]}


def test_processes_agree_to_skip_a_checkpoint_one_of_them_found_damaged(tmp_path: Path) -> None:
    per_rank = run_ranks(restore_past_a_damaged_shard, 2, args=(str(tmp_path / "c"),), timeout=TIMEOUT)
    assert [r["step"] for r in per_rank] == [1, 1]
    assert [r["w"] for r in per_rank] == [[1.0] * 4, [1.0] * 4]
    assert "another process found one of its files damaged" in per_rank[0]["warnings"][0]
    assert "rank-00001.safetensors is corrupt" in per_rank[1]["warnings"][0]
