"""The op schema under its old name, for code written before the registry was split (schema, propagation,
dispatch, execution). New code imports ``sbpflow.ops.schema``."""

from __future__ import annotations

from .schema import DYNAMIC, REGISTRY, Meta, OpDef, Scalar, ShardCtx, Sig, op

__all__ = ["DYNAMIC", "REGISTRY", "Meta", "OpDef", "Scalar", "ShardCtx", "Sig", "op"]
