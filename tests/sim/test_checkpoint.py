"""Sharded checkpoints on virtual ranks: resharding on load, each element written once, atomic saves, clear errors.

Every case compares logical values against the numbers that were saved
(NumPy), and the layout cases run every pair of a set of source and target
layouts on uneven shapes (5, 7), 2-D meshes and partial values included.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow.checkpoint import _save, read_index
from sbpflow.checkpoint._fill import target_shards
from sbpflow.comm import record
from sbpflow.errors import CheckpointError

P1 = sbpflow.placement("cpu", [0])
P2 = sbpflow.placement("cpu", [0, 1])
P3 = sbpflow.placement("cpu", [0, 1, 2])
P22 = sbpflow.placement("cpu", [[0, 1], [2, 3]])
P4 = sbpflow.placement("cpu", [0, 1, 2, 3])
P_LATE = sbpflow.placement("cpu", [2, 3])  # a pipeline stage that does not hold rank 0

LAYOUTS = [
    (P1, (S.broadcast,)),
    (P2, (S.split(0),)),
    (P3, (S.split(1),)),
    (P2, (S.broadcast,)),
    (P2, (S.partial_sum,)),
    (P22, (S.split(0), S.split(1))),
    (P22, (S.broadcast, S.split(0))),
    (P22, (S.partial_sum, S.split(1))),
    (P4, (S.split(0),)),
    (P_LATE, (S.split(1),)),
]
VALUE = np.arange(35, dtype=np.float32).reshape(5, 7) / 7


def _layout_id(layout: tuple[Any, Any]) -> str:
    placement, nd = layout
    return f"{placement.hierarchy}-{'.'.join(str(s) for s in nd)}"


def _global(value: np.ndarray, placement: Any, nd: Any) -> sbpflow.Tensor:
    """``value`` as a global tensor; on a partial axis of n ranks each rank holds value / n of its box."""
    from sbpflow._layout import shard_box

    if not any(isinstance(s, S.Partial) for s in nd):
        return sbpflow.tensor(value, placement=placement, sbp=nd)
    parts = np.prod([n for n, s in zip(placement.hierarchy, nd, strict=True) if isinstance(s, S.Partial)])
    full = torch.from_numpy(value) / float(parts)
    shards = {r: full[tuple(slice(a, b) for a, b in shard_box(value.shape, placement, tuple(nd), r))].clone()
              for r in placement.flat_ranks}
    return sbpflow.Tensor._from_shards(value.shape, torch.float32, placement, tuple(nd), shards)


@pytest.mark.parametrize("src", LAYOUTS, ids=_layout_id)
def test_every_layout_pair_reshards(tmp_path: Any, src: Any) -> None:
    path = str(tmp_path / "ckpt")
    saved = _global(VALUE, *src)
    np.testing.assert_allclose(saved.numpy(), VALUE, rtol=1e-6)
    sbpflow.save({"x": saved}, path)
    entry = read_index(path).entries["x"]
    volumes = [np.prod([b - a for a, b in rec.box]) for rec in entry.boxes]  # type: ignore[union-attr]
    assert sum(volumes) == VALUE.size  # each element once
    for placement, nd in LAYOUTS:
        target = sbpflow.zeros(5, 7, placement=placement, sbp=nd)
        report = sbpflow.load({"x": target}, path)
        np.testing.assert_allclose(target.numpy(), VALUE, rtol=1e-6, err_msg=f"{_layout_id((placement, nd))}")
        want = sum(t.numel() for r, t in target.local_tensors().items() if not _zero_piece(placement, nd, r)) * 4
        assert report.bytes_read == want  # only the parts of the boxes each shard holds


def _zero_piece(placement: Any, nd: Any, rank: int) -> bool:
    coords = placement.coords(rank)
    return any(isinstance(s, S.Partial) and c != 0 for s, c in zip(nd, coords, strict=True))


def test_partial_is_reduced_once_and_broadcast_written_once(tmp_path: Any) -> None:
    psum = _global(VALUE, P22, (S.partial_sum, S.split(1)))
    bcast = sbpflow.tensor(VALUE, placement=P22, sbp=[S.broadcast, S.broadcast])
    with record() as log:
        sbpflow.save({"p": psum, "b": bcast}, str(tmp_path / "c"))
    assert [e.kind for e in log.events] == ["all_reduce", "all_reduce"]  # P -> B on axis 0, per column group
    index = read_index(str(tmp_path / "c"))
    # p's columns went to ranks 0 and 1 (first holders), so the least loaded holder of b is rank 2
    assert [r.file for r in index.entries["b"].boxes] == ["rank-00002.safetensors"]  # type: ignore[union-attr]
    p_boxes = index.entries["p"].boxes  # type: ignore[union-attr]
    assert [(r.box, r.file) for r in p_boxes] == [(((0, 5), (0, 4)), "rank-00000.safetensors"),
                                                 (((0, 5), (4, 7)), "rank-00001.safetensors")]
    assert index.entries["p"].sbp == ("P(sum)", "S(1)")  # type: ignore[union-attr]
    assert sorted(os.listdir(tmp_path / "c")) == ["index.json", "rank-00000.safetensors", "rank-00001.safetensors",
                                                  "rank-00002.safetensors"]


def test_nested_state_scalars_and_local_tensors(tmp_path: Any) -> None:
    state = {"model": {"w": sbpflow.tensor(VALUE, placement=P2, sbp=S.split(0)), "b": sbpflow.tensor(VALUE[0])},
             "optim": {"state": {0: {"step": 3.0, "m": torch.arange(4.0)}},
                       "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "name": "decay", "nesterov": False,
                                         "foreach": None, "params": [0]}]},
             "step": 7, "int64": torch.arange(3), "half": torch.ones(2, dtype=torch.bfloat16),
             "scalar": torch.tensor(2.5)}
    sbpflow.save(state, str(tmp_path / "c"))
    fresh = {"model": {"w": sbpflow.zeros(5, 7, placement=P22, sbp=[S.broadcast, S.split(1)]), "b": sbpflow.zeros(7)},
             "optim": {"state": {0: {"step": 0.0, "m": torch.zeros(4)}},
                       "param_groups": [{"betas": (0.0, 0.0), "lr": 0.0, "name": "", "nesterov": True,
                                         "foreach": True, "params": [5]}]},
             "step": 0, "int64": torch.zeros(3, dtype=torch.int64), "half": torch.zeros(2, dtype=torch.bfloat16),
             "scalar": torch.tensor(0.0)}
    m = fresh["optim"]["state"][0]["m"]  # type: ignore[index]
    report = sbpflow.load(fresh, str(tmp_path / "c"))
    assert m is fresh["optim"]["state"][0]["m"] and m.tolist() == [0.0, 1.0, 2.0, 3.0]  # type: ignore[index]
    assert fresh["optim"]["param_groups"] == state["optim"]["param_groups"]  # type: ignore[index]
    assert isinstance(fresh["optim"]["param_groups"][0]["betas"], tuple)  # type: ignore[index]
    assert fresh["step"] == 7 and isinstance(fresh["step"], int)
    assert fresh["optim"]["state"][0]["step"] == 3.0  # type: ignore[index]
    np.testing.assert_array_equal(fresh["model"]["w"].numpy(), VALUE)  # type: ignore[index]
    np.testing.assert_array_equal(fresh["model"]["b"].numpy(), VALUE[0])  # type: ignore[index]
    assert fresh["int64"].tolist() == [0, 1, 2] and fresh["scalar"].item() == 2.5  # type: ignore[attr-defined]
    assert (report.tensors, report.scalars) == (6, 9)


def test_optimizer_and_model_restore_through_the_state_dict_pattern(tmp_path: Any) -> None:
    model = _tiny_model(P2, "col", seed=0)  # weight S(0) on 2 ranks
    opt = sbpflow.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        _step(model, opt)
    sbpflow.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}, str(tmp_path / "c"))
    fresh = _tiny_model(P3, "row", seed=5)  # weight S(1) on 3 ranks, another init
    fresh_opt = sbpflow.optim.AdamW(fresh.parameters(), lr=0.5)
    st = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "step": 0}
    assert len(st["optim"]["state"]) == 2  # a fresh optimizer lists its state (zeros)
    sbpflow.load(st, str(tmp_path / "c"))
    fresh.load_state_dict(st["model"])
    fresh_opt.load_state_dict(st["optim"])
    assert st["step"] == 2 and fresh_opt.param_groups[0]["lr"] == 0.1
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(opt.state[a][key].numpy(), fresh_opt.state[b][key].numpy())
            assert fresh_opt.state[b][key].sbp == b.sbp  # the fresh optimizer's layout, not the saved one
        assert opt.state[a]["step"] == fresh_opt.state[b]["step"] == 2.0
    assert _step(model, opt) == pytest.approx(_step(fresh, fresh_opt), rel=1e-6)


def _tiny_model(placement: Any, style: str, seed: int) -> sbpflow.nn.Module:
    from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, apply_plan

    sbpflow.manual_seed(seed)
    model = sbpflow.nn.Linear(6, 5)
    apply_plan(model, {"": ColwiseParallel() if style == "col" else RowwiseParallel()}, placement)
    return model


def _step(model: sbpflow.nn.Module, opt: Any) -> float:
    weight = next(iter(model.parameters()))
    x = sbpflow.tensor(np.linspace(-1, 1, 18, dtype=np.float32).reshape(3, 6), placement=weight.placement,
                       sbp=S.broadcast)
    loss = (model(x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


# ----------------------------------------------------------------------------- errors and integrity


def _saved(tmp_path: Any) -> str:
    path = str(tmp_path / "c")
    sbpflow.save({"w": sbpflow.tensor(VALUE, placement=P2, sbp=S.split(1)), "step": 1}, path)
    return path


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_truncated_corrupt_and_missing_files_are_clear_errors(tmp_path: Any) -> None:
    path = _saved(tmp_path)
    shard = os.path.join(path, "rank-00001.safetensors")
    with open(shard, "rb") as f:
        data = f.read()
    fresh = {"w": sbpflow.zeros(5, 7), "step": 0}
    with open(shard, "wb") as f:
        f.write(data[:-9])
    with pytest.raises(CheckpointError, match=r"rank-00001.safetensors is truncated: \d+ bytes, but the index"):
        sbpflow.load(fresh, path)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    with open(shard, "wb") as f:
        f.write(bytes(flipped))
    with pytest.raises(CheckpointError, match="is corrupt: its SHA-256 differs"):
        sbpflow.load(fresh, path)
    sbpflow.load(fresh, path, verify=False)  # length only: the flipped byte goes unnoticed, as asked
    os.remove(shard)
    with pytest.raises(CheckpointError, match="rank-00001.safetensors is missing"):
        sbpflow.load(fresh, path)
    with open(os.path.join(path, "index.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="index.json is damaged or not an sbpflow index"):
        sbpflow.load(fresh, path)


def test_a_state_that_does_not_fit_the_checkpoint_names_the_entry(tmp_path: Any) -> None:
    path = _saved(tmp_path)
    wrong_shape = {"w": sbpflow.zeros(7, 5, placement=P2, sbp=S.split(0)), "step": 0}
    with pytest.raises(CheckpointError, match=r"'w' has shape \[7, 5\] float32 on cpu:\[0, 1\] sbp \(S\(0\)\) in the "
                                              r"state to fill, but the checkpoint holds 'w' saved with shape \[5, 7\] "
                                              r"float32 on cpu:\[0, 1\] sbp \(S\(1\)\)"):
        sbpflow.load(wrong_shape, path)
    with pytest.raises(CheckpointError, match=r"no entry 'bias' \(for local shape \[3\] float32\); it holds 'w', "):
        sbpflow.load({"bias": sbpflow.zeros(3)}, path)
    with pytest.raises(CheckpointError, match=r"'step' is a torch tensor of shape \[\] int64 in the state to fill, "
                                              "but the checkpoint holds the scalar 1"):
        sbpflow.load({"step": torch.tensor(0)}, path)
    with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere: it does not exist"):
        sbpflow.load({}, str(tmp_path / "nowhere"))


def test_states_that_cannot_be_saved_say_why(tmp_path: Any) -> None:
    with pytest.raises(CheckpointError, match=r"'opt/extra' is a ndarray"):
        sbpflow.save({"opt": {"extra": np.zeros(2)}}, str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match="are both named '0'"):
        sbpflow.save({0: 1, "0": 2}, str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match="must be a dict or a list at its root"):
        sbpflow.save(sbpflow.zeros(2), str(tmp_path / "c"))
    os.makedirs(tmp_path / "notes")
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refuses to replace .*notes: it is a directory that is not empty"):
        sbpflow.save({"step": 1}, str(tmp_path / "notes"))
    with pytest.raises(CheckpointError, match="format=...\\) is one of \\('sbpflow', 'torch'\\), but got 'dcp'"):
        sbpflow.save({"step": 1}, str(tmp_path / "c"), format="dcp")


def test_a_save_that_fails_mid_write_leaves_the_last_checkpoint(tmp_path: Any, monkeypatch: Any) -> None:
    path = _saved(tmp_path)
    before = _text(os.path.join(path, "index.json"))

    def fail_half_way(f: Any, data: bytes) -> None:
        f.write(data[: len(data) // 2])
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(_save, "write_chunks", fail_half_way)
    with pytest.raises(OSError, match="disk full"):
        sbpflow.save({"w": sbpflow.tensor(VALUE * 2, placement=P2, sbp=S.split(1)), "step": 2}, path)
    monkeypatch.undo()
    assert os.path.isdir(path + ".partial")  # the unfinished save, never renamed into place
    assert _text(os.path.join(path, "index.json")) == before
    fresh = {"w": sbpflow.zeros(5, 7), "step": 0}
    sbpflow.load(fresh, path)
    assert fresh["step"] == 1
    np.testing.assert_array_equal(fresh["w"].numpy(), VALUE)
    sbpflow.save({"w": sbpflow.tensor(VALUE * 2, placement=P2, sbp=S.split(1)), "step": 2}, path)
    assert not os.path.exists(path + ".partial") and not os.path.exists(path + ".old")
    sbpflow.load(fresh, path)
    assert fresh["step"] == 2


def test_an_interrupted_swap_points_to_the_previous_checkpoint(tmp_path: Any) -> None:
    path = _saved(tmp_path)
    os.rename(path, path + ".old")  # a crash between the two renames of commit()
    with pytest.raises(CheckpointError, match=r"previous checkpoint is complete at .*c\.old"):
        sbpflow.load({"step": 0}, path)


def test_index_records_layout_lengths_and_hashes(tmp_path: Any) -> None:
    path = _saved(tmp_path)
    body = json.loads(_text(os.path.join(path, "index.json")))
    entry = body["entries"]["w"]
    assert entry["shape"] == [5, 7] and entry["dtype"] == "float32" and entry["sbp"] == ["S(1)"]
    assert entry["placement"] == {"type": "cpu", "ranks": [0, 1]}
    assert entry["boxes"] == [{"box": [[0, 5], [0, 4]], "file": "rank-00000.safetensors"},
                              {"box": [[0, 5], [4, 7]], "file": "rank-00001.safetensors"}]
    for name, file in body["files"].items():
        assert os.path.getsize(os.path.join(path, name)) == file["bytes"]
    assert body["entries"]["step"] == {"kind": "scalar", "path": ["step"], "value": 1}


# ----------------------------------------------------------------------------- torch files


def test_torch_format_is_one_consolidated_file(tmp_path: Any) -> None:
    w = sbpflow.tensor(VALUE, placement=P22, sbp=[S.split(0), S.split(1)])
    path = str(tmp_path / "model.pt")
    sbpflow.save({"model": {"w": w}, "step": 3, "betas": (0.9, 0.95)}, path, format="torch")
    plain = torch.load(path, weights_only=True)
    assert plain["step"] == 3 and plain["betas"] == (0.9, 0.95)
    np.testing.assert_array_equal(plain["model"]["w"].numpy(), VALUE)
    fresh = {"model": {"w": sbpflow.zeros(5, 7, placement=P3, sbp=S.split(0))}, "step": 0, "betas": (0.0, 0.0)}
    sbpflow.load(fresh, path)
    np.testing.assert_array_equal(fresh["model"]["w"].numpy(), VALUE)
    assert fresh["step"] == 3 and fresh["betas"] == (0.9, 0.95)


def test_load_reads_a_plain_torch_state_dict(tmp_path: Any) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    torch.save(ref.state_dict(), tmp_path / "ref.pt")
    from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, apply_plan

    ours = sbpflow.nn.Sequential(sbpflow.nn.Linear(6, 8), sbpflow.nn.ReLU(), sbpflow.nn.Linear(8, 3))
    apply_plan(ours, {"0": ColwiseParallel(), "2": RowwiseParallel()}, P2)
    st = ours.state_dict()
    report = sbpflow.load(st, str(tmp_path / "ref.pt"))
    ours.load_state_dict(st)
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)
    got = ours(sbpflow.tensor(x, placement=P2, sbp=S.broadcast)).numpy()
    np.testing.assert_allclose(got, ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert report.tensors == 4
    from safetensors.torch import save_file

    save_file({**ref.state_dict(), "scale": torch.tensor(1.5)}, str(tmp_path / "ref.safetensors"))
    st = {name: sbpflow.zeros_like(t) for name, t in ours.state_dict().items()}
    held = sum(s.data.numel() * 4 for t in st.values() for s in target_shards(t))  # the row-parallel bias: twice
    st["scale"] = torch.tensor(0.0)
    report = sbpflow.load(st, str(tmp_path / "ref.safetensors"))  # Hugging Face style weights, read by slices
    assert st["scale"].item() == 1.5 and report.bytes_read == 4 + held
    np.testing.assert_array_equal(st["0.weight"].numpy(), ref.state_dict()["0.weight"].numpy())
    with pytest.raises(CheckpointError, match=r"'0.weight' has shape \[8, 6\] float32 .* but the torch file holds "
                                              r"shape \[3, 8\]"):
        sbpflow.load({"0.weight": sbpflow.zeros(8, 6, placement=P2, sbp=S.split(0)),}, _renamed(tmp_path, ref))


def _renamed(tmp_path: Any, ref: torch.nn.Module) -> str:
    torch.save({"0.weight": ref.state_dict()["2.weight"]}, tmp_path / "wrong.pt")
    return str(tmp_path / "wrong.pt")


def test_a_failed_load_changes_nothing(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    sbpflow.save({"a": sbpflow.tensor(VALUE, placement=P2, sbp=S.split(0)), "b": torch.ones(3), "step": 4}, path)
    a, b = sbpflow.zeros(5, 7, placement=P2, sbp=S.split(0)), torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"'b' has a torch tensor of shape \[4\]"):
        sbpflow.load({"a": a, "b": torch.zeros(4), "step": 0}, path)  # the shapes are checked first
    os.remove(os.path.join(path, "rank-00001.safetensors"))  # holds a's last rows; b (local) is in rank 0's file
    state = {"b": b, "a": a, "step": 0}
    with pytest.raises(CheckpointError, match="rank-00001.safetensors is missing"):
        sbpflow.load(state, path)  # every file is checked before b is filled
    assert not a.numpy().any() and not b.any() and state["step"] == 0


class _ShardedStateAdamW(sbpflow.optim.AdamW):
    """AdamW whose state is split on dim 0 while the parameters are replicated (ZeRO-1's layout)."""

    def state_sbp(self, param: sbpflow.Tensor) -> Any:
        return (S.split(0),)


def test_sharded_optimizer_state_loads_into_a_replicated_one(tmp_path: Any) -> None:
    from sbpflow.nn.parallel import Replicate, apply_plan

    def model_and_opt(kind: type, seed: int) -> tuple[sbpflow.nn.Module, Any]:
        sbpflow.manual_seed(seed)
        model = apply_plan(sbpflow.nn.Linear(6, 5), {"": Replicate()}, P2)
        return model, kind(model.parameters(), lr=0.1)

    model, opt = model_and_opt(_ShardedStateAdamW, 0)
    fresh_state = opt.state_dict()["state"][0]["exp_avg"]
    assert fresh_state.sbp == (S.split(0),)  # a fresh optimizer's state in its own (sharded) layout
    _step(model, opt)
    sbpflow.save({"model": model.state_dict(), "optim": opt.state_dict()}, str(tmp_path / "c"))
    plain_model, plain = model_and_opt(sbpflow.optim.AdamW, 3)
    st = {"model": plain_model.state_dict(), "optim": plain.state_dict()}
    sbpflow.load(st, str(tmp_path / "c"))
    plain_model.load_state_dict(st["model"])
    plain.load_state_dict(st["optim"])
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert plain.state[b]["exp_avg"].sbp == (S.broadcast,)
        np.testing.assert_array_equal(opt.state[a]["exp_avg_sq"].numpy(), plain.state[b]["exp_avg_sq"].numpy())
    assert _step(model, opt) == pytest.approx(_step(plain_model, plain), rel=1e-6)
