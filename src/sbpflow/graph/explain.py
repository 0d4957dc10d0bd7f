"""Seeing a compiled plan: ``explain`` (text) and ``save_dot`` (Graphviz)."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from typing import Any

from ..boxing import get_cost_model
from ..sbp import format_nd
from .fuse import FUSED, sub_nodes
from .group import members
from .ir import LogicalGraph
from .physical import PhysicalPlan, PNode


def collective_counts(plan: PhysicalPlan, rank: int) -> Counter[str]:
    """Collectives rank ``rank`` issues per step, by kind (micro-phase ones counted once per micro-batch)."""
    counts: Counter[str] = Counter()
    for n in plan.collectives(rank):
        assert n.boxing is not None
        counts[n.boxing.steps[0].kind] += plan.micro_batches if n.phase == "micro" else 1
    return counts


def _link(n: PNode) -> str:
    assert n.boxing is not None
    step = n.boxing.steps[0]
    ranks = tuple(sorted(set(step.src.placement.flat_ranks) | set(step.dst.placement.flat_ranks)))
    model = get_cost_model()
    return "inter" if len({r // model.ranks_per_node for r in ranks}) > 1 else "intra"


def explain(g: LogicalGraph, plan: PhysicalPlan, report: Any, rank: int | None = None) -> str:
    """Signatures, boxing nodes with bytes and estimated time, and per-step totals."""
    rank = plan.world[0] if rank is None else rank
    m = plan.micro_batches
    lines = [f"compiled step: {len(g.nodes)} logical nodes ({report.removed_nodes} dead removed), "
             f"{len(plan.nodes)} physical nodes, {m} micro-batch{'es' if m > 1 else ''}"]
    fused = [n for n in plan.for_rank(rank) if n.op == FUSED]
    if fused:
        lines.append(f"fused segments (graph.fuse): {len(fused)} nodes of rank {rank} run "
                     f"{sum(len(sub_nodes(n)) for n in fused)} compute nodes as generated code")
    lines += accumulate_text(plan, rank)
    sel = report.selection
    if sel is not None:
        lines.append(f"sbp selection: {sel.method}, estimated {sel.chosen_cost * 1e3:.3f} ms "
                     f"(greedy {sel.greedy_cost * 1e3:.3f} ms), solved in {sel.solve_s:.2f} s"
                     + (f", {sel.classes} classes of tied ops, {sel.variables} variables" if sel.variables else ""))
    lines.append("")
    lines.append("ops (signature: inputs -> outputs):")
    for n in g.nodes:
        if n.kind == "op":
            ins = ", ".join(format_nd(s) for s in n.in_sbps)
            outs = ", ".join(format_nd(g.values[v].sbp) for v in n.outputs)
            lines.append(f"  {n.name:<24} ({ins}) -> ({outs})")
    lines.append("")
    lines.append(f"boxing nodes of rank {rank}:")
    per_link: Counter[str] = Counter()
    comm_time = 0.0
    for pn in plan.for_rank(rank):
        if pn.kind != "boxing" or pn.boxing is None:
            continue
        step = pn.boxing.steps[0]
        times = m if pn.phase == "micro" else 1
        per_link[_link(pn)] += step.bytes_per_rank * times
        comm_time += step.time * times
        lines.append(f"  #{pn.id:<5} {pn.name:<48} {step.bytes_per_rank:>10} B/rank {step.time * 1e6:9.1f} us"
                     f"{'  x' + str(m) if times > 1 else ''}")
    lines.append("")
    counts = collective_counts(plan, rank)
    lines.append("per step: collectives " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"))
    lines.append("          bytes per link " + (", ".join(f"{k} {v} B" for k, v in sorted(per_link.items()))
                                                or "none") + f", communication {comm_time * 1e3:.3f} ms")
    if sel is not None:
        lines.append(f"          predicted step time {sel.chosen_cost * 1e3 * m:.3f} ms (compute + boxing)")
    peaks = ", ".join(f"rank {r}: {b / 2**20:.2f} MiB" for r, b in sorted(plan.peak_bytes.items()))
    lines.append(f"          peak memory {peaks}")
    lines.append("compile time: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in report.times.items()))
    if plan.pipeline is not None:
        lines += ["", pipeline_text(plan)]
    return "\n".join(lines)


def accumulate_text(plan: PhysicalPlan, rank: int, width: int = 110) -> list[str]:
    """Rank ``rank``'s grouped accumulates (``graph.group``): acts per step, and each group's members."""
    accs = [n for n in plan.for_rank(rank) if n.kind == "accumulate"]
    groups = [n for n in accs if len(n.inputs) > 1]
    if not groups:
        return []
    m = plan.micro_batches
    gradients = sum(len(n.inputs) for n in accs)
    lines = [f"grouped accumulation (graph.group): rank {rank} sums {gradients} gradients with {len(accs)} "
             f"accumulate nodes, {len(accs) * m} acts per step (one per gradient: {gradients * m})"]
    for n in groups:
        head = f"  #{n.id} {n.name}:"
        line = head
        for member in members(n):
            buf = plan.bufs[member.outputs[0]]
            item = f" %{member.inputs[0]}->%{buf.id} {list(buf.shape)}"
            if len(line) + len(item) > width:
                lines.append(line)
                line = " " * len(head)
            line += item
        lines.append(line)
    return lines


def pipeline_text(plan: PhysicalPlan) -> str:
    """The pipeline schedule: activation bounds per stage and the rank x step grid of its dry run."""
    pipe = plan.pipeline
    sched = pipe.schedule
    bounds = ", ".join(f"stage {s}: {b}" for s, b in enumerate(sched.bounds))
    stages = f"{len(pipe.stages)} stages"
    if sched.virtual > 1:
        stages = (f"{sched.virtual_stages} stages on {len(pipe.stages)} placements (stage k on placement k mod "
                  f"{len(pipe.stages)}; F3.1 is micro-batch 3 on a placement's second stage)")
    return (f"pipeline: {stages}, schedule {sched.name}, {sched.micro_batches} micro-batches; "
            f"activation registers (micro-batches) {bounds}\n" + pipe.grid())


def _dot_logical(g: LogicalGraph) -> str:
    out = ["digraph logical {", "  rankdir=TB; node [shape=box, fontsize=10]; edge [fontsize=8];"]
    for n in g.nodes:
        shape = "ellipse" if n.kind in ("input", "variable", "constant") else "box"
        out.append(f'  n{n.id} [label="{n.kind}: {n.name}", shape={shape}];')
    for n in g.nodes:
        for i, vid in enumerate(n.inputs):
            v = g.values[vid]
            want = format_nd(n.in_sbps[i]) if n.in_sbps and i < len(n.in_sbps) else format_nd(v.sbp)
            label = format_nd(v.sbp) if want == format_nd(v.sbp) else f"{format_nd(v.sbp)}->{want}"
            out.append(f'  n{v.producer} -> n{n.id} [label="{label}"];')
    out.append("}")
    return "\n".join(out)


def _dot_physical(plan: PhysicalPlan, rank: int) -> str:
    out = [f'digraph physical_rank{rank} {{', "  rankdir=TB; node [fontsize=10];"]
    producers = plan.producers()
    mine = plan.for_rank(rank)
    ids = {n.id for n in mine}
    for n in mine:
        style = 'shape=hexagon, style=filled, fillcolor="#ffd8a8"' if n.is_comm else "shape=box"
        out.append(f'  p{n.id} [label="{n.kind}: {n.name}\\n{n.phase}", {style}];')
    for n in mine:
        for b in n.inputs:
            src = producers.get(b)
            if src in ids:
                out.append(f"  p{src} -> p{n.id};")
        for c in n.control:
            out.append(f"  p{c} -> p{n.id} [style=dashed];")
    out.append("}")
    return "\n".join(out)


def save_dot(g: LogicalGraph, plan: PhysicalPlan, path: str, rank: int | None = None) -> list[str]:
    """Writes ``path.logical.dot`` and ``path.rank<r>.dot``, plus SVGs when Graphviz's ``dot`` is installed."""
    rank = plan.world[0] if rank is None else rank
    written = []
    for suffix, text in (("logical", _dot_logical(g)), (f"rank{rank}", _dot_physical(plan, rank))):
        name = f"{path}.{suffix}.dot"
        with open(name, "w") as f:
            f.write(text)
        written.append(name)
        if shutil.which("dot"):
            subprocess.run(["dot", "-Tsvg", name, "-o", name[:-4] + ".svg"], check=True, timeout=60)
            written.append(name[:-4] + ".svg")
    return written
