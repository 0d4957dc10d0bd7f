"""What ``sbpflow plan`` prints: the chosen plan, its time and memory by component, the runners-up and why
they lost, and the assumptions every number rests on. The same content as one JSON object for ``--json``."""

from __future__ import annotations

from typing import Any

from .predict import TIME_KEYS, Cluster, Prediction
from .search import SearchResult
from .transformer import TransformerSpec

GB = 1e9


def why_lost(loser: Prediction, best: Prediction) -> str:
    """One line: a plan that does not fit says by how much; a slower one names the components that grew most.

    The components are compared as totals over the step, so ``bubble +1.2 s`` means the pipeline's fill and
    drain cost 1.2 s more than in the chosen plan.
    """
    if not loser.fits:
        return (f"needs {loser.memory_per_device / GB:.1f} GB per device, {loser.usable_memory / GB:.1f} GB usable "
                f"({_largest_memory(loser)})")
    slower = loser.step_time - best.step_time
    deltas = sorted(((loser.breakdown[k] - best.breakdown[k], k) for k in TIME_KEYS), reverse=True)
    grew = ", ".join(f"{k} {d:+.2f} s" for d, k in deltas[:2] if d > 0)
    return f"{slower:+.2f} s ({slower / best.step_time:+.1%}): {grew or 'no component grew'}"


def _largest_memory(prediction: Prediction) -> str:
    name, size = max(prediction.memory.items(), key=lambda kv: kv[1])
    return f"{name} {size / GB:.1f} GB"


def plan_line(p: Prediction) -> str:
    return (f"{p.plan}  stages {_cuts(p.stage_layers)}  {p.step_time:.2f} s  {p.tflops_per_device:.1f} TFLOP/s  "
            f"{p.memory_per_device / GB:.1f} GB")


def _cuts(stage_layers: tuple[int, ...]) -> str:
    if len(set(stage_layers)) == 1:
        return f"{len(stage_layers)}x{stage_layers[0]}"
    return "[" + ",".join(map(str, stage_layers)) + "]"


def explain(spec: TransformerSpec, cluster: Cluster, best: Prediction, result: SearchResult | None = None) -> str:
    """The human-readable report (``result`` None: a fully given plan, predicted without a search)."""
    lines = [_header(spec, cluster, best), *_chosen(best), *_memory(best)]
    if result is not None:
        lines += _runners_up(result)
        lines.append(f"searched {result.candidates} plans, costed {result.costed} exactly (the rest bounded out) "
                     f"in {result.seconds:.2f} s")
    lines += _assumptions(cluster)
    return "\n".join(lines)


def _header(spec: TransformerSpec, cluster: Cluster, best: Prediction) -> str:
    nodes = -(-cluster.devices // cluster.gpus_per_node)
    return (f"model: {spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads, seq {spec.seq}, "
            f"vocab {spec.vocab} ({spec.params / 1e9:.1f}B parameters), batch {best.batch}\n"
            f"cluster: {cluster.devices} x {cluster.profile.name}, {cluster.gpus_per_node} per node ({nodes} nodes)")


def _chosen(p: Prediction) -> list[str]:
    micro_batches = p.batch // (p.plan.dp * p.plan.micro_batch)
    lines = [f"plan: {p.plan}, {micro_batches} micro-batches, stages {_cuts(p.stage_layers)} blocks",
             f"  step {p.step_time:.3f} s   {p.tflops_per_device:.1f} TFLOP/s per device (Megatron's count)   "
             f"MFU {p.mfu:.1%}",
             "  time by component (the slowest stage, times the micro-batches; bubble: the other stages' fill "
             "and drain):"]
    for key in TIME_KEYS:
        lines.append(f"    {key:<10} {p.breakdown[key]:9.3f} s  {p.breakdown[key] / p.step_time:6.1%}")
    return lines


def _memory(p: Prediction) -> list[str]:
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines = [f"  memory on the fullest device: {p.memory_per_device / GB:.1f} GB of {p.usable_memory / GB:.1f} GB "
             f"usable ({verdict})"]
    for key, size in p.memory.items():
        lines.append(f"    {key:<12} {size / GB:8.2f} GB")
    return lines


def _runners_up(result: SearchResult) -> list[str]:
    lines = ["runners-up (why they lost):"]
    for p in result.runners_up:
        lines.append(f"  {plan_line(p)}\n      {why_lost(p, result.best)}")
    if result.too_big:
        lines.append("faster, but not in memory:")
        for p in result.too_big:
            lines.append(f"  {plan_line(p)}\n      {why_lost(p, result.best)}")
    return lines


def _assumptions(cluster: Cluster) -> list[str]:
    prof = cluster.profile
    intra, inter = prof.intra_bandwidth * prof.eta_intra, prof.inter_bandwidth * prof.eta_inter
    return [
        f"what this rests on ({prof.source}):",
        f"  GEMMs at {prof.peak_flops / 1e12:.0f} TFLOP/s peak x eta {prof.eta_matmul:.2f}; other kernels at "
        f"{prof.mem_bandwidth / GB:.0f} GB/s x eta {prof.eta_memory:.2f}; {prof.launch_s * 1e6:.0f} us per kernel",
        f"  collectives alpha-beta: intra-node {prof.intra_alpha * 1e6:.0f} us + {intra / GB:.0f} GB/s, inter-node "
        f"{prof.inter_alpha * 1e6:.0f} us + {inter / GB:.0f} GB/s per device; ring algorithms",
        "  1F1B schedule; tensor parallel without sequence parallelism; gradient sync not overlapped; "
        "mixed-precision Adam (16 bytes/parameter before ZeRO)",
        f"  {prof.reserved_bytes / GB:.0f} GB per device reserved (context, fragmentation)",
    ]


def to_json(spec: TransformerSpec, cluster: Cluster, best: Prediction, result: SearchResult | None = None
            ) -> dict[str, Any]:
    """The ``--json`` object (its schema: ``PLAN_SCHEMA``)."""
    out = _prediction_json(best)
    out.update(
        model={"layers": spec.layers, "hidden": spec.hidden, "heads": spec.heads, "seq": spec.seq,
               "vocab": spec.vocab, "parameters": spec.params},
        cluster={"devices": cluster.devices, "device": cluster.profile.name,
                 "gpus_per_node": cluster.gpus_per_node},
        batch=best.batch,
        runners_up=[dict(_prediction_json(p), why=why_lost(p, best)) for p in (result.runners_up if result else [])],
        search=None if result is None else {"candidates": result.candidates, "costed": result.costed,
                                            "seconds": result.seconds},
    )
    return out


def _prediction_json(p: Prediction) -> dict[str, Any]:
    return {
        "tp": p.plan.tp, "pp": p.plan.pp, "dp": p.plan.dp, "micro_batch": p.plan.micro_batch,
        "zero": p.plan.zero, "recompute": p.plan.recompute, "stage_layers": list(p.stage_layers),
        "step_time_s": p.step_time, "tflops_per_device": p.tflops_per_device, "mfu": p.mfu,
        "memory_per_device_gb": p.memory_per_device / GB, "fits": p.fits,
        "memory_gb": {k: v / GB for k, v in p.memory.items()},
        "breakdown": dict(p.breakdown),
    }


_NUMBER = {"type": "number", "minimum": 0}
_PLAN_FIELDS = {
    "tp": {"type": "integer", "minimum": 1}, "pp": {"type": "integer", "minimum": 1},
    "dp": {"type": "integer", "minimum": 1}, "micro_batch": {"type": "integer", "minimum": 1},
    "zero": {"enum": [0, 1, 2, 3]}, "recompute": {"enum": ["none", "selective", "full"]},
    "stage_layers": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
    "step_time_s": {"type": "number", "exclusiveMinimum": 0}, "tflops_per_device": _NUMBER,
    "mfu": {"type": "number", "minimum": 0, "maximum": 1}, "memory_per_device_gb": _NUMBER,
    "fits": {"type": "boolean"},
    "memory_gb": {"type": "object", "required": ["weights", "gradients", "optimizer", "activations"],
                  "additionalProperties": _NUMBER},
    "breakdown": {"type": "object", "required": list(TIME_KEYS), "additionalProperties": False,
                  "properties": {k: _NUMBER for k in TIME_KEYS}},
}

PLAN_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "sbpflow plan --json",
    "type": "object",
    "required": [*_PLAN_FIELDS, "model", "cluster", "batch", "runners_up", "search"],
    "properties": {
        **_PLAN_FIELDS,
        "model": {"type": "object", "required": ["layers", "hidden", "heads", "seq", "vocab", "parameters"]},
        "cluster": {"type": "object", "required": ["devices", "device", "gpus_per_node"]},
        "batch": {"type": "integer", "minimum": 1},
        "runners_up": {"type": "array", "items": {"type": "object", "required": [*_PLAN_FIELDS, "why"],
                                                   "properties": {**_PLAN_FIELDS, "why": {"type": "string"}}}},
        "search": {"oneOf": [{"type": "null"}, {"type": "object", "required": ["candidates", "costed", "seconds"]}]},
    },
}
