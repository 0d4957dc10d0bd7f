"""The mutation check: flip one declared property of one op, rerun that op's partial-value checks, see them fail.

A flip toggles one partial signature of one case: a property the op declares is dropped, or one it does not
declare is added (each of sum, max and min through each data input, and the order-reversing max/min pair).
The rule table is patched in memory (``OpDef.sbp`` wrapped, the dispatch cache swapped for an empty one) and
restored afterwards; no file changes. A flip is caught when a check's outcome differs from the unflipped
run: a passing check fails, or a check failing on a known-wrong rule passes (a strict xfail turning red).

Run the whole sweep and write ``docs/testing.md`` with ``PYTHONPATH=src python -m tests.mutation_report``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opcases import OpCase, data_positions, sig, sig_text
from partial_checks import case_values, check_partial_inputs, check_table, declared, run_kernel_properties, run_local
from sbpflow.ops import dispatch
from sbpflow.ops.schema import REGISTRY, Meta, Sig
from sbpflow.sbp import Broadcast, Partial

PATTERNS = [("sum", "sum"), ("max", "max"), ("min", "min"), ("max", "min"), ("min", "max")]  # (input, output)

# The numeric checks (what the flips are meant to trip) and the table of kept signatures (a backstop).
CHECKS: dict[str, Callable[[OpCase], None]] = {
    "property": run_kernel_properties,
    "mesh 2": lambda c: check_partial_inputs(c, "2"),
    "mesh 3": lambda c: check_partial_inputs(c, "3"),
    "mesh 2x2": lambda c: check_partial_inputs(c, "2x2"),
    "table": check_table,
}


_MONOTONE = ("P(max) -> P(max)", "P(min) -> P(min)")
_ANTITONE = ("P(max) -> P(min)", "P(min) -> P(max)")
_PASSES_MAX_MIN = ("P(max) B -> P(max)", "P(min) B -> P(min)")  # selects or moves elements of a partial input
_BOOL_ALGEBRA = tuple(f"{a} -> {k}" for k in ("P(sum)", "P(max)", "P(min)")  # and/or distribute over or/and
                      for a in (f"{k} B", f"B {k}"))

# Added properties that hold for every input (reviewed by hand; no numeric check fails either): declarations
# the op could make to save a collective, not lies. A flip adding anything else must be caught.
_HOLDS: dict[str, tuple[str, ...]] = {
    "rsub": _ANTITONE,
    "maximum": _PASSES_MAX_MIN + ("B P(max) -> P(max)", "B P(min) -> P(min)"),
    "minimum": _PASSES_MAX_MIN + ("B P(max) -> P(max)", "B P(min) -> P(min)"),
    # a comparison with a NaN piece is False where the NaN value's is too only for the min of the pieces
    "lt": ("P(max) B -> P(min)", "B P(min) -> P(min)"),
    "le": ("P(max) B -> P(min)", "B P(min) -> P(min)"),
    "gt": ("P(min) B -> P(min)", "B P(max) -> P(min)"),
    "ge": ("P(min) B -> P(min)", "B P(max) -> P(min)"),
    "isnan": ("P(max) -> P(max)", "P(min) -> P(max)"),  # max and min propagate NaN
    "logical_and": _BOOL_ALGEBRA,
    "logical_or": _BOOL_ALGEBRA,
    "logical_not": _ANTITONE,
    "where": ("B P(max) B -> P(max)", "B P(min) B -> P(min)", "B B P(max) -> P(max)", "B B P(min) -> P(min)"),
    "relu_backward": _PASSES_MAX_MIN,
    "gelu_backward": ("P(sum) B -> P(sum)",),  # dy * gelu'(x): linear in dy
    "index_scatter": _PASSES_MAX_MIN,
    "pick": _PASSES_MAX_MIN,
    "unpick": _PASSES_MAX_MIN,
    "slice_backward": _MONOTONE,
    "cat": _PASSES_MAX_MIN + ("B P(max) -> P(max)", "B P(min) -> P(min)"),
    "bucket_flatten": _PASSES_MAX_MIN + ("B P(max) -> P(max)", "B P(min) -> P(min)"),  # a cat, flattened
    # ZeRO's gather bucket cut back into tensors: it only moves elements, so it is linear and passes max/min
    "bucket_unshard": tuple(f"{k} -> {k} {k}" for k in ("P(sum)", "P(max)", "P(min)")),
    "embedding": ("B P(sum) -> P(sum)", "B P(max) -> P(max)", "B P(min) -> P(min)"),  # rows of the weight
    "linear": ("B P(sum) -> P(sum)", "B B P(max) -> P(max)", "B B P(min) -> P(min)"),  # in w; in the bias
    "conv2d": ("B B P(max) -> P(max)", "B B P(min) -> P(min)"),  # monotone in the bias
    "conv_transpose2d": ("B B P(max) -> P(max)", "B B P(min) -> P(min)"),  # monotone in the bias
    # monotone in the bias; mean and rstd do not depend on it, so they are B, and also P(max)/P(min) of equal pieces
    "layer_norm": ("B B P(max) -> P(max) B B", "B B P(min) -> P(min) B B", "B B P(max) -> P(max) P(max) P(max)",
                   "B B P(min) -> P(min) P(min) P(min)"),
    "rms_norm": ("B P(sum) -> P(sum) B",),  # linear in the weight; rstd does not depend on it
    "rms_norm_backward": ("P(sum) B B B -> P(sum) P(sum)",),  # linear in dy
    # linear in dy; the bias does not enter the gradients at all
    "any": ("P(sum) -> P(sum)",),  # a P(sum) of bools reduces as OR, any()'s own partial
    "masked_select_backward": _PASSES_MAX_MIN,
    # an update is monotone in the parameter (for weight decay below 1 / lr)
    "sgd_update": _PASSES_MAX_MIN,
    "sgd_momentum_update": ("P(max) B B -> P(max) P(max)", "P(min) B B -> P(min) P(min)"),
    "adam_update_multi": ("P(max) B B B -> P(max) P(max) P(max)", "P(min) B B B -> P(min) P(min) P(min)"),
    "scale_multi": ("B B P(sum) -> P(sum) P(sum)",),  # g * c is linear in the factor c
    "layer_norm_backward": ("P(sum) B B B B B -> P(sum) P(sum) P(sum)",) + tuple(
        f"B B B B B {a} -> {b} {b} {b}" for a, b in [("P(max)", "P(max)"), ("P(min)", "P(min)"), ("P(max)", "P(min)"),
                                                  ("P(min)", "P(max)")]),
}
TRUE_PROPERTIES: set[tuple[str, str]] = {(op, sig_text(sig(s))) for op, sigs in _HOLDS.items() for s in sigs}


@dataclass(frozen=True)
class Flip:
    op: str
    sig: Sig
    adds: bool  # True: declares a property the op lacks; False: drops one it declares

    def __str__(self) -> str:
        return f"{'+' if self.adds else '-'} {sig_text(self.sig)}"


@dataclass(frozen=True)
class Verdict:
    flip: Flip
    caught_by: tuple[str, ...]  # "case: check" for each check whose outcome changed
    first_error: str  # the first changed check's message, shortened
    known_wrong: bool  # a case of this op already fails on a known-wrong rule

    @property
    def caught(self) -> bool:
        """Caught by a numeric check, not only by the table of kept signatures."""
        return any(not by.endswith(": table") for by in self.caught_by)


def by_op(cases: list[OpCase]) -> dict[str, list[OpCase]]:
    grouped: dict[str, list[OpCase]] = {}
    for c in cases:
        grouped.setdefault(c.op, []).append(c)
    return grouped


def flips(op: str, cases: list[OpCase]) -> list[Flip]:
    """Every kept or declared partial signature of the op's cases (dropped) and every pattern not declared (added)."""
    now = [s for c in cases for s in declared(c)]
    candidates = [s for c in cases for s in [sig(k) for k in c.keeps] + declared(c) + _patterns(c)]
    return [Flip(op, s, adds=s not in now) for s in dict.fromkeys(candidates)]


def _n_tensors(case: OpCase) -> int:
    return sum(1 for a in case_values(case) if hasattr(a, "shape"))


def _patterns(case: OpCase) -> list[Sig]:
    args = case_values(case)
    n_in = _n_tensors(case)
    n_out = len(run_local(case, args))
    out = []
    for k in data_positions(case, args):
        for kin, kout in PATTERNS:
            ins = tuple(Partial(kin) if i == k else Broadcast() for i in range(n_in))
            out.append(Sig(ins, (Partial(kout),) * n_out))
    return out


@contextmanager
def flipped(flip: Flip) -> Iterator[None]:
    """The op's rules with ``flip.sig`` toggled (dropped where declared, else added), for the block."""
    opdef = REGISTRY[flip.op]
    original = opdef.sbp

    def mutant(*args: Any, **kw: Any) -> list[Sig]:
        sigs = list(original(*args, **kw))
        if flip.sig in sigs:
            return [s for s in sigs if s != flip.sig]
        fits = len(flip.sig.ins) == sum(isinstance(a, Meta) for a in args)
        return sigs + [flip.sig] if fits else sigs

    cache = dispatch._global_cache
    opdef.sbp = mutant
    dispatch._global_cache = {}  # decisions made under the real rules must not answer for the mutant
    try:
        yield
    finally:
        opdef.sbp = original
        dispatch._global_cache = cache


def outcomes(case: OpCase) -> dict[str, str]:
    """Each check's failure message for ``case`` ("" when it passes)."""
    result = {}
    for name, check in CHECKS.items():
        try:
            check(case)
            result[name] = ""
        except Exception as e:  # any failure counts: an assertion, an error from dispatch, a hypothesis report
            lines = str(e).strip().splitlines() or [""]
            line = next((x for x in lines if case.id in x), lines[0])  # the check's own message, not numpy's
            result[name] = f"{type(e).__name__}: {line.strip()}"[:200]
    return result


def judge(flip: Flip, cases: list[OpCase], baselines: dict[str, dict[str, str]]) -> Verdict:
    """Runs the checks of every case of the op that the flipped signature fits."""
    changed: list[str] = []
    first = ""
    with flipped(flip):
        for case in cases:
            if _n_tensors(case) != len(flip.sig.ins):
                continue
            before, after = baselines[case.id], outcomes(case)
            for name in CHECKS:
                if bool(after[name]) != bool(before[name]):
                    changed.append(f"{case.id}: {name}")
                    first = first or after[name] or f"passes now ({before[name]})"
    return Verdict(flip, tuple(changed), first, any(c.known_wrong for c in cases))


def sweep(cases: list[OpCase]) -> list[Verdict]:
    verdicts = []
    for op, group in by_op(cases).items():
        baselines = {c.id: outcomes(c) for c in group}
        verdicts += [judge(f, group, baselines) for f in flips(op, group)]
    return verdicts
