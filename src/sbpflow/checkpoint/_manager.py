"""``CheckpointManager``: numbered checkpoints of a run, saved every N steps (asynchronously by default),
pruned to the newest K, and the newest complete and undamaged one restored.

>>> import tempfile, sbpflow
>>> state = sbpflow.checkpoint.run_state(model=sbpflow.nn.Linear(2, 2))
>>> manager = CheckpointManager(tempfile.mkdtemp(), every=2, keep=1)
>>> manager.restore(state)                  # nothing saved yet: start at step 0
0
>>> for step in range(1, 5):
...     _ = manager.save(step, state)       # saves after steps 2 and 4
>>> manager.wait(); manager.steps()
[4]
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from typing import Any

import torch

from ..boxing import Layout, execute, plan
from ..comm import get_backend
from ..distributed import activity, world_size
from ..errors import CheckpointError, CheckpointWarning, CorruptCheckpointError
from ..placement import Placement
from ..sbp import Broadcast, Partial
from ._index import INDEX_FILE
from ._load import load_sharded
from ._run import RunState
from ._save import Staged, fsync_dir, manifests_written, publish, save_sharded, stage, write_durably, write_files

PREFIX = "step-"
PUBLISH_TIMEOUT_S = 600.0  # how long a lead's writer waits for the other processes' files


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _step_of(name: str) -> int | None:
    digits = name[len(PREFIX):]
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


def _everyone_succeeded(ok: bool) -> bool:
    """Whether every process's ``ok`` holds (a collective): each process reads only its shards' files, so
    they agree before any of them uses a checkpoint that one found damaged."""
    ranks = list(range(world_size()))
    if len(ranks) == 1:
        return ok
    backend = get_backend()
    everyone = Placement("cpu", ranks)
    flags = {r: torch.tensor([0.0 if ok else 1.0]) for r in backend.owned(ranks)}  # P(max): any one failed
    steps = plan((1,), torch.float32, Layout(everyone, (Partial("max"),)), Layout(everyone, (Broadcast(),)))
    with activity("checkpoint restore: agreeing whether every process could read the checkpoint"):
        reduced = execute(steps, flags)
    return all(float(t.item()) == 0.0 for t in reduced.values())


class CheckpointManager:
    """Checkpoints of a run in ``folder``: :meth:`save` every ``every`` steps, the newest ``keep`` kept
    (0: all), written by a writer thread when ``async_save``; :meth:`restore` fills a state from the newest.

    ``state`` is a :func:`~sbpflow.checkpoint.run_state` (restored into its model, optimizer, scheduler,
    scaler, loader and random stream) or any nested dict :func:`sbpflow.save` takes (filled in place).

    The folder holds ``step-00000020/``, ... (each an :func:`sbpflow.save` folder); one being written is
    ``step-N.partial`` and is never restored, so a crash leaves the previous one the newest complete one.
    A complete checkpoint damaged since (truncated, bit-flipped, missing files) is skipped with a
    CheckpointWarning naming the file, before any of its data is used, on every process alike.
    """

    def __init__(self, folder: str | os.PathLike[str], every: int = 1, keep: int = 2, async_save: bool = True,
                 *, verify: bool = True) -> None:
        for name, value, least in (("every", every, 1), ("keep", keep, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise CheckpointError(f"CheckpointManager({name}=...) must be an int >= {least}, but got {value!r}")
        self.folder = os.path.abspath(os.fspath(folder))
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise CheckpointError(f"CheckpointManager: {self.folder} is a file, not a folder of checkpoints")
        self.every, self.keep, self.async_save, self.verify = every, keep, bool(async_save), verify
        self._staging: dict[tuple[int, str], torch.Tensor] = {}  # host buffers, reused across saves
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved: int | None = None
        self.pause_s = 0.0  # the last save's time on the calling thread (the snapshot, for an asynchronous one)

    # -- which checkpoints exist -------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints in the folder, oldest first."""
        if not os.path.isdir(self.folder):
            return []
        found = []
        for name in os.listdir(self.folder):
            step = _step_of(name)
            if step is not None and os.path.isfile(os.path.join(self.folder, name, INDEX_FILE)):
                found.append(step)
        return sorted(found)

    def path(self, step: int) -> str:
        return os.path.join(self.folder, checkpoint_name(step))

    # -- restore ----------------------------------------------------------------------------------

    def restore(self, state: Any) -> int:
        """Fills ``state`` from the newest complete, undamaged checkpoint; returns its step (the first step to
        run), or 0 (``state`` untouched) when there is none. A damaged one is skipped with a warning."""
        self.wait()
        get_backend().barrier()  # every process sees the same folder
        skipped = []
        for step in reversed(self.steps()):
            tree, problem = self._try_load(state, step)
            if _everyone_succeeded(problem is None):
                if isinstance(state, RunState):
                    state.apply(tree)
                self.last_saved = step
                return step
            why = problem or "another process found one of its files damaged"
            skipped.append(f"step {step}: {why}")
            warnings.warn(f"CheckpointManager.restore: skipping the damaged checkpoint {self.path(step)} ({why}); "
                          "trying the one before it", CheckpointWarning, stacklevel=2)
        if skipped:
            raise CorruptCheckpointError(f"every checkpoint in {self.folder} is damaged: " + "; ".join(skipped))
        return 0

    def _try_load(self, state: Any, step: int) -> tuple[Any, str | None]:
        """The tree checkpoint ``step`` filled (``state`` itself, or a :class:`RunState`'s fresh tree, applied
        once every process succeeded) and what is damaged in it, or None. Every file is checked before it is read."""
        tree = state.tree(fresh=True) if isinstance(state, RunState) else state
        try:
            load_sharded(tree, self.path(step), self.verify)
        except CorruptCheckpointError as e:
            return tree, str(e)
        return tree, None

    # -- save -------------------------------------------------------------------------------------

    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Saves ``state`` as the checkpoint of ``step`` (the number of steps done) when ``step % every == 0``
        or ``force``; returns whether it saved. Every process calls it alike."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"CheckpointManager.save(step=...) must be an int >= 0, but got {step!r}")
        if not force and step % self.every:
            return False
        if step == self.last_saved:
            return False  # already saved (a forced save after the loop's last regular one)
        # The calling thread does the collective part (partial tensors reduced) and copies this process's boxes
        # into reused host buffers: the only pause. The writer thread then writes the files and a manifest; the
        # lead's writer waits for every manifest, writes the index, renames and prunes. It talks only through
        # files, so the next steps communicate meanwhile; wait() and restore() raise a failed save's error.
        start = time.perf_counter()
        self.wait()
        tree = self._tree(state, step)
        os.makedirs(self.folder, exist_ok=True)
        backend = get_backend()
        if not self.async_save:
            save_sharded(tree, self.path(step))
            if backend.owns(0):
                self._prune()
            self.last_saved = step
            self.pause_s = time.perf_counter() - start
            return True
        staged = stage(tree, self.path(step), backend, self._copy)
        self._writer = threading.Thread(target=self._write, args=(staged,), name="sbpflow checkpoint writer")
        self._writer.start()
        self.last_saved = step
        self.pause_s = time.perf_counter() - start
        return True

    def wait(self) -> None:
        """Waits for the save in flight (if any); raises its error if it failed."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"the asynchronous checkpoint save failed: {type(error).__name__}: {error}; "
                                  f"the newest complete checkpoint in {self.folder} is the one before it") from error

    @staticmethod
    def _tree(state: Any, step: int) -> Any:
        if isinstance(state, RunState):
            state.step = step
            return state.tree()
        return state

    def _copy(self, rank: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """The snapshot of one box, into its staging buffer (made once, reused while its shape and dtype hold)."""
        t = t.detach()
        buf = self._staging.get((rank, name))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            self._staging[(rank, name)] = buf
        buf.copy_(t)
        return buf

    def _write(self, staged: Staged) -> None:
        try:
            self._write_and_publish(staged)
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self._error = e
            try:
                write_durably(os.path.join(staged.partial, f"_failed-{staged.process:05d}"), repr(e).encode())
            except OSError:
                pass

    def _write_and_publish(self, staged: Staged) -> None:
        write_files(staged)
        if not staged.lead:
            return
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        while not manifests_written(staged.partial, staged.processes):
            failed = [n for n in os.listdir(staged.partial) if n.startswith("_failed-")]
            if failed:
                raise CheckpointError(f"another process could not write its part of {staged.final} ({failed[0]})")
            if time.monotonic() > deadline:
                raise CheckpointError(f"the other processes did not write their part of {staged.final} within "
                                      f"{PUBLISH_TIMEOUT_S:.0f} s")
            time.sleep(0.005)
        publish(staged)
        self._prune()

    def _prune(self) -> None:
        """Removes the checkpoints beyond the newest ``keep`` and the leftovers of saves that stopped."""
        steps = self.steps()
        doomed = steps[:-self.keep] if self.keep else []
        for step in doomed:
            shutil.rmtree(self.path(step), ignore_errors=True)
        newest = steps[-1] if steps else -1
        for name in os.listdir(self.folder):
            stem, _, suffix = name.rpartition(".")
            left = _step_of(stem)
            if left is not None and suffix in ("partial", "old") and left < newest:
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        fsync_dir(self.folder)
