"""Ops: one schema (:mod:`.schema`), propagation, dispatch and execution, one file per op family, the functional API."""

from __future__ import annotations

from . import bucket, composite_grads, dispatch, functional, methods, optimizer  # noqa: F401  # they register
from .schema import REGISTRY, Meta, OpDef, ShardCtx, Sig, op

__all__ = ["REGISTRY", "Meta", "OpDef", "ShardCtx", "Sig", "op", "bucket", "functional", "methods", "optimizer"]
