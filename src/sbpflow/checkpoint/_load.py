"""Reading a sharded checkpoint into the given state, in the state's own layout.

No communication: every process reads, from the shared files, the parts of
the saved boxes that overlap the shards it holds (safetensors slices read
just those bytes). A file is checked against the index before it is read:
its length always, its SHA-256 unless ``verify=False``.
"""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .._layout import intersect
from ..errors import CheckpointError, CorruptCheckpointError
from ..tensor import Tensor
from ._fill import Source, fill, target_shards
from ._index import INDEX_FILE, Entry, FileRecord, Index, ScalarEntry, TensorEntry
from ._tree import Leaf, Path, leaves, path_name, replace_scalars

HASH_CHUNK = 16 << 20


@dataclass
class LoadReport:
    """What this process read: the files it opened, the tensor bytes it read, and the wall time."""

    path: str
    files: list[str] = field(default_factory=list)
    bytes_read: int = 0
    tensors: int = 0
    scalars: int = 0
    seconds: float = 0.0


def read_index(path: str) -> Index:
    """The index of the checkpoint directory ``path`` (a clear error when it is missing or damaged)."""
    where = os.path.join(path, INDEX_FILE)
    if not os.path.isdir(path):
        hint = ""
        if os.path.isdir(path + ".old"):
            hint = f"; a save stopped while replacing it, and the previous checkpoint is complete at {path}.old"
        elif os.path.isdir(path + ".partial"):
            hint = f"; {path}.partial is an unfinished save, not a checkpoint"
        raise CheckpointError(f"no checkpoint at {path}: it does not exist{hint}")
    if not os.path.exists(where):
        raise CheckpointError(f"{path} is not an sbpflow checkpoint: it has no {INDEX_FILE}")
    with open(where, encoding="utf-8") as f:
        return Index.from_json(f.read(), where)


def load_sharded(state: Any, path: str, verify: bool = True) -> LoadReport:
    """See :func:`sbpflow.checkpoint.load`."""
    start = time.perf_counter()
    final = os.path.abspath(path)
    index = read_index(final)
    items = leaves(state)
    report = LoadReport(final)
    entries = [_entry_for(index, leaf) for leaf in items]  # every entry checked before anything is filled
    tensors = [(leaf, entry) for leaf, entry in zip(items, entries, strict=True) if isinstance(entry, TensorEntry)]
    with ExitStack() as stack:
        files = _Files(final, index, verify, report, stack)
        for file, name in _needed_files(tensors).items():  # and every file this process reads
            files.open(file, name)
        for leaf, entry in tensors:
            report.bytes_read += fill(leaf.value, leaf.name, [files.source(entry, b) for b in entry.boxes])
            report.tensors += 1
    scalars = {leaf.path: entry for leaf, entry in zip(items, entries, strict=True) if not leaf.is_tensor}
    replace_scalars(state, lambda p: _scalar_value(scalars, p))
    report.scalars = len(scalars)
    report.seconds = time.perf_counter() - start
    return report


def _needed_files(tensors: list[tuple[Leaf, TensorEntry]]) -> dict[str, str]:
    """``{file: an entry read from it}`` for the files holding a box that meets a shard this process fills
    (the zero pieces of partial targets read nothing)."""
    needed: dict[str, str] = {}
    for leaf, entry in tensors:
        shards = [s for s in target_shards(leaf.value) if not s.zero]
        for box in entry.boxes:
            if any(intersect(s.box, box.box) for s in shards):
                needed.setdefault(box.file, leaf.name)
    return dict(sorted(needed.items()))


def _scalar_value(scalars: dict[Path, Entry], path: Path) -> Any:
    entry = scalars[path]
    assert isinstance(entry, ScalarEntry)
    return entry.value


def _entry_for(index: Index, leaf: Leaf) -> Entry:
    """The saved entry for ``leaf``, checked to be the same kind (tensor or scalar) and, for tensors, shape."""
    entry = index.entries.get(leaf.name)
    if entry is None:
        raise CheckpointError(f"the checkpoint has no entry {leaf.name!r} (for {describe(leaf.value)}); it holds "
                              f"{_some_names(index)}")
    if leaf.is_tensor != isinstance(entry, TensorEntry):
        saved = "a tensor" if isinstance(entry, TensorEntry) else f"the scalar {entry.value!r}"
        raise CheckpointError(f"{leaf.name!r} is {describe(leaf.value)} in the state to fill, but the checkpoint "
                              f"holds {saved}")
    if isinstance(entry, TensorEntry) and tuple(leaf.value.shape) != entry.shape:
        raise CheckpointError(f"{leaf.name!r} has {describe(leaf.value)} in the state to fill, but the checkpoint "
                              f"holds {entry.describe()}; a checkpoint reshards a tensor, it does not reshape it")
    return entry


def describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return value._describe()
    if isinstance(value, torch.Tensor):
        return f"a torch tensor of shape {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return f"the scalar {value!r}"


def _some_names(index: Index, limit: int = 8) -> str:
    names = list(index.entries)
    more = f" ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


class _Files:
    """The shard files, opened (and checked against the index) the first time a box in them is read."""

    def __init__(self, root: str, index: Index, verify: bool, report: LoadReport, stack: ExitStack) -> None:
        self.root, self.index, self.verify, self.report, self.stack = root, index, verify, report, stack
        self.handles: dict[str, Any] = {}

    def source(self, entry: TensorEntry, box: Any) -> Source:
        name = path_name(entry.path)

        def read(slices: tuple[slice, ...]) -> torch.Tensor:
            handle = self.open(box.file, name)
            try:
                return handle.get_slice(name)[slices] if slices else handle.get_tensor(name)
            except SafetensorError as e:
                raise CorruptCheckpointError(f"reading {name!r} from {os.path.join(self.root, box.file)} failed: "
                                             f"{e}") from None

        return Source(box.box, read)

    def open(self, file: str, wanted: str) -> Any:
        """The open file, checked against the index on first use; ``wanted`` names the entry, for errors."""
        if file in self.handles:
            return self.handles[file]
        record = self.index.files.get(file)
        where = os.path.join(self.root, file)
        if record is None:
            raise CorruptCheckpointError(f"the checkpoint index places {wanted!r} in {file}, which it does not "
                                         "list; the index is damaged")
        check_inside(where, self.root)
        check_file(where, record, self.verify)
        try:
            handle = self.stack.enter_context(safe_open(where, framework="pt"))
        except SafetensorError as e:
            raise CorruptCheckpointError(f"{where} is not a readable safetensors file ({e}); the checkpoint is "
                                         "damaged") from None
        self.handles[file] = handle
        self.report.files.append(file)
        return handle


def check_inside(where: str, root: str) -> None:
    """The file ``where`` resolves (symlinks followed) to a regular file inside the checkpoint folder ``root``."""
    real, folder = os.path.realpath(where), os.path.realpath(root)
    if os.path.dirname(real) != folder:
        raise CorruptCheckpointError(f"the checkpoint file {where} resolves to {real}, outside the checkpoint "
                                     f"folder {folder}; refusing to read it")
    if os.path.exists(real) and not os.path.isfile(real):
        raise CorruptCheckpointError(f"the checkpoint file {where} is not a regular file; refusing to read it")


def check_file(where: str, record: FileRecord, verify: bool) -> None:
    """The file exists with the length (and, with ``verify``, the SHA-256) the index recorded."""
    if not os.path.exists(where):
        raise CorruptCheckpointError(f"the checkpoint file {where} is missing (the index lists it with "
                                     f"{record.nbytes} bytes)")
    size = os.path.getsize(where)
    if size != record.nbytes:
        what = "truncated" if size < record.nbytes else "longer than written"
        raise CorruptCheckpointError(f"the checkpoint file {where} is {what}: {size} bytes, but the index records "
                                     f"{record.nbytes}")
    if verify and _sha256(where) != record.sha256:
        raise CorruptCheckpointError(f"the checkpoint file {where} is corrupt: its SHA-256 differs from the one the "
                                     "index recorded when it was written (load(..., verify=False) skips this check)")


def _sha256(where: str) -> str:
    digest = hashlib.sha256()
    with open(where, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
