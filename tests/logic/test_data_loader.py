"""DataLoader without placement, and its source actor: seeded order, drop_last against torch, positions and resume,
the prefetch bound from the source's counters, and errors. (Placed batches: tests/sim/test_data_loader.py.)"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.utils.data as tud

from sbpflow.errors import SbpflowError
from sbpflow.runtime.inorder import ExecutionError
from sbpflow.runtime.source import SourceActor
from sbpflow.utils.data import DataLoader, Dataset, TensorDataset


class Counting(Dataset):
    """Sample i is (i as a float vector, i); records every index read, in order."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay
        self.reads: list[int] = []
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.delay:
            time.sleep(self.delay)
        with self.lock:
            self.reads.append(i)
        return torch.full((3,), float(i)), i


def ids(batch: Any) -> list[int]:
    return batch[1].tolist()


@pytest.mark.parametrize(("n", "bs", "drop_last"), [(10, 3, False), (10, 3, True), (9, 3, True), (2, 3, True),
                                                   (7, 1, False), (1, 2, False)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_batch_sizes_and_coverage_match_torch(n: int, bs: int, drop_last: bool, shuffle: bool) -> None:
    ds = Counting(n)
    ours = [ids(b) for b in DataLoader(ds, bs, shuffle, seed=5, drop_last=drop_last)]
    theirs = [b[1].tolist() for b in tud.DataLoader(ds, bs, shuffle=shuffle, drop_last=drop_last)]
    assert [len(b) for b in ours] == [len(b) for b in theirs]
    assert len(DataLoader(ds, bs, drop_last=drop_last)) == len(tud.DataLoader(ds, bs, drop_last=drop_last))
    flat = [i for b in ours for i in b]
    assert len(flat) == len(set(flat))  # every sample at most once per epoch
    if not drop_last:
        assert sorted(flat) == list(range(n))
    if not shuffle:  # sequential order: exactly torch's batches
        assert ours == theirs


def test_shuffle_is_seeded_per_epoch_and_reproducible() -> None:
    ds = Counting(20)
    a, b, c = (DataLoader(ds, 4, shuffle=True, seed=s, prefetch=p) for s, p in ((7, 2), (7, 0), (8, 1)))
    epochs_a = [[ids(x) for x in a] for _ in range(3)]
    epochs_b = [[ids(x) for x in b] for _ in range(3)]
    assert epochs_a == epochs_b  # same seed, any prefetch: the same batches
    assert epochs_a[0] != epochs_a[1]  # a fresh order every epoch
    assert [ids(x) for x in c] != epochs_a[0]  # another seed, another order
    assert a.state_dict()["epoch"] == 3 and a.state_dict()["index"] == 0


def test_default_collate_and_tensor_dataset() -> None:
    x, y = torch.randn(5, 2), torch.arange(5)
    batches = list(DataLoader(TensorDataset(x, y), 2))
    torch.testing.assert_close(torch.cat([b[0] for b in batches]), x, rtol=0, atol=0)
    assert [b[1].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    merged = list(DataLoader(Counting(4), 2, collate_fn=lambda rows: torch.stack([r[0] for r in rows])))
    assert [b[:, 0].tolist() for b in merged] == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_resume_mid_epoch_gives_the_remaining_batches(prefetch: int) -> None:
    ds = Counting(23)
    full = [ids(b) for b in DataLoader(ds, 4, True, seed=1).batches(steps=14)]  # 6 per epoch: crosses 2 epochs
    first = DataLoader(ds, 4, True, seed=1, prefetch=prefetch)
    head = []
    for b in first.batches(steps=9):  # the source loads ahead; the position counts batches taken
        head.append(ids(b))
        if len(head) == 4:
            state = dict(first.state_dict())
            break
    assert state["epoch"] == 0 and state["index"] == 4
    second = DataLoader(ds, 4, True, seed=1, prefetch=prefetch)
    second.load_state_dict(state)
    tail = [ids(b) for b in second.batches(steps=10)]
    assert head + tail == full


def _torch_and_ours(n: int, bs: int, script: list[int]) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """Runs ``script`` on torch's DataLoader and ours (sequential order): each entry starts a new ``iter()`` and
    takes that many batches (-1: to the end). The batches each iteration yielded, for both."""
    ds = Counting(n)

    def run(loader: Any) -> list[list[list[int]]]:
        out = []
        for take in script:
            got = []
            for batch in loader:
                got.append(batch[1].tolist())
                if len(got) == take:
                    break
            out.append(got)
        return out

    return run(tud.DataLoader(ds, bs)), run(DataLoader(ds, bs))


@pytest.mark.parametrize("script", [[1, -1], [2, -1, 3, -1], [-1, 1, 1, -1], [5, -1]])
def test_a_new_iter_starts_the_epoch_as_torch(script: list[int]) -> None:
    theirs, ours = _torch_and_ours(17, 4, script)  # 5 batches: after a peek the loop yields 0..16, not 4..16
    assert ours == theirs


def test_a_break_then_a_new_loop_takes_the_next_epochs_order() -> None:
    loader = DataLoader(Counting(20), 4, shuffle=True, seed=3)
    reference = DataLoader(Counting(20), 4, shuffle=True, seed=3)
    epoch0 = [ids(b) for b in reference]
    epoch1 = [ids(b) for b in reference]
    assert ids(next(iter(loader))) == epoch0[0]
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["index"] == 1  # one batch taken
    assert [ids(b) for b in loader] == epoch1  # a whole epoch, in the next epoch's order
    assert (loader.epoch, loader.index) == (2, 0)


def test_only_a_restored_loader_continues_mid_epoch() -> None:
    loader = DataLoader(Counting(10), 4)
    it = iter(loader)
    assert ids(next(it)) == [0, 1, 2, 3]
    it.close()
    state = loader.state_dict()
    assert (state["epoch"], state["index"]) == (0, 1)
    restored = DataLoader(Counting(10), 4)
    restored.load_state_dict(state)
    assert [ids(b) for b in restored] == [[4, 5, 6, 7], [8, 9]]  # the rest of the saved epoch, once
    assert (restored.epoch, restored.index) == (1, 0)
    assert [ids(b) for b in restored] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # then whole epochs again
    loader.load_state_dict(state)  # the same loader, restored in place
    assert [ids(b) for b in loader][0] == [4, 5, 6, 7]


def test_steps_continue_from_the_position_across_calls() -> None:
    loader = DataLoader(Counting(10), 4)
    first = [ids(b) for b in loader.batches(steps=2)]
    second = [ids(b) for b in loader.batches(steps=2)]
    assert first + second == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["index"] == 1


def test_load_state_dict_refuses_another_seed_or_dataset() -> None:
    loader = DataLoader(Counting(10), 4, True, seed=1)
    with pytest.raises(SbpflowError, match="saved seed is 2, but this loader's is 1"):
        loader.load_state_dict({"epoch": 0, "index": 1, "seed": 2})
    with pytest.raises(SbpflowError, match="saved samples is 11"):
        loader.load_state_dict({"epoch": 0, "index": 1, "samples": 11})
    with pytest.raises(SbpflowError, match="batch 3\\) is outside this loader's 3 batches"):
        loader.load_state_dict({"epoch": 0, "index": 3})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_size": 0}, "batch_size must be an int >= 1, but got 0"),
    ({"prefetch": -1}, "prefetch must be an int >= 0, but got -1"),
    ({"sbp": "S(0)"}, "got sbp='S\\(0\\)' without a placement"),
])
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SbpflowError, match=message):
        DataLoader(Counting(4), **kwargs)
    with pytest.raises(SbpflowError, match="map-style dataset"):
        DataLoader(iter([1, 2]))
    with pytest.raises(SbpflowError, match="cannot run 3 steps"):
        list(DataLoader(Counting(1), 2, drop_last=True).batches(steps=3))


# -- the source actor ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
def test_source_loads_at_most_its_register_count_ahead(k: int) -> None:
    """After the consumer took t values and waits, the source has loaded exactly t + k and stopped."""
    src = SourceActor(iter(range(100)), register_num=k, name="numbers")
    try:
        for t in range(1, 4):
            assert src.take() == t - 1
            deadline = time.monotonic() + 5
            while src.stats.loaded < t + k and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)  # time to overrun the bound, if it could
            assert src.stats.loaded == t + k
        assert src.stats.peak_ahead == k
        assert src.stats.full_waits >= 3
    finally:
        src.close()


def test_loader_prefetch_bound_holds_while_the_consumer_is_slow() -> None:
    ds = Counting(40)
    loader = DataLoader(ds, 2, prefetch=3)
    batches = loader.batches()
    for _ in range(4):
        next(batches)
        time.sleep(0.03)  # a step that computes: the source fills its registers meanwhile
        assert batches.source.stats.loaded <= batches.source.stats.taken + 3
    assert batches.source.stats.peak_ahead == 3
    batches.close()
    assert len(ds.reads) <= 2 * (4 + 3 + 1)  # no more than the bound (+ one batch being loaded at close)


def test_prefetch_zero_loads_in_the_consumers_thread() -> None:
    seen: list[str] = []

    def values() -> Any:
        for i in range(3):
            seen.append(threading.current_thread().name)
            yield i

    src = SourceActor(values(), register_num=0)
    assert [src.take(), src.take(), src.take()] == [0, 1, 2]
    with pytest.raises(StopIteration):
        src.take()
    assert set(seen) == {threading.current_thread().name} and src.stats.peak_ahead == 0


@pytest.mark.parametrize("k", [0, 2])
def test_a_failing_producer_is_raised_at_its_position_naming_the_source(k: int) -> None:
    def values() -> Any:
        yield 0
        yield 1
        raise KeyError("sample 17")

    src = SourceActor(values(), register_num=k, name="train loader")
    assert [src.take(), src.take()] == [0, 1]
    with pytest.raises(ExecutionError, match="source actor 'train loader' failed producing value #2: KeyError"):
        src.take()
    src.close()


def test_read_threads_read_a_batch_at_once_in_order() -> None:
    class Overlapping(Counting):
        """Counts how many reads are in flight at once."""

        active = peak = 0

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            with self.lock:
                self.active += 1
                self.peak = max(self.peak, self.active)
            try:
                return super().__getitem__(i)
            finally:
                with self.lock:
                    self.active -= 1

    slow = Overlapping(16, delay=0.02)
    got = [ids(b) for b in DataLoader(slow, 8, shuffle=True, seed=3, read_threads=8, prefetch=0)]
    assert slow.peak > 1  # reads of one batch overlapped
    assert got == [ids(b) for b in DataLoader(Counting(16), 8, shuffle=True, seed=3)]  # in order all the same
    assert sorted(slow.reads) == list(range(16))
    sequential = Overlapping(4, delay=0.01)
    list(DataLoader(sequential, 4, prefetch=0))
    assert sequential.peak == 1


def test_an_abandoned_iteration_stops_its_source_thread() -> None:
    def source_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "sbpflow cpu/source:abandoned"]

    loader = DataLoader(Counting(40), 2, prefetch=2, name="abandoned")
    for batch in loader:  # breaking out drops the iteration: its source stops, its prefetched batches go
        assert ids(batch) == [0, 1]
        break
    deadline = time.monotonic() + 5
    while source_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not source_threads()
    assert loader.state_dict()["index"] == 1 and [ids(b) for b in loader][0] == [0, 1]  # a new loop: a new epoch
