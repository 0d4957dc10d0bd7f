"""A checkpoint's index names its shard files; loading reads only plain files inside the checkpoint folder.

A crafted index (``../outside.safetensors`` with a matching length and
SHA-256, an absolute path, a sub-folder, a symlink out of the folder) is
refused with a ``CheckpointError`` before any byte of that file is read, and
the state to fill is left as it was. Damaged shards are named and never loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import pytest

import sbpflow
from sbpflow import sbp as S
from sbpflow.errors import CheckpointError

P2 = sbpflow.placement("cpu", [0, 1])


def _saved(tmp_path: Any) -> str:
    path = str(tmp_path / "ckpt")
    sbpflow.save({"w": sbpflow.arange(10.0, placement=P2, sbp=S.split(0)), "step": 3}, path)
    return path


def _rename_shard(path: str, new_name: str) -> None:
    """Points the index's ``rank-00001.safetensors`` at ``new_name`` (its length and hash left matching)."""
    where = os.path.join(path, "index.json")
    with open(where, encoding="utf-8") as f:
        text = f.read()
    with open(where, "w", encoding="utf-8") as f:
        f.write(text.replace('"rank-00001.safetensors"', json.dumps(new_name)))


def _fresh() -> dict[str, Any]:
    return {"w": sbpflow.zeros(10, placement=P2, sbp=S.broadcast), "step": 0}


def test_a_plain_checkpoint_loads(tmp_path: Any) -> None:
    state = _fresh()
    sbpflow.load(state, _saved(tmp_path))
    assert state["w"].tolist() == [float(i) for i in range(10)] and state["step"] == 3


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/rank-00001.safetensors", "..", ".", "",
                                  "sub\\rank-00001.safetensors", "C:rank-00001.safetensors"])
def test_an_index_naming_a_file_outside_is_refused(tmp_path: Any, name: str) -> None:
    path = _saved(tmp_path)
    shard = os.path.join(path, "rank-00001.safetensors")
    # the file the crafted index points at exists and matches the recorded length and SHA-256
    target = os.path.normpath(os.path.join(path, name)) if name not in ("", ".", "..") else None
    if target is not None and "\\" not in name and ":" not in name:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy(shard, target)
    _rename_shard(path, name)
    state = _fresh()
    with pytest.raises(CheckpointError, match=f"names the shard file {re.escape(repr(name))}, which is not a plain"):
        sbpflow.load(state, path)
    assert not state["w"].numpy().any() and state["step"] == 0


def test_an_absolute_file_name_is_refused(tmp_path: Any) -> None:
    path = _saved(tmp_path)
    outside = str(tmp_path / "outside.safetensors")
    shutil.copy(os.path.join(path, "rank-00001.safetensors"), outside)
    _rename_shard(path, outside)
    with pytest.raises(CheckpointError, match="which is not a plain file name inside the checkpoint folder"):
        sbpflow.load(_fresh(), path)


def test_a_symlink_out_of_the_folder_is_refused(tmp_path: Any) -> None:
    path = _saved(tmp_path)
    shard = os.path.join(path, "rank-00001.safetensors")
    outside = str(tmp_path / "outside.safetensors")
    shutil.move(shard, outside)
    os.symlink(outside, shard)  # same bytes, same hash: only where it lives is wrong
    state = _fresh()
    with pytest.raises(CheckpointError, match=r"rank-00001.safetensors resolves to .*outside.safetensors, outside "
                                              r"the checkpoint folder"):
        sbpflow.load(state, path)
    assert not state["w"].numpy().any()


def test_a_symlink_inside_the_folder_is_read(tmp_path: Any) -> None:
    path = _saved(tmp_path)
    shard = os.path.join(path, "rank-00001.safetensors")
    os.rename(shard, os.path.join(path, "kept.bin"))
    os.symlink("kept.bin", shard)
    state = _fresh()
    sbpflow.load(state, path)
    assert state["w"].tolist()[5:] == [5.0, 6.0, 7.0, 8.0, 9.0]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_shard_is_named_and_nothing_is_loaded(tmp_path: Any, damage: str) -> None:
    path = _saved(tmp_path)
    shard = os.path.join(path, "rank-00001.safetensors")
    with open(shard, "rb") as f:
        data = bytearray(f.read())
    if damage == "truncate":
        data = data[:-4]
    else:
        data[len(data) // 2 + 20] ^= 0x01  # one bit, in the tensor bytes
    with open(shard, "wb") as f:
        f.write(bytes(data))
    state = _fresh()
    what = "truncated" if damage == "truncate" else "corrupt"
    with pytest.raises(CheckpointError, match=f"rank-00001.safetensors is {what}"):
        sbpflow.load(state, path)
    assert not state["w"].numpy().any() and state["step"] == 0
