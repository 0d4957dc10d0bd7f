"""A Llama training step on one device: sbpflow (loaded from a Hugging Face folder) against transformers.

Run: ``.venv/bin/python benchmarks/llama_step.py`` (prints; ``--write`` replaces the "llama_step" section of
docs/benchmarks.md). Needs transformers (the dev extra).

Both contenders hold the same weights (a random ``LlamaForCausalLM`` saved with ``save_pretrained`` and read by
``sbpflow.models.from_pretrained``), take the same tokens, and step forward, backward and AdamW, one torch
thread; sbpflow eager on local tensors and as a compiled ``nn.Graph`` step on a 1-rank placement. Timed
rounds interleave the contenders (wall and this thread's CPU time); the table gives medians.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable

import numpy as np
import torch
import transformers
from _report import add_write_flag, machine, publish
from gpt_step import interleaved

import sbpflow
from sbpflow.models import from_pretrained

torch.set_num_threads(1)

LR = 3e-4
BATCH, SEQ = 4, 128
SIZES = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": SEQ}


class _Step(sbpflow.nn.Graph):
    def __init__(self, model: object, opt: object) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, ids: object, targets: object) -> object:
        _, loss = self.model(ids, targets)
        loss.backward()
        return loss


def contenders(folder: str, ref: torch.nn.Module) -> dict[str, Callable[[], object]]:
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], size=(BATCH, SEQ + 1))
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    t_ids, t_targets = torch.as_tensor(ids), torch.as_tensor(targets).reshape(-1)

    def torch_step() -> object:
        logits = ref(input_ids=t_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SIZES["vocab_size"]), t_targets)
        torch_opt.zero_grad()
        loss.backward()
        torch_opt.step()
        return loss

    eager = from_pretrained(folder)
    opt = sbpflow.optim.AdamW(eager.parameters(), lr=LR)
    x, y = sbpflow.tensor(ids), sbpflow.tensor(targets)

    def eager_step() -> object:
        _, loss = eager(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    compiled_model = from_pretrained(folder)
    p = sbpflow.placement("cpu", [0])
    compiled_model.to_global(p, sbpflow.sbp.broadcast)
    step = _Step(compiled_model, sbpflow.optim.AdamW(compiled_model.parameters(), lr=LR))
    gx = sbpflow.tensor(ids, placement=p, sbp=sbpflow.sbp.broadcast)
    gy = sbpflow.tensor(targets, placement=p, sbp=sbpflow.sbp.broadcast)
    return {"transformers": torch_step, "sbpflow eager": eager_step, "sbpflow compiled": lambda: step(gx, gy)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    add_write_flag(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).float()
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(folder)
        runs = contenders(folder, ref)
    for fn in runs.values():  # warm-up: caches and the graph's compile
        fn()
    wall, cpu = interleaved(runs, inner=2, rounds=args.rounds)
    rows = [f"| {name} | {1e3 * wall[name]:.1f} | {wall[name] / wall['transformers']:.3f}x | "
            f"{1e3 * cpu[name]:.1f} | {cpu[name] / cpu['transformers']:.3f}x |" for name in runs]
    body = "\n".join([
        "## Llama training step on one device (issue 26)",
        "",
        f"`.venv/bin/python benchmarks/llama_step.py --write` on {machine()}. A Llama of width 256, 4 layers, "
        f"8 query and 4 key/value heads, SwiGLU 688, vocabulary 512; batch {BATCH} x {SEQ} tokens; forward, "
        f"backward and AdamW; {args.rounds} interleaved rounds, medians.",
        "",
        "| contender | wall ms/step | wall vs transformers | CPU ms/step | CPU vs transformers |",
        "|---|---|---|---|---|",
        *rows,
    ])
    publish("llama_step", body, args.write)


if __name__ == "__main__":
    main()
