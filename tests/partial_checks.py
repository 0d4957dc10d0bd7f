"""The three checks behind the partial-value tests, as plain functions (the mutation check calls them too).

* :func:`check_table`: the op declares exactly the partial signatures its case ``keeps``.
* :func:`check_kernel_properties`: every declared property holds on the kernel for hypothesis-drawn pieces:
  the pieces' outputs, reduced, equal the output of the reduced inputs (``f(a) + f(b) = f(a + b)`` for
  ``P(sum)``, ``max(f(a), f(b)) = f(max(a, b))`` for ``P(max)``), with ±inf, zeros and the dtype's range
  for elementwise ops.
* :func:`check_partial_inputs`: on a placement, inputs held as random pieces in each kept or declared
  signature give the single-device value, with no collective and the output still partial.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import sbpflow
from harness import PLACEMENTS, global_tensor
from opcases import OpCase, sig, sig_text
from sbpflow.comm import record
from sbpflow.ops.schema import REGISTRY, Meta, Scalar, Sig
from sbpflow.sbp import Broadcast, Partial, Split
from sbpflow.tensor import Tensor

Draw = Callable[[st.SearchStrategy[Any]], Any]

# seeded, and no shrinking: a failure shows its (unshrunk) pieces, and known-wrong cases stay fast
PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def case_values(case: OpCase, seed: int = 0) -> tuple[Any, ...]:
    return case.args(torch.Generator().manual_seed(seed))


def _metas(args: Sequence[Any]) -> list[Any]:
    return [Meta(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else Scalar(type(a)) for a in args]


def declared(case: OpCase, mesh: tuple[int, ...] = (2,)) -> list[Sig]:
    """The op's signatures with a partial input, for this case's argument metadata."""
    opdef = REGISTRY[case.op]
    metas = _metas(case_values(case))
    outs = opdef.meta(*metas, **case.attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    extra = {"mesh": mesh} if opdef.mesh_aware else {}
    sigs = opdef.sbp(*metas, outs=outs, **extra, **case.attrs)
    n_tensors = sum(isinstance(m, Meta) for m in metas)
    return [s for s in sigs if len(s.ins) == n_tensors and any(isinstance(x, Partial) for x in s.ins)]


def run_local(case: OpCase, args: Sequence[Any]) -> tuple[torch.Tensor, ...]:
    """The op on whole (local) values: the single-device reference, and the kernel the properties are about."""
    wrapped = [Tensor._from_local(a) if isinstance(a, torch.Tensor) else a for a in args]
    out = REGISTRY[case.op](*wrapped, **case.attrs)
    return tuple(o.to_local() for o in (out if isinstance(out, tuple) else (out,)))


# -- the table ---------------------------------------------------------------------------------------


def check_table(case: OpCase) -> None:
    got = sorted(sig_text(s) for s in declared(case))
    want = sorted(sig_text(sig(k)) for k in case.keeps)
    assert got == want, f"{case.op} declares partial signatures {got}, the case keeps {want}"


# -- properties on the kernel ------------------------------------------------------------------------


def check_kernel_properties(case: OpCase, draw: Draw) -> None:
    """Each declared partial-to-partial signature (no split input) holds for drawn pieces."""
    args = case_values(case)
    for s in declared(case):
        if not any(isinstance(x, Split) for x in s.ins):
            _check_property(case, s, args, draw)


def _tensor_positions(args: Sequence[Any]) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


def run_kernel_properties(case: OpCase) -> None:
    """:func:`check_kernel_properties` under hypothesis, outside pytest (the mutation check)."""

    @PROPERTY_SETTINGS
    @given(data=st.data())
    def properties(data: st.DataObject) -> None:
        check_kernel_properties(case, data.draw)

    properties()


def _check_property(case: OpCase, s: Sig, args: tuple[Any, ...], draw: Draw) -> None:
    pieces: list[list[Any]] = [list(args), list(args)]  # the arguments rank 0 and rank 1 hold
    logical = list(args)
    drawn: list[list[torch.Tensor]] = [[], [], []]  # rank 0's pieces, rank 1's, their reductions
    for pos, spec in zip(_tensor_positions(args), s.ins, strict=True):
        if isinstance(spec, Partial):
            a = args[pos]
            p0, p1 = (draw(_pieces(a.shape, a.dtype, case.elementwise)) for _ in range(2))
            if case.elementwise and a.dtype.is_floating_point:  # pieces that cancel: x + -x, and inf + -inf
                p1 = torch.where(draw(hnp.arrays(np.bool_, tuple(a.shape)).map(torch.from_numpy)), -p0, p1)
            pieces[0][pos], pieces[1][pos] = p0, p1
            logical[pos] = _reduce(spec.op, [p0, p1])
            for held, x in zip(drawn, (p0, p1, logical[pos]), strict=True):
                held.append(x)
    outs = [run_local(case, p) for p in pieces]
    ref = run_local(case, logical)
    rtol = _rtol(case, s, logical)
    for j, spec in enumerate(s.outs):
        what = f"{case.id}: declared {sig_text(s)}, output {j}"
        got = [o[j] for o in outs]
        if isinstance(spec, Partial):
            _assert_reduces(spec.op, got, ref[j], drawn if case.elementwise else None, rtol,
                            0.0 if case.elementwise else rtol * 8 * _magnitude(logical), what)
        else:
            for g in got:  # B: the output does not depend on the partial input
                _assert_close(g, ref[j], rtol, 0.0, what)


def _reduce(op: str, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    out = xs[0]
    for x in xs[1:]:
        out = out + x if op == "sum" else (torch.maximum(out, x) if op == "max" else torch.minimum(out, x))
    return out


def _rtol(case: OpCase, s: Sig, logical: Sequence[Any]) -> float:
    """Rounding allowed: the partial inputs' precision (exact for integers), unless the case says otherwise."""
    if case.rtol is not None:
        return case.rtol
    positions = _tensor_positions(logical)
    dtypes = [logical[p].dtype for p, x in zip(positions, s.ins, strict=True) if isinstance(x, Partial)]
    eps = [torch.finfo(d).eps for d in dtypes if d.is_floating_point]
    return 16 * max(eps) if eps else 0.0


def _assert_reduces(op: str, outs: list[torch.Tensor], ref: torch.Tensor, drawn: list[list[torch.Tensor]] | None,
                    rtol: float, atol: float, what: str) -> None:
    """``op`` over the pieces' outputs equals ``ref``: exactly for max/min and integers, else within rounding.

    ``drawn`` (elementwise ops: the partial inputs' pieces and their reductions, shaped like the output) marks
    where a piece is ±inf, compared exactly, and where finite pieces overflow, which no rule can help.
    """
    reduced = _reduce(op, outs)
    if op != "sum" or not ref.dtype.is_floating_point:
        _assert_equal(reduced, ref, f"{what}: pieces reduced by {op} {_show(reduced)} != op of the reduced inputs "
                                    f"{_show(ref)}")
        return
    checked = _finite([*outs, ref], reduced)
    scale = sum((o.abs().double() for o in outs), ref.abs().double())  # the sum's own rounding grows with its terms
    if drawn is not None:
        ranks, sums = drawn[:2], drawn[2]
        finite_pieces = [_finite(held, reduced) for held in ranks]
        overflow = torch.stack([f & ~o.isfinite() for f, o in zip(finite_pieces, outs, strict=True)]).any(0)
        for p0, p1, total in zip(ranks[0], ranks[1], sums, strict=True):
            overflow |= _finite([p0, p1], reduced) & ~_finite([total], reduced)
        special = ~(finite_pieces[0] & finite_pieces[1]) & ~overflow
        _assert_equal(reduced[special], ref[special], f"{what}: with a ±inf piece")
        checked &= ~special & ~overflow
        scale = scale + sum((x.abs().double() for x in ranks[0] + ranks[1]), torch.zeros_like(scale))
        atol = 4 * torch.finfo(ref.dtype).tiny  # below the normal range rounding is absolute
    diff = (reduced.double() - ref.double()).abs()
    bad = checked & (diff > rtol * scale + atol)
    assert not bool(bad.any()), (f"{what}: sum of the pieces' outputs {_show(reduced[bad])} != op of the summed "
                                 f"inputs {_show(ref[bad])} (rtol {rtol:.2g})")


def _finite(xs: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Where every float tensor of ``xs`` (shaped like ``like``) is finite."""
    flags = [x.isfinite() for x in xs if x.dtype.is_floating_point and x.shape == like.shape]
    return torch.stack(flags).all(0) if flags else torch.ones(like.shape, dtype=torch.bool)


def _magnitude(args: Sequence[Any]) -> float:
    """The size of the terms a non-elementwise kernel sums (max |value| over the float inputs, squared)."""
    big = max((float(a.abs().max()) for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point
               and a.numel()), default=1.0)
    return max(1.0, big) ** 2


def _assert_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    np.testing.assert_array_equal(_np(a), _np(b), err_msg=what)


def _assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    np.testing.assert_allclose(_np(a), _np(b), rtol=rtol, atol=atol, err_msg=what)


def _np(x: torch.Tensor) -> np.ndarray:
    return (x.float() if x.dtype == torch.bfloat16 else x).numpy()


def _show(x: torch.Tensor) -> str:
    return str(x.reshape(-1)[:4].tolist())


def _pieces(shape: torch.Size, dtype: torch.dtype, elementwise: bool) -> st.SearchStrategy[torch.Tensor]:
    """One rank's piece: ±inf, NaN, ±0 and the dtype's extremes for elementwise ops; small exact values otherwise."""
    if not elementwise:
        return st.tuples(st.integers(0, 2**31), st.sampled_from([0.0, 0.5, 0.9])).map(
            lambda drawn: _seeded_piece(shape, dtype, *drawn))
    if dtype == torch.bool:
        elements: st.SearchStrategy[Any] = st.booleans()
        np_dtype: Any = np.bool_
    elif not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        elements = st.one_of(st.integers(-100, 100), st.sampled_from([info.min, info.max, 0, -1, 1]))
        np_dtype = np.int64
    else:
        return _float_pieces(shape, dtype)
    return hnp.arrays(np_dtype, tuple(shape), elements=elements).map(lambda a: torch.from_numpy(a).to(dtype))


def _float_pieces(shape: torch.Size, dtype: torch.dtype) -> st.SearchStrategy[torch.Tensor]:
    """Edge values per element (±inf, NaN, ±0, the dtype's extremes and subnormals, small quarters, floats), or
    dense noise over six decades (values no dtype holds exactly, so every piece rounds) with edges mixed in."""
    info = torch.finfo(dtype)
    edges = st.sampled_from([0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.max, -info.max, info.tiny,
                             -info.tiny, 0.5, -1.0])
    quarters = st.integers(-32, 32).map(lambda k: k / 4)  # exact sums, and pieces equal to other inputs
    dense = st.integers(0, 2**31).map(lambda seed: _noise(tuple(shape), seed))
    picked = hnp.arrays(np.float64, tuple(shape), elements=st.one_of(quarters, edges)).map(torch.from_numpy)
    where = hnp.arrays(np.bool_, tuple(shape)).map(torch.from_numpy)
    mixed = st.tuples(where, picked, dense).map(lambda t: torch.where(t[0], t[1], t[2]))
    per_element = hnp.arrays(np.float64, tuple(shape), elements=st.one_of(st.floats(-1e3, 1e3), quarters, edges))
    return st.one_of(per_element.map(torch.from_numpy), mixed).map(lambda t: t.to(dtype))


def _noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = 10 ** (torch.rand(shape, generator=gen, dtype=torch.float64) * 6 - 3)  # 1e-3 .. 1e3
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def _seeded_piece(shape: torch.Size, dtype: torch.dtype, seed: int, zeros: float) -> torch.Tensor:
    """Quarters in [-8, 8] (sums and products stay exact), a fraction of them zero: drawn in bulk, as a
    kernel over many elements needs values, not per-element edge cases (those are the elementwise ops')."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-32, 33, tuple(shape), generator=gen) / 4
    values = torch.where(torch.rand(tuple(shape), generator=gen) < zeros, 0.0, values)
    if dtype == torch.bool:
        return values > 0
    return values.to(dtype) if dtype.is_floating_point else (values * 4).to(dtype)


# -- random pieces on a mesh -------------------------------------------------------------------------


def check_partial_inputs(case: OpCase, placement_name: str, seed: int = 0) -> None:
    """Every kept or declared partial signature, on ``placement_name``, against the single-device value."""
    placement = PLACEMENTS[placement_name]
    args = case_values(case, seed)
    ref = run_local(case, args)
    sigs = [sig(k) for k in case.keeps]
    sigs += [s for s in declared(case, placement.hierarchy) if s not in sigs]
    for s in sigs:
        # losing max/min pieces with ±inf (as from empty shards), and all finite: each can hide a wrong rule
        shares = (0.25, 0.0) if any(isinstance(x, Partial) and x.op != "sum" for x in s.ins) else (0.25,)
        for combo in _combos(s, placement.ndim):
            for share in shares:
                _run_on_mesh(case, combo, placement, args, ref, seed, share)


def _combos(s: Sig, ndim: int) -> list[tuple[Sig, ...]]:
    """``s`` on every mesh axis, and on 2-D meshes also B on axis 0 with ``s`` on axis 1."""
    if ndim == 1:
        return [(s,)]
    all_b = Sig((Broadcast(),) * len(s.ins), (Broadcast(),) * len(s.outs))
    return [(s,) * ndim, (all_b,) * (ndim - 1) + (s,)]


def _run_on_mesh(case: OpCase, combo: tuple[Sig, ...], placement: sbpflow.Placement, args: tuple[Any, ...],
                 ref: tuple[torch.Tensor, ...], seed: int, empty_share: float) -> None:
    positions = _tensor_positions(args)
    wrapped = list(args)
    for k, pos in enumerate(positions):
        nd = tuple(axis.ins[k] for axis in combo)
        wrapped[pos] = global_tensor(args[pos], placement, nd, seed=seed + 101 * k + 7, empty_share=empty_share)
    with record() as log:
        out = REGISTRY[case.op](*wrapped, **case.attrs)
    outs = out if isinstance(out, tuple) else (out,)
    layout = " x ".join(f"({sig_text(axis)})" for axis in combo)
    what = f"{case.id} on {placement} with {layout}"
    assert not log.events, f"{what}: a declared partial signature must run without communication: {log.counts()}"
    for j, (o, r) in enumerate(zip(outs, ref, strict=True)):
        want = tuple(axis.outs[j] for axis in combo)
        assert o.sbp == want, f"{what}: output {j} is {tuple(map(str, o.sbp))}, expected {tuple(map(str, want))}"
        if r.dtype.is_floating_point:
            _assert_close(torch.as_tensor(o.numpy()), r, 1e-4, 1e-5, f"{what}: output {j}")
        else:
            _assert_equal(torch.as_tensor(o.numpy()), r, f"{what}: output {j}")
