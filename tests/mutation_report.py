"""Runs the full mutation sweep and writes ``docs/testing.md``.

    PYTHONPATH=src python -m tests.mutation_report          # from the repository root (a few minutes)
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from mutation import TRUE_PROPERTIES, Verdict, sweep  # noqa: E402
from opcases import CASES, sig_text  # noqa: E402

INTRO = """\
# Testing partial values

An op declares its algebraic properties inside its SBP signatures: `P(sum) -> P(sum)` means linear in that
input, `P(max) -> P(max)` monotone non-decreasing, `P(max) -> P(min)` non-increasing. A wrong declaration gives
wrong numbers with no error, so three kinds of tests hold every op to its rules (issue 13, section 2):

* **Random pieces** (`tests/harness.py`, `partial_shards`): a partial input is built from random per-rank
  pieces, each wrong alone, whose reduction is the value: noise adding up for `P(sum)`; for `P(max)`/`P(min)`
  one rank per element holds the value and the others something below (above), a quarter of them ±inf as from
  an empty shard. Nested along every partial axis of 2-D meshes, seeded. Every `check(...)` case uses them.
* **Properties on the kernel** (`tests/logic/test_op_properties.py`): for each case of `tests/opcases.py`
  (every registered op has one), every declared partial signature is checked with hypothesis on the kernel
  itself: the pieces' outputs, reduced, equal the output of the reduced inputs, including ±inf, ±0, subnormals
  and the dtype's extremes for elementwise ops. The declared signatures must also equal the case's `keeps`.
* **Pieces on meshes** (`tests/sim/test_partial_inputs.py`): on 2 and 3 ranks and a 2x2 mesh, every kept or
  declared partial signature gives the single-device value, with no collective and a partial output.

Declarations proven wrong and listed in issue 13 section 1 (casts of partials, `log`/`sqrt` of `P(max)`) are
strict xfails naming that section; they turn red when the rules are fixed, and the marker goes then.

## Mutation check

`tests/mutation.py` flips one partial signature of one case at a time, in memory (the op's `sbp` rule wrapped,
the dispatch cache swapped), and reruns that case's checks: a declared property is dropped, or one not
declared is added (sum, max and min through each data input, and the order-reversing max/min pairs). A flip
is *caught* when a numeric check (kernel property or mesh) changes outcome; the `keeps` table catches every
flip by construction and is listed but not counted. `tests/sim/test_mutation.py` runs a representative
subset in the default run and the whole sweep under `-m slow`; regenerate this file with
`PYTHONPATH=src python -m tests.mutation_report`.

Additions that no check catches are reviewed by hand and listed in `TRUE_PROPERTIES` (`tests/mutation.py`):
properties that hold for every input, so declaring them would save a collective rather than lie. Among
them: `linear` and `embedding` are linear in the weight, `gelu_backward`, `layer_norm_backward` and
`rms_norm_backward` linear in `dy`, `rms_norm` in its weight, and comparisons, `where`, `cat`, `pick`,
`maximum`/`minimum` pass `P(max)`/`P(min)`. Any other uncaught flip fails the slow test.

## Found on the way

* `conv2d` under `S(1) x S(1) -> P(sum)` (row parallel) fails when a rank holds no input channel (2
  channels on 3 ranks): its kernel returns a `(N, 0, H, W)` piece. The random-pieces mesh test found it;
  the case `conv2d-empty-shard` was a strict xfail on the 3-rank and 2x2 meshes until the kernel was fixed
  (such a rank now runs on one zero channel: its piece is the bias piece alone).
* `log` and `sqrt` are right to pass `P(min)` (where the smallest piece is out of the domain, so is the
  value) and wrong to pass `P(max)`; casts are linear only to a wider float and monotone unless the target
  is an integer or bool (section 1's list, strict xfails here).
"""


def _note(v: Verdict) -> str:
    if v.caught:
        return ""
    if (v.flip.op, sig_text(v.flip.sig)) in TRUE_PROPERTIES:
        return "holds: a true property the op does not declare (reviewed), not a lie"
    if v.known_wrong:
        return "masked: a case of this op already fails on its known-wrong rule (section 1)"
    return "NOT CAUGHT"


def render(verdicts: list[Verdict], seconds: float) -> str:
    total = len(verdicts)
    caught = sum(v.caught for v in verdicts)
    notes = Counter(_note(v) for v in verdicts if not v.caught)
    true_ones = notes.get("holds: a true property the op does not declare (reviewed), not a lie", 0)
    lines = [INTRO, "## Results", ""]
    lines.append(f"{total} flips over {len({v.flip.op for v in verdicts})} ops ({len(CASES)} cases) in "
                 f"{seconds:.0f} s on one thread: **{caught}/{total} caught ({100 * caught / total:.1f} %)** by a "
                 f"numeric check; **{caught}/{total - true_ones} ({100 * caught / (total - true_ones):.1f} %)** of the "
                 f"flips that make a rule lie.")
    lines.append("")
    for note, n in sorted(notes.items()):
        lines.append(f"* Not caught, {note}: {n}.")
    lines += ["", "| op | flip | caught by (case: check) | note |", "|---|---|---|---|"]
    for v in verdicts:
        by = ", ".join(v.caught_by) or "-"
        lines.append(f"| {v.flip.op} | `{v.flip}` | {by} | {_note(v)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    verdicts = sweep(CASES)
    text = render(verdicts, time.perf_counter() - start)
    out = TESTS.parent / "docs" / "testing.md"
    out.write_text(text)
    print(text.split("| op |")[0])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
