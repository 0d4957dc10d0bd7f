"""Training a GPT under any data x tensor x pipeline strategy, and the ``sbpflow demo``.

:func:`train_gpt` is the equivalence workhorse: the same seed, data and hyper-parameters under any strategy
give one device's losses and parameters, on whatever comm backend is installed. :func:`main` is the demo: a
character-level GPT trained on Python's standard-library sources on virtual CPU devices.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import sysconfig
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import sbpflow
from sbpflow import nn, optim
from sbpflow.autoparallel.graph_plan import plan_graph
from sbpflow.comm import CommEvent, record
from sbpflow.graph.explain import explain, pipeline_text
from sbpflow.models import llama, moe
from sbpflow.models.gpt import GPT, GPTConfig, Strategy, parallelize, parse_strategy
from sbpflow.nn.trace_step import trace_training_step
from sbpflow.tensor import Tensor
from sbpflow.utils.data import DataLoader, Dataset

from .resume import checkpoint_from_args, demo_run_state, manager_from_args, resume_from_args

# ----------------------------------------------------------------------------- training


@dataclass
class Trainer:
    """A model, its strategy (None on one device) and its optimizer: one training step at a time."""

    model: GPT | llama.Llama  # a Mixtral is a Llama
    strategy: Strategy | None
    optimizer: Any
    clip: float | None = 1.0

    def inputs(self, ids: Any, targets: Any) -> tuple[Tensor, Tensor]:
        """Logical (B, T) arrays as the model's inputs: local tensors, or laid out by the strategy (global tensors,
        as a placed DataLoader makes them, pass as they are)."""
        if isinstance(ids, Tensor) and ids.is_global:
            return ids, targets
        if self.strategy is None:
            return sbpflow.tensor(ids.astype(np.int64)), sbpflow.tensor(targets.astype(np.int64))
        ids_t, targets_t = self.strategy.shard_inputs(ids, targets)
        assert targets_t is not None
        return ids_t, targets_t

    graph: Any = None  # a compiled TrainStep, when training in graph mode
    amp: torch.dtype | None = None  # eager mixed precision: the forward runs under sbpflow.autocast(amp)

    def step(self, ids: Any, targets: Any, phases: PhaseLog | None = None) -> float:
        """Forward, backward, gradient clipping and an optimizer step; returns the loss."""
        phases = phases or PhaseLog(None)
        ids_t, targets_t = self.inputs(ids, targets)
        if self.graph is not None:
            return scalar(self.graph(ids_t, targets_t), self.strategy)
        with phases("forward"), sbpflow.autocast(self.amp or torch.bfloat16, enabled=self.amp is not None):
            _, loss = self.model(ids_t, targets_t)
        assert loss is not None
        self.optimizer.zero_grad()
        with phases("backward"):
            loss.backward()
        with phases("clip_grad_norm"):
            if self.clip is not None:
                nn.utils.clip_grad_norm_(list(self.model.parameters()), self.clip)
        with phases("optimizer"):
            self.optimizer.step()
        return scalar(loss, self.strategy)


class TrainStep(nn.Graph):
    """The GPT's training step, compiled: forward, backward, clipping and AdamW in one plan."""

    def __init__(self, model: GPT, optimizer: Any, clip: float | None, micro_batches: int = 1,
                 executor: str | None = None, schedule: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer, clip_grad_max_norm=clip)
        self.config.set_gradient_accumulation_steps(micro_batches)
        if executor is not None:
            self.config.set_executor(executor)
        if schedule is not None:
            self.config.set_pipeline_schedule(schedule)

    def build(self, ids: Tensor, targets: Tensor) -> Tensor:
        _, loss = self.model(ids, targets)
        assert loss is not None
        loss.backward()
        return loss


def build(config: GPTConfig, strategy: str | dict[str, int] | None, *, seed: int = 0, lr: float = 1e-3,
          weight_decay: float = 0.1, clip: float | None = 1.0, device: str = "cpu", graph: bool = False,
          micro_batches: int = 1, executor: str | None = None, schedule: str | None = None,
          virtual_stages: int = 1, zero: int = 0, amp: torch.dtype | None = None, model: str = "gpt") -> Trainer:
    """Builds the GPT from ``seed``, places it under ``strategy`` (None or "single": no placement), adds AdamW.

    ``virtual_stages`` > 1 cuts the blocks into that many stages per pipeline placement (interleaved 1F1B).
    ``zero`` (1-3) shards optimizer state, gradients and parameters on the data axis (``sbpflow.optim.zero``,
    or ``config.enable_zero`` in graph mode); ``amp`` (``torch.bfloat16``) runs matmuls in low precision with fp32
    master weights (``sbpflow.autocast``, or ``config.enable_amp``).

    Weight decay applies to matrices (weights and embeddings), not to biases and LayerNorm scales, as in nanoGPT.
    """
    sbpflow.manual_seed(seed)
    net = _make_model(model, config)
    degrees = parse_strategy(strategy)
    placed = None
    if not _is_single(strategy) and isinstance(net, GPT):
        placed = parallelize(net, device=device, virtual=virtual_stages, **degrees)
    elif not _is_single(strategy):
        if virtual_stages > 1:
            raise sbpflow.SbpflowError(f"virtual pipeline stages are the GPT's; --model {model} takes 1, "
                                       f"but got {virtual_stages}")
        placed = llama.parallelize(net, device=device, **degrees)
    params = list(net.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt: optim.Optimizer = optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    step = TrainStep(net, opt, clip, micro_batches, executor, schedule) if graph else None
    if zero and step is not None:
        step.config.enable_zero(zero)
    elif zero:
        opt = optim.zero(opt, zero, model=net)
    if amp is not None and step is not None:
        step.config.enable_amp(amp)
    return Trainer(net, placed, opt, clip, step, None if step is not None else amp)


MODELS = ("gpt", "llama", "moe")


def _make_model(kind: str, config: GPTConfig) -> Any:
    """The demo's model of ``kind`` at the GPT config's sizes (Llama: half as many k/v heads, a SwiGLU of 2x width;
    moe: a Mixtral with 4 experts, top-2, each of the residual width)."""
    if kind == "gpt":
        return GPT(config)
    sizes: dict[str, Any] = {
        "vocab_size": config.vocab_size, "hidden_size": config.n_embd, "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head, "num_key_value_heads": max(1, config.n_head // 2),
        "max_position_embeddings": config.block_size, "initializer_range": 0.02,
    }
    if kind == "llama":
        return llama.Llama(llama.LlamaConfig(intermediate_size=2 * config.n_embd, **sizes))
    if kind == "moe":
        return moe.Mixtral(moe.MixtralConfig(intermediate_size=config.n_embd, num_local_experts=4,
                                             num_experts_per_tok=2, output_router_logits=True,
                                             router_aux_loss_coef=0.01, **sizes))
    raise sbpflow.SbpflowError(f"the demo's models are {', '.join(MODELS)}, but got {kind!r}")


def _is_single(strategy: str | dict[str, int] | None) -> bool:
    return strategy is None or (isinstance(strategy, str) and strategy.strip() in ("", "single", "none"))


def scalar(t: Tensor, strategy: Strategy | None) -> float:
    """A one-element tensor's value on every process, also where its placement has no rank of this process."""
    if strategy is not None and strategy.pipeline > 1:
        t = t.to_global(placement=strategy.everywhere, sbp=sbpflow.sbp.broadcast)
    return float(t.item())


def random_batches(vocab_size: int, steps: int, batch_size: int, seq_len: int,
                   seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``steps`` batches of random token ids as (ids, targets), targets being ids shifted by one."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(0, vocab_size, size=(batch_size, seq_len + 1))
        yield tokens[:, :-1], tokens[:, 1:]


def train_gpt(strategy: str | dict[str, int] | None, steps: int, *, config: GPTConfig | None = None,
              batch_size: int = 8, seq_len: int = 16, lr: float = 1e-3, seed: int = 0,
              clip: float | None = 1.0, graph: bool = False, micro_batches: int = 1,
              executor: str | None = None, schedule: str | None = None,
              device: str = "cpu") -> tuple[list[float], dict[str, np.ndarray]]:
    """Trains a GPT for ``steps`` AdamW steps on random tokens; returns the losses and the final parameters.

    ``strategy`` is None / "single" (one device, local tensors) or a spec such
    as ``"dp=2,tp=2,pp=2"``; ranks are those of the installed comm backend, on ``device`` ("cpu" or "cuda").
    Parameters are logical values by name, comparable across strategies.

    >>> cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> losses, params = train_gpt("dp=2", steps=2, config=cfg, batch_size=4, seq_len=8)
    >>> len(losses), params["wte.weight"].shape
    (2, (20, 8))
    """
    config = config or GPTConfig(vocab_size=100, block_size=seq_len, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
    trainer = build(config, strategy, seed=seed, lr=lr, clip=clip, graph=graph, micro_batches=micro_batches,
                    executor=executor, schedule=schedule, device=device)
    losses = [trainer.step(ids, targets) for ids, targets in random_batches(
        config.vocab_size, steps, batch_size, seq_len, seed=seed + 1)]
    return losses, parameter_values(trainer)


def parameter_values(trainer: Trainer) -> dict[str, np.ndarray]:
    """Each parameter's logical value by name, on every process."""
    out = {}
    for name, p in trainer.model.named_parameters():
        value = p.detach()
        if trainer.strategy is not None and trainer.strategy.pipeline > 1:
            value = value.to_global(placement=trainer.strategy.everywhere, sbp=sbpflow.sbp.broadcast)
        out[name] = value.numpy()
    return out


# ----------------------------------------------------------------------------- where collectives happen


class PhaseLog:
    """Attributes the collectives of one step to a phase (forward, backward ...) and, in forward, to a module.

    One :func:`sbpflow.comm.record` log is open for the step; each module's
    forward claims the events issued while it ran and not claimed by a child
    (children finish first), so every event lands in its innermost module.
    """

    def __init__(self, model: nn.Module | None) -> None:
        self.log: Any = None
        self.where: dict[int, str] = {}
        self._phase = ""
        self._model = model
        self._undo: list[Callable[[], None]] = []

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.log is None:
            yield
            return
        self._phase = phase
        start = len(self.log.events)
        yield
        self._claim(start, phase)

    @contextmanager
    def recording(self) -> Iterator[PhaseLog]:
        """Records one step, wrapping every module's forward to tag its events."""
        assert self._model is not None
        with record() as log:
            self.log = log
            for name, module in self._model.named_modules():
                self._wrap(name or "gpt", module)
            try:
                yield self
            finally:
                for undo in self._undo:
                    undo()
                self._undo.clear()

    def _wrap(self, name: str, module: nn.Module) -> None:
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            start = len(self.log.events)
            out = inner(*args, **kwargs)
            self._claim(start, f"forward {_short_name(name)}")
            return out

        object.__setattr__(module, "forward", forward)
        self._undo.append(lambda: object.__delattr__(module, "forward"))

    def _claim(self, start: int, label: str) -> None:
        for i in range(start, len(self.log.events)):
            self.where.setdefault(i, label)

    def table(self) -> str:
        """Collectives of the recorded step: where they ran, their kind, calls and bytes (summed over ranks)."""
        rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for i, event in enumerate(self.log.events):
            where = self.where.get(i, "other")
            for key, table in (((where, event.kind), rows), ((event.kind,), kinds)):
                table[key][0] += 1  # type: ignore[index]
                table[key][1] += event.bytes  # type: ignore[index]
        return _format_comm(rows, kinds, self.log.events)


def _short_name(name: str) -> str:
    """``h.0.attn.c_proj`` -> ``h.*.attn.c_proj``: blocks share rows so the table stays short."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "h" and parts[1].isdigit():
        parts[1] = "*"
    return ".".join(parts)


def _format_comm(rows: dict[tuple[str, str], list[int]], kinds: dict[Any, list[int]],
                 events: Sequence[CommEvent]) -> str:
    width = max([len(w) for w, _ in rows] + [20])
    lines = [f"  {'where':<{width}}  {'collective':<15} {'calls':>5} {'bytes':>12}"]
    for (where, kind), (calls, nbytes) in sorted(rows.items(), key=_phase_order):
        lines.append(f"  {where:<{width}}  {kind:<15} {calls:>5} {nbytes:>12,}")
    lines.append("  " + "-" * (width + 36))
    for (kind,), (calls, nbytes) in sorted(kinds.items()):
        lines.append(f"  {'total':<{width}}  {kind:<15} {calls:>5} {nbytes:>12,}")
    lines.append(f"  {'total':<{width}}  {'all':<15} {len(events):>5} {sum(e.bytes for e in events):>12,}")
    return "\n".join(lines)


def _phase_order(item: tuple[tuple[str, str], list[int]]) -> tuple[int, str, str]:
    (where, kind), _ = item
    order = ["forward", "backward", "clip_grad_norm", "optimizer", "other"]
    first = where.split(" ")[0]
    return (order.index(first) if first in order else len(order), where, kind)


# ----------------------------------------------------------------------------- the demo

STDLIB_FILES = (
    "abc.py", "bisect.py", "contextlib.py", "copy.py", "fractions.py", "functools.py", "heapq.py", "operator.py",
    "pprint.py", "queue.py", "random.py", "shlex.py", "statistics.py", "string.py", "textwrap.py",
)


def stdlib_text(files: Sequence[str] = STDLIB_FILES) -> str:
    """The concatenated sources of a fixed list of standard-library modules (about 300 KB, nothing downloaded).

    Characters outside 7-bit ASCII become ``?`` so the vocabulary is the same on every machine.
    """
    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in sorted(files):
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    if not parts:
        raise FileNotFoundError(f"none of the standard-library files {list(files)} exist under {root}")
    return "".join(c if ord(c) < 128 else "?" for c in "\n".join(parts))


@dataclass(frozen=True)
class CharData:
    """A character-level corpus: the vocabulary and the text as ids."""

    chars: str
    ids: np.ndarray

    @classmethod
    def from_text(cls, text: str) -> CharData:
        chars = "".join(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(chars)}
        return cls(chars, np.array([lookup[c] for c in text], dtype=np.int64))

    def encode(self, text: str) -> list[int]:
        return [self.chars.index(c) for c in text if c in self.chars]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batches(self, batch_size: int, block: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Random windows of ``block + 1`` characters, forever."""
        rng = np.random.default_rng(seed)
        while True:
            starts = rng.integers(0, len(self.ids) - block - 1, size=batch_size)
            windows = np.stack([self.ids[s : s + block + 1] for s in starts])
            yield windows[:, :-1], windows[:, 1:]


class CharWindows(Dataset):
    """Every window of ``block + 1`` characters of a corpus: sample i is (ids[i : i+block], ids[i+1 : i+block+1])."""

    def __init__(self, ids: np.ndarray, block: int) -> None:
        if len(ids) <= block:
            raise sbpflow.SbpflowError(f"a corpus of {len(ids)} characters has no window of {block + 1}")
        self.ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        self.block = block

    def __len__(self) -> int:
        return len(self.ids) - self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[i : i + self.block + 1]
        return window[:-1], window[1:]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options (shared by ``sbpflow demo`` and ``python -m sbpflow.demo``)."""
    parser.add_argument("--devices", type=int, default=4,
                        help="number of virtual CPU devices (default 4)")
    parser.add_argument("--strategy", default=None,
                        help='how to use them, e.g. "dp=2,tp=2" (default for 4 devices), "dp=4", "tp=2", "pp=2" or '
                             '"dp=2,tp=2,pp=2": data, tensor (Megatron) and pipeline degrees, whose product must be '
                             "--devices; without it, dp=2,tp=2 on 4 devices and dp=N otherwise")
    parser.add_argument("--model", choices=MODELS, default="gpt",
                        help="gpt (nanoGPT), llama (RMSNorm, rotary, SwiGLU, grouped-query attention) or moe "
                             "(Mixtral: 4 experts, top-2; prints the tokens each expert received) (default gpt)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--n-layer", type=int, default=3, help="transformer blocks (default 3)")
    parser.add_argument("--n-embd", type=int, default=128, help="model width; a multiple of 4, the head count "
                                                               "(default 128)")
    parser.add_argument("--block-size", type=int, default=64, help="characters of context (default 64)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all data ranks "
                                                                   "(default 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init, dropout and batches (default 0)")
    parser.add_argument("--sample-length", type=int, default=160, help="characters to sample at the end "
                                                                       "(default 160)")
    parser.add_argument("--out", default="out", help="folder for the loss curve PNG (default out/)")
    parser.add_argument("--no-tour", action="store_true", help="skip the matmul tour that runs before training")
    parser.add_argument("--graph", action="store_true", help="compile the training step with nn.Graph and run it on "
                                                             "the actor runtime (prints the plan, writes a timeline)")
    parser.add_argument("--auto", action="store_true", help="plan the model for --devices with the auto-parallel "
                        "planner (its traced step, on metadata), print the plan, then train it in graph mode")
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps in graph mode "
                                                                      "(default 1)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="save a sharded checkpoint every N steps, in the background, to "
                             "OUT/checkpoints/step-NNNNNNNN (default: never)")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="continue from a checkpoint (or the newest one in a folder of them), under this run's "
                             "own --devices and --strategy: bit-exact under the same ones")
    parser.add_argument("--pipeline-schedule", choices=["1f1b", "gpipe", "zero_bubble", "interleaved_1f1b"],
                        default=None, help="how pipeline stages take turns in graph mode (default 1f1b); the grid "
                                           "is printed")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], metavar="STAGE",
                        help="ZeRO stage on the data axis: 1 shards optimizer state, 2 also gradients, 3 also "
                        "parameters (default 0: none)")
    parser.add_argument("--amp", choices=["bf16"], default=None,
                        help="mixed precision: matmuls in bf16, master weights and the loss in fp32")
    parser.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                        help="stages per pipeline placement, for interleaved_1f1b (default 2 there, else 1)")
    return parser


def _resolve_strategy(args: argparse.Namespace) -> dict[str, int]:
    """The degrees from --strategy and --devices; a mismatch ends the program with a message."""
    if args.devices < 1:
        raise SystemExit(f"sbpflow demo: --devices must be at least 1, but got {args.devices}")
    if args.strategy is None:
        if args.devices == 4:
            return {"data": 2, "tensor": 2, "pipeline": 1}
        return {"data": args.devices, "tensor": 1, "pipeline": 1}
    try:
        degrees = parse_strategy(args.strategy)
    except sbpflow.SbpflowError as e:
        raise SystemExit(f"sbpflow demo: {e}") from None
    used = degrees["data"] * degrees["tensor"] * degrees["pipeline"]
    if used != args.devices:
        raise SystemExit(f"sbpflow demo: --strategy {args.strategy} uses {used} devices, but --devices is "
                         f"{args.devices}")
    return degrees


def _virtual_stages(args: argparse.Namespace) -> int:
    if args.virtual_stages is not None:
        return int(args.virtual_stages)
    return 2 if args.pipeline_schedule == "interleaved_1f1b" else 1


def _auto_plan(args: argparse.Namespace, config: GPTConfig, print_fn: Callable[[str], None]) -> dict[str, int]:
    """``--auto``: the graph planner's plan of the demo's model (built under ``meta_init()``, its training step
    traced on metadata) for ``--devices`` CPU devices; sets graph mode, micro-batches, ZeRO and the schedule from
    it and returns its degrees. (The demo cuts stages evenly by blocks, and keeps every activation.)"""

    with sbpflow.meta_init():
        model = _make_model(args.model, config)
    # on one rank: the demo's models make their position ids on their strategy's placement
    placement = sbpflow.parallelize(model).stages[0]
    ids = sbpflow.meta_tensor(args.batch_size, args.block_size, dtype=torch.int64, placement=placement,
                              sbp=[sbpflow.sbp.broadcast] * placement.ndim)
    try:
        plan = plan_graph(trace_training_step(model, (ids, ids)), args.devices, "cpu", precision="traced")
    except sbpflow.SbpflowError as e:
        raise SystemExit(f"sbpflow demo --auto: {e}") from None
    print_fn("\n== the auto-parallel plan (sbpflow.autoparallel, from the traced training step)\n" + plan.explain())
    k = plan.knobs
    args.graph, args.micro_batches, args.zero = True, plan.micro_batches, k.zero
    args.pipeline_schedule, args.virtual_stages = k.schedule, k.virtual
    return {"data": k.dp, "tensor": k.tp, "pipeline": k.pp}


def main(argv: Sequence[str] | None = None, print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Parses the demo's options and runs it; returns what it showed (losses, tables, PNG path, sample)."""
    parser = add_arguments(argparse.ArgumentParser(prog="sbpflow demo", description=DESCRIPTION))
    return run_from_args(parser.parse_args(list(argv) if argv is not None else None), print_fn)


def run_from_args(args: argparse.Namespace, print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the demo with parsed options (see :func:`add_arguments`)."""
    degrees = _resolve_strategy(args)
    # Virtual devices run their shards one after another on small tensors, where torch's intra-op threads
    # only add synchronisation (4x slower on a shared 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, degrees, print_fn)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, degrees: dict[str, int], print_fn: Callable[[str], None]) -> dict[str, Any]:
    if not args.no_tour:
        _matmul_tour(print_fn)
    data = CharData.from_text(stdlib_text())
    print_fn(f"\n== training a character-level {args.model.upper()} on {len(data.ids):,} characters of Python's "
             f"standard library (vocabulary {len(data.chars)})")
    config = GPTConfig(vocab_size=len(data.chars), block_size=args.block_size, n_layer=args.n_layer, n_head=4,
                       n_embd=args.n_embd, dropout=0.0)
    if args.auto:
        degrees = _auto_plan(args, config, print_fn)
    try:
        trainer = build(config, dict(degrees), seed=args.seed, lr=args.lr, graph=args.graph,
                        micro_batches=args.micro_batches, schedule=args.pipeline_schedule,
                        virtual_stages=_virtual_stages(args), zero=args.zero,
                        amp=torch.bfloat16 if args.amp == "bf16" else None, model=args.model)
    except sbpflow.SbpflowError as e:  # e.g. more pipeline stages than blocks
        raise SystemExit(f"sbpflow demo: {e}") from None
    assert trainer.strategy is not None
    print_fn(trainer.strategy.describe())
    if args.zero or args.amp:
        extras = ([f"ZeRO stage {args.zero} on the data axis"] if args.zero else []) + \
            ([f"mixed precision {args.amp} (fp32 master weights)"] if args.amp else [])
        print_fn("memory: " + ", ".join(extras))
    if trainer.graph is not None:
        os.makedirs(args.out, exist_ok=True)
        trainer.graph.config.trace_path = os.path.join(args.out, "timeline.json")
    warmup = min(max(1, args.steps // 10), args.steps - 1)
    schedule = optim.lr_scheduler.WarmupCosine(trainer.optimizer, warmup_steps=warmup, total_steps=args.steps)
    losses, comm_table = _train(trainer, data, args, schedule, print_fn)
    if trainer.graph is not None:
        comm_table = _plan_summary(trainer.graph)
        print_fn("\n== the compiled step (nn.Graph on the actor runtime)\n" + comm_table)
        print_fn(f"timeline: {trainer.graph.config.trace_path} (open it at ui.perfetto.dev)")
    else:
        print_fn("\n== collectives of one training step (bytes summed over ranks)\n" + comm_table)
    png = plot_losses(losses, os.path.join(args.out, f"{args.model}_loss.png"), trainer.strategy)
    print_fn(f"\nloss {losses[0]:.3f} -> {losses[-1]:.3f}; curve saved to {png}")
    if isinstance(trainer.model, moe.Mixtral):
        counts = [[int(n) for n in layer] for layer in moe.expert_tokens(trainer.model)]
        print_fn("tokens each expert received in the last step, per layer: " + "; ".join(map(str, counts)))
    sample = _sample(trainer, data, args)
    print_fn("\n== sample (the prompt is a block of the training text)\n" + sample)
    return {"losses": losses, "png": png, "sample": sample, "strategy": trainer.strategy.describe(),
            "comm": comm_table}


DESCRIPTION = (
    "Trains a small character-level GPT on Python standard-library sources on virtual CPU devices. Parameters are "
    "laid out Megatron-style on the tensor axis (q/k/v and MLP fc split by output, c_proj by input, embedding and "
    "head by vocabulary), replicated on the data axis, and divided by blocks among pipeline stages; sbpflow inserts "
    "every collective. Prints the strategy, the collectives of one step, a progress bar, then saves the loss curve "
    "as a PNG and prints a sample."
)


def _plan_summary(graph: Any) -> str:
    """The compiled plan's summary: node counts, selection, per-step collectives, bytes, memory, compile time."""
    compiled = graph._compiled()
    text = explain(compiled.logical, compiled.plan, compiled.report)
    lines = text.splitlines()
    keep = [ln for ln in lines if ln.startswith(("compiled step", "sbp selection", "per step", "          ",
                                                  "compile time"))]
    if compiled.plan.pipeline is not None:
        keep += ["", pipeline_text(compiled.plan)]
    return "\n".join(keep)


def _matmul_tour(print_fn: Callable[[str], None]) -> None:
    try:  # the tour is its own module; the demo trains without it
        matmul_tour = importlib.import_module("sbpflow.demo.matmul_tour")
    except ImportError:
        return
    print_fn("== a tour of matmul under SBP")
    matmul_tour.run(print_fn=print_fn)


def _train(trainer: Trainer, data: CharData, args: argparse.Namespace, schedule: Any,
           print_fn: Callable[[str], None]) -> tuple[list[float], str]:
    loader = demo_loader(data, trainer, args)
    state = demo_run_state(trainer, schedule, loader=loader)
    manager = manager_from_args(args)  # None without --checkpoint-every
    first = resume_from_args(args, state, print_fn)  # 0 without --resume
    bar = ProgressBar(args.steps)
    losses: list[float] = []
    tables: list[str] = []
    start = time.perf_counter()
    for step, loss in zip(range(first, args.steps), _losses(trainer, loader, args.steps - first, tables),
                          strict=True):
        losses.append(loss)
        schedule.step()
        checkpoint_from_args(args, manager, state, step + 1, print_fn)
        tokens = (step + 1 - first) * args.batch_size * args.block_size
        bar.update(step + 1, losses[-1], tokens / max(time.perf_counter() - start, 1e-9))
    bar.close()
    if manager is not None:
        manager.wait()
    return losses, "".join(tables)


def demo_loader(data: CharData, trainer: Trainer, args: argparse.Namespace) -> DataLoader:
    """Shuffled windows of the corpus (seeded; no window twice in an epoch), ids laid out on the first stage and
    targets on the last, each process reading only its ranks' rows; its position is checkpointed (``--resume``)."""
    strategy = trainer.strategy
    assert strategy is not None
    return DataLoader(CharWindows(data.ids, args.block_size), args.batch_size, shuffle=True, seed=args.seed + 1,
                      drop_last=True, placement=[strategy.stages[0], strategy.stages[-1]],
                      sbp=[strategy.input_sbp, strategy.input_sbp])


def _losses(trainer: Trainer, loader: DataLoader, steps: int, tables: list[str]) -> Iterator[float]:
    """The loss of each of ``steps`` steps on the loader's batches: compiled steps fed by the loader's source actor
    (``Graph.iterate``: the loader's lane is on the timeline), or eager steps, recording the second one's
    collectives into ``tables`` (the first also fills dispatch caches and optimizer state)."""
    if trainer.graph is not None:
        for loss in trainer.graph.iterate(loader, steps=steps):
            yield scalar(loss, trainer.strategy)
        return
    for k, (ids, targets) in enumerate(loader.batches(steps=steps)):
        if k != 1:
            yield trainer.step(ids, targets)
            continue
        phases = PhaseLog(trainer.model)
        with phases.recording():
            loss = trainer.step(ids, targets, phases)
        tables.append(phases.table())
        yield loss


def _sample(trainer: Trainer, data: CharData, args: argparse.Namespace) -> str:
    """Continues a full block of training text; a fixed window length keeps every forward's shapes (and so
    the dispatch and boxing caches) the same."""
    ids, _ = next(data.batches(1, args.block_size, args.seed + 2))
    tokens = trainer.model.generate(sbpflow.tensor(ids), args.sample_length, temperature=0.8, seed=args.seed)
    return data.decode(tokens)


class ProgressBar:
    """A plain-stdout progress bar: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, width: int = 30, stream: Any = None) -> None:
        self.total, self.width = total, width
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_tenth = -1

    def update(self, done: int, loss: float, tokens_per_s: float) -> None:
        filled = int(self.width * done / max(self.total, 1))
        text = (f"[{'#' * filled}{'.' * (self.width - filled)}] step {done}/{self.total}  loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s")
        if self.tty:
            self.stream.write("\r" + text)
            self.stream.flush()
            return
        tenth = 10 * done // max(self.total, 1)
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(text + "\n")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()


def plot_losses(losses: Sequence[float], path: str, strategy: Strategy | None = None) -> str:
    """Saves the loss curve as a PNG (matplotlib's Agg backend, no display needed); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    where = (f"data={strategy.data} x tensor={strategy.tensor} x pipeline={strategy.pipeline}"
             if strategy else "one device")
    ax.set_title(f"char-level GPT, {where}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
