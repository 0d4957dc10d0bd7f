"""Signature lists and dispatch choices (dispatch.decide), without running kernels."""

from __future__ import annotations

import torch

import sbpflow
from sbpflow import sbp as S
from sbpflow.ops import dispatch, schema
from sbpflow.ops import elementwise as E
from sbpflow.ops import matrix as M
from sbpflow.ops import reduction as RD
from sbpflow.ops.propagation import decide
from sbpflow.ops.schema import Meta, Sig, op

B, PSUM, PMAX = S.broadcast, S.partial_sum, S.partial_max
P1 = sbpflow.placement("cpu", [0])
P2 = sbpflow.placement("cpu", [0, 1])
P4 = sbpflow.placement("cpu", [0, 1, 2, 3])
MESH = sbpflow.placement("cpu", [[0, 1], [2, 3]])
F32 = torch.float32


def _t(shape: tuple[int, ...], p: sbpflow.Placement, sbp: object) -> sbpflow.Tensor:
    return sbpflow.zeros(*shape, placement=p, sbp=sbp)


def _sigs(opdef: schema.OpDef, *metas: Meta, **attrs: object) -> set[tuple[tuple[str, ...], tuple[str, ...]]]:
    outs = opdef.meta(*metas, **attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return {(tuple(map(str, s.ins)), tuple(map(str, s.outs))) for s in opdef.sbp(*metas, outs=outs, **attrs)}


def test_matmul_signature_table() -> None:
    sigs = _sigs(M.matmul, Meta((4, 5), F32), Meta((5, 3), F32))
    assert sigs == {(("B", "B"), ("B",)), (("S(0)", "B"), ("S(0)",)), (("B", "S(1)"), ("S(1)",)),
                    (("S(1)", "S(0)"), ("P(sum)",)), (("P(sum)", "B"), ("P(sum)",)), (("B", "P(sum)"), ("P(sum)",))}


def test_batched_matmul_signatures_split_batch_dims() -> None:
    sigs = _sigs(M.matmul, Meta((2, 6, 4, 5), F32), Meta((6, 5, 3), F32))
    assert (("S(1)", "S(0)"), ("S(1)",)) in sigs  # batch dim 1 of a is batch dim 0 of b
    assert (("S(0)", "B"), ("S(0)",)) in sigs  # b has no dim 0 of the output: it stays B
    assert (("S(3)", "S(1)"), ("P(sum)",)) in sigs


def test_elementwise_signatures_follow_broadcasting() -> None:
    sigs = _sigs(E.add, Meta((4, 1, 3), F32), Meta((5, 3), F32))
    assert (("S(0)", "B"), ("S(0)",)) in sigs
    assert (("B", "S(0)"), ("S(1)",)) in sigs  # a's dim 1 has size 1: it is broadcast, stays B
    assert (("S(2)", "S(1)"), ("S(2)",)) in sigs
    assert (("P(sum)", "P(sum)"), ("P(sum)",)) in sigs
    assert (("P(sum)", "B"), ("P(sum)",)) not in sigs  # P + B would add b once per rank
    mul = _sigs(E.mul, Meta((3,), F32), Meta((3,), F32))
    assert (("P(sum)", "B"), ("P(sum)",)) in mul and (("P(sum)", "P(sum)"), ("P(sum)",)) not in mul


def test_reduction_signatures_give_matching_partials() -> None:
    assert (("S(1)",), ("P(sum)",)) in _sigs(RD.sum_, Meta((4, 5), F32), dim=1)
    assert (("S(1)",), ("P(max)",)) in _sigs(RD.amax, Meta((4, 5), F32), dim=1)
    assert (("S(0)",), ("S(0)",)) in _sigs(RD.mean, Meta((4, 5), F32), dim=1)
    assert (("S(2)",), ("S(1)",)) in _sigs(RD.sum_, Meta((4, 5, 6), F32), dim=1)
    # max over a dim returns indices: the reduced dim is never split
    assert all(ins != ("S(1)",) for ins, _ in _sigs(RD.max_dim, Meta((4, 5), F32), dim=1))


# -- decide ---------------------------------------------------------------------------------------


def test_exact_match_needs_no_boxing() -> None:
    d = decide(M.matmul, (_t((4, 6), P2, S.split(1)), _t((6, 3), P2, S.split(0))), {}, P2)
    assert d.plans == (None, None) and d.out_sbps == ((PSUM,),)


def test_the_cheapest_boxing_wins() -> None:
    # S(0) @ S(0): re-slicing b to B costs an all-gather of b; the alternatives cost more
    a, b = _t((64, 8), P4, S.split(0)), _t((8, 4), P4, S.split(0))
    d = decide(M.matmul, (a, b), {}, P4)
    assert d.in_sbps == ((S.split(0),), (B,)) and d.plans[0] is None
    assert d.plans[1] is not None and d.plans[1].collectives() == ["all_gather"]
    # a small a and a large b: gathering a is cheaper, and the output follows b's columns
    a, b = _t((2, 8), P4, S.split(1)), _t((8, 512), P4, S.split(1))
    d = decide(M.matmul, (a, b), {}, P4)
    assert d.in_sbps == ((B,), (S.split(1),)) and d.out_sbps == ((S.split(1),),)


def test_one_rank_runs_no_boxing_at_all() -> None:
    # on a one-rank axis every SBP names the same shard: conversions are relabels and dispatch runs none
    d = decide(M.matmul, (_t((3, 4, 2), P1, B), _t((3, 2, 5), P1, S.split(0))), {}, P1)
    assert d.plans == (None, None)
    d = decide(M.matmul, (_t((3, 4), P1, S.partial_sum), _t((4, 5), P1, S.split(1))), {}, P1)
    assert d.plans == (None, None)


def test_no_partial_is_invented_from_split_inputs() -> None:
    # (5, 4) rows 2,2,1 on 3 ranks do not map onto (20,) shards 7,7,6: no split rule applies.
    # S -> P(sum) would be free locally but defers an all-reduce; the fallback is B.
    p3 = sbpflow.placement("cpu", [0, 1, 2])
    from sbpflow.ops import shape as SH

    d = decide(SH.reshape, (_t((5, 4), p3, S.split(0)),), {"shape": (20,)}, p3)
    assert d.in_sbps == ((B,),) and d.out_sbps == ((B,),)
    # zeroing a B input is fine: a row-parallel linear counts its bias once, with no communication
    x, w, b = _t((5, 8), P2, S.split(1)), _t((6, 8), P2, S.split(1)), _t((6,), P2, B)
    d = decide(M.linear, (x, w, b), {}, P2)
    assert d.out_sbps == ((PSUM,),) and all(p is None or not p.collectives() for p in d.plans)
    # with a partial input, zeroing the B side to add partials is the cheap choice
    d = decide(E.add, (_t((4,), P2, PSUM), _t((4,), P2, B)), {}, P2)
    assert d.out_sbps == ((PSUM,),) and d.plans[0] is None and d.plans[1].collectives() == []


def test_partial_reduced_only_for_a_consumer_that_needs_it() -> None:
    x = _t((4, 6), P2, PSUM)
    assert decide(E.mul, (x, 2.0), {}, P2).out_sbps == ((PSUM,),)
    d = decide(E.exp, (x,), {}, P2)
    assert d.plans[0] is not None and len(d.plans[0].collectives()) == 1
    assert d.plans[0].collectives()[0] in ("all_reduce", "reduce_scatter")
    assert decide(E.exp, (_t((4, 6), P2, PMAX),), {}, P2).out_sbps == ((PMAX,),)  # exp is monotone


_ONLY_B = "test_signatures_only_b"
if _ONLY_B not in schema.REGISTRY:

    @op(_ONLY_B, meta=lambda x: x, sbp=lambda x, outs: [Sig((B,), (B,))])
    def _only_b(x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_an_op_without_a_rule_boxes_its_inputs_to_broadcast() -> None:
    only_b = schema.REGISTRY[_ONLY_B]
    for sbp, kind in ((S.split(0), "all_gather"), (PSUM, "all_reduce")):
        d = decide(only_b, (_t((5, 3), P2, sbp),), {}, P2)
        assert d.in_sbps == ((B,),) and d.plans[0].collectives() == [kind]
    d = decide(only_b, (_t((5, 3), MESH, (S.split(0), S.split(1))),), {}, MESH)
    assert d.in_sbps == ((B, B),)
    x = sbpflow.tensor(torch.arange(6.0), placement=P2, sbp=S.split(0))
    assert only_b(x).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_mesh_signatures_are_products_of_1d_ones() -> None:
    a, b = _t((4, 6), MESH, (S.split(0), S.split(1))), _t((6, 3), MESH, (B, S.split(0)))
    d = decide(M.matmul, (a, b), {}, MESH)
    assert d.plans == (None, None) and d.out_sbps == ((S.split(0), PSUM),)


def test_decisions_are_cached_per_op_and_metadata(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = []
    real = dispatch.decide

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "decide", counting)
    x = sbpflow.tensor(torch.ones(13, 3), placement=P2, sbp=S.split(0))  # a shape no other test uses
    for _ in range(3):
        x.tanh()
    assert calls == ["tanh"]
    sbpflow.tensor(torch.ones(13, 3), placement=P2, sbp=S.split(1)).tanh()  # another SBP: a new decision
    x.sum(dim=0)
    x.sum(dim=0)
    x.sum(dim=1)  # another attribute: a new decision
    assert calls == ["tanh", "tanh", "sum", "sum"]
