"""The checkpoint's ``index.json``: what each entry is, which file holds which box of it, and each file's hash.

Pure data and logic; no files are touched here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from .._layout import Box, Shape, box_shape, numel, shard_box
from ..errors import CheckpointError, CorruptCheckpointError
from ..placement import Placement
from ..sbp import Broadcast, NdSbp, Partial, Split, parse
from ._tree import Path, path_name

FORMAT = "sbpflow-checkpoint"
VERSION = 1
INDEX_FILE = "index.json"


def rank_file(rank: int) -> str:
    """The shard file of global rank ``rank`` (the same name whichever process wrote it)."""
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class BoxRecord:
    """One box of a tensor and the file that holds it."""

    box: Box
    file: str


@dataclass(frozen=True)
class TensorEntry:
    """A saved tensor: its logical shape and dtype, the layout it was saved from, and its boxes."""

    path: Path
    shape: Shape
    dtype: str
    placement: dict[str, Any] | None  # {"type", "ranks"}; None for a local tensor
    sbp: tuple[str, ...] | None
    boxes: tuple[BoxRecord, ...]

    def describe(self) -> str:
        where = f"on {self.placement['type']}:{self.placement['ranks']} sbp ({', '.join(self.sbp or ())})" \
            if self.placement else "(local)"
        return f"{path_name(self.path)!r} saved with shape {list(self.shape)} {self.dtype} {where}"


@dataclass(frozen=True)
class ScalarEntry:
    """A saved Python scalar (bool, int, float, str or None)."""

    path: Path
    value: Any


@dataclass(frozen=True)
class FileRecord:
    """A shard file's length and SHA-256, checked before it is read."""

    nbytes: int
    sha256: str


Entry = TensorEntry | ScalarEntry


# index.json, for example:
#   {"format": "sbpflow-checkpoint", "version": 1,
#    "files":   {"rank-00000.safetensors": {"bytes": 9216, "sha256": "..."}, ...},
#    "entries": {"model/wte.weight": {"kind": "tensor", "path": ["model", "wte.weight"],
#                                     "shape": [64, 32], "dtype": "float32",
#                                     "placement": {"type": "cpu", "ranks": [[0, 1], [2, 3]]},
#                                     "sbp": ["B", "S(0)"],
#                                     "boxes": [{"box": [[0, 32], [0, 32]], "file": "rank-00000.safetensors"},
#                                               {"box": [[32, 64], [0, 32]], "file": "rank-00001.safetensors"}]},
#                "step": {"kind": "scalar", "path": ["step"], "value": 7}}}
# A box is [start, stop) per logical dim; a tensor's boxes are disjoint and cover it (writer_boxes), and a
# file stores a box under the entry's name.
@dataclass
class Index:
    entries: dict[str, Entry]
    files: dict[str, FileRecord]

    def to_json(self) -> str:
        """One line per file and per entry: readable, and written by json's C encoder (``indent`` is pure Python,
        a tenth of a second for a GPT's few hundred entries)."""
        files = {name: {"bytes": f.nbytes, "sha256": f.sha256} for name, f in sorted(self.files.items())}
        entries = {name: _entry_json(e) for name, e in self.entries.items()}
        return (f'{{"format": {json.dumps(FORMAT)}, "version": {VERSION},\n'
                f'"files": {{\n{_lines(files)}\n}},\n"entries": {{\n{_lines(entries)}\n}}}}\n')

    @classmethod
    def from_json(cls, text: str, where: str) -> Index:
        try:
            body = json.loads(text)
            _check_header(body, where)
            files = {name: FileRecord(int(f["bytes"]), str(f["sha256"])) for name, f in body["files"].items()}
            entries = {name: _entry_from_json(e) for name, e in body["entries"].items()}
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"the checkpoint index {where} is damaged or not an sbpflow index: "
                                  f"{type(e).__name__}: {e}") from None
        named = set(files) | {b.file for e in entries.values() if isinstance(e, TensorEntry) for b in e.boxes}
        for name in sorted(named):
            check_file_name(name, where)
        return cls(entries, files)


def check_file_name(name: str, where: str) -> None:
    """A shard file named by an index is a plain file name inside the checkpoint's folder: no directory part
    (``/``, ``\\``), no ``.`` or ``..``, not absolute, no NUL; anything else could read a file from elsewhere."""
    plain = (name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name
             and ":" not in name)
    if not plain:
        raise CorruptCheckpointError(f"the checkpoint index {where} names the shard file {name!r}, which is not a "
                                     "plain file name inside the checkpoint folder; refusing to read it (the index "
                                     "is damaged or crafted)")


def _lines(mapping: dict[str, Any]) -> str:
    return ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in mapping.items())


def _check_header(body: Any, where: str) -> None:
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f"its format is not {FORMAT!r}")
    if body.get("version") != VERSION:
        raise CheckpointError(f"the checkpoint index {where} has version {body.get('version')!r}; this sbpflow reads "
                              f"version {VERSION}")


def _entry_json(e: Entry) -> dict[str, Any]:
    if isinstance(e, ScalarEntry):
        return {"kind": "scalar", "path": list(e.path), "value": e.value}
    return {"kind": "tensor", "path": list(e.path), "shape": list(e.shape), "dtype": e.dtype,
            "placement": e.placement, "sbp": list(e.sbp) if e.sbp is not None else None,
            "boxes": [{"box": [list(r) for r in b.box], "file": b.file} for b in e.boxes]}


def _entry_from_json(e: dict[str, Any]) -> Entry:
    path = tuple(e["path"])
    if e["kind"] == "scalar":
        return ScalarEntry(path, e["value"])
    boxes = tuple(BoxRecord(tuple((int(a), int(b)) for a, b in r["box"]), str(r["file"])) for r in e["boxes"])
    sbp = tuple(e["sbp"]) if e["sbp"] is not None else None
    return TensorEntry(path, tuple(int(n) for n in e["shape"]), str(e["dtype"]), e["placement"], sbp, boxes)


# ----------------------------------------------------------------------------- who writes which box


def written_sbp(nd_sbp: NdSbp) -> NdSbp:
    """The layout a tensor is written in: partial axes reduced to broadcast (a partial piece is not the value),
    zigzag splits made plain (the index records logical boxes)."""
    return tuple(Broadcast() if isinstance(s, Partial) else Split(s.dim) if isinstance(s, Split) else s
                 for s in nd_sbp)


def writer_boxes(shape: Shape, placement: Placement, nd_sbp: NdSbp, itemsize: int,
                 loads: dict[int, int]) -> list[tuple[Box, int]]:
    """``(box, writer rank)`` for every distinct non-empty box of a tensor in the (non-partial) layout ``nd_sbp``.

    Ranks that hold the same box (broadcast axes) hold the same values, so only
    one of them writes it: each element is written once. The writer is the
    holder with the fewest bytes to write so far (``loads``, updated here; the
    first in mesh order on a tie), so replicas share the writing, as every
    process computes the same assignment from the same state.
    """
    holders: dict[Box, list[int]] = {}
    for rank in placement.flat_ranks:
        box = shard_box(shape, placement, nd_sbp, rank)
        if numel(box_shape(box)) > 0:
            holders.setdefault(box, []).append(rank)
    out = []
    for box, ranks in holders.items():
        writer = min(ranks, key=lambda r: loads.get(r, 0))  # min keeps the first of equals
        loads[writer] = loads.get(writer, 0) + numel(box_shape(box)) * itemsize
        out.append((box, writer))
    return out


def tensor_entry(path: Path, shape: Shape, dtype: torch.dtype, placement: Placement | None,
                 nd_sbp: NdSbp | None, written: list[tuple[Box, int]]) -> TensorEntry:
    """The index entry of a tensor whose boxes ``written`` (box, writer rank) come from :func:`writer_boxes`;
    a local tensor has no placement, and one box written by rank 0."""
    boxes = tuple(BoxRecord(box, rank_file(rank)) for box, rank in written)
    if placement is None or nd_sbp is None:
        return TensorEntry(path, shape, dtype_name(dtype), None, None, boxes)
    ranks = json.loads(json.dumps(placement.ranks))  # nested tuples -> nested lists
    return TensorEntry(path, shape, dtype_name(dtype), {"type": placement.type, "ranks": ranks},
                       tuple(str(s) for s in nd_sbp), boxes)


def saved_sbp(entry: TensorEntry) -> NdSbp | None:
    return tuple(parse(s) for s in entry.sbp) if entry.sbp is not None else None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint names the dtype {name!r}, which this torch does not have")
    return dtype
