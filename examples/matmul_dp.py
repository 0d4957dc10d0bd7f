"""Data-parallel least squares: the same script on virtual ranks in one process or on real processes.

    python examples/matmul_dp.py                        # 1 process, ranks 0 and 1 simulated
    sbpflow launch -n 2 examples/matmul_dp.py           # 2 processes, one rank each (gloo)
    python examples/matmul_dp.py --ranks 3              # uneven: 10 rows over 3 ranks
    sbpflow launch -n 3 examples/matmul_dp.py --ranks 3

Both ways print the same numbers. The data ``x`` is split by rows (S(0)), the
weight ``w`` is broadcast (B): forward needs no communication, and backward
turns the per-rank partial gradient of ``w`` into one all-reduce.
"""

from __future__ import annotations

import argparse

import sbpflow
from sbpflow import sbp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the placement (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="gradient steps (default 5)")
    args = parser.parse_args(argv)

    p = sbpflow.placement("cpu", list(range(args.ranks)))
    sbpflow.manual_seed(0)
    x = sbpflow.randn(10, 4, placement=p, sbp=sbp.split(0))  # logical (10, 4); each rank holds some rows
    w_true = sbpflow.randn(4, 1, placement=p, sbp=sbp.broadcast)
    y = x @ w_true  # (10, 1), split like x
    w = sbpflow.zeros(4, 1, placement=p, sbp=sbp.broadcast, requires_grad=True)
    for step in range(args.steps):
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()  # w.grad: partial sums of each rank's rows, reduced into w's layout (B)
        with sbpflow.no_grad():
            w.sub_(0.2 * w.grad)
        w.grad = None
        sbpflow.print0(f"step {step}: loss {loss.item():.6f}")
    sbpflow.print0("w      =", [f"{v:.5f}" for v in w.numpy().ravel().tolist()])
    sbpflow.print0("w_true =", [f"{v:.5f}" for v in w_true.numpy().ravel().tolist()])


if __name__ == "__main__":
    main()
