"""What ``sbpflow plan`` prints: the chosen plan, its time and memory by component, the runners-up and why
they lost, and the assumptions every number rests on. The same content as one JSON object for ``--json``."""

from __future__ import annotations

from typing import Any

from .block_sbp import megatron
from .graph_plan import param_sbp
from .predict import TIME_KEYS, Cluster, Prediction, even_cuts
from .search import SearchResult
from .transformer import TransformerSpec
from .units import seconds, size

GB = 1e9


def flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def why_lost(loser: Prediction, best: Prediction) -> str:
    """One line: a plan that does not fit says by how much; a slower one names the components that grew most.

    The components are compared as totals over the step, so ``bubble +1.2 s`` means the pipeline's fill and
    drain cost 1.2 s more than in the chosen plan.
    """
    if not loser.fits:
        return (f"needs {size(loser.memory_per_device)} per device, {size(loser.usable_memory)} usable "
                f"({_largest_memory(loser)})")
    slower = loser.step_time - best.step_time
    deltas = sorted(((loser.breakdown[k] - best.breakdown[k], k) for k in TIME_KEYS), reverse=True)
    grew = ", ".join(f"{k} +{seconds(d)}" for d, k in deltas[:2] if d > 0)
    return f"+{seconds(slower)} ({slower / best.step_time:+.1%}): {grew or 'no component grew'}"


def _largest_memory(prediction: Prediction) -> str:
    name, nbytes = max(prediction.memory.items(), key=lambda kv: kv[1])
    return f"{name} {size(nbytes)}"


def plan_line(p: Prediction) -> str:
    return (f"{p.plan}  stages {_cuts(p.stage_layers)}  {seconds(p.step_time)}  "
            f"{flops(p.tflops_per_device * 1e12)} hardware, {flops(p.model_tflops_per_device * 1e12)} model  "
            f"{size(p.memory_per_device)}")


def _cuts(stage_layers: tuple[int, ...]) -> str:
    if len(set(stage_layers)) == 1:
        return f"{len(stage_layers)}x{stage_layers[0]}"
    return "[" + ",".join(map(str, stage_layers)) + "]"


def explain(spec: TransformerSpec, cluster: Cluster, best: Prediction, result: SearchResult | None = None) -> str:
    """The human-readable report (``result`` None: a fully given plan, predicted without a search)."""
    lines = [_header(spec, cluster, best), *_chosen(best), *_memory(best), *_block_lines(spec, cluster, best)]
    if result is not None:
        lines += _runners_up(result)
        lines.append(f"searched {result.candidates} plans, costed {result.costed} exactly (the rest bounded out) "
                     f"in {seconds(result.seconds)}")
    lines += _assumptions(cluster, spec)
    return "\n".join(lines)


def _header(spec: TransformerSpec, cluster: Cluster, best: Prediction) -> str:
    nodes = -(-cluster.devices // cluster.gpus_per_node)
    padded = spec.padded_vocab(best.plan.tp)
    vocab = f" (padded to {padded})" if padded != spec.vocab else ""
    return (f"model: {spec.describe()}{vocab}, {_count(spec.params)} parameters, batch {best.batch}\n"
            f"cluster: {cluster.devices} x {cluster.profile.name}, {cluster.gpus_per_node} per node ({nodes} nodes)")


def _count(n: float) -> str:
    """``174.6B``, ``1.3M``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def _chosen(p: Prediction) -> list[str]:
    micro_batches = p.batch // (p.plan.dp * p.plan.micro_batch)
    lines = [f"plan: {p.plan}, {micro_batches} micro-batches, stages {_cuts(p.stage_layers)} blocks",
             f"  step {seconds(p.step_time)}   per device: {flops(p.tflops_per_device * 1e12)} hardware (the FLOPs "
             f"this plan executes, recompute={p.plan.recompute} included), {flops(p.model_tflops_per_device * 1e12)}"
             f" model (forward and backward alone)   MFU {p.mfu:.1%}",
             "  time by component (the slowest stage, times the micro-batches; bubble: the other stages' fill "
             "and drain):"]
    for key in TIME_KEYS:
        lines.append(f"    {key:<10} {seconds(p.breakdown[key]):>11}  {p.breakdown[key] / p.step_time:6.1%}")
    return lines


def _memory(p: Prediction) -> list[str]:
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines = [f"  memory on the fullest device: {size(p.memory_per_device)} of {size(p.usable_memory)} "
             f"usable ({verdict})"]
    for key, nbytes in p.memory.items():
        lines.append(f"    {key:<12} {size(nbytes):>9}")
    return lines


def _block_lines(spec: TransformerSpec, cluster: Cluster, p: Prediction) -> list[str]:
    """The SBPs inside every block on the tensor-parallel group that this prediction priced."""
    if p.plan.tp == 1 or p.block is None:
        return []
    return [f"  inside each block, the SBPs this prediction used ({block_source(p)}):", f"    {p.block}"]


def block_source(p: Prediction) -> str:
    """Where a prediction's block SBPs came from, and whether they are Megatron-LM's."""
    assert p.block is not None
    kind = "Megatron-LM's column/row layers" if megatron(p.block) else "not Megatron-LM's layers"
    if p.block.method == "given":
        why = ("Megatron-LM's layout, as parallelize applies it" if p.plan.layout == "megatron"
               else "Megatron-LM's layout: no choice fits the block ILP's memory limit")
        return f"{why}; {kind}"
    stream = dict(p.block.choices)["x"]
    return (f"the block ILP's choice on the tp{p.plan.tp} group, one solve for all {sum(p.stage_layers)} blocks, "
            f"{seconds(p.block.solve_s)}; {kind}, residual stream {stream}")


def _runners_up(result: SearchResult) -> list[str]:
    lines = ["runners-up (why they lost):"]
    for p in result.runners_up:
        lines.append(f"  {plan_line(p)}\n      {why_lost(p, result.best)}")
    if result.too_big:
        lines.append("faster, but not in memory:")
        for p in result.too_big:
            lines.append(f"  {plan_line(p)}\n      {why_lost(p, result.best)}")
    return lines


def _assumptions(cluster: Cluster, spec: TransformerSpec) -> list[str]:
    prof = cluster.profile
    intra, inter = prof.intra_bandwidth * prof.eta_intra, prof.inter_bandwidth * prof.eta_inter
    return [
        f"what this rests on ({prof.source}):",
        f"  GEMMs at {flops(prof.peak_flops)} peak x eta {prof.eta_matmul:.2f}; other kernels at "
        f"{size(prof.mem_bandwidth)}/s x eta {prof.eta_memory:.2f}; {seconds(prof.launch_s)} per kernel",
        f"  collectives alpha-beta: intra-node {seconds(prof.intra_alpha)} + {size(intra)}/s, inter-node "
        f"{seconds(prof.inter_alpha)} + {size(inter)}/s per device; ring algorithms",
        "  1F1B schedule (interleaved: bubble / v, v times the sends); tensor parallel without sequence "
        "parallelism; gradient sync not overlapped, across nodes on every rank's NIC at once; "
        "mixed-precision Adam (16 bytes/parameter before ZeRO)",
        f"  {size(prof.reserved_bytes)} per device reserved (context, fragmentation)",
        "  activations kept for backward as Korthikanti et al. count them, per token and layer: fp16 inputs of "
        "every norm and linear layer, Q, K, V and the MLP's activation input, 1-byte dropout masks; "
        + ("attention scores stored (softmax output, its dropout mask and output: 5·heads·seq bytes; unfused "
           "attention), dropped by selective recompute" if spec.attention == "unfused" else
           "no attention scores (flash attention: one fp32 log-sum-exp per head, scores rebuilt in backward)")
        + "; the last stage's fp32 logits and their gradient",
    ]


def to_json(spec: TransformerSpec, cluster: Cluster, best: Prediction, result: SearchResult | None = None
            ) -> dict[str, Any]:
    """The ``--json`` object (its schema: ``PLAN_SCHEMA``)."""
    out = _prediction_json(best)
    out.update(
        model={"layers": spec.layers, "hidden": spec.hidden, "heads": spec.heads, "seq": spec.seq,
               "vocab": spec.vocab, "parameters": spec.params, "ffn_hidden": spec.ffn, "kv_heads": spec.kv,
               "mlp": spec.mlp, "norm": spec.norm, "position": spec.position, "bias": spec.bias,
               "tied": spec.tied, "attention": spec.attention, "padded_vocab": spec.padded_vocab(best.plan.tp)},
        cluster={"devices": cluster.devices, "device": cluster.profile.name,
                 "gpus_per_node": cluster.gpus_per_node},
        batch=best.batch,
        runners_up=[dict(_prediction_json(p), why=why_lost(p, best)) for p in (result.runners_up if result else [])],
        search=None if result is None else {"candidates": result.candidates, "costed": result.costed,
                                            "seconds": result.seconds},
        stages=stage_modules(spec, best),
        sbp=parameter_sbps(spec, best),
    )
    return out


# a block's linear layers as the block ILP names its choices, and the parameter style each choice lays out
BLOCK_LINEARS = ("qkv", "proj", "fc1", "fc2")
LINEAR_STYLES = {"column": "colwise", "row": "rowwise", "replicate": "replicate", "tokens": "replicate"}


def stage_modules(spec: TransformerSpec, p: Prediction) -> list[list[str]]:
    """The modules of each stage (chunk), in order, as the graph planner's ``stages``: the token embedding on the
    first, blocks ``layers.i`` as cut, the final norm and the output layer (a tied one's copy when pp > 1) on the
    last. Interleaved plans spread the blocks evenly over ``pp · virtual`` chunks.

    >>> from sbpflow.autoparallel import ParallelPlan
    >>> from types import SimpleNamespace
    >>> gpt = TransformerSpec(layers=3, hidden=64, heads=4, seq=16, vocab=128)
    >>> stage_modules(gpt, SimpleNamespace(plan=ParallelPlan(1, 2, 1, 1), stage_layers=(1, 2)))
    [['embedding', 'layers.0'], ['layers.1', 'layers.2', 'final_norm', 'output']]
    """
    plan = p.plan
    chunks = plan.pp * plan.virtual
    sizes = list(p.stage_layers) if plan.virtual == 1 else list(even_cuts(spec.layers, chunks))
    out, first = [], 0
    for i, n in enumerate(sizes):
        modules = [f"layers.{j}" for j in range(first, first + n)]
        first += n
        if i == 0:
            modules.insert(0, "embedding")
        if i == chunks - 1:
            modules += ["final_norm"] + (["output"] if not spec.tied or plan.pp > 1 else [])
        out.append(modules)
    return out


def parameter_sbps(spec: TransformerSpec, p: Prediction) -> dict[str, str]:
    """Each parameter's SBP on its stage's (data, tensor) mesh, as the graph planner's ``sbp``: a block's linear
    layers by the block's choice (column: weight S(0); row: S(1); replicate or token-split: B), the token embedding
    and an untied output layer vocab-parallel, norms and learned positions B; ZeRO-3 splits them over data too.
    Every block has the same SBPs, so blocks are one pattern (``layers.*``)."""
    plan = p.plan
    choices = dict(p.block.choices) if p.block is not None and plan.tp > 1 else {}
    vocab = "vocab" if plan.tp > 1 else "replicate"
    h = spec.hidden
    norm = ("weight", "bias") if spec.norm == "layernorm" else ("weight",)
    widths = {"qkv": spec.qkv_width, "proj": h, "fc1": (2 if spec.gated else 1) * spec.ffn, "fc2": h}
    inputs = {"qkv": h, "proj": h, "fc1": h, "fc2": spec.ffn}
    out = {"embedding.word.weight": param_sbp(vocab, plan.zero, (spec.padded_vocab(plan.tp), h))}
    if spec.position == "learned":
        out["embedding.position.weight"] = param_sbp("replicate", plan.zero, (spec.seq, h))
    for layer in ("ln1", "qkv", "proj", "ln2", "fc1", "fc2"):
        if layer in BLOCK_LINEARS:
            style = LINEAR_STYLES[choices.get(layer, "replicate")]
            out[f"layers.*.{layer}.weight"] = param_sbp(style, plan.zero, (widths[layer], inputs[layer]))
            if spec.bias:
                out[f"layers.*.{layer}.bias"] = param_sbp(style, plan.zero, (widths[layer],))
        else:
            out.update({f"layers.*.{layer}.{n}": param_sbp("replicate", plan.zero, (h,)) for n in norm})
    out.update({f"final_norm.{n}": param_sbp("replicate", plan.zero, (h,)) for n in norm})
    if not spec.tied:
        out["output.weight"] = param_sbp(vocab, plan.zero, (spec.padded_vocab(plan.tp), h))
    return out


def _prediction_json(p: Prediction) -> dict[str, Any]:
    return {
        "tp": p.plan.tp, "pp": p.plan.pp, "dp": p.plan.dp, "micro_batch": p.plan.micro_batch,
        "zero": p.plan.zero, "recompute": p.plan.recompute, "virtual": p.plan.virtual,
        "stage_layers": list(p.stage_layers),
        "step_time_s": p.step_time, "tflops_per_device": p.tflops_per_device,
        "model_tflops_per_device": p.model_tflops_per_device, "mfu": p.mfu,
        "memory_per_device_gb": p.memory_per_device / GB, "fits": p.fits,
        "memory_gb": {k: v / GB for k, v in p.memory.items()},
        "breakdown": dict(p.breakdown),
        "block": None if p.block is None else {
            "choices": dict(p.block.choices), "method": p.block.method, "layout": p.plan.layout,
            "megatron": _is_megatron(p), "seconds": p.block.seconds, "comm_seconds": p.block.comm_seconds},
    }


def _is_megatron(p: Prediction) -> bool:
    return p.block is not None and megatron(p.block)


_NUMBER = {"type": "number", "minimum": 0}
_PLAN_FIELDS = {
    "tp": {"type": "integer", "minimum": 1}, "pp": {"type": "integer", "minimum": 1},
    "dp": {"type": "integer", "minimum": 1}, "micro_batch": {"type": "integer", "minimum": 1},
    "zero": {"enum": [0, 1, 2, 3]}, "recompute": {"enum": ["none", "selective", "full"]},
    "virtual": {"type": "integer", "minimum": 1},
    "stage_layers": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
    "step_time_s": {"type": "number", "exclusiveMinimum": 0}, "tflops_per_device": _NUMBER,
    "model_tflops_per_device": _NUMBER,
    "mfu": {"type": "number", "minimum": 0, "maximum": 1}, "memory_per_device_gb": _NUMBER,
    "fits": {"type": "boolean"},
    "memory_gb": {"type": "object", "required": ["weights", "gradients", "optimizer", "activations"],
                  "additionalProperties": _NUMBER},
    "breakdown": {"type": "object", "required": list(TIME_KEYS), "additionalProperties": False,
                  "properties": {k: _NUMBER for k in (*TIME_KEYS, "cp_comm", "ep_comm")}},
    "block": {"oneOf": [{"type": "null"}, {
        "type": "object", "required": ["choices", "method", "layout", "megatron", "seconds", "comm_seconds"],
        "properties": {"choices": {"type": "object", "additionalProperties": {"type": "string"}},
                       "method": {"type": "string"}, "layout": {"enum": ["ilp", "megatron"]},
                       "megatron": {"type": "boolean"}, "seconds": _NUMBER, "comm_seconds": _NUMBER}}]},
}

_CP = {"type": "integer", "minimum": 1}  # the graph planner's context- and expert-parallel degrees (optional)
PLAN_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "sbpflow plan --json",
    "type": "object",
    "required": [*_PLAN_FIELDS, "model", "cluster", "batch", "runners_up", "search", "stages", "sbp"],
    "properties": {
        **_PLAN_FIELDS,
        "cp": _CP, "ep": _CP,
        "block_recompute": {"type": "array", "items": {"enum": ["none", "selective", "full"]}},  # per block, or []
        "model": {"type": "object", "required": ["layers", "hidden", "heads", "seq", "vocab", "parameters"]},
        "cluster": {"type": "object", "required": ["devices", "device", "gpus_per_node"]},
        "batch": {"type": "integer", "minimum": 1},
        "runners_up": {"type": "array", "items": {
            "type": "object", "required": [*_PLAN_FIELDS, "why"],
            "properties": {**_PLAN_FIELDS, "cp": _CP, "ep": _CP, "why": {"type": "string"}}}},
        "search": {"oneOf": [{"type": "null"}, {"type": "object", "required": ["candidates", "costed", "seconds"]}]},
        "stages": {"type": "array", "minItems": 1,
                   "items": {"type": "array", "items": {"type": "string"}}},
        "sbp": {"type": "object", "additionalProperties": {"type": "string", "pattern": r"^\(.*\)$"}},
    },
}
