"""Runs the full mutation sweep of the ops' partial signatures and writes its section of ``docs/testing.md``.

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

START, END = "<!-- op_mutation:start -->", "<!-- op_mutation:end -->"  # the section of docs/testing.md this writes


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
    lines = ["## Results", ""]
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
    doc = out.read_text()
    head, rest = doc.split(START, 1)
    out.write_text(f"{head}{START}\n{text}{END}{rest.split(END, 1)[1]}")
    print(text.split("| op |")[0])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
