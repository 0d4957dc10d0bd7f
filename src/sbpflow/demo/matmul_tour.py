"""A tour of one matmul, ``x (4, 5) @ w (5, 8)``, under data, model and pipeline parallelism on virtual CPU
devices, each result checked against the single-device product.

>>> result = run(print_fn=lambda line: None)
>>> result["data_parallel"]["sbp"], result["model_parallel"]["sbp"]
('(S(0))', '(S(1))')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import sbpflow
from sbpflow import sbp as S
from sbpflow.comm import CommLog

PrintFn = Callable[[str], None]
SEED = 0


def _reference() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, w0, w1 and the single-device values; random values depend only on the seed and call order."""
    sbpflow.manual_seed(SEED)
    x = sbpflow.randn(4, 5)  # local (4, 5)
    w0 = sbpflow.randn(5, 8)  # local (5, 8)
    w1 = sbpflow.randn(8, 3)  # local (8, 3)
    return x.numpy(), w0.numpy(), w1.numpy()


def _check(name: str, got: sbpflow.Tensor, expected: np.ndarray) -> None:
    if tuple(got.shape) != expected.shape or not np.allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5):
        raise sbpflow.SbpflowError(
            f"matmul tour, {name}: the global result {got._describe()} differs from the single-device product"
        )


def _summary(name: str, out: sbpflow.Tensor, log: CommLog, print_fn: PrintFn, plans: list[str]) -> dict[str, Any]:
    sbp_text = S.format_nd(out.sbp)
    print_fn(f"-- {name}: out shape {list(out.shape)} on {out.placement}, sbp {sbp_text}")
    counts = log.counts()
    print_fn(f"   collectives: {counts if counts else 'none'}")
    for text in plans:
        print_fn("   " + text.replace("\n", "\n   "))
    return {"shape": tuple(out.shape), "placement": str(out.placement), "sbp": sbp_text, "collectives": counts,
            "plans": plans}


def _plan_text(x: sbpflow.Tensor, placement: sbpflow.Placement, sbp: Any) -> str:
    """What ``x.to_global(placement, sbp)`` will run, as text (``sbpflow.explain`` without printing)."""
    nd = S.normalize(sbp, placement, x.ndim)
    layout = sbpflow.boxing.Layout
    return str(sbpflow.boxing.plan(tuple(x.shape), x.dtype, layout(x.placement, x.sbp), layout(placement, nd)))


def _one_placement(label: str, x_sbp: Any, w_sbp: Any, print_fn: PrintFn) -> dict[str, Any]:
    """x @ w on ranks [0, 1] with the given layouts, checked against one device."""
    x_ref, w_ref, _ = _reference()
    placement = sbpflow.placement("cpu", [0, 1])
    sbpflow.manual_seed(SEED)
    x = sbpflow.randn(4, 5, placement=placement, sbp=x_sbp)  # logical (4, 5)
    w = sbpflow.randn(5, 8, placement=placement, sbp=w_sbp)  # logical (5, 8)
    with sbpflow.comm.record() as log:
        out = sbpflow.functional.matmul(x, w)  # logical (4, 8)
    _check(label.split(" (")[0], out, x_ref @ w_ref)
    gather = _plan_text(out, placement, S.broadcast)
    return _summary(label, out, log, print_fn, ["to see it whole, .numpy() runs:\n" + gather])


def data_parallel(print_fn: PrintFn = print) -> dict[str, Any]:
    """x split by rows, w broadcast: every rank multiplies its rows; the output stays S(0) and nothing moves."""
    return _one_placement("data parallel (x S(0), w B)", S.split(dim=0), S.broadcast, print_fn)


def model_parallel(print_fn: PrintFn = print) -> dict[str, Any]:
    """x broadcast, w split by columns: every rank computes some output columns; the output is S(1)."""
    return _one_placement("model parallel (x B, w S(1))", S.broadcast, S.split(dim=1), print_fn)


def pipeline(print_fn: PrintFn = print) -> dict[str, Any]:
    """Stage 0 on ranks [0, 1], stage 1 on [2, 3]; ``to_global`` carries stage 0's output across."""
    x_ref, w0_ref, w1_ref = _reference()
    stage0 = sbpflow.placement("cpu", [0, 1])
    stage1 = sbpflow.placement("cpu", [2, 3])
    sbpflow.manual_seed(SEED)
    x = sbpflow.randn(4, 5)  # a local batch, like data read on one host
    w0 = sbpflow.randn(5, 8, placement=stage0, sbp=S.broadcast)  # stage 0's weight
    w1 = sbpflow.randn(8, 3, placement=stage1, sbp=S.broadcast)  # stage 1's weight
    with sbpflow.comm.record() as log:
        # Every virtual rank of stage 0 offers the same local batch as its shard, so B is its layout.
        in0 = x.to_global(placement=stage0, sbp=S.broadcast)  # logical and local (4, 5)
        out0 = sbpflow.functional.matmul(in0, w0)  # logical (4, 8) on stage 0, B
        hop = _plan_text(out0, stage1, S.broadcast)
        in1 = out0.to_global(placement=stage1, sbp=S.broadcast)  # the same value, now on ranks 2 and 3
        out1 = sbpflow.functional.matmul(in1, w1)  # logical (4, 3) on stage 1, B
    _check("pipeline stage 0", out0, x_ref @ w0_ref)
    _check("pipeline stage 1", out1, x_ref @ w0_ref @ w1_ref)
    return _summary("two-stage pipeline ([0, 1] -> [2, 3])", out1, log, print_fn, ["stage 0 -> stage 1:\n" + hop])


def run(print_fn: PrintFn = print) -> dict[str, Any]:
    """Runs the three programs, checks each against the single-device product, prints what moved.

    Returns ``{program: {"shape", "placement", "sbp", "collectives", "plans"}}``; raises
    ``SbpflowError`` if a result differs from ``x @ w`` computed on one device.
    """
    print_fn("matmul x (4, 5) @ w (5, 8) on virtual cpu devices, checked against one device")
    return {
        "data_parallel": data_parallel(print_fn),
        "model_parallel": model_parallel(print_fn),
        "pipeline": pipeline(print_fn),
    }


if __name__ == "__main__":
    run()
