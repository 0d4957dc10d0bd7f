"""Placed batches on virtual ranks: global tensors equal to torch's batch, each process reads only its ranks' rows,
nn.Graph fed by a loader (Graph.iterate) trains exactly as hand-fed batches, resumes bit-exactly through
sbpflow.save/load, and its timeline shows the loader's lane loading while the step computes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.comm import SimulatedBackend, set_backend
from sbpflow.errors import SbpflowError
from sbpflow.runtime.trace import load as load_trace
from sbpflow.utils.data import DataLoader, Dataset
from sbpflow.utils.data._layout import row_ranges

IN, OUT = 6, 3


class Rows(Dataset):
    """Sample i: (x_i, y_i) of fixed random data; records the indices read (optionally sleeping per read)."""

    def __init__(self, n: int, delay: float = 0.0, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)
        self.delay = delay
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        self.reads.append(i)
        return self.x[i], self.y[i]


class Owning(SimulatedBackend):
    """Virtual ranks as one process of a larger job sees them: it owns only ``mine``."""

    def __init__(self, mine: set[int]) -> None:
        super().__init__()
        self.mine = mine

    def owns(self, rank: int) -> bool:
        return rank in self.mine


MESH = [[0, 1], [2, 3]]
LAYOUTS = [([0, 1], (S.split(0),), 8), ([0, 1, 2], (S.split(0),), 7), ([0, 1], (S.broadcast,), 5),
           (MESH, (S.split(0), S.broadcast), 6), (MESH, (S.split(0), S.split(0)), 9), ([0, 1], (S.split(1),), 4)]


@pytest.mark.parametrize(("mesh", "sbp", "n"), LAYOUTS)
def test_placed_batches_equal_torch_and_each_rank_reads_only_its_rows(mesh: Any, sbp: Any, n: int) -> None:
    p = sbpflow.placement("cpu", mesh)
    ds = Rows(n)
    loader = DataLoader(ds, batch_size=n, shuffle=True, seed=4, placement=p, sbp=sbp, prefetch=0)
    x, y = next(iter(loader))
    order = loader.order(0)
    assert (x.placement, x.sbp, tuple(x.shape)) == (p, sbp, (n, IN))
    np.testing.assert_array_equal(x.numpy(), ds.x[order].numpy())
    np.testing.assert_array_equal(y.numpy(), ds.y[order].numpy())
    assert sorted(ds.reads) == list(range(n))  # one process owning every rank: each row read once, even under B
    for rank in p.flat_ranks:  # a process owning one rank reads exactly that rank's rows
        ds.reads.clear()
        previous = set_backend(Owning({rank}))
        try:
            (xr, _), = [loader.load(0, 0)]
        finally:
            set_backend(previous)
        lo, hi = (row_ranges(n, [(p, sbp, [rank])]) or [(0, 0)])[0]
        assert ds.reads == order[lo:hi].tolist()
        np.testing.assert_array_equal(xr._shards[rank].numpy(), x._shards[rank].numpy())


def test_a_process_reads_the_rows_of_its_ranks_together() -> None:
    """Ranks 2 and 3 of a 2x2 mesh under (S(0), S(0)) hold rows 4..7 of 8: one process owning both reads them."""
    p = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    ds = Rows(8)
    loader = DataLoader(ds, batch_size=8, placement=p, sbp=(S.split(0), S.split(0)), prefetch=0)
    previous = set_backend(Owning({2, 3}))
    try:
        x, _ = loader.load(0, 0)
    finally:
        set_backend(previous)
    assert ds.reads == [4, 5, 6, 7]
    assert {r: t[:, 0].tolist() for r, t in x._shards.items()} == {2: ds.x[4:6, 0].tolist(), 3: ds.x[6:8, 0].tolist()}


def test_fields_on_pipeline_stages_read_their_stages_rows() -> None:
    """x on stage 0 (ranks 0, 1), y on stage 1 (ranks 2, 3), both S(0): a process of rank 3 reads rows 3.."""
    first, last = sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [2, 3])
    ds = Rows(6)
    loader = DataLoader(ds, 6, placement=[first, last], sbp=[S.split(0), None], prefetch=0)
    x, y = next(iter(loader))
    assert (x.placement, y.placement, y.sbp) == (first, last, (S.split(0),))
    np.testing.assert_array_equal(y.numpy(), ds.y.numpy())
    for mine, rows in (({3}, [3, 4, 5]), ({0}, [0, 1, 2]), ({0, 2}, [0, 1, 2])):
        ds.reads.clear()
        previous = set_backend(Owning(mine))
        try:
            loader.load(0, 0)
        finally:
            set_backend(previous)
        assert ds.reads == rows
    with pytest.raises(SbpflowError, match="sbp must be a list of 2"):
        DataLoader(ds, 6, placement=[first, last], sbp=S.split(0))


def test_dict_samples_become_dicts_of_global_tensors() -> None:
    class Named(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"ids": torch.full((4,), i), "label": i % 2}

    p = sbpflow.placement("cpu", [0, 1])
    batch = next(iter(DataLoader(Named(), 6, placement=p, sbp=S.split(0))))
    assert sorted(batch) == ["ids", "label"]
    assert batch["ids"].numpy()[:, 0].tolist() == list(range(6)) and batch["label"].numpy().tolist() == [0, 1] * 3
    assert batch["ids"].sbp == (S.split(0),) and batch["label"]._shards[1].tolist() == [1, 0, 1]


def test_partial_sbp_and_bad_split_are_refused() -> None:
    p = sbpflow.placement("cpu", [0, 1])
    with pytest.raises(SbpflowError, match="split or broadcast .* but the sbp has P\\(sum\\)"):
        DataLoader(Rows(4), 2, placement=p, sbp=S.partial_sum)
    with pytest.raises(SbpflowError, match="shape \\[2, 6\\], but the sbp splits dim 2"):
        next(iter(DataLoader(Rows(4), 2, placement=p, sbp=S.split(2))))


# -- nn.Graph fed by a loader ----------------------------------------------------------------------


def make_step(p: Any, width: int = 16) -> tuple[nn.Graph, nn.Module]:
    sbpflow.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, OUT)).to_global(p, S.broadcast)
    opt = sbpflow.optim.Adam(model.parameters(), lr=1e-2)

    class Step(nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)

        def build(self, x: Any, y: Any) -> Any:
            loss = (self.model(x) - y).square().mean()
            loss.backward()
            return loss

    return Step(), model


def params(model: nn.Module) -> list[np.ndarray]:
    return [t.numpy() for t in model.parameters()]


def test_graph_iterate_trains_exactly_as_hand_fed_batches(one_torch_thread: None) -> None:
    p = sbpflow.placement("cpu", [0, 1])
    ds = Rows(20)
    graph, model = make_step(p)
    loader = DataLoader(ds, 4, shuffle=True, seed=2, placement=p, sbp=S.split(0), prefetch=2)
    losses = []
    for loss in graph.iterate(loader, steps=8):  # 5 batches per epoch: crosses an epoch
        losses.append(float(loss.numpy()))
        assert loader.stats.loaded <= loader.stats.taken + 2  # the prefetch bound, from the source's counters
        if len(losses) == 3:  # a slow step: the source fills both registers, then waits
            deadline = time.monotonic() + 5
            while loader.stats.loaded < 5 and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)
            assert (loader.stats.taken, loader.stats.loaded) == (3, 5)
    assert loader.stats.peak_ahead == 2 and loader.stats.taken == 8
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["index"] == 3

    by_hand, model2 = make_step(p)
    expected = []
    for step in range(8):
        epoch, index = divmod(step, 5)
        rows = loader.order(epoch)[index * 4:(index + 1) * 4]
        x = sbpflow.tensor(ds.x[rows], placement=p, sbp=S.split(0))
        y = sbpflow.tensor(ds.y[rows], placement=p, sbp=S.split(0))
        expected.append(float(by_hand(x, y).numpy()))
    assert losses == expected
    for got, want in zip(params(model), params(model2), strict=True):
        np.testing.assert_array_equal(got, want)


def test_resume_mid_epoch_through_a_checkpoint_is_bit_exact(tmp_path: Path, one_torch_thread: None) -> None:
    p = sbpflow.placement("cpu", [0, 1])
    ds = Rows(14)
    graph, model = make_step(p)
    loader = DataLoader(ds, 4, True, seed=9, drop_last=True, placement=p)
    straight = [float(loss.numpy()) for loss in graph.iterate(loader, steps=7)]
    final = params(model)

    graph, model = make_step(p)
    loader = DataLoader(ds, 4, True, seed=9, drop_last=True, placement=p)
    first = [float(loss.numpy()) for loss in graph.iterate(loader, steps=2)]  # stops mid-epoch 0 (3 per epoch)
    opt = graph._optimizers[0].optimizer
    sbpflow.save({"model": model.state_dict(), "optim": opt.state_dict(), "data": loader.state_dict()},
                 tmp_path / "ckpt")

    graph2, model2 = make_step(p)  # a fresh run: other initial weights would also be overwritten
    opt2 = graph2._optimizers[0].optimizer
    opt2.init_state()
    loader2 = DataLoader(ds, 4, True, seed=9, drop_last=True, placement=p)
    state = {"model": model2.state_dict(), "optim": opt2.state_dict(), "data": loader2.state_dict()}
    sbpflow.load(state, tmp_path / "ckpt")
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    loader2.load_state_dict(state["data"])
    assert (loader2.epoch, loader2.index) == (0, 2)
    rest = [float(loss.numpy()) for loss in graph2.iterate(loader2, steps=5)]
    assert first + rest == straight
    for got, want in zip(params(model2), final, strict=True):
        np.testing.assert_array_equal(got, want)


def spans(path: Path) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(loading spans, compute spans) of a timeline, as (start, end) in µs."""
    events = load_trace(path)
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    loads, computes = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        lane = lanes[e["tid"]]
        interval = (e["ts"], e["ts"] + e["dur"])
        if "/source:" in lane:
            loads.append(interval)
        elif lane.endswith("/compute") and e["cat"] not in ("input", "variable"):
            computes.append(interval)
    return loads, computes


def traced_run(path: Path, prefetch: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]], set[str]]:
    p = sbpflow.placement("cpu", [0, 1])
    graph, _ = make_step(p, width=384)  # a step of several ms: kernels that release the interpreter
    slow = Rows(64, delay=0.004)  # 4 ms a sample (a read that waits, as on a file or a network), 32 ms a batch
    losses = list(graph.iterate(DataLoader(slow, 8, placement=p, prefetch=prefetch, name="train"), steps=6))
    assert len(losses) == 6
    graph._compiled().executor.close()  # closes the timeline file
    loads, computes = spans(path)
    lanes = {e["args"]["name"] for e in load_trace(path) if e.get("name") == "thread_name"}
    return loads, computes, lanes


def test_timeline_shows_the_loader_loading_while_the_step_computes(tmp_path: Path, monkeypatch: Any,
                                                                   one_torch_thread: None) -> None:
    """With prefetch, batch t+1 loads on the loader's lane while step t's actors compute; without, never."""
    monkeypatch.setenv("SBPFLOW_TRACE", str(tmp_path / "prefetch.json"))
    loads, computes, lanes = traced_run(tmp_path / "prefetch.json", prefetch=1)
    assert "cpu/source:train" in lanes and len(loads) == 6 and computes
    busy = [(lo, hi) for lo, hi in loads if any(lo < c0 and c1 < hi for c0, c1 in computes)]
    assert len(busy) >= 3, f"only {len(busy)} of 6 loads overlap a compute span"

    monkeypatch.setenv("SBPFLOW_TRACE", str(tmp_path / "inline.json"))
    loads, computes, _ = traced_run(tmp_path / "inline.json", prefetch=0)
    assert len(loads) == 6
    assert not [c for c in computes if any(lo < c[0] < hi for lo, hi in loads)]  # the caller loads, then computes


def test_pipeline_gpt_fed_by_a_loader_equals_hand_fed(one_torch_thread: None) -> None:
    """dp=2 x pp=2 with 2 micro-batches: ids go to the first stage and targets to the last, from one loader."""
    from sbpflow.demo.train_gpt import build
    from sbpflow.models.gpt import GPTConfig
    from sbpflow.utils.data import TensorDataset

    cfg = GPTConfig(vocab_size=24, block_size=8, n_layer=2, n_head=2, n_embd=16)
    tokens = torch.randint(0, 24, (12, 9), generator=torch.Generator().manual_seed(0))
    ds = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    fed = build(cfg, "dp=2,pp=2", graph=True, micro_batches=2)
    strategy = fed.strategy
    assert strategy is not None
    loader = DataLoader(ds, 4, shuffle=True, seed=1, placement=[strategy.stages[0], strategy.stages[-1]],
                        sbp=[strategy.input_sbp, strategy.input_sbp])
    losses = [float(loss.to_global(placement=strategy.everywhere, sbp=S.broadcast).numpy())
              for loss in fed.graph.iterate(loader, steps=4)]

    by_hand = build(cfg, "dp=2,pp=2", graph=True, micro_batches=2)
    expected = []
    for step in range(4):
        epoch, index = divmod(step, 3)
        rows = loader.order(epoch)[index * 4:(index + 1) * 4]
        expected.append(by_hand.step(ds.tensors[0][rows].numpy(), ds.tensors[1][rows].numpy()))
    assert losses == expected
