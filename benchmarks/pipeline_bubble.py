"""The pipeline bubble measured on the actor runtime's timeline, against (p - 1) / (m + p - 1).

A GPT with one block per stage is compiled under ``pp=p`` with ``m`` micro-batches and each schedule; the
plan then runs in synthetic time (``ActorRuntime(synthetic=...)``): every stage's forward sleeps F seconds
and its backward 2F, spread over its compute nodes (``graph.pipeline.balanced_durations``), everything
else takes no time. Sleeping threads overlap like devices, so p stages run concurrently on 2 cores. The
bubble of a stage is the share of the step (first act to last act of any stage) that its compute thread
spends outside those sleeps; the table gives the mean over stages.

    PYTHONPATH=src python benchmarks/pipeline_bubble.py [--forward-ms 40] [--write] [--png docs/img/x.png]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _report import machine, write_section  # noqa: E402

from sbpflow.demo.train_gpt import build, random_batches  # noqa: E402
from sbpflow.graph.pipeline import PipelineWarning, balanced_durations  # noqa: E402
from sbpflow.graph.schedule import bubble_theory, zero_bubble_theory  # noqa: E402
from sbpflow.models.gpt import GPTConfig  # noqa: E402
from sbpflow.runtime import trace as runtime_trace  # noqa: E402
from sbpflow.runtime.actors import ActorRuntime  # noqa: E402

SECTION = "pipeline-bubble"


def compile_plan(p: int, m: int, schedule: str, virtual: int = 1) -> Any:
    """The compiled training step of a small GPT (one block per stage), without running it."""
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=p * virtual, n_head=2, n_embd=16, dropout=0.0)
    trainer = build(config, f"pp={p}", graph=True, micro_batches=m, schedule=schedule, virtual_stages=virtual)
    trainer.graph.config.set_sbp_selection("greedy")
    ids, targets = next(random_batches(config.vocab_size, 1, m, config.block_size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PipelineWarning)
        return trainer.graph._compile(trainer.inputs(ids, targets)).plan


def run_synthetic(plan: Any, forward_s: float, path: str) -> list[dict[str, Any]]:
    """One step in synthetic time with its timeline written to ``path``; returns the timeline's events.
    Backward is 2F; under zero_bubble, B (input gradients) F and W (weight gradients) F."""
    if plan.pipeline.schedule.splits_backward:
        durations = balanced_durations(plan, forward_s, forward_s, forward_s)
    else:
        durations = balanced_durations(plan, forward_s, 2 * forward_s)
    with ActorRuntime(plan, trace=path, synthetic=lambda node: durations.get(node.id, 0.0)) as runtime:
        runtime.run({}, {})
    return [dict(e, sleeps=durations.get(_node_id(e), 0.0)) for e in runtime_trace.load(path)]


def _node_id(event: dict[str, Any]) -> int:
    name = event.get("name", "")
    return int(name.split()[0][1:]) if name.startswith("#") else -1


def stage_spans(plan: Any, events: list[dict[str, Any]]) -> list[list[tuple[float, float, str]]]:
    """Per stage, the (start, end, label) of its sleeping compute acts, in seconds."""
    pipe = plan.pipeline
    spans: list[list[tuple[float, float, str]]] = [[] for _ in pipe.stages]
    for e in events:
        if e.get("ph") != "X" or e["sleeps"] <= 0:
            continue
        nid = _node_id(e)
        stage = pipe.stage_of[nid]
        chunk = f".{stage // len(pipe.stages)}" if pipe.virtual > 1 else ""
        label = f"{pipe.part_of[nid]}{e['args']['micro_batch']}{chunk}"
        spans[stage % len(pipe.stages)].append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, label))
    return spans


def theory(schedule: str, p: int, m: int, virtual: int = 1) -> float:
    """(p - 1) / (v m + p - 1); ZB-H1 with F = B = W: (p - 1) / (3m + p - 1), a third of 1F1B's idle time."""
    return zero_bubble_theory(p, m) if schedule == "zero_bubble" else bubble_theory(p, m, virtual)


def measured_bubble(spans: list[list[tuple[float, float, str]]]) -> float:
    start = min(s for stage in spans for s, _, _ in stage)
    end = max(e for stage in spans for _, e, _ in stage)
    busy = [sum(e - s for s, e, _ in stage) for stage in spans]
    return float(np.mean([1.0 - b / (end - start) for b in busy]))


def gantt(spans: list[list[tuple[float, float, str]]], title: str, path: str) -> None:
    """A Gantt chart of the stages' forward (light), backward (dark) and weight-gradient (green) acts, merged per
    micro-batch (and chunk: F3.1 is micro-batch 3 on a placement's second stage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(s for stage in spans for s, _, _ in stage)
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(spans)))
    for row, stage in enumerate(spans):
        for s, e, label in _merge(stage):
            color = {"F": "#9ecae1", "B": "#3182bd", "W": "#74c476"}[label[0]]
            ax.barh(row, e - s, left=s - origin, color=color, edgecolor="white")
            ax.text((s + e) / 2 - origin, row, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(spans)), [f"stage {s}" for s in range(len(spans))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _merge(stage: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Consecutive acts of one F or B (same label) as one bar."""
    out: list[tuple[float, float, str]] = []
    for s, e, label in sorted(stage):
        if out and out[-1][2] == label:
            out[-1] = (out[-1][0], e, label)
        else:
            out.append((s, e, label))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward-ms", type=float, default=200.0, help="each stage's forward time (backward: 2x)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "zero_bubble", "interleaved_1f1b"])
    parser.add_argument("--virtual", type=int, default=2, help="stages per placement under interleaved_1f1b")
    parser.add_argument("--png", default="docs/img/pipeline_1f1b_p4_m8.png", help="Gantt chart of 1f1b, p=4, m=8")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    pngs: list[str] = []
    folder = tempfile.mkdtemp()
    for schedule in args.schedules:
        for p in args.stages:
            for m in args.micro_batches:
                v = args.virtual if schedule == "interleaved_1f1b" else 1
                if m % p and v > 1:
                    continue  # Megatron's interleaved order takes micro-batches in groups of p
                plan = compile_plan(p, m, schedule, v)
                events = run_synthetic(plan, args.forward_ms / 1e3, os.path.join(folder, f"{schedule}{p}{m}.json"))
                spans = stage_spans(plan, events)
                got, want = measured_bubble(spans), theory(schedule, p, m, v)
                rows.append((schedule, p, m, got, want))
                print(f"{schedule:<16} p={p} m={m:<3} bubble {got:6.1%}  theory {want:6.1%}  "
                      f"({(got - want) * 100:+.1f} points)", flush=True)
                if args.png and (schedule, p, m) == ("1f1b", 4, 8):
                    gantt(spans, "1F1B, 4 stages, 8 micro-batches (synthetic time, B = 2F)", args.png)
                    print(f"wrote {args.png}")
                if args.png and (schedule, p, m) in (("interleaved_1f1b", 4, 8), ("zero_bubble", 4, 8)):
                    path = args.png.replace("1f1b", schedule)
                    gantt(spans, f"{schedule}, 4 stages, 8 micro-batches (synthetic time)", path)
                    pngs.append(path)
    body = _table(rows, args.forward_ms, args.png, pngs)
    print(body)
    if args.write:
        write_section(SECTION, body)


def _table(rows: list[tuple[str, int, int, float, float]], forward_ms: float, png: str | None,
           pngs: list[str]) -> str:
    lines = [
        "## Pipeline bubble (synthetic time)",
        "",
        f"`PYTHONPATH=src python benchmarks/pipeline_bubble.py --write` on {machine()}. A GPT with one block per",
        f"stage, compiled under `pp=p`; each stage's forward sleeps {forward_ms:g} ms and its backward twice that,",
        "spread over its compute nodes fed by the model's input; everything else takes no time",
        "(`ActorRuntime(synthetic=...)`). The bubble is the mean over stages of the idle share of the step, read",
        "from the runtime's timeline. Theory: (p - 1) / (m + p - 1); interleaved 1F1B (v = 2 stages per",
        "placement, one block each, each taking half a stage's time; m a multiple of p) (p - 1) / (v m + p - 1);",
        "ZB-H1 (B and W each take F; the first stage, which needs no input gradient, spends both in W)",
        "(p - 1) / (3m + p - 1), a third of 1F1B's idle time, or 1 - 3m / (2m + 2p - 1) when m < p (the first",
        "micro-batch's trip to the last stage and back comes first). The schedule comes from register counts",
        "(1F1B: p - s activation slots on stage s; ZB: p, and its B-to-W buffers what W's lag keeps in flight;",
        "interleaved: each virtual stage's peak along",
        "Megatron's order) and each rank's action order (ZB-H1: 1F1B's F and B, W k - s right after B k on",
        "stage s). Interleaved p = 8, m = 4 is left out (Megatron's order takes micro-batches in groups of p).",
        "The unit-step dry runs of every schedule equal their theory exactly (tests/logic/test_schedule.py);",
        "what the table adds over theory is the runtime's own cost between acts (thread hand-offs, bookkeeping",
        "on a shared 2-core machine), which counts as idle time here.",
        "",
        "| schedule | p | m | measured | theory | difference |",
        "|---|---|---|---|---|---|",
    ]
    for schedule, p, m, got, want in rows:
        lines.append(f"| {schedule} | {p} | {m} | {got:.1%} | {want:.1%} | {(got - want) * 100:+.1f} points |")
    if png:
        lines += ["", f"![1F1B, 4 stages, 8 micro-batches]({os.path.relpath(png, 'docs')})"]
    for path in pngs:
        name = os.path.basename(path).removesuffix(".png").replace("_", " ")
        lines += ["", f"![{name}]({os.path.relpath(path, 'docs')})"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
