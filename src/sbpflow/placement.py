"""Placements: a device type plus the ranks of a 1-D, 2-D or 3-D device mesh; frozen, hashable, validated.

>>> import sbpflow
>>> p = sbpflow.placement("cpu", [[0, 1], [2, 3]])
>>> p.hierarchy, p.ranks
((2, 2), ((0, 1), (2, 3)))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import PlacementError

DEVICE_TYPES = ("cpu", "cuda")
# how many processes the job has: sbpflow.distributed registers its world_size here (placements are pure data,
# below the process layer); without it, one process
WORLD_SIZE: list[Callable[[], int]] = []
MAX_MESH_NDIM = 3


def _nest(ranks: Any, where: str) -> Any:
    """Turns nested lists/tuples/ranges into nested tuples of int, checking leaves."""
    if isinstance(ranks, (list, tuple, range)):
        return tuple(_nest(r, where) for r in ranks)
    if hasattr(ranks, "tolist"):  # numpy arrays and torch tensors
        return _nest(ranks.tolist(), where)
    if isinstance(ranks, bool) or not isinstance(ranks, int):
        raise PlacementError(f"placement ranks must be non-negative ints, but {where} contains {ranks!r}")
    return ranks


def _mesh_shape(ranks: Any, full: Any) -> tuple[int, ...]:
    if not isinstance(ranks, tuple):
        return ()
    if len(ranks) == 0:
        raise PlacementError(f"placement ranks must not be empty, but got {full!r}")
    shapes = {_mesh_shape(r, full) for r in ranks}
    if len(shapes) != 1:
        raise PlacementError(f"placement ranks must form a rectangular mesh, but {full!r} is ragged")
    return (len(ranks),) + shapes.pop()


def _flatten(ranks: Any) -> Iterator[int]:
    if isinstance(ranks, tuple):
        for r in ranks:
            yield from _flatten(r)
    else:
        yield ranks


@dataclass(frozen=True)
class Placement:
    """Where a global tensor lives: a device type and a mesh of global ranks."""

    type: str
    ranks: Any  # nested tuples of int, one level per mesh axis
    hierarchy: tuple[int, ...] = field(init=False, compare=False)
    flat_ranks: tuple[int, ...] = field(init=False, compare=False, repr=False)
    # Derived once, so that per-rank lookups stay O(1) on meshes of many thousand virtual ranks: the position of
    # each rank in flat_ranks (coords used tuple.index, O(ranks), which made creating a tensor quadratic) and the
    # hash (a placement keys the shard_box and dispatch caches; hashing the nested rank tuples is O(ranks)).
    _index: dict[int, int] = field(init=False, compare=False, repr=False)
    _hash: int = field(init=False, compare=False, repr=False)

    @classmethod
    def all(cls, type: str) -> Placement:
        """Every process of the job, as OneFlow's ``placement.all("cuda")``: ``[0]`` in a plain one-process run.

        >>> import sbpflow
        >>> sbpflow.placement.all("cpu")
        placement(type='cpu', ranks=[0])
        """
        return cls(type, range(WORLD_SIZE[-1]() if WORLD_SIZE else 1))

    def __init__(self, type: str, ranks: Sequence[Any] | int | range) -> None:
        if type not in DEVICE_TYPES:
            raise PlacementError(f"placement type must be one of {DEVICE_TYPES}, but got {type!r}")
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        if not isinstance(ranks, (list, tuple, range)) and not hasattr(ranks, "tolist"):
            raise PlacementError(f"placement ranks must be a list (or nested lists) of ints, but got {ranks!r}")
        nested = _nest(ranks, repr(ranks))
        if not isinstance(nested, tuple):
            raise PlacementError(f"placement ranks must be a list, but got {ranks!r}")
        shape = _mesh_shape(nested, ranks)
        if len(shape) > MAX_MESH_NDIM:
            raise PlacementError(
                f"placement meshes have at most {MAX_MESH_NDIM} axes, but {ranks!r} has {len(shape)}"
            )
        flat = tuple(_flatten(nested))
        negative = [r for r in flat if r < 0]
        if negative:
            raise PlacementError(f"placement ranks must be non-negative, but {ranks!r} contains {negative[0]}")
        index = {r: i for i, r in enumerate(flat)}
        if len(index) != len(flat):
            dup = next(r for i, r in enumerate(flat) if index[r] != i)
            raise PlacementError(f"placement ranks must be distinct, but rank {dup} appears twice in {ranks!r}")
        if type == "cuda":
            _check_cuda_available(ranks)
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "ranks", nested)
        object.__setattr__(self, "hierarchy", shape)
        object.__setattr__(self, "flat_ranks", flat)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_hash", hash((type, nested)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt on unpickling: the cached hash of a str is only valid in the process that computed it
        return (Placement, (self.type, self.ranks))

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.hierarchy)

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.flat_ranks)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of a global rank of this placement (O(1): a dict lookup and a few divisions)."""
        index = self._index.get(rank)
        if index is None:
            raise PlacementError(f"rank {rank} is not in placement {self}")
        out = []
        for n in reversed(self.hierarchy):
            out.append(index % n)
            index //= n
        return tuple(reversed(out))

    def rank_at(self, coords: Sequence[int]) -> int:
        """Global rank at the given mesh coordinates."""
        node: Any = self.ranks
        for c in coords:
            node = node[c]
        return int(node)

    def axis_groups(self, axis: int) -> list[tuple[int, ...]]:
        """The rank groups that communicate along one mesh axis (every other coordinate fixed)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in self.flat_ranks:
            c = self.coords(rank)
            key = c[:axis] + c[axis + 1 :]
            groups.setdefault(key, []).append(rank)
        return [tuple(g) for g in groups.values()]

    def axis_group_of(self, rank: int, axis: int) -> tuple[int, ...]:
        """The group along ``axis`` that contains ``rank``, in mesh order."""
        c = list(self.coords(rank))
        out = []
        for i in range(self.hierarchy[axis]):
            c[axis] = i
            out.append(self.rank_at(c))
        return tuple(out)

    def __repr__(self) -> str:
        return f"placement(type={self.type!r}, ranks={_as_lists(self.ranks)})"

    def __str__(self) -> str:
        return f"{self.type}:{_as_lists(self.ranks)}"


def _as_lists(ranks: Any) -> Any:
    return [_as_lists(r) for r in ranks] if isinstance(ranks, tuple) else ranks


def _check_cuda_available(ranks: Any) -> None:
    import torch

    if not torch.cuda.is_available():
        raise PlacementError(
            f"placement('cuda', {ranks!r}) needs a CUDA GPU, but torch.cuda.is_available() is False; "
            "use placement('cpu', ...) on this machine"
        )


placement = Placement
