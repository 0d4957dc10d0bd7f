"""The planner on today's shapes: Llama-3 405B and 70B on H100 clusters, on metadata, against torchtitan's config.

Run: ``.venv/bin/python benchmarks/plan_llama.py [--write]`` (``--write`` replaces the "plan_llama" section of
docs/benchmarks.md). The reference point is the one the planning issue quotes from torchtitan: Llama-3.1 405B
on 512 H100 at FSDP 8 x TP 8 x PP 8 with interleaved 1F1B, about 128 tokens/s per GPU, full activation
checkpointing. Under a pipeline torchtitan's FSDP gathers the weights once per step and reduce-scatters the
gradients once per step, which the planner's ZeRO-1 prices (its ZeRO-3 gathers and scatters every micro-batch).
The global batch is not part of that report, so the table shows three.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _report import machine, write_section  # noqa: E402

from sbpflow.autoparallel import PROFILES, Cluster, Fixed, TransformerSpec, search  # noqa: E402
from sbpflow.autoparallel.block_sbp import cached_solve  # noqa: E402
from sbpflow.autoparallel.predict import Prediction  # noqa: E402

LLAMA = dict(seq=8192, vocab=128256, mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tied=False,
             attention="flash", kv_heads=8)
LLAMA3_405B = TransformerSpec(layers=126, hidden=16384, heads=128, ffn_hidden=53248, **LLAMA)  # type: ignore[arg-type]
LLAMA3_70B = TransformerSpec(layers=80, hidden=8192, heads=64, ffn_hidden=28672, **LLAMA)  # type: ignore[arg-type]
TORCHTITAN_405B = 128.0  # tokens/s per GPU, 512 H100, FSDP 8 x TP 8 x PP 8, interleaved 1F1B


def tokens_per_gpu(p: Prediction, spec: TransformerSpec, devices: int) -> float:
    return p.batch * spec.seq / p.step_time / devices


def timed_search(spec: TransformerSpec, cluster: Cluster, batch: int, fixed: Fixed) -> tuple[Prediction, float]:
    cached_solve.cache_clear()
    start = time.perf_counter()
    best = search(spec, cluster, batch, fixed).best
    return best, time.perf_counter() - start


def table() -> list[str]:
    h100 = PROFILES["h100-80gb"]
    lines = ["| model | H100 | batch | fixed | plan | tokens/s per GPU | model TFLOP/s | memory | search |",
             "|---|---|---|---|---|---|---|---|---|"]
    cases = [(LLAMA3_405B, 512, b, Fixed(tp=8, pp=8, dp=8, zero=1, recompute="full"), "torchtitan's degrees")
             for b in (64, 128, 256)]
    cases += [(LLAMA3_405B, 512, 256, Fixed(), "nothing"), (LLAMA3_70B, 256, 256, Fixed(), "nothing"),
              (LLAMA3_70B, 64, 128, Fixed(), "nothing")]
    for spec, devices, batch, fixed, what in cases:
        p, seconds = timed_search(spec, Cluster(devices, h100, 8), batch, fixed)
        name = "405B" if spec is LLAMA3_405B else "70B"
        lines.append(f"| Llama-3 {name} | {devices} | {batch} | {what} | {p.plan} | "
                     f"{tokens_per_gpu(p, spec, devices):.0f} | {p.model_tflops_per_device:.0f} | "
                     f"{p.memory_per_device / 1e9:.1f} GB | {seconds:.1f} s |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the plan_llama section of docs/benchmarks.md")
    args = parser.parse_args()
    body = ["## Planning Llama-3 405B and 70B (issue 25)", "",
            f"`.venv/bin/python benchmarks/plan_llama.py --write` on {machine()}. Metadata only: device profile "
            "h100-80gb (public specs, the planner's efficiencies), sequence 8192, flash attention, bf16 with "
            "mixed-precision Adam. torchtitan's published point: 405B on 512 H100 at FSDP 8 x TP 8 x PP 8, "
            f"interleaved 1F1B, about {TORCHTITAN_405B:.0f} tokens/s per GPU (its FSDP under a pipeline moves "
            "weights and gradients once per step: the planner's ZeRO-1).", "", *table()]
    text = "\n".join(body)
    print(text)
    if args.write:
        write_section("plan_llama", text)


if __name__ == "__main__":
    main()
