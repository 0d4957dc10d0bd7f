"""Cases that run the same way on virtual ranks (one process) and on real processes (one rank each).

Each ``*_job`` function runs every case of its kind and returns plain data:
per case the logical value (``.numpy()``, on every process), the shards this
process owns and the collectives it took part in. The tests call a job once
in the test process (simulated backend: the reference) and once per rank
under :func:`procrun.run_ranks`, and compare.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow._layout import shard_box
from sbpflow.comm import get_backend, record
from sbpflow.sbp import Partial
from sbpflow.tensor import Tensor

B, P, PMAX = S.broadcast, S.partial_sum, S.partial_max
S0, S1 = S.split(0), S.split(1)
MESH = [[0, 1], [2, 3]]

# name: (logical shape, source ranks, source sbp, destination ranks, destination sbp)
BOXING: dict[int, dict[str, tuple[Any, ...]]] = {
    2: {
        "S0->B": ((5, 3), [0, 1], (S0,), [0, 1], (B,)),
        "S0->S1": ((5, 3), [0, 1], (S0,), [0, 1], (S1,)),
        "P->B": ((5, 3), [0, 1], (P,), [0, 1], (B,)),
        "P->S0": ((5, 3), [0, 1], (P,), [0, 1], (S0,)),
        "Pmax->B": ((5, 3), [0, 1], (PMAX,), [0, 1], (B,)),
        "B->S1": ((5, 3), [0, 1], (B,), [0, 1], (S1,)),
        "S0 [0,1] -> B [1]": ((5, 3), [0, 1], (S0,), [1], (B,)),
        "B [0] -> S1 [0,1]": ((4, 5), [0], (B,), [0, 1], (S1,)),
        "P [0,1] -> B [0]": ((5, 3), [0, 1], (P,), [0], (B,)),
        "S0 [0,1] -> S0 [1,0]": ((5, 3), [0, 1], (S0,), [1, 0], (S0,)),
        "B [1] -> B [0]": ((3, 2), [1], (B,), [0], (B,)),
    },
    4: {
        "S0->B": ((7, 5), [0, 1, 2, 3], (S0,), [0, 1, 2, 3], (B,)),
        "P->S1": ((7, 5), [0, 1, 2, 3], (P,), [0, 1, 2, 3], (S1,)),
        "S0->S1": ((7, 5), [0, 1, 2, 3], (S0,), [0, 1, 2, 3], (S1,)),
        "mesh (S0,S1)->(B,B)": ((7, 5), MESH, (S0, S1), MESH, (B, B)),
        "mesh (P,S0)->(B,S0)": ((7, 5), MESH, (P, S0), MESH, (B, S0)),
        "mesh (B,P)->(S1,B)": ((7, 5), MESH, (B, P), MESH, (S1, B)),
        "S0 [1,2] -> B all": ((7, 5), [1, 2], (S0,), [0, 1, 2, 3], (B,)),
        "P [0,1,2] -> B [3]": ((7, 5), [0, 1, 2], (P,), [3], (B,)),
        "B [0] -> B all": ((7, 5), [0], (B,), [0, 1, 2, 3], (B,)),
        "S0 all -> mesh (S1,S0)": ((7, 5), [0, 1, 2, 3], (S0,), [[2, 3], [0, 1]], (S1, S0)),
        "S0 [0,1] -> S1 [2,3]": ((7, 5), [0, 1], (S0,), [2, 3], (S1,)),
    },
}


def base_value(shape: tuple[int, ...]) -> torch.Tensor:
    """A deterministic logical value with distinct entries."""
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 0.37 - 1.5).sin()


def make_input(shape: tuple[int, ...], ranks: Any, nd: tuple[Any, ...]) -> Tensor:
    """The input of a case. Partial axes get a different contribution per rank, so reductions really reduce."""
    placement = sbpflow.placement("cpu", ranks)
    value = base_value(shape)
    if not any(isinstance(s, Partial) for s in nd):
        return sbpflow.tensor(value, placement=placement, sbp=nd)
    shards = {}
    for r in get_backend().owned(placement.flat_ranks):
        # rank r's partial value depends on its coordinates on the partial axes only: along a broadcast
        # axis, ranks must hold the same value
        k = sum((c + 1) * 3**axis for axis, c in enumerate(placement.coords(r)) if isinstance(nd[axis], Partial))
        contribution = value * k + 0.25 * k
        shards[r] = contribution[tuple(slice(a, b) for a, b in shard_box(shape, placement, nd, r))].clone()
    return Tensor._from_shards(shape, torch.float32, placement, nd, shards)


def _outcome(y: Tensor, log: Any) -> dict[str, Any]:
    return {
        "value": y.numpy(),  # outside the record block: it may add collectives of its own
        "shards": {r: t.numpy() for r, t in y.local_tensors().items()},
        "counts": log.counts(),
    }


def boxing_job(world: int) -> dict[str, Any]:
    """Every boxing case for ``world`` ranks; also the input's logical value."""
    out = {}
    for name, (shape, src_ranks, src_sbp, dst_ranks, dst_sbp) in BOXING[world].items():
        x = make_input(shape, src_ranks, src_sbp)
        with record() as log:
            y = x.to_global(sbpflow.placement("cpu", dst_ranks), dst_sbp)
        out[name] = _outcome(y, log) | {"input": x.numpy()}
    return out


# -- ops ---------------------------------------------------------------------------------------


def ops_job(world: int) -> dict[str, Any]:
    """Ops on all ``world`` ranks with uneven splits, and a small data-parallel MLP's backward."""
    p = sbpflow.placement("cpu", list(range(world)))
    out: dict[str, Any] = {}
    a = sbpflow.tensor(base_value((5, 7)), placement=p, sbp=S1)
    b = sbpflow.tensor(base_value((7, 3)) * 2, placement=p, sbp=S0)
    with record() as log:
        c = a @ b  # contraction dim split on both sides: a partial sum, nothing moves
    out["matmul S1 x S0"] = _outcome(c, log) | {"sbp": str(c.sbp)}

    x = sbpflow.tensor(base_value((7, 5)), placement=p, sbp=S0)
    y = sbpflow.tensor(base_value((7, 5)) + 1, placement=p, sbp=S0)
    w = sbpflow.tensor(base_value((5,)), placement=p, sbp=B)
    with record() as log:
        z = (x * y + 1).relu() - w
    out["elementwise S0"] = _outcome(z, log)

    with record() as log:
        s = x.sum(0)  # over the split dim: partial sums per rank
    out["sum over split dim"] = _outcome(s, log) | {"sbp": str(s.sbp)}
    with record() as log:
        s_b = s.to_global(sbp=B)
    out["sum then B"] = _outcome(s_b, log)

    rows = sbpflow.tensor(base_value((5,)) > 0, placement=p, sbp=B)
    with record() as log:
        picked = a[rows]  # S(1) stays: a data-dependent length that each process reads off its own shard
    out["mask rows"] = _outcome(picked, log) | {"sbp": str(picked.sbp)}
    with record() as log:
        top = sbpflow.tensor(base_value((5, 7)), placement=p, sbp=S0).topk(3).values
    out["topk S0"] = _outcome(top, log)

    out["mlp backward"] = _mlp_backward(p)
    out["local to P(sum)"] = _local_to_partial_sum(p)
    out["in-place writes"] = _in_place_writes(p)
    return out


def _in_place_writes(p: sbpflow.Placement) -> dict[str, Any]:
    """x[...] = v, writes through views and -= on split and partial tensors: each rank writes its own shard."""
    def program(x: Any, y: Any) -> None:
        x[1, 1:4] = 7.0
        x[:, 0].fill_(-1.0)
        x.view(-1)[::4].add_(100.0)
        y -= 0.5 * y

    theirs_x, theirs_y = base_value((5, 7)), base_value((5, 7))
    x = sbpflow.tensor(theirs_x, placement=p, sbp=S1)
    y = sbpflow.tensor(theirs_y, placement=p, sbp=P)
    with sbpflow.no_grad():
        program(x, y)
    program(theirs_x, theirs_y)
    return {"x": x.numpy(), "y": y.numpy(), "torch x": theirs_x.numpy(), "torch y": theirs_y.numpy()}


def _local_to_partial_sum(p: sbpflow.Placement) -> dict[str, Any]:
    """Every rank passes the same local [1, 1] onto P(sum): the logical value adds every rank's contribution
    (world x [1, 1]) on virtual ranks and on processes alike; the local gradient of sum() is world x 1."""
    local = sbpflow.tensor([1.0, 1.0], requires_grad=True)
    y = local.to_global(p, P)
    y.sum().backward()
    assert local.grad is not None
    return {"value": y.numpy(), "grad": local.grad.numpy()}


def _mlp_backward(p: sbpflow.Placement) -> dict[str, Any]:
    """Broadcast weights, split data: backward needs exactly one all-reduce per weight (DDP)."""
    x = sbpflow.tensor(base_value((9, 4)), placement=p, sbp=S0)
    w1 = sbpflow.tensor(base_value((4, 6)) * 0.5, placement=p, sbp=B, requires_grad=True)
    w2 = sbpflow.tensor(base_value((6, 2)) * 0.5, placement=p, sbp=B, requires_grad=True)
    with record() as forward:
        loss = (((x @ w1).relu() @ w2) ** 2).sum()
    with record() as backward:
        loss.backward()
    assert w1.grad is not None and w2.grad is not None
    return {
        "loss": loss.numpy(), "grad w1": w1.grad.numpy(), "grad w2": w2.grad.numpy(),
        "grad sbp": [str(w1.grad.sbp), str(w2.grad.sbp)],
        "forward counts": forward.counts(), "backward counts": backward.counts(),
    }


def mlp_reference() -> dict[str, np.ndarray]:
    """The same MLP in plain torch: the numbers the distributed runs must give."""
    x = base_value((9, 4))
    w1 = (base_value((4, 6)) * 0.5).requires_grad_()
    w2 = (base_value((6, 2)) * 0.5).requires_grad_()
    loss = (((x @ w1).relu() @ w2) ** 2).sum()
    loss.backward()
    assert w1.grad is not None and w2.grad is not None
    return {"loss": loss.detach().numpy(), "grad w1": w1.grad.numpy(), "grad w2": w2.grad.numpy()}


# -- only meaningful with one process per rank ---------------------------------------------------


def multiprocess_only_job() -> dict[str, Any]:
    """local_to_global with uneven local shards, values on processes outside a placement, rank checks."""
    world, me = sbpflow.world_size(), sbpflow.rank()
    out: dict[str, Any] = {"rank": me, "world": world}
    # rank r holds rows of the logical (2 * world + 1, 3) tensor as torch.tensor_split cuts them
    logical = base_value((2 * world + 1, 3))
    local = torch.tensor_split(logical, world)[me]
    g = sbpflow.tensor(local).to_global(sbpflow.placement("cpu", list(range(world))), S0)
    out["local_to_global shape"] = tuple(g.shape)
    out["local_to_global value"] = g.numpy()
    try:
        sbpflow.tensor(logical[: me + 1]).to_global(sbpflow.placement("cpu", list(range(world))), S0)
    except sbpflow.ShapeError as e:
        out["uneven mismatch error"] = str(e)

    # a tensor on the last rank only: every process can still read it
    last = sbpflow.placement("cpu", [world - 1])
    t = sbpflow.tensor(logical, placement=last, sbp=B)
    out["outside value"] = t.numpy()
    out["outside shards"] = sorted(t.local_tensors())
    with record() as log:
        u = (t * 2).sum()  # computed by the last rank alone; others hold nothing
    out["outside op counts"] = log.counts()
    out["outside op value"] = u.item()

    try:
        sbpflow.randn(4, placement=sbpflow.placement("cpu", list(range(world + 1))), sbp=S0)
    except sbpflow.PlacementError as e:
        out["too many ranks error"] = str(e)
    out["print0"] = _captured_print0()
    return out


def _captured_print0() -> str:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        sbpflow.print0("hello from", sbpflow.rank())
    return buffer.getvalue()


def primitives_job() -> dict[str, Any]:
    """Each backend primitive called directly, with groups in non-sorted order, uneven shapes and odd dtypes.

    Returns, per primitive, (what this rank got, what the simulated backend gives that rank).
    """
    from sbpflow.comm import SimulatedBackend, Transfer

    world, me = sbpflow.world_size(), sbpflow.rank()
    backend, sim = get_backend(), SimulatedBackend()
    group = tuple(reversed(range(world)))  # mesh order differs from torch's (sorted) group order
    out: dict[str, Any] = {}

    def compare(name: str, mine: dict[int, Any], ref: dict[int, Any]) -> None:
        out[name] = (_np(mine.get(me)), _np(ref.get(me)))

    shapes = [(g + 1, 2) for g in group]
    gathered = {r: base_value((r + 1, 2)) + r for r in group}
    compare("all_gather uneven", backend.all_gather(group, {me: gathered[me]}, shapes, torch.float32),
            sim.all_gather(group, gathered, shapes, torch.float32))

    for name, dtype, op in [("all_reduce int64 min", torch.int64, "min"), ("all_reduce bool sum", torch.bool, "sum"),
                            ("all_reduce bfloat16 sum", torch.bfloat16, "sum")]:
        values = {r: ((torch.arange(6).reshape(2, 3) * (r + 2)) % 5).to(dtype) for r in group}
        compare(name, backend.all_reduce(group, {me: values[me]}, op), sim.all_reduce(group, values, op))

    # 16-bit sums are accumulated in fp32: 256 + 1 + 1 + 1 is 256 added up in bf16, 259 -> 260 in fp32
    sixteen = {r: torch.full((3,), 256.0 if r == 0 else 1.0, dtype=torch.bfloat16) for r in group}
    compare("all_reduce bfloat16 sum in fp32", backend.all_reduce(group, {me: sixteen[me]}, "sum"),
            sim.all_reduce(group, sixteen, "sum"))
    halves = {r: [torch.full((3,), 2048.0 if r == 0 else 1.0, dtype=torch.float16)] * world for r in group}
    compare("reduce_scatter float16 sum in fp32", backend.reduce_scatter(group, {me: halves[me]}, "sum"),
            sim.reduce_scatter(group, halves, "sum"))

    pieces = {r: [base_value((j + 1, 3)) * (r + 1) for j in range(world)] for r in group}
    compare("reduce_scatter max", backend.reduce_scatter(group, {me: pieces[me]}, "max"),
            sim.reduce_scatter(group, pieces, "max"))

    sends = {r: [torch.full((r + j + 1,), float(10 * r + j)) for j in range(world)] for r in group}
    recv = {r: [tuple(sends[g][group.index(r)].shape) for g in group] for r in group}
    compare("all_to_all uneven", backend.all_to_all(group, {me: sends[me]}, {me: recv[me]}, torch.float32, 0),
            sim.all_to_all(group, sends, recv, torch.float32, 0))

    root = world - 1
    value = base_value((3, 2))
    compare("broadcast", backend.broadcast(group, root, {me: value} if me == root else {}, (3, 2), torch.float32),
            sim.broadcast(group, root, {root: value}, (3, 2), torch.float32))
    contributions = {r: base_value((2, 2)) * (r - 1) for r in group}
    compare("reduce to rank 0", backend.reduce(group, 0, {me: contributions[me]}, "sum", (2, 2), torch.float32),
            sim.reduce(group, 0, contributions, "sum", (2, 2), torch.float32))

    transfers = [Transfer(r, (r + 1) % world, (r + 1,), torch.float32) for r in range(world)]
    transfers.append(Transfer(0, 0, (2,), torch.float32))
    payloads = {i: torch.full(t.shape, float(t.src)) for i, t in enumerate(transfers)}
    got = backend.send_recv(transfers, {i: v for i, v in payloads.items() if transfers[i].src == me})
    ref = sim.send_recv(transfers, payloads)
    out["send_recv ring"] = ({i: v.numpy() for i, v in got.items()},
                             {i: ref[i].numpy() for i, t in enumerate(transfers) if t.dst == me})
    return out


def _np(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_np(v) for v in value]
    return value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()


def full_job(world: int) -> dict[str, Any]:
    """Everything a real-process run checks, in one job (process start-up is the expensive part)."""
    return {"boxing": boxing_job(world), "ops": ops_job(world), "multi": multiprocess_only_job(),
            "primitives": primitives_job()}
