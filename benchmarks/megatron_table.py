"""The planner against Megatron-LM's weak-scaling table (Narayanan et al., SC'21, Table 1): 1.7B to 1T
parameters on 32 to 3072 A100-80GB, 137 to 163 TFLOP/s per GPU.

Run: ``.venv/bin/python benchmarks/megatron_table.py [--write]`` (prints; ``--write`` replaces the
"megatron_table" section of docs/benchmarks.md). Metadata only.

Each row fixes what the paper states (tensor and pipeline degrees, GPUs, global batch; GPT shapes with sequence
2048 and vocabulary 51200; fp16 with full recompute, as every run of the paper) and searches what it does not
state (micro-batch size, interleaving degree), as Megatron-LM's authors tuned those per run. The throughput
compared is the hardware figure: the FLOPs the plan executes, recompute included (the paper's eq. 3). No
constant is fitted to any row: the device profile is the public A100 datasheet with the planner's efficiencies.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _report import machine, write_section  # noqa: E402

from sbpflow.autoparallel import PROFILES, Cluster, Fixed, TransformerSpec, search  # noqa: E402
from sbpflow.autoparallel.predict import TIME_KEYS, Prediction  # noqa: E402

# billions of parameters, heads, hidden, layers, tp, pp, GPUs, global batch, published TFLOP/s per GPU
LAYOUT = "megatron"  # the paper's block layout (2021: norms and dropouts whole on every tensor rank)
TABLE_1 = ((1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163))


def predict_row(row: tuple) -> tuple[TransformerSpec, Prediction]:
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    spec = TransformerSpec(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)
    fixed = Fixed(tp=tp, pp=pp, dp=gpus // (tp * pp), zero=0, recompute="full", layout=LAYOUT)
    return spec, search(spec, Cluster(gpus, PROFILES["a100-80gb"], 8), batch, fixed).best


def sensitivity() -> list[str]:
    """Mean and worst error when the profile's two GEMM constants move: the fit is not on a knife edge."""
    base = PROFILES["a100-80gb"]
    lines = ["| η (large GEMMs) | k_half | mean | worst |", "|---|---|---|---|"]
    try:
        for eta, k_half in ((0.7, 64.0), (0.7, 128.0), (0.75, 64.0), (0.75, 128.0), (0.8, 128.0), (0.8, 256.0)):
            PROFILES["a100-80gb"] = replace(base, eta_matmul=eta, gemm_k_half=k_half)
            errors = rows()[1]
            lines.append(f"| {eta} | {k_half:.0f} | {sum(abs(e) for e in errors) / len(errors):.1%} | "
                         f"{max(errors, key=abs):+.1%} |")
    finally:
        PROFILES["a100-80gb"] = base
    return lines


def rows() -> tuple[list[str], list[float]]:
    lines = ["| model | GPUs | tp x pp x dp | chosen micro-batch, interleaving | predicted | published | error | "
             "time besides compute and recompute |", "|---|---|---|---|---|---|---|---|"]
    errors = []
    for row in TABLE_1:
        spec, p = predict_row(row)
        error = p.tflops_per_device / row[-1] - 1
        errors.append(error)
        other = sorted(((p.breakdown[k] / p.step_time, k) for k in TIME_KEYS if k not in ("compute", "recompute")),
                       reverse=True)
        rest = ", ".join(f"{k} {share:.1%}" for share, k in other[:3] if share >= 0.005)
        lines.append(f"| {row[0]}B ({spec.params / 1e9:.1f}B) | {row[6]} | {p.plan.tp} x {p.plan.pp} x {p.plan.dp} | "
                     f"{p.plan.micro_batch}, x{p.plan.virtual} | {p.tflops_per_device:.1f} | {row[-1]} | "
                     f"{error:+.1%} | {rest} |")
    return lines, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the megatron_table section of docs/benchmarks.md")
    args = parser.parse_args()
    table, errors = rows()
    mean = sum(abs(e) for e in errors) / len(errors)
    worst = max(errors, key=abs)
    body = ["## The planner against Megatron-LM's Table 1 (issue 25)", "",
            f"`.venv/bin/python benchmarks/megatron_table.py --write` on {machine()}. Predictions from metadata: "
            "device profile a100-80gb (public specs, the planner's efficiencies). Fixed per row: tp, pp, GPUs, "
            "batch, fp16, full recompute; searched: micro-batch and interleaving (the paper does not state them). "
            "Hardware TFLOP/s per GPU (recompute included), as the paper counts.", "", *table, "",
            f"Mean absolute error {mean:.1%}, worst row {worst:+.1%}"
            + ("; every row is under-predicted." if all(e < 0 for e in errors) else "."), "",
            "How the profile prices it. The block layout is Megatron-LM's of 2021 (`layout=\"megatron\"`: layer "
            "norms, dropouts and residual adds whole on every tensor rank, two all-reduces per block forward; "
            "sequence parallelism came a year later), not the SBP search's choice. GEMMs run at η = 0.75 of the "
            "A100's 312 TFLOP/s when large (cuBLAS's fp16 range is 70-80%), times a tile model: the best of three "
            "output tiles (256 x 128, 128 x 128 at 0.9, 128 x 64 at 0.8 of the rate, as cuBLAS picks one per "
            "shape) with the last wave's idle SMs out of 108, and k / (k + 128) for each tile's fixed cost. That model "
            "is what changed the rows most: attention's per-head products (k = 96-128) sustain about half the "
            "large-GEMM rate, which weighs on the small models, and the large models' GEMMs reach the full η. The "
            "two constants are the device's, shared by every row (nothing is fitted per row); the table below "
            "moves them to show how much the result depends on them:", "", *sensitivity(), "",
            "Remaining error: the mid-size rows (39B-145B, tp 8 with pipelining) are over-predicted by 2-4%. Their "
            "tensor-parallel all-reduces are priced at NCCL's large-message bus bandwidth (75% of NVLink) with no "
            "slowdown from running beside the GEMMs, and the interleaved schedule's extra point-to-point traffic "
            "is priced as overlapped; the paper does not give the micro-batch and interleaving it ran, so the "
            "search's best stands in for them."]
    text = "\n".join(body)
    print(text)
    if args.write:
        write_section("megatron_table", text)


if __name__ == "__main__":
    main()
