"""From ``sbpflow plan``'s flags to a prediction: the fully given plan, or the search over what is left open."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .predict import Cluster, ParallelPlan, Prediction
from .profiles import get_profile
from .search import Fixed, SearchResult, predict, search
from .transformer import TransformerSpec


def plan_from_args(args: argparse.Namespace) -> tuple[TransformerSpec, Cluster, Prediction, SearchResult | None]:
    """The model, the cluster, the best (or given) plan's prediction, and the search (None when not searched)."""
    spec = spec_from_args(args)
    profile = get_profile(args.device)
    cluster = Cluster(args.devices, profile, args.gpus_per_node or profile.gpus_per_node)
    _check_positive(args)
    if None not in (args.tp, args.pp, args.dp, args.micro_batch):
        plan = ParallelPlan(args.tp, args.pp, args.dp, args.micro_batch, args.zero or 0, args.recompute or "full",
                            virtual=args.virtual or 1)
        return spec, cluster, predict(spec, cluster, plan, args.batch), None
    fixed = Fixed(args.tp, args.pp, args.dp, args.micro_batch, args.zero, args.recompute, virtual=args.virtual)
    result = search(spec, cluster, args.batch, fixed, keep=max(args.top, 1))
    return spec, cluster, result.best, result


def _check_positive(args: argparse.Namespace) -> None:
    for name in ("devices", "batch", "gpus_per_node", "tp", "pp", "dp", "micro_batch", "virtual"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be at least 1, but got {value}")


SIZES = ("layers", "hidden", "heads", "seq", "vocab")


def spec_from_args(args: argparse.Namespace) -> TransformerSpec:
    """The model's sizes from the flags, or from ``--hf-config`` (flags that are given override the file)."""
    given = {name: getattr(args, name) for name in SIZES if getattr(args, name) is not None}
    shape: dict[str, Any] = {"ffn_hidden": args.ffn_hidden, "kv_heads": args.kv_heads, "mlp": args.mlp,
                             "norm": args.norm, "position": args.position, "bias": not args.no_bias,
                             "tied": not args.untied, "attention": args.attention}
    if args.hf_config is not None:
        shape = spec_fields_from_hf(args.hf_config)
    missing = [f"--{name}" for name in SIZES if name not in given and name not in shape]
    if missing:
        raise PlanError(f"sbpflow plan needs the model's sizes: {', '.join(missing)} (or --hf-config config.json)")
    return TransformerSpec(**{**shape, **given}, vocab_multiple=args.vocab_multiple)


def spec_fields_from_hf(path: str | Path) -> dict[str, Any]:
    """TransformerSpec's fields from a Hugging Face Llama-style ``config.json`` (Llama, Mistral).

    >>> import tempfile
    >>> f = Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = f.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 172, "vocab_size": 100,
    ...     "max_position_embeddings": 128}))
    >>> spec_fields_from_hf(f)["kv_heads"], spec_fields_from_hf(f)["mlp"]
    (2, 'swiglu')
    """
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"--hf-config {path}: cannot read a JSON config ({e})") from e
    kind = config.get("model_type", "?")
    if config.get("num_local_experts") or config.get("num_experts"):
        raise PlanError(f"--hf-config {path}: a mixture-of-experts model ({kind}) is not planned by the sizes "
                        f"planner, which prices dense blocks only")
    if kind not in ("llama", "mistral"):
        raise PlanError(f"--hf-config reads Llama-style configs (model_type llama or mistral), but {path} "
                        f"has model_type {kind!r}")
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    absent = [k for k in need if k not in config]
    if absent:
        raise PlanError(f"--hf-config {path} lacks {', '.join(absent)}")
    return {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"],
            "heads": config["num_attention_heads"], "seq": config.get("max_position_embeddings", 2048),
            "vocab": config["vocab_size"], "ffn_hidden": config["intermediate_size"],
            "kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"], "mlp": "swiglu",
            "norm": "rmsnorm", "position": "rope", "bias": bool(config.get("attention_bias") or config.get("mlp_bias")),
            "tied": bool(config.get("tie_word_embeddings", False)), "attention": "flash"}
