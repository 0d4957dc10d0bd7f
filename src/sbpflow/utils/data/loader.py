"""``DataLoader``: batches of a map-style dataset, shuffled by a seed, placed on ranks, prefetched by a source actor.

Each process reads only the rows its ranks hold; a restored loader resumes mid-epoch bit-exactly.

>>> import torch, sbpflow
>>> from sbpflow.utils.data import TensorDataset
>>> ds = TensorDataset(torch.arange(10.0).reshape(5, 2))
>>> loader = DataLoader(ds, batch_size=2, placement=sbpflow.placement("cpu", [0, 1]), sbp=sbpflow.sbp.split(0))
>>> [list(b[0].shape) for b in loader]          # the last batch holds the 5th sample
[[2, 2], [2, 2], [1, 2]]
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import default_collate

from ...comm import get_backend
from ...errors import SbpflowError
from ...placement import Placement
from ...random import mix_key
from ...runtime.source import SourceActor, SourceStats
from ...sbp import NdSbp, broadcast, normalize, split
from ...tensor import Tensor
from ._layout import check_batch_sbp, flatten, row_ranges, shards_of, unflatten

Position = tuple[int, int]  # (epoch, index of a batch in that epoch)


class DataLoader:
    """Batches of ``dataset``, each tensor laid out by ``placement`` and ``sbp``.

    ``batch_size``: samples per batch (over all ranks). ``shuffle``/``seed``: a fresh seeded order each epoch.
    ``drop_last``: drop the last, smaller batch. ``collate_fn``: samples -> batch. ``placement``/``sbp``:
    the layout of produced batches (default sbp with a placement: S(0) on the first mesh axis, B on the others);
    lists of them give each field of a batch its own (pipeline stages).
    ``prefetch``: the source actor's register count (batches loaded ahead; 0: none). ``read_threads``: how many
    ``dataset[i]`` calls of one batch run at once (for reads that wait; the dataset must allow concurrent reads).

    ``collate_fn`` (default: torch's ``default_collate``) gets only the rows this process's ranks hold, so it
    must work row by row (dim 0 of its outputs = its samples). The source actor's thread overlaps loading that
    waits (files, I/O) or runs outside the GIL (torch kernels, decoders); a pure-Python ``__getitem__`` shares
    the GIL with the step.

    >>> import torch
    >>> from sbpflow.utils.data import TensorDataset
    >>> peek = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    >>> next(iter(peek))[0].tolist()
    [0.0, 1.0]
    >>> [b[0].tolist() for b in peek]           # a new iter() starts the epoch, as torch's does
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, *, seed: int = 0,
                 drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None,
                 placement: Placement | Sequence[Placement] | None = None, sbp: Any = None, prefetch: int = 2,
                 read_threads: int = 1, name: str = "loader") -> None:
        _check_dataset(dataset)
        _check_int("batch_size", batch_size, 1)
        _check_int("prefetch", prefetch, 0)
        _check_int("read_threads", read_threads, 1)
        _check_int("seed", seed, None)
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn or default_collate
        self.layouts = _layouts(placement, sbp)  # (placement, sbp) for every field, or one for all; [] unplaced
        self.placement = self.layouts[0][0] if self.layouts else None
        self.prefetch = prefetch
        self.read_threads = read_threads
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self.epoch = 0
        self.index = 0  # the next batch the consumer takes in this epoch
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its sample order): the last one made
        self._active: weakref.ref[Batches] | None = None  # the open iteration (weak: dropping it stops it)
        self._restored = False  # set by load_state_dict: the next iteration continues the saved epoch
        self._stats: SourceStats | None = None  # the counters of the last batches() call's source actor

    # -- order and positions ------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """The sample indices of ``epoch`` in visiting order (the same on every process)."""
        cached = self._order
        if cached is not None and cached[0] == epoch:
            return cached[1]
        n = len(self.dataset)
        if self.shuffle:  # seeded by (seed, epoch) alone: every process, and a resumed loader, draws the same order
            gen = torch.Generator().manual_seed(mix_key(self.seed, epoch + 1) & (2**63 - 1))
            order = torch.randperm(n, generator=gen)
        else:
            order = torch.arange(n)
        self._order = (epoch, order)
        return order

    def batch_indices(self, epoch: int, index: int) -> list[int]:
        """The sample indices of batch ``index`` of ``epoch``."""
        if not 0 <= index < len(self):
            raise SbpflowError(f"DataLoader has {len(self)} batches per epoch, but batch {index} was asked for")
        start = index * self.batch_size
        return self.order(epoch)[start:start + self.batch_size].tolist()

    def positions(self, steps: int | None = None) -> Iterator[Position]:
        """The positions from the current one: the rest of this epoch, or ``steps`` batches across epochs."""
        self._check_steps(steps)
        return self._positions(self.epoch, self.index, steps)

    def _check_steps(self, steps: int | None) -> None:
        if steps is None:
            return
        _check_int("steps", steps, 0)
        if len(self) == 0 and steps > 0:
            raise SbpflowError(f"DataLoader yields no batch per epoch ({len(self.dataset)} samples, batch_size "
                               f"{self.batch_size}, drop_last={self.drop_last}), so it cannot run {steps} steps")

    def _positions(self, epoch: int, index: int, steps: int | None) -> Iterator[Position]:
        per_epoch, taken = len(self), 0
        while steps is None or taken < steps:
            if index >= per_epoch:
                if steps is None:
                    return
                epoch, index = epoch + 1, 0
            yield epoch, index
            index += 1
            taken += 1

    # -- loading -------------------------------------------------------------------------------------

    def load(self, epoch: int, index: int) -> Any:
        """Batch ``index`` of ``epoch``, reading only the rows this process's ranks hold."""
        indices = self.batch_indices(epoch, index)
        if not self.layouts:
            return self.collate_fn(self._read(indices))
        return self._load_placed(indices)

    def _read(self, rows: list[int]) -> list[Any]:
        """``dataset[i]`` for each row, in order: on ``read_threads`` threads at once when there are several."""
        if self.read_threads == 1 or len(rows) < 2:
            return [self.dataset[i] for i in rows]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix=f"sbpflow {self.name} read")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return list(self._pool.map(self.dataset.__getitem__, rows))

    def _load_placed(self, indices: list[int]) -> Any:
        backend = get_backend()
        holders = [(p, nd, backend.owned(p.flat_ranks)) for p, nd in self.layouts]
        n = len(indices)
        ranges = row_ranges(n, holders)
        rows = [indices[j] for lo, hi in ranges for j in range(lo, hi)]
        if rows:
            part = self.collate_fn(self._read(rows))
        else:  # this process holds no row: one sample gives the fields' shapes and dtypes (0-row shards)
            part = _empty_rows(self.collate_fn([self.dataset[indices[0]]]))
        leaves, spec = flatten(part)
        if len(holders) > 1 and len(holders) != len(leaves):
            raise SbpflowError(f"DataLoader has {len(holders)} placements, one per field, but a batch has "
                               f"{len(leaves)} fields: {[name for name, _ in leaves]}")
        tensors = []
        for k, (field, leaf) in enumerate(leaves):
            placement, nd_sbp, ranks = holders[k if len(holders) > 1 else 0]
            if leaf.dim() == 0:
                raise SbpflowError(f"DataLoader: {field} of the collated batch is 0-d; a batch needs a first dim")
            devices = {r: backend.device_for(placement.type, r) for r in ranks}
            shards = shards_of(leaf, n, ranges, placement, nd_sbp, ranks, devices, field)
            tensors.append(Tensor._from_shards((n, *leaf.shape[1:]), leaf.dtype, placement, nd_sbp, shards))
        return unflatten(tensors, spec)

    # -- iteration and state -------------------------------------------------------------------------

    def __iter__(self) -> Batches:
        return self.batches()

    def batches(self, steps: int | None = None) -> Batches:
        """An iterator over one epoch (``steps=None``) or ``steps`` batches across epochs from the position,
        prefetched by a source actor; one at a time per loader (a new one closes the previous one).

        An epoch starts at its first batch: a partly taken epoch is left (the next epoch's order starts), as a
        new ``iter()`` of torch's DataLoader does, unless ``load_state_dict`` restored this position."""
        self._check_steps(steps)
        self._close_active()
        if steps is None and self.index > 0 and not self._restored:
            self.epoch, self.index = self.epoch + 1, 0
        self._restored = False
        batches = Batches(self, steps)
        self._active = weakref.ref(batches)
        self._stats = batches.source.stats
        return batches

    def _close_active(self) -> None:
        batches = self._active() if self._active is not None else None
        if batches is not None:
            batches.close()
        self._active = None

    @property
    def stats(self) -> SourceStats:
        """The source actor's counters of the current (or last) iteration: batches loaded and taken, the most
        ever loaded ahead (at most ``prefetch``), time spent loading and waiting for a batch."""
        return self._stats if self._stats is not None else SourceStats()

    def _taken(self, epoch: int, index: int) -> None:
        """The consumer took batch (epoch, index): the position moves past it."""
        index += 1
        if index >= len(self):
            epoch, index = epoch + 1, 0
        self.epoch, self.index = epoch, index

    def state_dict(self) -> dict[str, int]:
        """The loader's position (batches taken), as integers ``sbpflow.save`` writes with a checkpoint.

        >>> import torch
        >>> from sbpflow.utils.data import TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.arange(10.0).reshape(5, 2)), batch_size=2, shuffle=True, seed=3)
        >>> _ = [b for b in loader]
        >>> loader.state_dict()["epoch"], loader.state_dict()["index"]   # one epoch consumed
        (1, 0)
        """
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "batch_size": self.batch_size,
                "samples": len(self.dataset), "shuffle": int(self.shuffle), "drop_last": int(self.drop_last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a saved position (the next iteration yields the rest of the saved epoch); the seed, batch
        size, dataset length, shuffle and drop_last must be the saved ones (where saved)."""
        if not isinstance(state, dict) or "epoch" not in state or "index" not in state:
            raise SbpflowError(f"DataLoader.load_state_dict needs 'epoch' and 'index' (a state_dict() of a "
                               f"DataLoader), but got {sorted(state) if isinstance(state, dict) else type(state)}")
        try:  # integers, or what a checkpoint gives back for them (0-d tensors)
            state = {k: int(v) for k, v in state.items()}
        except (TypeError, ValueError, RuntimeError) as e:
            raise SbpflowError(f"DataLoader.load_state_dict takes integers (a state_dict() of a DataLoader), but got "
                               f"{state} ({e})") from None
        for key, mine in (("seed", self.seed), ("batch_size", self.batch_size), ("samples", len(self.dataset)),
                          ("shuffle", int(self.shuffle)), ("drop_last", int(self.drop_last))):
            if key in state and int(state[key]) != mine:
                raise SbpflowError(f"DataLoader.load_state_dict: the saved {key} is {int(state[key])}, but this "
                                   f"loader's is {mine}; a position only means the same batches under the same "
                                   "seed, batch size and dataset")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= max(len(self) - 1, 0):
            raise SbpflowError(f"DataLoader.load_state_dict: position (epoch {epoch}, batch {index}) is outside "
                               f"this loader's {len(self)} batches per epoch")
        self._close_active()
        self.epoch, self.index = epoch, index
        self._restored = True


class Batches:
    """The batches of one :meth:`DataLoader.batches` call, made ahead by :attr:`source` (a source actor)."""

    def __init__(self, loader: DataLoader, steps: int | None) -> None:
        self.loader = loader
        producer = ((pos, loader.load(*pos)) for pos in loader.positions(steps))
        device = loader.placement.type if loader.placement is not None else "cpu"
        self.source = SourceActor(producer, loader.prefetch, loader.name, device=device, measure=_nbytes)
        self._closed = False

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            (epoch, index), batch = self.source.take()
        except StopIteration:
            self.close()
            raise
        self.loader._taken(epoch, index)
        return batch

    def close(self) -> None:
        """Stops the prefetching; batches loaded and not taken are dropped (the position does not count them)."""
        if not self._closed:
            self._closed = True
            self.source.close()
            active = self.loader._active
            if active is not None and active() is self:
                self.loader._active = None

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.source.close()


def _nbytes(item: tuple[Position, Any]) -> int:
    """Bytes of the shards this process holds of a loaded batch (the timeline's bytes)."""
    leaves, _ = flatten(_locals(item[1]))
    return sum(t.numel() * t.element_size() for _, t in leaves)


def _locals(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        shards = batch._shards if batch.is_global else {0: batch.to_local()}
        return list((shards or {}).values())
    if isinstance(batch, (tuple, list)):
        return [_locals(b) for b in batch]
    if isinstance(batch, dict):
        return [_locals(b) for b in batch.values()]
    return batch if isinstance(batch, torch.Tensor) else []


def _empty_rows(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, (tuple, list)):
        return type(value)(_empty_rows(v) for v in value)
    if isinstance(value, dict):
        return {k: _empty_rows(v) for k, v in value.items()}
    return value


def _layouts(placement: Any, sbp: Any) -> list[tuple[Placement, NdSbp]]:
    """One (placement, sbp) for every field, or one per field when ``placement`` is a list (pipeline stages:
    the ids on the first stage, the targets on the last); ``sbp`` is then a list of as many (or None)."""
    if placement is None:
        if sbp is not None:
            raise SbpflowError(f"DataLoader got sbp={sbp!r} without a placement; pass placement= as well")
        return []
    if not isinstance(placement, (list, tuple)):
        return [_layout(placement, sbp, "DataLoader batches")]
    sbps = [None] * len(placement) if sbp is None else sbp
    if not isinstance(sbps, (list, tuple)) or len(sbps) != len(placement):
        raise SbpflowError(f"DataLoader got {len(placement)} placements, one per field, so sbp must be a list of "
                           f"{len(placement)} (or None), but got {sbp!r}")
    return [_layout(p, s, f"DataLoader field {i}") for i, (p, s) in enumerate(zip(placement, sbps, strict=True))]


def _layout(placement: Any, sbp: Any, what: str) -> tuple[Placement, NdSbp]:
    if not isinstance(placement, Placement):
        raise SbpflowError(f"DataLoader(placement=...) takes an sbpflow.placement (or a list of them, one per "
                           f"field), but got {type(placement).__name__}")
    if sbp is None:
        sbp = (split(0),) + (broadcast,) * (placement.ndim - 1)
    nd = normalize(sbp, placement, what=what)
    check_batch_sbp(nd, placement)
    return placement, nd


def _check_dataset(dataset: Any) -> None:
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise SbpflowError(f"DataLoader needs a map-style dataset (with __len__ and __getitem__), but got "
                           f"{type(dataset).__name__}")


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise SbpflowError(f"DataLoader {name} must be an int{bound}, but got {value!r}")
