"""Ops: one registry (:mod:`.registry`), one file per op family, the functional API."""

from __future__ import annotations

from . import bucket, functional, methods, optimizer
from .registry import REGISTRY, Meta, OpDef, ShardCtx, Sig, op

__all__ = ["REGISTRY", "Meta", "OpDef", "ShardCtx", "Sig", "op", "bucket", "functional", "methods", "optimizer"]
