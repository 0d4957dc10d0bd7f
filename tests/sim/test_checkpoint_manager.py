"""CheckpointManager on virtual ranks: bit-exact resume of a whole run (eager and nn.Graph), asynchronous saves
write the same files as synchronous ones, pruning, a save that fails or is killed mid-write, and a newest
checkpoint damaged on disk (restore falls back to the one before it).

A run here has dropout (the random stream), Adam (moments), a warmup-cosine LR
schedule and a shuffled DataLoader (its position): resuming from a checkpoint
must give the uninterrupted run's losses and parameters bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.checkpoint import CheckpointManager, _save, run_state
from sbpflow.errors import CheckpointError, CheckpointWarning, CorruptCheckpointError
from sbpflow.optim.lr_scheduler import WarmupCosine
from sbpflow.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P2 = sbpflow.placement("cpu", [0, 1])
IN, OUT, TOTAL = 6, 3, 9


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(14, IN, generator=g), torch.randn(14, OUT, generator=g))


class Run:
    """A fresh run (``seed`` sets its initial weights, which a restore overwrites): model with dropout, Adam,
    a warmup-cosine schedule, a shuffled loader laid out S(0) on two ranks; eager or one nn.Graph step."""

    def __init__(self, graph: bool, seed: int = 0, amp: bool = False) -> None:
        sbpflow.manual_seed(seed)
        # fp16 with a scale that overflows at first and grows every 2 clean steps: skips, backoffs and growths
        self.scaler = sbpflow.amp.GradScaler(init_scale=2.0**22, growth_interval=2) if amp else None
        self.model = nn.Sequential(nn.Linear(IN, 16), nn.ReLU(), nn.Dropout(0.2),
                                   nn.Linear(16, OUT)).to_global(P2, S.broadcast)
        self.opt = sbpflow.optim.Adam(self.model.parameters(), lr=1e-2)
        self.sched = WarmupCosine(self.opt, warmup_steps=3, total_steps=TOTAL)
        self.loader = DataLoader(_data(), 4, shuffle=True, seed=3, drop_last=True, placement=P2, sbp=S.split(0))
        self.graph = self._graph() if graph else None
        self.state = run_state(model=self.model, optimizer=self.opt, scheduler=self.sched, loader=self.loader,
                               scaler=self.scaler)

    def _graph(self) -> nn.Graph:
        run = self

        class Step(nn.Graph):
            def __init__(self) -> None:
                super().__init__()
                self.model = run.model
                self.add_optimizer(run.opt, lr_sch=run.sched)
                if run.scaler is not None:
                    self.config.enable_amp(torch.float16, loss_scaler=run.scaler)

            def build(self, x: Any, y: Any) -> Any:
                loss = (self.model(x) - y).square().mean()
                loss.backward()
                return loss

        return Step()

    def train(self, steps: int, manager: CheckpointManager | None = None, start: int = 0) -> list[float]:
        self.scales: list[float] = []
        losses = []
        for k, (x, y) in enumerate(self.loader.batches(steps=steps)):
            if self.graph is not None:
                loss = self.graph(x, y)
            else:
                loss = (self.model(x) - y).square().mean()
                loss.backward()
                self.opt.step()
                self.opt.zero_grad()
                self.sched.step()
            losses.append(float(loss.numpy()))
            if self.scaler is not None:
                self.scales.append(self.scaler.get_scale())
            if manager is not None:
                manager.save(start + k + 1, self.state)
        return losses

    def params(self) -> list[np.ndarray]:
        return [t.numpy().copy() for t in self.model.parameters()]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_restore_continues_bit_for_bit(tmp_path: Any, graph: bool, async_save: bool) -> None:
    straight = Run(graph)
    losses = straight.train(TOTAL)  # 3 batches an epoch: crosses epochs
    final = straight.params()

    first = Run(graph)
    manager = CheckpointManager(tmp_path / "ckpt", every=4, keep=2, async_save=async_save)
    assert manager.restore(first.state) == 0
    head = first.train(5, manager)  # saves after step 4, mid-epoch 1; step 5 runs during the write
    manager.wait()
    assert manager.steps() == [4]

    fresh = Run(graph, seed=11)  # other weights, a fresh loader and random stream: all from the checkpoint
    sbpflow.manual_seed(99)
    resumed = CheckpointManager(tmp_path / "ckpt", every=4, keep=2, async_save=async_save)
    start = resumed.restore(fresh.state)
    assert start == 4 and (fresh.loader.epoch, fresh.loader.index) == (1, 1)
    tail = fresh.train(TOTAL - start, resumed, start)
    resumed.wait()
    assert head[:4] + tail == losses
    assert head[4] == losses[4]
    for got, want in zip(fresh.params(), final, strict=True):
        np.testing.assert_array_equal(got, want)
    assert resumed.steps() == [4, 8]  # keep=2


def test_a_compiled_fp16_step_with_a_grad_scaler_resumes_bit_for_bit(tmp_path: Any) -> None:
    straight = Run(True, amp=True)
    losses = straight.train(TOTAL)
    scales, final = straight.scales, straight.params()
    changes = [b - a for a, b in zip(scales[:-1], scales[1:], strict=True)]
    assert min(changes) < 0 < max(changes), scales  # backoffs (skipped steps) and growths both happened

    first = Run(True, amp=True)
    manager = CheckpointManager(tmp_path / "ckpt", every=4, keep=2)
    head = first.train(5, manager)  # saves after step 4: the scale and growth tracker mid-way
    manager.wait()
    fresh = Run(True, seed=11, amp=True)
    scaler = fresh.scaler
    assert scaler is not None
    scaler._scale, scaler._growth_tracker = 1.0, 0  # both must come from the checkpoint
    assert CheckpointManager(tmp_path / "ckpt").restore(fresh.state) == 4
    assert scaler.get_scale() == scales[3]
    tail = fresh.train(TOTAL - 4)
    assert head[:4] + tail == losses
    assert fresh.scales == scales[4:]
    for got, want in zip(fresh.params(), final, strict=True):
        np.testing.assert_array_equal(got, want)


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def test_async_writes_the_same_files_as_sync_and_reuses_its_staging_buffers(tmp_path: Any) -> None:
    sync = CheckpointManager(tmp_path / "sync", every=2, keep=0, async_save=False)
    asyn = CheckpointManager(tmp_path / "async", every=2, keep=0, async_save=True)
    Run(False).train(4, sync)  # one run after the other: each seeds the random stream
    b = Run(False)
    b.train(2, asyn)
    buffers = {key: t.data_ptr() for key, t in asyn._staging.items()}
    assert buffers  # the snapshot went through staging buffers
    b.train(2, asyn, start=2)
    asyn.wait()
    assert {key: t.data_ptr() for key, t in asyn._staging.items()} == buffers  # the same buffers, refilled
    assert sync.steps() == asyn.steps() == [2, 4]
    for step in (2, 4):
        assert _files(sync.path(step)) == _files(asyn.path(step))


def test_keep_prunes_the_oldest_and_every_and_force_choose_the_steps(tmp_path: Any) -> None:
    run = Run(False)
    manager = CheckpointManager(tmp_path / "c", every=3, keep=2)
    saved = [step for step in range(1, 11) if manager.save(step, run.state)]
    assert manager.save(10, run.state) is False  # already saved: force does not repeat it
    assert manager.save(11, run.state, force=True)
    manager.wait()
    assert saved == [3, 6, 9] and manager.steps() == [9, 11]
    assert sorted(os.listdir(tmp_path / "c")) == ["step-00000009", "step-00000011"]


def test_an_exception_mid_write_leaves_the_previous_checkpoint(tmp_path: Any, monkeypatch: Any) -> None:
    run = Run(False)
    manager = CheckpointManager(tmp_path / "c", every=2, keep=3)
    run.train(2, manager)
    manager.wait()
    at_two = run.params()
    real = _save.write_durably

    def torn(path: str, data: bytes) -> None:  # half a file on disk, then the writer fails
        if path.endswith(".safetensors"):
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(_save, "write_durably", torn)
    run.train(2, manager, start=2)  # the save of step 4 fails in the writer thread; training goes on
    with pytest.raises(CheckpointError, match="asynchronous checkpoint save failed: OSError.*No space left"):
        manager.wait()
    monkeypatch.setattr(_save, "write_durably", real)
    assert manager.steps() == [2] and os.path.isdir(tmp_path / "c" / "step-00000004.partial")
    fresh = Run(False, seed=5)
    assert CheckpointManager(tmp_path / "c").restore(fresh.state) == 2
    for got, want in zip(fresh.params(), at_two, strict=True):
        np.testing.assert_array_equal(got, want)
    run.train(2, manager, start=4)  # the next save works and clears the torn one
    manager.wait()
    assert manager.steps() == [2, 6] and not os.path.exists(tmp_path / "c" / "step-00000004.partial")


def test_a_writer_thread_that_dies_before_publishing_leaves_the_previous_checkpoint(tmp_path: Any,
                                                                                    monkeypatch: Any) -> None:
    run = Run(False)
    manager = CheckpointManager(tmp_path / "c", every=2)
    run.train(2, manager)
    manager.wait()
    entered, release = threading.Event(), threading.Event()

    def killed(staged: Any) -> None:  # the thread stops between its files and the commit
        entered.set()
        release.wait(10)
        raise SystemExit("writer killed")

    monkeypatch.setattr(_save, "publish", killed)
    monkeypatch.setattr("sbpflow.checkpoint._manager.publish", killed)
    run.train(2, manager, start=2)
    assert entered.wait(10)
    assert manager.steps() == [2]  # in flight: not a checkpoint yet
    release.set()
    with pytest.raises(CheckpointError, match="SystemExit: writer killed"):
        manager.wait()
    assert manager.steps() == [2]
    assert CheckpointManager(tmp_path / "c").restore(Run(False, seed=3).state) == 2


KILLED_MID_WRITE = textwrap.dedent('''
    import os, sys, threading
    import torch, sbpflow
    from sbpflow.checkpoint import CheckpointManager, _save
    folder = sys.argv[1]
    w = {"w": sbpflow.arange(4096.0, placement=sbpflow.placement("cpu", [0, 1]), sbp=sbpflow.sbp.split(0))}
    manager = CheckpointManager(folder, every=1)
    manager.save(1, w); manager.wait()
    real = _save.write_chunks
    def slow(f, data):   # writes half a shard, then the process is killed while the writer is at it
        f.write(memoryview(data)[: len(data) // 2]); f.flush(); os._exit(9)
    _save.write_chunks = slow
    w["w"].add_(1.0)
    manager.save(2, w)
    threading.Event().wait(30)
''')


def test_a_process_killed_mid_write_restores_the_previous_checkpoint(tmp_path: Any) -> None:
    folder = str(tmp_path / "c")
    script = tmp_path / "killed.py"
    script.write_text(KILLED_MID_WRITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, str(script), folder], env=env, timeout=120, capture_output=True)
    assert done.returncode == 9, done.stderr.decode()[-2000:]
    assert sorted(os.listdir(folder)) == ["step-00000001", "step-00000002.partial"]
    torn = os.path.join(folder, "step-00000002.partial")
    assert any(name.endswith(".safetensors") for name in os.listdir(torn))  # a torn shard is on disk
    state = {"w": sbpflow.zeros(4096, placement=P2, sbp=S.broadcast)}
    assert CheckpointManager(folder).restore(state) == 1
    assert state["w"].tolist() == [float(i) for i in range(4096)]


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)


def _flip_a_bit(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


DAMAGES = {"truncated": (_truncate, "is truncated"), "bit-flipped": (_flip_a_bit, "is corrupt: its SHA-256"),
           "deleted": (os.remove, "is missing")}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_newest_checkpoint_is_named_and_skipped_for_the_one_before(tmp_path: Any, damage: str) -> None:
    run = Run(False)
    manager = CheckpointManager(tmp_path / "c", every=2, keep=3)
    run.train(2, manager)
    manager.wait()
    at_two = run.params()
    run.train(2, manager, start=2)
    manager.wait()
    assert manager.steps() == [2, 4]
    shard = os.path.join(manager.path(4), "rank-00001.safetensors")
    harm, said = DAMAGES[damage]
    harm(shard)

    fresh = Run(False, seed=5)
    with pytest.warns(CheckpointWarning, match=f"skipping the damaged checkpoint .*step-00000004.*{shard}.*{said}"):
        assert CheckpointManager(tmp_path / "c").restore(fresh.state) == 2
    assert fresh.state.step == 2 and (fresh.loader.epoch, fresh.loader.index) == (0, 2)
    for got, want in zip(fresh.params(), at_two, strict=True):
        np.testing.assert_array_equal(got, want)  # step 2's values: nothing of step 4 was used


def test_a_damaged_index_is_skipped_and_every_checkpoint_damaged_is_an_error(tmp_path: Any) -> None:
    run = Run(False)
    manager = CheckpointManager(tmp_path / "c", every=2, keep=3, async_save=False)
    run.train(4, manager)
    with open(os.path.join(manager.path(4), "index.json"), "w") as f:
        f.write('{"format": "sbpflow-checkpoint", "version": 1, "files": {')  # torn JSON
    fresh = Run(False, seed=5)
    with pytest.warns(CheckpointWarning, match=r"step-00000004.*index.json is damaged"):
        assert CheckpointManager(tmp_path / "c").restore(fresh.state) == 2
    _flip_a_bit(os.path.join(manager.path(2), "rank-00000.safetensors"))
    before = Run(False, seed=5)
    untouched = before.params()
    with pytest.warns(CheckpointWarning), pytest.raises(
            CorruptCheckpointError, match=r"every checkpoint in .* is damaged: step 4: .*; step 2: .*rank-00000"):
        CheckpointManager(tmp_path / "c").restore(before.state)
    assert before.state.step == 0
    for got, want in zip(before.params(), untouched, strict=True):
        np.testing.assert_array_equal(got, want)  # files are checked before any is read


def test_a_mismatched_state_is_an_error_not_a_fallback(tmp_path: Any) -> None:
    manager = CheckpointManager(tmp_path / "c", every=1, async_save=False)
    run = Run(False)
    run.train(2, manager)
    with pytest.raises(CheckpointError, match="does not reshape it") as caught:
        manager.restore(run_state(model=nn.Sequential(nn.Linear(2, 2))))
    assert not isinstance(caught.value, CorruptCheckpointError)


def test_run_state_covers_the_scaler_and_refuses_a_checkpoint_without_a_part(tmp_path: Any) -> None:
    scaler = sbpflow.amp.GradScaler(init_scale=256.0)
    state = run_state(scaler=scaler, step=0)
    manager = CheckpointManager(tmp_path / "c", async_save=False)
    scaler._scale = 32.0
    scaler._growth_tracker = 7
    manager.save(1, state)
    other = sbpflow.amp.GradScaler(init_scale=2.0 ** 16)
    restored = run_state(scaler=other)
    assert manager.restore(restored) == 1 and restored.step == 1
    assert other.state_dict()["scale"] == 32.0 and other._growth_tracker == 7
    with pytest.raises(CheckpointError, match="no entry 'model/0.weight'"):
        manager.restore(run_state(model=nn.Sequential(nn.Linear(2, 2)), scaler=other))


def test_bad_arguments_are_clear_errors(tmp_path: Any) -> None:
    with pytest.raises(CheckpointError, match=r"every=...\) must be an int >= 1, but got 0"):
        CheckpointManager(tmp_path, every=0)
    with pytest.raises(CheckpointError, match=r"keep=...\) must be an int >= 0, but got -1"):
        CheckpointManager(tmp_path, keep=-1)
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a folder of checkpoints"):
        CheckpointManager(tmp_path / "f")
    with pytest.raises(CheckpointError, match="step=...\\) must be an int >= 0"):
        CheckpointManager(tmp_path / "g").save(-1, {})
