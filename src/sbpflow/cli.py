"""The ``sbpflow`` command: demo | launch | graph | trace | plan | calibrate."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

from .autoparallel.calibrate import calibrate, describe
from .autoparallel.explain import explain, to_json
from .autoparallel.from_trace import calibrate_from_trace
from .autoparallel.graph_plan import plan_graph
from .autoparallel.planning import plan_from_args
from .autoparallel.profiles import get_profile, save_profile
from .demo.train_gpt import DESCRIPTION, add_arguments, run_from_args
from .distributed import RESTART_BASE
from .errors import SbpflowError
from .nn import graph
from .nn.trace_step import trace_training_step
from .runtime.trace import merge


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sbpflow", description="sbpflow: distribution as a property of tensors")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_launch(sub)
    _add_trace(sub)
    _add_graph(sub)
    _add_plan(sub)
    _add_calibrate(sub)
    args = parser.parse_args(argv)
    if args.command == "graph":
        return show_graphs(args)
    if args.command == "plan":
        return plan_command(args)
    if args.command == "calibrate":
        return calibrate_command(args)
    if args.command == "launch":
        return launch(args)
    if args.command == "trace":
        return trace_merge(args)
    if args.command == "demo":
        run_from_args(args)
        return 0
    return 0


def _add_graph(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("graph", help="run a script and show every nn.Graph it compiles (plan, boxing, DOT files)",
                       description="Runs SCRIPT; each nn.Graph it compiles prints its explain() text and writes the "
                                   "logical and one rank's physical graph as DOT (and SVG with Graphviz) into --out.")
    p.add_argument("--out", default="out", help="folder for the DOT/SVG files (default out/)")
    p.add_argument("--rank", type=int, default=None, help="whose physical graph to draw (default the first rank)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def show_graphs(args: argparse.Namespace) -> int:
    """``sbpflow graph script.py``: the script runs as ``__main__``; compiled graphs describe themselves."""
    import os
    import runpy

    os.makedirs(args.out, exist_ok=True)
    graph.SHOW.append((args.out, args.rank))
    saved = sys.argv
    sys.argv = [args.script, *args.script_args]
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        sys.argv = saved
        graph.SHOW.pop()
    return 0


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_arguments(sub.add_parser("demo", help="train a small GPT on virtual CPU devices (data x tensor x pipeline)",
                                 description=DESCRIPTION))


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "launch", help="run a script on N processes per node (torchrun, c10d rendezvous)",
        description="Runs SCRIPT in N processes per node, one global rank each, through torchrun's c10d "
                    "rendezvous. The same script also runs as plain `python SCRIPT` on virtual ranks.",
    )
    p.add_argument("-n", "--nproc-per-node", required=True, metavar="N|MIN:MAX",
                   help="processes (ranks) on this node; MIN:MAX (elastic, with --max-restarts): start on MAX, and "
                        "restart after a failure on MIN, which a script restoring with CheckpointManager resumes "
                        "on by resharding its newest checkpoint")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", default=None, help="rendezvous host (needed with --nnodes > 1)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole job up to N times after a failure (default 0); a script that restores "
                        "with sbpflow.checkpoint.CheckpointManager resumes from its newest checkpoint")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_trace(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="timelines of the actor runtime (SBPFLOW_TRACE files)",
                       description="Joins the per-rank timelines that SBPFLOW_TRACE=path.json writes into one "
                                   "Chrome-trace/Perfetto file (open it at ui.perfetto.dev or chrome://tracing).")
    actions = p.add_subparsers(dest="action", required=True)
    merge = actions.add_parser("merge", help="join several ranks' trace files into one")
    merge.add_argument("files", nargs="+", help="trace files (one per rank)")
    merge.add_argument("-o", "--output", required=True, help="the merged trace file to write")


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="predict or search a tensor x pipeline x data plan for a transformer, without "
                                    "hardware",
                       description="Predicts the step time, TFLOP/s and memory of a transformer's (GPT, Llama) 3-D "
                                   "parallel plan on a "
                                   "cluster described by a device profile. Flags that are given fix that part of "
                                   "the plan; the rest is searched. With --tp, --pp, --dp and --micro-batch all "
                                   "given it predicts that plan (ZeRO 0 and full recompute unless given).")
    sizes = p.add_argument_group("model sizes (or --hf-config)")
    for flag, what in (("layers", "transformer blocks"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("seq", "sequence length"), ("vocab", "vocabulary size")):
        sizes.add_argument(f"--{flag}", type=int, default=None, help=what)
    sizes.add_argument("--ffn-hidden", type=int, default=0, help="the MLP's inner width (default 4 x hidden)")
    sizes.add_argument("--kv-heads", type=int, default=0, help="key/value heads, grouped-query attention (default: "
                                                               "heads)")
    sizes.add_argument("--mlp", choices=("gelu", "swiglu"), default="gelu", help="MLP kind (default gelu)")
    sizes.add_argument("--norm", choices=("layernorm", "rmsnorm"), default="layernorm", help="norm (default layernorm)")
    sizes.add_argument("--position", choices=("learned", "rope"), default="learned",
                       help="position embedding (default learned)")
    sizes.add_argument("--attention", choices=("unfused", "flash"), default="unfused",
                       help="core attention: scores in memory (Megatron-LM 2021) or one fused kernel (default "
                            "unfused; --hf-config: flash)")
    sizes.add_argument("--no-bias", action="store_true", help="linear layers without biases")
    sizes.add_argument("--untied", action="store_true", help="an output layer of its own (not the token embedding)")
    sizes.add_argument("--vocab-multiple", type=int, default=128,
                       help="pad the vocabulary to a multiple of this times tp, as Megatron-LM does (default 128)")
    sizes.add_argument("--hf-config", default=None, metavar="CONFIG_JSON",
                       help="a Hugging Face Llama-style config.json instead of the size flags (--seq overrides its "
                            "max_position_embeddings)")
    sizes.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                       help="plan any model from its traced training step instead of sizes: FACTORY() returns the "
                            "model, built under sbpflow.meta_init(), and a tuple of example inputs (metadata; no "
                            "data, no weights); the batch defaults to the inputs'")
    p.add_argument("--batch", type=int, default=None, help="global batch (sequences; required with sizes)")
    p.add_argument("--devices", type=int, required=True, help="number of devices")
    p.add_argument("--memory-per-device", type=float, default=None, metavar="GB",
                   help="with --model: memory a device offers the plan (default: the profile's usable memory)")
    p.add_argument("--device", default="a100-80gb", help="a100-40gb | a100-80gb | h100-80gb | a profile file "
                                                         "written by `sbpflow calibrate` (default a100-80gb)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: the profile's, 8)")
    for flag, what in (("tp", "tensor-parallel degree"), ("pp", "pipeline stages"), ("dp", "data-parallel degree"),
                       ("micro-batch", "sequences per micro-batch"), ("zero", "ZeRO stage 0-3"),
                       ("virtual", "model chunks per pipeline stage (interleaved 1F1B when > 1)")):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"{what} (searched if not given)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                   help="activation recomputation (searched if not given)")
    p.add_argument("--top", type=int, default=5, help="plans to report: the best and its runners-up (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the explanation")


def plan_command(args: argparse.Namespace) -> int:
    """``sbpflow plan``: explain (or ``--json``) the best plan, or the one the flags fix completely."""
    import json

    if args.model is not None:
        return _plan_model(args, json)
    try:
        if args.batch is None:
            raise SbpflowError("sbpflow plan needs --batch (the global batch) with the model's sizes")
        spec, cluster, best, result = plan_from_args(args)
    except SbpflowError as e:
        print(f"sbpflow plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(spec, cluster, best, result), indent=2) if args.json
          else explain(spec, cluster, best, result))
    return 0


def _plan_model(args: argparse.Namespace, json: Any) -> int:
    """``sbpflow plan --model pkg.module:factory``: the graph planner on the factory's traced training step."""
    try:
        model, inputs = _factory(args.model)()
        graph_of_step = trace_training_step(model, inputs if isinstance(inputs, (tuple, list)) else (inputs,))
        memory = None if args.memory_per_device is None else args.memory_per_device * 1e9
        plan = plan_graph(graph_of_step, args.devices, args.device, memory_per_device=memory,
                          gpus_per_node=args.gpus_per_node, batch=args.batch, keep=max(args.top, 1))
    except SbpflowError as e:
        print(f"sbpflow plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.cli_json(), indent=2) if args.json else plan.explain())
    return 0


def _factory(spec: str) -> Any:
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise SbpflowError(f"--model takes pkg.module:factory, but got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SbpflowError(f"--model {spec}: cannot import {module_name} ({e})") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SbpflowError(f"--model {spec}: {module_name} has no callable {name}")
    return factory


def _add_calibrate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("calibrate", help="measure this machine into a device profile for `sbpflow plan`",
                       description="Measures matmul and elementwise throughput, memcpy bandwidth and the α-β of "
                                   "gloo collectives between local processes, and writes a profile file.")
    p.add_argument("-o", "--output", default="sbpflow-profile.json", help="profile file to write")
    p.add_argument("--name", default="local-cpu", help="the profile's name")
    p.add_argument("--processes", type=int, default=2, help="gloo processes for the α-β fit (default 2)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (seconds, noisier)")
    p.add_argument("--from-trace", nargs="+", metavar="TRACE", default=None,
                   help="instead of measuring: refit α-β and memory efficiency of --profile from a run's timeline "
                        "files (SBPFLOW_TRACE), and show the prediction error before and after")
    p.add_argument("--profile", default="cpu", help="the profile --from-trace starts from (a name or a file)")


def calibrate_command(args: argparse.Namespace) -> int:
    """``sbpflow calibrate``: measure, print what was measured, write the profile."""
    if args.from_trace:
        try:
            result = calibrate_from_trace(get_profile(args.profile), args.from_trace)
        except SbpflowError as e:
            print(f"sbpflow calibrate: {e}", file=sys.stderr)
            return 2
        save_profile(result.after, args.output)
        print(result.describe())
    else:
        profile, measurements = calibrate(args.name, processes=args.processes, quick=args.quick)
        save_profile(profile, args.output)
        print(describe(measurements))
    print(f"sbpflow calibrate: wrote {args.output}")
    return 0


def trace_merge(args: argparse.Namespace) -> int:
    """``sbpflow trace merge a.json b.json -o out.json``: one timeline with a process lane group per rank."""
    spans = merge(args.files, args.output)
    print(f"sbpflow trace: {spans} spans from {len(args.files)} files -> {args.output}")
    return 0


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for ``sbpflow launch`` arguments.

    >>> import argparse
    >>> torchrun_argv(argparse.Namespace(nproc_per_node=2, nnodes=1, node_rank=0, master_addr=None,
    ...                                  master_port=None, script="train.py", script_args=["--lr", "0.1"]))
    ['--nproc-per-node', '2', '--nnodes', '1', '--max-restarts', '0', '--standalone', 'train.py', '--lr', '0.1']
    """
    restarts = getattr(args, "max_restarts", 0)
    if not isinstance(restarts, int) or restarts < 0:
        raise SystemExit(f"sbpflow launch: --max-restarts must be at least 0, but got {restarts}")
    argv = ["--nproc-per-node", str(args.nproc_per_node), "--nnodes", str(args.nnodes), "--max-restarts",
            str(restarts)]
    if args.nnodes == 1 and args.master_addr is None and args.master_port is None:
        argv.append("--standalone")  # c10d rendezvous on localhost, on a free port
    else:
        if args.master_addr is None and args.nnodes > 1:
            raise SystemExit("sbpflow launch: --nnodes > 1 needs --master-addr (the host of node 0)")
        endpoint = f"{args.master_addr or '127.0.0.1'}:{args.master_port or 29500}"
        argv += ["--node-rank", str(args.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-id", "sbpflow"]
    return argv + [args.script, *args.script_args]


def nproc_range(text: str) -> tuple[int, int]:
    """``-n``'s (MIN, MAX): ``"4"`` is (4, 4), ``"2:4"`` is (2, 4).

    >>> nproc_range("2:4"), nproc_range("3")
    ((2, 4), (3, 3))
    """
    low, _, high = str(text).partition(":")
    try:
        least, most = int(low), int(high or low)
    except ValueError:
        raise SystemExit(f"sbpflow launch: -n takes N or MIN:MAX (whole numbers), but got {text!r}") from None
    if not 1 <= least <= most:
        raise SystemExit(f"sbpflow launch: -n needs 1 <= MIN <= MAX, but got {text!r}")
    return least, most


def launch(args: argparse.Namespace) -> int:
    """Runs the script under torchrun; on failure prints which ranks failed and returns 1.

    torchrun stops every other process of the job as soon as one fails. With ``-n MIN:MAX`` each attempt is a
    torchrun job of its own: the first on MAX processes, the restarts on MIN.
    """
    least, most = nproc_range(args.nproc_per_node)
    torchrun_argv(argparse.Namespace(**(vars(args) | {"nproc_per_node": most})))  # checks the other arguments
    if least == most:
        return _run_torchrun(argparse.Namespace(**(vars(args) | {"nproc_per_node": most})))
    restarts = args.max_restarts
    for attempt in range(restarts + 1):
        n = most if attempt == 0 else least
        if attempt:
            print(f"sbpflow launch: restart {attempt} of {restarts}, on {n} processes (was {most})", file=sys.stderr,
                  flush=True)
        one = argparse.Namespace(**(vars(args) | {"nproc_per_node": n, "max_restarts": 0}))
        if _run_torchrun(one, attempt) == 0:
            return 0
    return 1


def _run_torchrun(args: argparse.Namespace, attempt: int = 0) -> int:
    """One torchrun job; ``attempt``: how many shrinking restarts came before it (``SBPFLOW_RESTART_BASE`` in the
    workers, added to torchrun's own restart count: the rendezvous prefix and a script's attempt number)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    saved = os.environ.get(RESTART_BASE)
    os.environ[RESTART_BASE] = str(attempt)  # the launcher's own environment, which the workers inherit
    try:
        run(get_args_parser().parse_args(torchrun_argv(args)))
    except ChildFailedError as e:
        print(_failure_summary(e), file=sys.stderr, flush=True)
        return 1
    finally:
        if saved is None:
            os.environ.pop(RESTART_BASE, None)
        else:
            os.environ[RESTART_BASE] = saved
    return 0


def _failure_summary(error: Any) -> str:
    """Names the rank that failed first. torchrun's own pick goes by whole-second timestamps, so a rank
    stopped by the launcher (a signal) or failing because a peer went away can tie with the real cause."""
    failures = sorted(error.failures.items(), key=lambda kv: (kv[1].exitcode < 0, _secondary(kv[1]),
                                                              kv[1].timestamp, kv[0]))
    first_rank, first = failures[0]
    lines = [f"sbpflow launch: {error.name} failed; first failure: rank {first_rank} "
             f"(exit code {first.exitcode}{_signal_name(first.exitcode)}){_message(first)}"]
    for rank, failure in sorted(error.failures.items()):
        lines.append(f"  rank {rank} (local rank {failure.local_rank}): exit code {failure.exitcode}"
                     f"{_signal_name(failure.exitcode)}{_message(failure)}")
    return "\n".join(lines)


def _message(failure: Any) -> str:
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
    return f": {message.splitlines()[0]}" if message else ""


def _secondary(failure: Any) -> bool:
    return "a peer closed its connection" in _message(failure)


def _signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return ""
    import signal

    try:
        return f", {signal.Signals(-exitcode).name}: stopped by the launcher after another rank failed"
    except ValueError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
