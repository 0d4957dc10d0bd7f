"""From ``sbpflow plan``'s flags to a prediction: the fully given plan, or the search over what is left open."""

from __future__ import annotations

import argparse

from ..errors import PlanError
from .predict import Cluster, ParallelPlan, Prediction
from .profiles import get_profile
from .search import Fixed, SearchResult, predict, search
from .transformer import TransformerSpec


def plan_from_args(args: argparse.Namespace) -> tuple[TransformerSpec, Cluster, Prediction, SearchResult | None]:
    """The model, the cluster, the best (or given) plan's prediction, and the search (None when not searched)."""
    spec = TransformerSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab)
    profile = get_profile(args.device)
    cluster = Cluster(args.devices, profile, args.gpus_per_node or profile.gpus_per_node)
    _check_positive(args)
    if None not in (args.tp, args.pp, args.dp, args.micro_batch):
        plan = ParallelPlan(args.tp, args.pp, args.dp, args.micro_batch, args.zero or 0, args.recompute or "full")
        return spec, cluster, predict(spec, cluster, plan, args.batch), None
    fixed = Fixed(args.tp, args.pp, args.dp, args.micro_batch, args.zero, args.recompute)
    result = search(spec, cluster, args.batch, fixed, keep=max(args.top, 1))
    return spec, cluster, result.best, result


def _check_positive(args: argparse.Namespace) -> None:
    for name in ("devices", "batch", "gpus_per_node", "tp", "pp", "dp", "micro_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be at least 1, but got {value}")
