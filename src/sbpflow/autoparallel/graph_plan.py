"""A plan for any traced model: what was chosen, why, and how to lay it out again.

:func:`plan_graph` reads a traced training step (``nn.Graph.trace``), searches it (``graph_search``) and returns a
:class:`Plan`: ``explain()`` in words, ``to_json()`` / :meth:`Plan.load` for a replayable file, and
``parallelize_kwargs()`` / ``graph_config()`` for ``sbpflow.parallelize`` and the ``nn.Graph`` config.

>>> plan = Plan.from_json(Plan.example().to_json())
>>> plan.parallelize_kwargs()["tensor"], plan.graph_config()["schedule"]
(2, '1f1b')
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ..graph.ir import LogicalGraph
from .graph_model import GraphModel, read_graph
from .graph_search import GraphPrediction, GraphSearch, Knobs, _count, _size, candidates, search_graph
from .predict import Cluster
from .profiles import DeviceProfile, get_profile
from .units import seconds

GB = 1e9
TENSOR_SBP = {"colwise": "S(0)", "rowwise": "S(1)", "vocab": "S(0)", "replicate": "B"}  # a (out, in) weight's


@dataclass
class Plan:
    """The chosen plan of a traced model (see the module docstring); plain data, so it round-trips JSON."""

    knobs: Knobs
    devices: int
    device: str  # the device profile's name
    gpus_per_node: int
    batch: int
    step_time: float
    breakdown: dict[str, float]  # seconds
    memory: dict[str, float]  # bytes on the fullest device
    usable_memory: float
    tflops_per_device: float  # hardware: FLOPs executed, recompute included
    model_tflops_per_device: float  # forward and backward alone
    stages: list[list[str]]  # the modules of each stage (chunk), in order
    styles: dict[str, str]  # module glob -> colwise / rowwise / vocab (replicate is the default)
    sbp: dict[str, str]  # parameter -> its SBP on the stage's (data, tensor) mesh
    parameters: int
    mfu: float = 0.0  # model FLOPs / time / (devices · peak)
    repeated_blocks: int = 1  # how often the most repeated segment of the graph occurs
    blocks: list[str] = field(default_factory=list)  # the modules of the repeated blocks (what recompute reruns)
    runners_up: list[dict[str, Any]] = field(default_factory=list)  # plan, step_time, memory, why
    too_big: list[dict[str, Any]] = field(default_factory=list)  # faster plans that did not fit
    search: dict[str, float] = field(default_factory=dict)  # candidates, costed, seconds

    @property
    def micro_batches(self) -> int:
        return self.batch // (self.knobs.dp * self.knobs.micro_batch)

    @property
    def memory_per_device(self) -> float:
        return sum(self.memory.values())

    def parallelize_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``sbpflow.parallelize(model, **kwargs)`` that lay this plan out."""
        k = self.knobs
        return {"data": k.dp, "tensor": k.tp, "pipeline": k.pp, "virtual": k.virtual, "context": k.cp, "expert": k.ep,
                "plan": dict(self.styles),
                "stages": [stage[0] for stage in self.stages] if k.pp > 1 else None}

    def graph_config(self) -> dict[str, Any]:
        """What the ``nn.Graph`` config takes besides the layout: ZeRO stage, micro-batches, schedule, recompute."""
        k = self.knobs
        return {"zero": k.zero, "micro_batches": self.micro_batches, "schedule": k.schedule,
                "recompute": k.recompute, "recomputed_blocks": self.recomputed_blocks()}

    def recomputed_blocks(self) -> list[str]:
        """The repeated blocks (module names) this plan fully recomputes: all under ``recompute="full"``, else
        those whose ``block_recompute`` is "full"."""
        k = self.knobs
        modes = k.block_recompute or (k.recompute,) * len(self.blocks)
        if len(modes) != len(self.blocks):
            raise PlanError(f"the plan recomputes per repeated block, one choice each, but names {len(self.blocks)} "
                            f"blocks ({', '.join(self.blocks)}) for {len(modes)} choices")
        return [name for name, mode in zip(self.blocks, modes, strict=True) if mode == "full"]

    def explain(self) -> str:
        """What was chosen, the predicted time and memory by component, and the runners-up and why they lost."""
        k = self.knobs
        lines = [f"plan: {k} on {self.devices} x {self.device} ({self.gpus_per_node} per node), batch {self.batch} "
                 f"in {self.micro_batches} micro-batches of {k.micro_batch} per replica",
                 f"predicted step {self.step_time:.4g} s: " + _parts(self.breakdown, "s"),
                 f"throughput {self.batch / self.step_time:.4g} samples/s; {self.tflops_per_device:.1f} hardware "
                 f"TFLOP/s per device (recompute included), {self.model_tflops_per_device:.1f} model TFLOP/s "
                 "(forward and backward alone)",
                 f"memory on the fullest device {_size(self.memory_per_device)} of {_size(self.usable_memory)} "
                 "usable: " + ", ".join(f"{n} {_size(v)}" for n, v in self.memory.items()),
                 f"parameters: {_count(self.parameters)}"]
        for i, modules in enumerate(self.stages):
            shown = modules if len(modules) <= 4 else modules[:2] + ["..."] + modules[-2:]
            lines.append(f"  stage {i}: {len(modules)} modules: {', '.join(shown)}")
        if self.styles and k.tp > 1:
            lines.append("tensor parallel: " + ", ".join(f"{g} {s}" for g, s in self.styles.items()))
        for other in self.runners_up:
            lines.append(f"  runner-up {other['plan']}: {other['step_time']:.4g} s ({other['why']})")
        for other in self.too_big:
            lines.append(f"  faster but too big {other['plan']}: {other['step_time']:.4g} s, needs "
                         f"{_size(other['memory'])} per device")
        if self.search:
            lines.append(f"searched {self.search['candidates']:.0f} plans, costed {self.search['costed']:.0f}, in "
                         f"{self.search['seconds']:.2f} s")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    def cli_json(self) -> dict[str, Any]:
        """``sbpflow plan --json``'s object (the sizes planner's schema, ``explain.PLAN_SCHEMA``) plus ``stages``
        (the modules of each stage), ``sbp`` (each parameter's) and ``replay`` (this plan, for :meth:`load`)."""
        k = self.knobs
        other = [dict(r["fields"], why=r["why"]) for r in self.runners_up]
        return {
            "tp": k.tp, "pp": k.pp, "dp": k.dp, "cp": k.cp, "ep": k.ep, "micro_batch": k.micro_batch, "zero": k.zero,
            "recompute": k.recompute, "block_recompute": list(k.block_recompute), "virtual": k.virtual,
            "schedule": k.schedule, "stage_layers": [len(s) for s in self.stages], "step_time_s": self.step_time,
            "tflops_per_device": self.tflops_per_device, "model_tflops_per_device": self.model_tflops_per_device,
            "mfu": self.mfu, "memory_per_device_gb": self.memory_per_device / GB,
            "fits": self.memory_per_device <= self.usable_memory,
            "memory_gb": {n: v / GB for n, v in self.memory.items()}, "breakdown": dict(self.breakdown),
            "block": None,
            "model": {"layers": self.repeated_blocks, "hidden": None, "heads": None, "seq": None, "vocab": None,
                      "parameters": self.parameters},
            "cluster": {"devices": self.devices, "device": self.device, "gpus_per_node": self.gpus_per_node},
            "batch": self.batch, "runners_up": other, "search": dict(self.search) or None,
            "stages": self.stages, "sbp": self.sbp, "replay": json.loads(self.to_json()),
        }

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
            data = data.get("replay", data)  # sbpflow plan --json's object holds the plan under "replay"
            knobs = data["knobs"]
            data["knobs"] = Knobs(**dict(knobs, block_recompute=tuple(knobs.get("block_recompute", ()))))
            return cls(**data)
        except (ValueError, TypeError, KeyError) as e:
            raise PlanError(f"a plan file is the JSON that Plan.to_json writes, but this one could not be read: "
                            f"{e}") from e

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """A plan written by :meth:`save` (or ``sbpflow plan --model ... --json``)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanError(f"cannot read the plan file {path}: {e}") from e
        return cls.from_json(text)

    @classmethod
    def example(cls) -> Plan:
        """A small plan, for documentation."""
        return cls(Knobs(2, 1, 2, 4), 4, "cpu", 4, 8, 0.01, {"compute": 0.01}, {"weights": 1.0}, 2.0, 1.0, 1.0,
                   [["0", "2"]], {"0": "colwise", "2": "rowwise"}, {"0.weight": "(B, S(0))"}, 10)


def _parts(values: dict[str, float], unit: str) -> str:
    return ", ".join(f"{name} {v:.3g}" for name, v in values.items() if v) + f" {unit}"


def plan_graph(g: LogicalGraph, devices: int, profile: str | DeviceProfile = "cpu", *,
               memory_per_device: float | None = None, gpus_per_node: int | None = None, batch: int | None = None,
               keep: int = 5, only: Callable[[Knobs], bool] | None = None, precision: str = "mixed") -> Plan:
    """The fastest plan of the traced step ``g`` on ``devices`` devices of ``profile`` that fits
    ``memory_per_device`` bytes (default: the profile's usable memory); ``batch`` defaults to the traced one;
    ``only`` keeps the candidate plans it accepts (what a caller can run, such as eager training's);
    ``precision`` prices bytes as mixed-precision training holds them (a what-if for accelerators) or, with
    ``"traced"``, as the traced step does (its dtypes and optimizer state: for plans that run that step)."""
    found = get_profile(profile)
    if memory_per_device is not None:
        if memory_per_device <= 0:
            raise PlanError(f"memory_per_device must be positive bytes, but got {memory_per_device}")
        found = replace(found, memory_bytes=float(memory_per_device), reserved_bytes=0.0)
    if devices < 1:
        raise PlanError(f"a plan needs devices >= 1, but got {devices}")
    model = read_graph(g, precision)
    cluster = Cluster(devices, found, min(gpus_per_node or found.gpus_per_node, devices))
    batch = batch or model.batch
    plans = None if only is None else [k for k in candidates(model, cluster, batch) if only(k)]
    result = search_graph(model, cluster, batch, keep=keep, only=plans, accept=only)
    return make_plan(model, cluster, result)


def make_plan(model: GraphModel, cluster: Cluster, result: GraphSearch) -> Plan:
    best = result.best
    prefix = _prefix(list(model.param_names.values()))
    tp = best.knobs.tp
    styles = {n[len(prefix):]: s for n, s in model.styles.items()}
    return Plan(
        knobs=best.knobs, devices=cluster.devices, device=cluster.profile.name, gpus_per_node=cluster.gpus_per_node,
        batch=best.batch, step_time=best.step_time, breakdown=dict(best.breakdown), memory=dict(best.memory),
        usable_memory=best.usable_memory, tflops_per_device=best.tflops_per_device,
        model_tflops_per_device=best.model_tflops_per_device, stages=_stages(model, best, prefix),
        styles=_globs(styles) if tp > 1 else {},
        sbp={n: param_sbp(s if tp > 1 else "replicate", best.knobs.zero, model.param_shapes[prefix + n])
             for n, s in styles.items()},
        parameters=model.param_count, mfu=best.model_tflops_per_device * 1e12 / cluster.profile.peak_flops,
        repeated_blocks=model.repeats, blocks=_block_modules(model, prefix),
        runners_up=[_other(p, best, cluster, len(model.segments)) for p in _distinct(best, result.runners_up)],
        too_big=[{"plan": str(p.knobs), "step_time": p.step_time, "memory": p.memory_per_device}
                 for p in _distinct(None, result.too_big)],
        search={"candidates": result.candidates, "costed": result.costed, "seconds": result.seconds})


def _distinct(best: GraphPrediction | None, others: list[GraphPrediction]) -> list[GraphPrediction]:
    """``others`` without the plans that cost exactly what an earlier one does (a recompute choice that
    changes nothing on a graph with nothing to recompute is no alternative)."""
    seen = set() if best is None else {(best.step_time, best.memory_per_device)}
    out = []
    for p in others:
        if (p.step_time, p.memory_per_device) not in seen:
            seen.add((p.step_time, p.memory_per_device))
            out.append(p)
    return out


def _other(p: GraphPrediction, best: GraphPrediction, cluster: Cluster, segments: int) -> dict[str, Any]:
    """A runner-up as ``--json`` shows one: its plan's fields, and why it lost."""
    worse = sorted(((p.breakdown[n] - best.breakdown.get(n, 0.0), n) for n in p.breakdown), reverse=True)[:2]
    why = ", ".join(f"{n} +{seconds(d)}" for d, n in worse if d > 1e-6 * best.step_time) or "ties"
    k = p.knobs
    bounds = list(p.cuts) + [segments]
    return {"plan": str(k), "step_time": p.step_time, "memory": p.memory_per_device,
            "why": f"{(p.step_time / best.step_time - 1) * 100:.1f}% slower: {why}",
            "fields": {"tp": k.tp, "pp": k.pp, "dp": k.dp, "cp": k.cp, "ep": k.ep, "micro_batch": k.micro_batch,
                       "zero": k.zero,
                       "recompute": k.recompute, "virtual": k.virtual, "schedule": k.schedule,
                       "stage_layers": [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
                       "step_time_s": p.step_time, "tflops_per_device": p.tflops_per_device,
                       "model_tflops_per_device": p.model_tflops_per_device,
                       "mfu": p.model_tflops_per_device * 1e12 / cluster.profile.peak_flops,
                       "memory_per_device_gb": p.memory_per_device / GB, "fits": p.fits,
                       "memory_gb": {n: v / GB for n, v in p.memory.items()}, "breakdown": dict(p.breakdown),
                       "block": None}}


def _block_modules(model: GraphModel, prefix: str) -> list[str]:
    """The modules holding the repeated segments: the parent of each one's first module (``h.3``)."""
    out: list[str] = []
    for segment, repeated in zip(model.segments, model.block, strict=True):
        parent = segment.first_module.rpartition(".")[0]
        name = parent[len(prefix):] if parent.startswith(prefix) else parent
        if repeated and name and name not in out:
            out.append(name)
    return out


def _prefix(names: list[str]) -> str:
    """The graph's attribute prefix of every parameter name (``model.``), dropped to name the model's own."""
    heads = {n.split(".", 1)[0] for n in names}
    return heads.pop() + "." if len(heads) == 1 and all("." in n for n in names) else ""


def _module(param: str) -> str:
    return param.rpartition(".")[0]


def _globs(styles: dict[str, str]) -> dict[str, str]:
    """Module glob -> style for the parameters not replicated: numbered modules merged (``h.*.attn.q``)."""
    by_module: dict[str, str] = {}
    for param, style in styles.items():
        if style != "replicate" and param.endswith("weight"):
            by_module[_module(param)] = style
    globbed: dict[str, set[str]] = {}
    for module, style in by_module.items():
        globbed.setdefault(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", module), set()).add(style)
    out = {}
    for glob, found in globbed.items():
        if len(found) == 1:
            out[glob] = found.pop()
        else:
            out.update({m: s for m, s in by_module.items() if re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", m) == glob})
    return out


def param_sbp(style: str, zero: int, shape: tuple[int, ...]) -> str:
    """A parameter's SBP on its stage's (data, tensor) mesh; ZeRO-3 also splits it over data (another dim).

    >>> param_sbp("colwise", 3, (64, 16)), param_sbp("rowwise", 0, (16, 64)), param_sbp("colwise", 0, (64,))
    ('(S(1), S(0))', '(B, S(1))', '(B, S(0))')
    """
    if len(shape) == 2:
        tensor = TENSOR_SBP[style]
    else:
        tensor = "S(0)" if style in ("colwise", "vocab") else "B"
    data = "B"
    if zero == 3:
        data = "S(1)" if tensor == "S(0)" and len(shape) == 2 else "S(0)"
    return f"({data}, {tensor})"


def _stages(model: GraphModel, best: GraphPrediction, prefix: str) -> list[list[str]]:
    bounds = list(best.cuts) + [len(model.segments)]
    order = [_module(n[len(prefix):]) for n in model.param_names.values()]
    first: dict[str, int] = {}
    for i, m in enumerate(order):
        first.setdefault(m, i)
    stages = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        modules: list[str] = []
        for seg in model.segments[lo:hi]:
            for m in seg.modules:
                short = m[len(prefix):] if m.startswith(prefix) else m
                if short not in modules:
                    modules.append(short)
        stages.append(modules)
    out = []
    for i, modules in enumerate(stages):
        elsewhere = {m for j, other in enumerate(stages) if j != i for m in other}
        out.append([_outermost(modules[0], first, elsewhere)] + modules[1:] if modules else modules)
    return out


def _outermost(module: str, first: dict[str, int], elsewhere: set[str]) -> str:
    """The outermost module that starts where ``module`` does (``h.3`` for ``h.3.ln_1``), so a stage begins
    with a whole block: the parent's first parameter is this module's, and no module of another stage is inside
    it (``h`` itself spans the stages)."""
    at = first.get(module)
    parts = module.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if any(m == parent or m.startswith(parent + ".") for m in elsewhere):
            continue
        if at is not None and min((v for m, v in first.items() if m == parent or m.startswith(parent + ".")),
                                  default=None) == at:
            return parent
    return module
