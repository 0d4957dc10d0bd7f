"""Mixed-integer program plumbing for SBP selection (graph.select): the program's arrays, and HiGHS.

:class:`Program` lays out one-hot choice columns, edge columns coupled to them and the rows that tie them;
:func:`solve` runs HiGHS (through highspy) on the arrays, relaxation first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NODE_LIMIT = 5000  # branch-and-bound nodes; the greedy baseline stands if no better solution is proven by then


def intern(keys: list[Any]) -> np.ndarray:
    """Each key -> a small int, equal keys equal ints."""
    table: dict[Any, int] = {}
    return np.array([table.setdefault(k, len(table)) for k in keys], dtype=np.int64)


class Program:
    """An integer program in the making: choice columns first (binary), then edge columns (continuous), then,
    where gradient all-reduces may hide behind backward, the column of their uncovered time.

    ``*_hidden`` is the part of a column's cost that is gradient all-reduces (also in ``*_cost``), ``cover``
    what each choice column gives to cover them."""

    def __init__(self, choice_cost: np.ndarray, cover: np.ndarray) -> None:
        self.choice_cost = choice_cost
        self.choice_hidden = np.zeros_like(choice_cost)
        self.cover = cover
        self.hidden_constant = 0.0
        self.edge_cost: list[np.ndarray] = []
        self.edge_hidden: list[np.ndarray] = []
        self.n_col = len(choice_cost)
        self.n_row = 0
        self.entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, columns, values)
        self.bounds: list[tuple[int, float, float]] = []  # (rows, lower, upper), in order

    def add_rows(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, lower: float, upper: float) -> None:
        """Rows ``self.n_row + rows``, all with the same bounds."""
        n = int(rows.max()) + 1
        self.entries.append((self.n_row + rows, cols, vals))
        self.bounds.append((n, lower, upper))
        self.n_row += n

    def add_edge(self, matrix: np.ndarray, hidden: np.ndarray, src_cols: np.ndarray, src_option: np.ndarray,
                 dst_cols: np.ndarray, dst_option: np.ndarray) -> None:
        """Columns ``e[s, t]`` costing ``matrix`` (``hidden`` of it gradient all-reduces); rows: sum over t of
        ``e[s, t]`` = the producer's choices that give ``s`` (``src_option[k]``: the option choice ``k`` gives),
        and alike for the consumer."""
        a, b = matrix.shape
        e = self.n_col + np.arange(a * b)
        self.edge_cost.append(matrix.ravel())
        self.edge_hidden.append(hidden.ravel())
        self.n_col += a * b
        rows = np.concatenate([np.repeat(np.arange(a), b), a + np.tile(np.arange(b), a), src_option, a + dst_option])
        cols = np.concatenate([e, e, src_cols, dst_cols])
        vals = np.concatenate([np.ones(2 * a * b), -np.ones(len(src_cols) + len(dst_cols))])
        self.add_rows(rows, cols, vals, 0.0, 0.0)

    def arrays(self) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray, np.ndarray,
                              np.ndarray, int]:
        """(costs, matrix by columns, row lower bounds, row upper bounds, column upper bounds, number of binary
        columns)."""
        cost = np.concatenate([self.choice_cost, *self.edge_cost])
        hidden = np.concatenate([self.choice_hidden, *self.edge_hidden])
        upper = np.ones(self.n_col)
        if hidden.any():  # z >= hidden @ x - cover @ x + constant, z >= 0; the objective pays z, not hidden
            z = self.n_col
            cover = np.concatenate([self.cover, np.zeros(self.n_col - len(self.cover))])
            used = np.flatnonzero((hidden != 0) | (cover != 0))
            self.add_rows(np.zeros(len(used) + 1, dtype=np.int64), np.append(used, z),
                          np.append(cover[used] - hidden[used], 1.0), self.hidden_constant, np.inf)
            cost = np.append(cost - hidden, 1.0)
            upper = np.append(upper, np.inf)
            self.n_col += 1
        rows, cols, vals = (np.concatenate(part) for part in zip(*self.entries, strict=True))
        lo = np.concatenate([np.full(n, lower) for n, lower, _ in self.bounds])
        hi = np.concatenate([np.full(n, upper) for n, _, upper in self.bounds])
        return cost, columnwise(rows, cols, vals, self.n_col), lo, hi, upper, len(self.choice_cost)


def columnwise(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray,
                n_col: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, column, value) entries -> compressed columns (start, index, value), as HiGHS takes a matrix."""
    order = np.argsort(cols, kind="stable")
    start = np.searchsorted(cols[order], np.arange(n_col + 1))
    return start, rows[order], vals[order]


def solve(cost: np.ndarray, matrix: tuple[np.ndarray, np.ndarray, np.ndarray], lo: np.ndarray, hi: np.ndarray,
           upper: np.ndarray, n_choice: int, twins: np.ndarray, time_limit: float) -> np.ndarray | None:
    """Minimises ``cost @ x`` over ``lo <= matrix @ x <= hi`` (``matrix`` by columns) and ``0 <= x <= upper``,
    the first ``n_choice`` columns binary; returns x, or None when no solution was found.

    The relaxation is solved first: one-hot choices with marginal-coupled edges make it integral as a rule, and
    then it is the answer. The column of uncovered gradient all-reduces couples every choice; where it binds
    (the all-reduces just covered) the relaxation mixes two plans, and an integer program over the mixed choices
    and their twins (``twins``: an id per choice column, see :func:`neighbourhood`) picks among them. Only when
    that finds nothing does the branch and bound cover the whole program.
    """
    import highspy  # lazy, as before the split: its 20 ms of import are paid by the first compile, not every process

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), len(lo)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(len(cost)), upper
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = matrix
    solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    # a node limit, not a time limit: the result must not depend on how busy the machine is, since every
    # process compiles its own copy of the plan and all must agree
    solver.setOptionValue("mip_max_nodes", NODE_LIMIT)
    solver.setOptionValue("time_limit", float(time_limit))
    solver.passModel(lp)
    solver.run()
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n_choice + \
        [highspy.HighsVarType.kContinuous] * (len(cost) - n_choice)
    if solver.getModelStatus() == highspy.HighsModelStatus.kOptimal:
        x = np.array(solver.getSolution().col_value)
        whole = np.minimum(x[:n_choice], 1 - x[:n_choice]) <= 1e-7
        if whole.all():
            return x
        found = neighbourhood(solver, lp, x, np.flatnonzero(~np.isin(twins, twins[~whole])))
        if found is not None:
            return found
        lp.col_lower_, lp.col_upper_ = np.zeros(len(cost)), upper
    # the MIP presolve costs more than it saves on the whole program (24-layer dp2 x tp2 GPT: 3.8 s of selection
    # with it, 2.3 s without, the same plan)
    solver.setOptionValue("presolve", "off")
    solver.passModel(lp)
    solver.run()
    if not solver.getSolution().value_valid:
        return None
    return np.array(solver.getSolution().col_value)


def neighbourhood(solver: Any, lp: Any, x: np.ndarray, fixed: np.ndarray) -> np.ndarray | None:
    """The integer program ``lp`` with the choice columns ``fixed`` held at their values in the relaxation's
    solution ``x``; its solution, or None where it has none.

    This is RENS (relaxation-induced neighbourhood search) widened by twins. Where the coupling column binds,
    the relaxation mixes a plan whose all-reduces are not covered with one that covers them by doing more of
    backward's work on every rank (a weight gradient computed whole rather than summed from halves); the
    optimum trades a few such choices against each other, like items of a knapsack. The free choices are the
    mixed ones and the same choices of their twins: backward's classes of the same op on the same shapes
    (another layer's or another projection's weight gradient), which the relaxation could have mixed instead.

    Why not the branch and bound over the whole program: it spends its time at the root (cuts, heuristics,
    strong branching), about 0.9 s a solve for a 24-layer GPT, although it ends within a few nodes. This program
    has a few dozen free choices, and HiGHS's presolve removes the fixed rest: about 0.1 s. Where measured
    (tests/sim/test_graph_select.py; the compile benchmark's GPTs, 2 to 24 layers, before small gradients were
    priced as bucketed) it found the whole program's plan, or one within 0.01 % of its estimated time; without
    the twins, one 0.04 % dearer on the 12-layer dp=2 GPT.
    """
    lower, upper = np.array(lp.col_lower_, dtype=float), np.array(lp.col_upper_, dtype=float)
    lower[fixed] = upper[fixed] = np.round(x[fixed])
    lp.col_lower_, lp.col_upper_ = lower, upper
    solver.passModel(lp)
    solver.run()
    if not solver.getSolution().value_valid:
        return None
    return np.array(solver.getSolution().col_value)
