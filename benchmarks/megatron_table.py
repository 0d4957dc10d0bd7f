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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _report import machine, write_section  # noqa: E402

from sbpflow.autoparallel import PROFILES, Cluster, Fixed, TransformerSpec, search  # noqa: E402
from sbpflow.autoparallel.predict import TIME_KEYS, Prediction  # noqa: E402

# billions of parameters, heads, hidden, layers, tp, pp, GPUs, global batch, published TFLOP/s per GPU
TABLE_1 = ((1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163))


def predict_row(row: tuple) -> tuple[TransformerSpec, Prediction]:
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    spec = TransformerSpec(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)
    fixed = Fixed(tp=tp, pp=pp, dp=gpus // (tp * pp), zero=0, recompute="full")
    return spec, search(spec, Cluster(gpus, PROFILES["a100-80gb"], 8), batch, fixed).best


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
            "Where the rest of the error sits: compute and recompute are 80-98% of every predicted step, priced with "
            "one GEMM efficiency (the profile's η = 0.6 of peak for every matrix product) and memory-bound "
            "attention scores (fused scale-mask-softmax, then dropout, as Megatron-LM 2021 ran them). The rows "
            "most under-predicted are the smallest (hidden 2304-4096: the core attention is a third of a block's "
            "predicted time, at head dimension 96-128) and the largest (hidden 20480-25600, whose GEMMs sustain "
            "more of the peak than a flat η grants). A GEMM efficiency by shape, calibrated per device, is what "
            "the model lacks; a constant fitted per row would hide it."]
    text = "\n".join(body)
    print(text)
    if args.write:
        write_section("megatron_table", text)


if __name__ == "__main__":
    main()
