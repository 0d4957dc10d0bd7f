"""OneFlow's documentation habits on real processes: a script written as OneFlow's docs write them (only the
import and "cuda" changed) under ``sbpflow launch -n 2``, and a local model wrapped in DistributedDataParallel
on 2 processes against one process training on the whole batch."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import torch
from procrun import run_command, run_ranks

SCRIPT = textwrap.dedent("""
    import sbpflow as flow
    from sbpflow import nn

    rank = flow.env.get_rank()
    placement = flow.placement(type="cpu", ranks=[0, 1])
    x = flow.randn(4, 5, placement=placement, sbp=flow.sbp.split(dim=0))
    local = x.to_local()
    print(f"rank {rank}: local {tuple(local.shape)} of {tuple(x.shape)} on {flow.placement.all('cpu')}")
    w = flow.randn(5, 8, placement=placement, sbp=flow.sbp.broadcast())
    y = flow.matmul(x, w)
    assert y.sbp == (flow.sbp.split(0),), y.sbp
    full = x.numpy() @ w.numpy()
    assert abs(y.numpy() - full).max() < 1e-5
    lonely = flow.ones(3, placement=flow.placement("cpu", [0]), sbp=flow.sbp.broadcast)
    print(f"rank {rank}: outside shard {tuple(lonely.to_local().shape)}")  # rank 1 is outside: an empty tensor
    tree = flow.utils.global_view.to_global({"a": flow.Tensor([[1, 2]])}, placement=placement,
                                            sbp=flow.sbp.split(0), check_meta=False)
    print(f"rank {rank}: global_view {tuple(tree['a'].shape)}")
""")


def test_a_oneflow_style_script_runs_under_launch(tmp_path: object) -> None:
    path = f"{tmp_path}/oneflow_style.py"
    with open(path, "w") as f:
        f.write(SCRIPT)
    result = run_command([sys.executable, "-m", "sbpflow.cli", "launch", "-n", "2", path], timeout=120)
    assert result.returncode == 0, result.report()
    out = result.stdout  # the two processes' lines may interleave
    for rank in (0, 1):
        assert f"rank {rank}: local (2, 5) of (4, 5) on cpu:[0, 1]" in out, out
        assert f"rank {rank}: global_view (2, 2)" in out
    assert "rank 0: outside shard (3,)" in out and "rank 1: outside shard (0,)" in out


def ddp_train(steps: int) -> list[list[float]]:
    """A local model under DistributedDataParallel, each process training on its half of every batch."""
    import sbpflow as flow
    from sbpflow import nn

    rank = flow.env.get_rank()
    flow.manual_seed(rank)  # different starts: DDP must give every process process 0's
    model = flow.nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
    opt = flow.optim.SGD(model.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        loss = nn.CrossEntropyLoss()(model(flow.tensor(x[mine])), flow.tensor(y[mine]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.numpy().tolist() for p in model.parameters()]


def test_ddp_on_two_processes_equals_one_process_on_the_whole_batch() -> None:
    per_rank = run_ranks(ddp_train, 2, args=(3,), timeout=120)
    assert per_rank[0] == per_rank[1]  # every process holds the same parameters
    import sbpflow as flow
    from sbpflow import nn

    flow.manual_seed(0)  # process 0's start
    model = nn.Linear(6, 3)
    twin = torch.nn.Linear(6, 3)
    twin.load_state_dict({k: torch.as_tensor(v.numpy()) for k, v in model.state_dict().items()})
    opt = torch.optim.SGD(twin.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()  # the mean of two halves' means
        opt.step()
    for ours, theirs in zip(per_rank[0], twin.parameters(), strict=True):
        np.testing.assert_allclose(np.array(ours), theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
