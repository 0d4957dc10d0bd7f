"""Dispatch's interpreter stack and input hooks, and random's key hooks: what a pushed interpreter (nn.Graph's
tracer, or any other) receives instead of eager execution, and that popping it gives eager numbers back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import sbpflow
from sbpflow import random as sbp_random
from sbpflow import sbp as S
from sbpflow.ops import dispatch
from sbpflow.ops.schema import OpDef
from sbpflow.placement import Placement
from sbpflow.tensor import Tensor


class Recorder:
    """An interpreter that records each global op and conversion, and answers with a marker."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.conversions: list[tuple[Any, Any]] = []

    def apply_global(self, opdef: OpDef, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
        self.ops.append((opdef.name, tuple(args), dict(attrs)))
        return "recorded"

    def to_global(self, x: Tensor, placement: Placement, sbp: Any) -> Any:
        self.conversions.append((placement, sbp))
        return "converted"

    def root_grad(self, root: Tensor) -> Tensor:
        raise AssertionError("no backward here")


def test_a_pushed_interpreter_gets_global_ops_and_conversions() -> None:
    p = sbpflow.placement("cpu", [0, 1])
    x = sbpflow.tensor(np.arange(8.0).reshape(4, 2), placement=p, sbp=S.split(0))
    y = sbpflow.ones(4, 2, placement=p, sbp=S.broadcast)
    rec = Recorder()
    dispatch.INTERPRETERS.append(rec)
    try:
        out = sbpflow.add(x, y)
        moved = x.to_global(p, S.broadcast)
        local = sbpflow.tensor([1.0, 2.0]) * 2  # local tensors never reach an interpreter
    finally:
        dispatch.INTERPRETERS.pop()
    assert out == "recorded" and moved == "converted"
    assert [(name, args[0] is x, args[1] is y) for name, args, _ in rec.ops] == [("add", True, True)]
    assert rec.conversions == [(p, (S.broadcast,))]
    assert local.tolist() == [2.0, 4.0]
    np.testing.assert_array_equal(sbpflow.add(x, y).numpy(), np.arange(8.0).reshape(4, 2) + 1)


def test_an_input_hook_sees_every_op_first() -> None:
    seen: list[str] = []

    def hook(name: str, args: Sequence[Any]) -> Sequence[Any]:
        seen.append(name)
        return tuple(a * 10 if isinstance(a, float) else a for a in args)

    dispatch.INPUT_HOOKS.stack.append(hook)
    try:
        out = sbpflow.tensor([1.0, 2.0]) + 0.5
    finally:
        dispatch.INPUT_HOOKS.stack.pop()
    assert seen == ["add"] and out.tolist() == [6.0, 7.0]


def test_a_key_hook_turns_random_draws() -> None:
    class Hook:
        random_keys = 0

        def next_random_key(self, key: int) -> int:
            self.random_keys += 1
            return 12345

    sbpflow.manual_seed(0)
    plain = sbp_random.next_key()
    hook = Hook()
    sbpflow.manual_seed(0)
    sbp_random.KEY_HOOKS.append(hook)
    try:
        hooked = sbp_random.next_key()
        state = sbp_random.get_state()
    finally:
        sbp_random.KEY_HOOKS.pop()
    assert hooked == 12345 and plain != 12345 and hook.random_keys == 1 and state[2] == 1
