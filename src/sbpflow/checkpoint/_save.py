"""Writing a sharded checkpoint: each process writes its ranks' boxes, then one process commits the folder.

A crash before the commit's rename leaves the previous checkpoint at ``PATH`` whole. Processes must share
one file system, as with torch DCP's file-system writer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import torch
from safetensors.torch import save as safetensors_bytes

from ..boxing import Layout, execute, plan
from ..comm import get_backend
from ..comm.base import Backend
from ..distributed import activity, rank, world_size
from ..errors import CheckpointError
from ..tensor import Tensor
from ._index import INDEX_FILE, FileRecord, Index, ScalarEntry, rank_file, tensor_entry, writer_boxes, written_sbp
from ._tree import Leaf, leaves

CHUNK_BYTES = 64 << 20  # a file is written in pieces of this size


@dataclass
class SaveReport:
    """What this process wrote: its files, their bytes, and the wall time of the whole save."""

    path: str
    files: list[str] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0


def save_sharded(state: Any, path: str) -> SaveReport:
    """See :func:`sbpflow.checkpoint.save`."""
    start = time.perf_counter()
    backend = get_backend()
    # the lead (owner of global rank 0) makes a fresh PATH.partial; partial tensors are reduced to B; each
    # distinct box gets one writer (writer_boxes)
    staged = stage(state, path, backend)
    # one fsynced safetensors file per owned rank with boxes, lengths and SHA-256 in a per-process manifest
    report = write_files(staged)
    backend.barrier()
    if staged.lead:  # manifests -> index.json; PATH.partial -> PATH (an older PATH via PATH.old); a stale .partial
        publish(staged)  # is removed by the next save
    backend.barrier()
    report.seconds = time.perf_counter() - start
    return report


@dataclass
class Staged:
    """A save between its collective part (done) and its file writing: the index's entries, the boxes this
    process writes (``{rank: {name: tensor}}``), and where they go."""

    final: str
    index: Index
    per_rank: dict[int, dict[str, torch.Tensor]]
    lead: bool  # this process commits the directory
    process: int
    processes: int

    @property
    def partial(self) -> str:
        return self.final + ".partial"


def stage(state: Any, path: str, backend: Backend, copy: Callable[[int, str, torch.Tensor], torch.Tensor] | None
          = None) -> Staged:
    """Steps 1 and 2 up to the files (every process, collectively): ``PATH.partial`` made, partial tensors
    reduced, each process's boxes chosen; ``copy(rank, name, box)`` (an asynchronous save's snapshot into
    host memory) replaces each box this process writes."""
    final = os.path.abspath(path)
    items = leaves(state)
    _check_replaceable(final)
    lead = backend.owns(0)
    if lead:
        _fresh_dir(final + ".partial")
    backend.barrier()
    index, per_rank = _collect(items, backend)
    if copy is not None:
        per_rank = {r: {name: copy(r, name, t) for name, t in tensors.items()} for r, tensors in per_rank.items()}
    return Staged(final, index, per_rank, lead, rank(), world_size())


def write_files(staged: Staged) -> SaveReport:
    """Step 2's files: this process's shard files and its manifest in ``PATH.partial`` (no communication)."""
    report = SaveReport(staged.final)
    records = {}
    for r, tensors in sorted(staged.per_rank.items()):
        records[rank_file(r)] = write_safetensors(os.path.join(staged.partial, rank_file(r)), tensors)
        report.files.append(rank_file(r))
        report.bytes_written += records[rank_file(r)].nbytes
    _write_manifest(staged.partial, staged.process, records)
    return report


def publish(staged: Staged) -> None:
    """Step 3, on the lead process once every process's manifest is written: the index, then the rename."""
    staged.index.files = _read_manifests(staged.partial, staged.processes)
    write_durably(os.path.join(staged.partial, INDEX_FILE), staged.index.to_json().encode())
    commit(staged.partial, staged.final)


def manifests_written(partial: str, processes: int) -> bool:
    """Whether every process's manifest is in ``partial`` (an asynchronous save's lead polls this)."""
    return all(os.path.exists(os.path.join(partial, _manifest_name(p))) for p in range(processes))


# ----------------------------------------------------------------------------- what this process writes


def _collect(items: list[Leaf], backend: Backend) -> tuple[Index, dict[int, dict[str, torch.Tensor]]]:
    """The index entries (the same on every process) and ``{rank: {name: box}}`` for the ranks this process writes."""
    index = Index({}, {})
    per_rank: dict[int, dict[str, torch.Tensor]] = {}
    loads: dict[int, int] = {}  # bytes each rank writes so far: replicas share the writing
    for leaf in items:
        value = leaf.value
        if not leaf.is_tensor:
            index.entries[leaf.name] = ScalarEntry(leaf.path, value)
            continue
        if isinstance(value, Tensor) and value.is_global:
            shape = tuple(value.shape)
            written = writer_boxes(shape, value.placement, written_sbp(value.sbp), value.element_size(), loads)
            shards = _reduced_shards(value, leaf.name)
            for _box, writer in written:
                if writer in shards:
                    per_rank.setdefault(writer, {})[leaf.name] = shards[writer]
            entry = tensor_entry(leaf.path, shape, value.dtype, value.placement, value.sbp, written)
        else:
            local = value.to_local() if isinstance(value, Tensor) else value
            full = tuple((0, n) for n in local.shape)
            entry = tensor_entry(leaf.path, tuple(local.shape), local.dtype, None, None, [(full, 0)])
            loads[0] = loads.get(0, 0) + local.numel() * local.element_size()
            if backend.owns(0):  # local tensors are taken as the same on every process: rank 0 writes them
                per_rank.setdefault(0, {})[leaf.name] = local
        index.entries[leaf.name] = entry
    return index, per_rank


def _reduced_shards(t: Tensor, name: str) -> dict[int, torch.Tensor]:
    """``t``'s own shards with its partial axes reduced to broadcast (a collective: every process runs it)."""
    if t._lazy is not None:
        t._lazy.refuse_data(f"saving it in a checkpoint (as {name!r})")
    target = written_sbp(t.sbp)
    shards = t.local_tensors()
    if target == t.sbp:
        return shards
    steps = plan(tuple(t.shape), t.dtype, Layout(t.placement, t.sbp), Layout(t.placement, target))
    with activity(f"checkpoint: reducing the partial tensor {name!r} before writing it"):
        return execute(steps, shards)


# ----------------------------------------------------------------------------- files


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> FileRecord:
    """One safetensors file of CPU copies of ``tensors``, fsynced; returns its length and SHA-256."""
    # one metadata key: safetensors writes a metadata map in hash order, so two keys would make equal
    # checkpoints differ byte for byte from one process to the next
    data = safetensors_bytes(_separate(tensors), metadata={"format": "pt"})
    write_durably(path, data)
    return FileRecord(len(data), hashlib.sha256(data).hexdigest())


def _separate(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors refuses shared storage)."""
    out = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel() > 0:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def write_durably(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` and fsyncs it, so a later rename publishes complete bytes."""
    with open(path, "wb") as f:
        write_chunks(f, data)
        f.flush()
        os.fsync(f.fileno())


def write_chunks(f: IO[bytes], data: bytes) -> None:
    view = memoryview(data)
    for start in range(0, len(view), CHUNK_BYTES):
        f.write(view[start : start + CHUNK_BYTES])


def _manifest_name(process: int) -> str:
    return f"_manifest-{process:05d}.json"


def _write_manifest(partial: str, process: int, records: dict[str, FileRecord]) -> None:
    body = {name: {"bytes": r.nbytes, "sha256": r.sha256} for name, r in records.items()}
    where = os.path.join(partial, _manifest_name(process))
    write_durably(where + ".tmp", json.dumps(body).encode())
    os.replace(where + ".tmp", where)  # whole or absent: an asynchronous lead polls for it


def _read_manifests(partial: str, processes: int) -> dict[str, FileRecord]:
    files = {}
    for process in range(processes):
        path = os.path.join(partial, _manifest_name(process))
        with open(path) as f:
            for name, r in json.load(f).items():
                files[name] = FileRecord(int(r["bytes"]), str(r["sha256"]))
        os.remove(path)
    return files


# ----------------------------------------------------------------------------- the directory


def _check_replaceable(final: str) -> None:
    """A save may replace an older checkpoint or an empty directory, never other files."""
    if not os.path.lexists(final):
        return
    if not os.path.isdir(final):
        raise CheckpointError(f"sbpflow.save(format='sbpflow') writes a directory, but {final} is a file; "
                              "remove it or choose another path")
    if os.listdir(final) and not os.path.exists(os.path.join(final, INDEX_FILE)):
        raise CheckpointError(f"sbpflow.save refuses to replace {final}: it is a directory that is not empty and "
                              f"has no {INDEX_FILE}, so it is not an sbpflow checkpoint")


def _fresh_dir(partial: str) -> None:
    """An empty ``PATH.partial`` (the leftovers of a save that crashed are removed)."""
    if os.path.lexists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)


def commit(partial: str, final: str) -> None:
    """Publishes the complete ``partial`` directory (or file) as ``final`` by renames; fsyncs the parent."""
    parent = os.path.dirname(final)
    if os.path.isdir(partial):
        fsync_dir(partial)
    if os.path.isdir(final):
        old = final + ".old"
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(partial, final)
        fsync_dir(parent)
        shutil.rmtree(old)
    else:
        os.replace(partial, final)
        fsync_dir(parent)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
