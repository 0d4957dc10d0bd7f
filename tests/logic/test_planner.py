"""The boxing planner without devices: chosen primitives, bytes, α-β times, cost models, determinism.

Sizes: an (8, 8) float32 tensor is |T| = 256 bytes; on p = 4 ranks the table in
sbpflow.boxing.plan gives all_gather (p-1)/p |T| = 192 B per rank, and so on.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import sbpflow
from sbpflow import boxing
from sbpflow import sbp as S
from sbpflow.boxing import CostModel, Layout
from sbpflow.comm.base import TARGET_COST_FACTORS

B, PSUM, PMAX, PMIN = S.broadcast, S.partial_sum, S.partial_max, S.partial_min
S0, S1 = S.split(0), S.split(1)
P4 = sbpflow.placement("cpu", [0, 1, 2, 3])
MESH = sbpflow.placement("cpu", [[0, 1], [2, 3]])
F32 = torch.float32
ALPHA, BETA = 100e-6, 1 / 2e9  # the default cost model's cpu intra-node link (gloo over TCP)
INTER_ALPHA, INTER_BETA = 200e-6, 1 / 1.25e9  # and its inter-node link


@pytest.fixture(autouse=True)
def _table_as_written(native_collectives: None) -> None:
    """These tests check the α-β table itself: every collective native (gloo's factor: its own test below)."""


def _plan(src: object, dst: object, src_pl: sbpflow.Placement = P4, dst_pl: sbpflow.Placement | None = None,
          shape: tuple[int, ...] = (8, 8), model: CostModel | None = None) -> boxing.Plan:
    dst_pl = dst_pl or src_pl
    src_nd = S.normalize(src, src_pl)
    dst_nd = S.normalize(dst, dst_pl)
    return boxing.plan(shape, F32, Layout(src_pl, src_nd), Layout(dst_pl, dst_nd), model)


def _kinds(p: boxing.Plan) -> list[str]:
    return [s.kind for s in p.steps]


# -- the canonical 1-D pairs: kind, bytes, time -----------------------------------------------


@pytest.mark.parametrize(
    "src, dst, kind, total, per_rank, rounds",
    [
        (S0, B, "all_gather", 3 * 256, 192, 3),
        (S0, S1, "all_to_all", 4 * 48, 48, 3),
        (PSUM, B, "all_reduce", 4 * 384, 384, 6),
        (PSUM, S0, "reduce_scatter", 4 * 192, 192, 3),
        (PMAX, B, "all_reduce", 4 * 384, 384, 6),
        (PMIN, S1, "reduce_scatter", 4 * 192, 192, 3),
    ],
    ids=lambda v: str(v),
)
def test_one_collective_with_table_bytes_and_time(src: object, dst: object, kind: str, total: int, per_rank: int,
                                                  rounds: int) -> None:
    p = _plan(src, dst)
    assert _kinds(p) == [kind]
    step = p.steps[0]
    assert (step.bytes, step.bytes_per_rank) == (total, per_rank)
    assert step.time == pytest.approx(rounds * ALPHA + per_rank * BETA)
    assert (p.bytes, p.bytes_per_rank, p.time) == (step.bytes, step.bytes_per_rank, step.time)
    assert step.axis == 0
    if isinstance(src, S.Partial):
        assert step.detail == src.op


@pytest.mark.parametrize("src, dst", [(B, S0), (B, S1), (B, PSUM), (B, PMAX), (S0, PSUM), (S1, PMIN)], ids=str)
def test_moves_nothing(src: object, dst: object) -> None:
    p = _plan(src, dst)
    assert _kinds(p) == ["local"]
    assert (p.bytes, p.bytes_per_rank, p.time) == (0, 0, 0.0)
    assert p.collectives() == []


@pytest.mark.parametrize("sbp", [S0, S1, B, PSUM, PMAX, (S0, S1), (PSUM, S0)], ids=str)
def test_identity_is_an_empty_plan(sbp: object) -> None:
    placement = MESH if isinstance(sbp, tuple) else P4
    p = _plan(sbp, sbp, placement)
    assert p.steps == () and p.bytes == 0 and p.time == 0.0
    assert "identity: nothing moves" in str(p)


def test_cheapest_plan_wins_over_the_obvious_detours() -> None:
    # S(0) -> S(1): one all-to-all beats all-gather + slice; P -> S: a reduce-scatter beats all-reduce + slice.
    a2a, gather = _plan(S0, S1), _plan(S0, B)
    assert a2a.time < gather.time and a2a.bytes < gather.bytes
    rs, ar = _plan(PSUM, S0), _plan(PSUM, B)
    assert rs.time < ar.time and rs.bytes < ar.bytes
    # P(max) -> P(sum) goes through S (a reduce-scatter), not B (an all-reduce), then pads locally.
    assert _kinds(_plan(PMAX, PSUM)) == ["reduce_scatter", "local"]


def test_gloo_target_prices_a_reduce_scatter_as_the_all_reduce_it_runs() -> None:
    # the cpu target (comm.base.TARGET_COST_FACTORS, every backend's default): gloo runs a reduce-scatter as one
    # all-reduce, so P -> S costs what P -> B costs, bytes and time, twice the table's ring reduce-scatter
    with boxing.target_factors(TARGET_COST_FACTORS):
        rs, ar = _plan(PSUM, S0), _plan(PSUM, B)
    native = _plan(PSUM, S0)
    assert (rs.bytes, rs.bytes_per_rank) == (ar.bytes, ar.bytes_per_rank)
    assert (rs.bytes, rs.bytes_per_rank) == (2 * native.bytes, 2 * native.bytes_per_rank)
    assert rs.time == pytest.approx(ar.time) and rs.time > native.time
    assert boxing.current_factors() == ()  # the fixture's block, inside which the test's own block nested


def test_all_reduce_beats_its_two_step_equivalent_on_equal_time() -> None:
    # all_reduce == reduce_scatter + all_gather in the α-β model; float noise must not pick the longer plan.
    for shape in [(8, 8), (5, 3), (7,), (1, 3)]:
        for placement in [P4, sbpflow.placement("cpu", [0, 1, 2])]:
            assert _kinds(_plan(PSUM, B, placement, shape=shape)) == ["all_reduce"], (shape, placement)


# -- across placements ------------------------------------------------------------------------


def test_same_mesh_shape_moves_pairwise() -> None:
    p = _plan(S0, S0, sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [2, 3]))
    assert _kinds(p) == ["send_recv"] and p.steps[0].detail == "pairwise"
    assert (p.bytes, p.bytes_per_rank) == (256, 128)
    assert p.time == pytest.approx(ALPHA + 128 * BETA)


def test_partial_values_move_pairwise_as_they_are() -> None:
    p = _plan(PSUM, PSUM, sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [3, 2]))
    assert _kinds(p) == ["send_recv"] and p.steps[0].detail == "pairwise"
    assert p.bytes == 2 * 256


def test_different_sizes_use_the_general_transfer() -> None:
    # [0, 1] S(0) -> [2, 3, 4] S(0): rows 0-3 | 4-7 become 0-2 | 3-5 | 6-7; ranks 0 and 1 each send 2 pieces.
    p = _plan(S0, S0, sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [2, 3, 4]))
    assert _kinds(p) == ["send_recv"] and p.steps[0].detail == "general"
    assert (p.bytes, p.bytes_per_rank) == (256, 128)
    assert p.time == pytest.approx(2 * ALPHA + 128 * BETA)


def test_one_rank_to_many_is_a_broadcast_and_back_a_reduce() -> None:
    one, three = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [0, 1, 2])
    out = _plan(B, B, one, three)
    assert _kinds(out) == ["broadcast"]
    assert (out.bytes, out.bytes_per_rank) == (2 * 256, 256)
    assert out.time == pytest.approx(2 * ALPHA + 256 * BETA)  # ⌈log2 3⌉ rounds
    back = _plan(PSUM, B, three, one)
    assert _kinds(back) == ["reduce"] and back.steps[0].detail == "sum"
    assert (back.bytes, back.bytes_per_rank) == (2 * 256, 256)
    assert _kinds(_plan(S0, B, three, one)) == ["send_recv"]  # rank 0 gathers the other two rows


def test_a_flat_placement_onto_its_own_mesh_moves_no_bytes() -> None:
    p = _plan(S0, (S0, S0), P4, MESH)
    assert _kinds(p) == ["send_recv"] and p.bytes == 0 and p.time == 0.0


def test_overlapping_rank_sets_only_count_what_leaves_a_rank() -> None:
    # [0, 1, 2] -> [1, 2, 3], B: every destination but rank 3 already holds the value.
    p = _plan(B, B, sbpflow.placement("cpu", [0, 1, 2]), sbpflow.placement("cpu", [1, 2, 3]), shape=(4,))
    assert _kinds(p) == ["send_recv"] and p.steps[0].detail == "general"
    assert p.bytes == 16


# -- n-D: one mesh axis at a time --------------------------------------------------------------


def test_nested_split_of_one_dim_gathers_inner_axis_first() -> None:
    p = _plan((S0, S0), (B, B), MESH)
    assert [(s.kind, s.axis) for s in p.steps] == [("all_gather", 1), ("all_gather", 0)]
    assert [s.dst.sbp for s in p.steps] == [(S0, B), (B, B)]


def test_independent_axes_convert_separately() -> None:
    p = _plan((S0, PSUM), (S0, B), MESH)
    assert [(s.kind, s.axis) for s in p.steps] == [("all_reduce", 1)]
    assert p.steps[0].bytes == 2 * (2 * 1 * 128 // 2) * 2  # two groups of 2 ranks, a 128-byte half each


def test_mixed_partial_ops_are_resolved_inner_first() -> None:
    p = _plan((PSUM, PMAX), (B, B), MESH)
    first = p.steps[0]
    assert first.axis == 1 and first.detail == "max"  # the outer sum cannot reduce through an inner max
    assert p.steps[-1].dst.sbp == (B, B)


def test_swapped_splits_use_one_general_transfer() -> None:
    p = _plan((S0, S1), (S1, S0), MESH)
    assert _kinds(p) == ["send_recv"] and p.steps[0].detail == "general"


# -- the transition table in the module docstring matches the planner --------------------------

_TABLE_VALUES = {"S(i)": S0, "S(j)": S1, "B": B, "P(op)": PSUM, "P(a)": PMAX, "P(b)": PSUM}


_ROW = re.compile(r"\s+(S\(i\)|B|P\(op\)|P\(a\))\s+(S\([ij]\)|B|P\(op\)|P\(b\))\s+(\(identity\)|\(through|\w+)")


def _table_rows() -> list[tuple[str, str, str]]:
    doc = importlib.import_module("sbpflow.boxing.plan").__doc__ or ""  # boxing.plan is the function
    table = doc.split("from      to")[1].split("Across placements")[0]
    rows = []
    for line in table.splitlines()[1:]:
        m = _ROW.match(line)
        if m:
            rows.append(m.groups())
    return rows


def test_docstring_table_has_every_one_d_pair() -> None:
    pairs = {(a, b) for a, b, _ in _table_rows()}
    assert len(pairs) == 9


@pytest.mark.parametrize("row", _table_rows(), ids=lambda r: f"{r[0]}->{r[1]}")
def test_docstring_table_row_is_what_the_planner_does(row: tuple[str, str, str]) -> None:
    a, b, step = row
    p = _plan(_TABLE_VALUES[a], _TABLE_VALUES[b])
    if step == "(identity)":
        assert p.steps == ()
    elif step == "(through":
        assert len(p.steps) == 2 and _kinds(p)[-1] == "local"
    else:
        assert _kinds(p) == [step]


# -- cost models --------------------------------------------------------------------------------


def test_with_link_changes_times() -> None:
    slow = CostModel().with_link("cpu", "intra", alpha=1e-3, beta=1e-6)
    p = _plan(S0, B, model=slow)
    assert p.time == pytest.approx(3 * 1e-3 + 192 * 1e-6)
    assert _plan(S0, B).time == pytest.approx(3 * ALPHA + 192 * BETA)
    # Another device type's link leaves cpu plans alone.
    assert _plan(S0, B, model=CostModel().with_link("cuda", "intra", alpha=1.0, beta=1.0)).time == _plan(S0, B).time


def test_cost_model_context_applies_inside_the_block_only() -> None:
    model = CostModel().with_link("cpu", "intra", alpha=0.5, beta=0.0)
    with boxing.cost_model(model) as active:
        assert active is model and boxing.get_cost_model() is model
        assert _plan(PSUM, B).time == pytest.approx(6 * 0.5)
    assert boxing.get_cost_model() == CostModel()
    assert _plan(PSUM, B).time == pytest.approx(6 * ALPHA + 384 * BETA)


def test_ranks_across_nodes_pay_the_inter_node_link() -> None:
    inter = CostModel(ranks_per_node=2)  # ranks 0, 1 on node 0; 2, 3 on node 1
    assert _plan(S0, B, model=inter).time == pytest.approx(3 * INTER_ALPHA + 192 * INTER_BETA)
    two = sbpflow.placement("cpu", [0, 1])
    assert _plan(S0, B, two, model=inter).time == pytest.approx(ALPHA + 128 * BETA)
    # On a 2x2 mesh, axis 0 groups (0, 2), (1, 3) cross nodes; axis 1 groups (0, 1), (2, 3) do not.
    gather_outer = _plan((S0, B), (B, B), MESH, model=inter).steps[0]
    gather_inner = _plan((B, S0), (B, B), MESH, model=inter).steps[0]
    assert gather_outer.time == pytest.approx(INTER_ALPHA + 128 * INTER_BETA)
    assert gather_inner.time == pytest.approx(ALPHA + 128 * BETA)


def test_a_slow_link_between_stages_changes_the_choice() -> None:
    # [0, 1] S(0) -> [2, 3] B: on one node, one general transfer; when the stages sit on two nodes, cross the
    # slow link once with half the data per rank, then all-gather on the fast side.
    a, b = sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [2, 3])
    same_node = _plan(S0, B, a, b, shape=(64, 64))
    two_nodes = _plan(S0, B, a, b, shape=(64, 64), model=CostModel(ranks_per_node=2))
    assert [(s.kind, s.detail) for s in same_node.steps] == [("send_recv", "general")]
    assert [(s.kind, s.detail) for s in two_nodes.steps] == [("send_recv", "pairwise"), ("all_gather", "")]
    assert two_nodes.steps[1].src.placement == b


def test_cost_models_are_values() -> None:
    a = CostModel().with_link("cpu", "inter", alpha=1.0, beta=2.0)
    b = CostModel().with_link("cpu", "inter", alpha=1.0, beta=2.0)
    assert a == b and hash(a) == hash(b) and a != CostModel()
    assert a.link("cpu", (0, 9)) == boxing.LinkCost(1.0, 2.0)
    assert a.link("cpu", (0, 7)) == boxing.LinkCost(ALPHA, BETA)


def test_plans_print_steps_bytes_and_time() -> None:
    text = str(_plan(S0, B))
    assert text.splitlines()[0] == "boxing (8, 8) float32: cpu:[0, 1, 2, 3] (S(0)) -> cpu:[0, 1, 2, 3] (B)"
    assert "1. all_gather axis 0" in text and "192 B/rank, 768 B total, 300.1 us" in text


# -- determinism ---------------------------------------------------------------------------------

_PLANS_SCRIPT = textwrap.dedent("""
    import itertools, torch, sbpflow
    from sbpflow import boxing, sbp as S
    mesh = sbpflow.placement("cpu", [[0, 1, 2], [3, 4, 5]])
    flat = sbpflow.placement("cpu", [5, 3, 1])
    opts = [S.broadcast, S.split(0), S.split(1), S.partial_sum, S.partial_max]
    for a, b in itertools.product(itertools.product(opts, repeat=2), repeat=2):
        print(boxing.plan((5, 7), torch.float32, boxing.Layout(mesh, a), boxing.Layout(mesh, b)))
    for a, b in itertools.product(itertools.product(opts, repeat=2), opts):
        print(boxing.plan((5, 7), torch.float32, boxing.Layout(mesh, a), boxing.Layout(flat, (b,))))
""")


def test_plans_do_not_depend_on_the_hash_seed() -> None:
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run([sys.executable, "-c", _PLANS_SCRIPT], capture_output=True, text=True, env=env,
                             timeout=120, check=True)
        outputs.append(run.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[0].count("boxing (5, 7)") == 25 * 25 + 25 * 5


# -- general transfers find the boxes a destination needs without scanning every source box (issue 13, part 5) --


Piece = tuple[int, int, tuple[tuple[int, int], ...]]  # (src rank, dst rank, logical box)


def _scanned_pieces(shape: tuple[int, ...], src: Layout, dst: Layout) -> list[Piece]:
    """The reference: every destination checks every distinct source box."""
    from sbpflow._layout import intersect, shard_box

    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for r in src.placement.flat_ranks:
        holders.setdefault(shard_box(shape, src.placement, src.sbp, r), []).append(r)
    out = []
    for i, d in enumerate(dst.placement.flat_ranks):
        want = shard_box(shape, dst.placement, dst.sbp, d)
        for box, replicas in holders.items():
            common = intersect(want, box)
            if common is not None:
                out.append((d if d in replicas else replicas[i % len(replicas)], d, common))
    return out


GRID_CASES = [
    ((7, 5), sbpflow.placement("cpu", [0, 1, 2]), (S0,), sbpflow.placement("cpu", [3, 4]), (S1,)),
    ((7, 5), MESH, (S0, S1), sbpflow.placement("cpu", [[3, 2], [1, 0]]), (S1, S0)),
    ((3, 5), sbpflow.placement("cpu", list(range(6))), (S0,), P4, (S1,)),  # empty boxes (6 ranks, 3 rows)
    ((7, 5), MESH, (S0, S0), P4, (B,)),
    ((9,), sbpflow.placement("cpu", [[0, 1, 2], [3, 4, 5]]), (B, S0), sbpflow.placement("cpu", [5, 6]), (S0,)),
    ((), P4, (B,), sbpflow.placement("cpu", [4, 5]), (B,)),
]


@pytest.mark.parametrize("case", GRID_CASES, ids=range(len(GRID_CASES)))
def test_transfer_pieces_match_a_full_scan(case: tuple[object, ...]) -> None:
    from sbpflow.boxing.plan import transfer_pieces

    shape, src_p, src_sbp, dst_p, dst_sbp = case
    src, dst = Layout(src_p, src_sbp), Layout(dst_p, dst_sbp)  # type: ignore[arg-type]
    assert list(transfer_pieces(shape, src, dst)) == _scanned_pieces(shape, src, dst)  # type: ignore[arg-type]


def test_transfer_pieces_are_linear_in_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """1024 ranks to 1024 others, rows split: each destination meets 1 or 2 source boxes, not all 1024."""
    plan_module = importlib.import_module("sbpflow.boxing.plan")  # the package's `plan` is the function
    calls = []
    real = plan_module.intersect
    monkeypatch.setattr(plan_module, "intersect", lambda a, b: calls.append(1) or real(a, b))
    src = Layout(sbpflow.placement("cpu", list(range(1024))), (S0,))
    dst = Layout(sbpflow.placement("cpu", list(range(1024, 2048))), (S0,))
    plan_module.transfer_pieces.cache_clear()  # an earlier call must not answer from the cache
    pieces = plan_module.transfer_pieces((3000, 2), src, dst)
    assert len(pieces) >= 1024 and 1024 <= len(calls) <= 3 * 1024
