"""One concrete call per op for the partial-value tests: values, attributes, and the partial rules it must keep.

An op declares its algebraic properties inside its SBP signatures: ``P(sum) -> P(sum)`` says it is
linear in that input, ``P(max) -> P(max)`` monotone non-decreasing, ``P(max) -> P(min)`` non-increasing.
``keeps`` lists, for each case, the signatures with a partial input the op must declare: the contract
the tests hold it to, written here rather than read from the rules, so that a declaration removed from the
rules (a new all-reduce) fails too. Three checks use a case (``tests/partial_checks.py``):

* the declared partial signatures equal ``keeps``;
* every declared partial-to-partial property holds on the kernel itself (hypothesis, ``tests/logic``);
* on 1-D and 2-D meshes, random per-rank pieces give the single-device value with no collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sbpflow.ops.schema import Sig
from sbpflow.sbp import parse

Args = tuple[Any, ...]


@dataclass(frozen=True)
class OpCase:
    """A call ``REGISTRY[op](*args(gen), **attrs)`` and the partial signatures it keeps."""

    id: str
    op: str
    args: Callable[[torch.Generator], Args]  # positional: tensors (logical values) and dynamic scalars
    attrs: dict[str, Any] = field(default_factory=dict)
    keeps: tuple[str, ...] = ()  # "P(sum) B -> P(sum)": one SBP per tensor input, then one per output
    elementwise: bool = False  # output element i depends on input element i only: ±inf and the dtype's range apply
    rtol: float | None = None  # property tolerance; default from the partial input's dtype
    known_wrong: str = ""  # a declaration proven wrong, to be fixed in the rules (strict xfail until then)
    wrong_in: tuple[str, ...] = ("table", "property", "mesh")  # the checks that show it ("mesh": on every mesh)
    data: tuple[int, ...] | None = None  # tensor inputs that may be partial (default: floating-point ones)

    def __str__(self) -> str:
        return self.id


def shows(case: OpCase, check: str) -> bool:
    """Whether ``check`` ("table", "property", "mesh 2", ...) fails on the case's known-wrong rule."""
    return bool(case.known_wrong) and (check in case.wrong_in or check.split()[0] in case.wrong_in)


def marked(cases: list[OpCase], check: str) -> list[Any]:
    """``cases`` as pytest params, the known-wrong ones a strict xfail for the ``check`` that shows it."""
    import pytest

    return [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=c.known_wrong)) if shows(c, check) else c
            for c in cases]


def marked_on_meshes(cases: list[OpCase], placements: list[str]) -> list[Any]:
    """``(case, placement)`` pytest params, strict xfails where the known-wrong rule shows on that mesh."""
    import pytest

    return [pytest.param(c, p, id=f"{c.id}-{p}", marks=pytest.mark.xfail(strict=True, reason=c.known_wrong))
            if shows(c, f"mesh {p}") else pytest.param(c, p, id=f"{c.id}-{p}") for c in cases for p in placements]


def sig(text: str) -> Sig:
    """``"P(sum) B -> P(sum)"`` as a :class:`Sig`."""
    ins, outs = text.split("->")
    return Sig(tuple(parse(s) for s in ins.split()), tuple(parse(s) for s in outs.split()))


def sig_text(s: Sig) -> str:
    return " ".join(map(str, s.ins)) + " -> " + " ".join(map(str, s.outs))


def _r(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _ints(g: torch.Generator, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=g)


SUM, MAX, MIN = "P(sum) -> P(sum)", "P(max) -> P(max)", "P(min) -> P(min)"
FLIPS = ("P(max) -> P(min)", "P(min) -> P(max)")
ALL3 = (SUM, MAX, MIN)


def _unary(name: str, keeps: tuple[str, ...] = (), *, wrong: str = "", **attrs: Any) -> OpCase:
    return OpCase(name, name, lambda g: (_r(g, 3, 4),), attrs, keeps, elementwise=True, known_wrong=wrong)


def _cast(src: torch.dtype, dst: torch.dtype, keeps: tuple[str, ...], wrong: str = "",
          wrong_in: tuple[str, ...] = ("table", "property", "mesh")) -> OpCase:
    def args(g: torch.Generator) -> Args:
        x = _r(g, 3, 4) * 4
        x[0] = 0  # a zero is where a cast to bool sees the pieces, not the value
        # integers beyond float32's 24 bits: where a cast of each piece rounds
        return (x.to(src) if src.is_floating_point else (x * 2**30).round().to(src) + 1,)

    short = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.int64: "i64", torch.bool: "bool"}
    return OpCase(f"cast-{short[src]}-{short[dst]}", "cast", args, {"dtype": dst}, keeps, elementwise=True,
                  known_wrong=wrong, wrong_in=wrong_in, data=(0,))


def _tt(name: str, keeps: tuple[str, ...], small: bool = False, infinite: bool = False) -> OpCase:
    """Two tensors; ``small``: integer values, so that comparisons meet equal pieces too; ``infinite``: ±inf
    among the values, where a B operand meets the -inf piece of an empty shard."""
    def args(g: torch.Generator) -> Args:
        values = tuple((_r(g, 3, 4) * 2).round() if small else _r(g, 3, 4) for _ in range(2))
        for v in values if infinite else ():
            v[:2, :2], v[1:, 2:] = float("inf"), float("-inf")
        return values

    return OpCase(f"{name}-tt" + ("-inf" if infinite else ""), name, args, {}, keeps, elementwise=True)


def _ts(name: str, keeps: tuple[str, ...], scalar: float = 2.5) -> OpCase:
    """A tensor and a scalar; the rule sees only the scalar's type, so each op gets a negative one too."""
    suffix = "-ts" + ("-inf" if abs(scalar) == float("inf") else "") + ("" if scalar > 0 else "-neg")
    return OpCase(f"{name}{suffix}", name, lambda g: (_r(g, 3, 4), scalar), {}, keeps, elementwise=True)


def _partials(*inputs: str) -> tuple[str, ...]:
    """The three partial kinds through one input (others B): ``_partials("_", "B")``."""
    return tuple(" ".join(kind if s == "_" else s for s in inputs) + f" -> {kind}"
                 for kind in ("P(sum)", "P(max)", "P(min)"))


_CONV = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
_POOL = {"kernel_size": (2, 2), "stride": (2, 2), "padding": (0, 0)}
_MAXPOOL = dict(_POOL, dilation=(1, 1), ceil_mode=False)
_AVGPOOL = dict(_POOL, ceil_mode=False, count_include_pad=True)


def _elementwise_cases() -> list[OpCase]:
    monotone = (MAX, MIN)
    return [
        _unary("neg", (SUM,) + FLIPS),
        *[_unary(n, monotone) for n in ("exp", "tanh", "sigmoid", "relu", "floor", "ceil", "round")],
        # P(min) holds: where the smallest piece is out of the domain, so is the value
        _unary("log", (MIN,)),  # not P(max): NaN where a losing piece is <= 0 or -inf
        _unary("sqrt", (MIN,)),  # not P(max): NaN where a losing piece is < 0
        *[_unary(n) for n in ("abs", "rsqrt", "silu", "sign", "gelu")],
        _cast(torch.float32, torch.float64, ALL3),
        _cast(torch.float32, torch.float16, monotone),  # a narrowing cast of P(sum) is not linear
        _cast(torch.float32, torch.int64, ()),  # neither linear nor defined on the -inf of empty shards
        _cast(torch.float32, torch.bool, ()),  # neither linear nor monotone
        _cast(torch.int64, torch.float32, monotone),  # int64 -> float32 of P(sum) would round each piece
        # the opt-in narrowing cast of bf16 gradient communication: P(sum) passes, each piece rounded (bf16 rtol)
        OpCase("comm_cast-f32-bf16", "comm_cast", lambda g: (_r(g, 3, 4),), {"dtype": torch.bfloat16}, (SUM,),
               elementwise=True, rtol=3e-2, wrong_in=("mesh",),
               known_wrong="comm_cast rounds each partial piece on purpose (bf16 gradient communication): the "
                           "exact mesh check sees the bf16 rounding of the pieces"),
        OpCase("clamp", "clamp", lambda g: (_r(g, 3, 4), -0.5, 0.5), {}, monotone, elementwise=True),
        OpCase("clamp-lo", "clamp", lambda g: (_r(g, 3, 4), -0.5, None), {}, monotone, elementwise=True),
        OpCase("dropout", "dropout", lambda g: (_r(g, 3, 4), 7), {"p": 0.5}, (SUM,), elementwise=True),
        # no P(max)/P(min) with B: an infinite B meets the -inf piece of an empty shard (-inf + inf is NaN)
        _tt("add", ("P(sum) P(sum) -> P(sum)",)),
        _tt("sub", ("P(sum) P(sum) -> P(sum)",)),
        _tt("add", ("P(sum) P(sum) -> P(sum)",), infinite=True),
        _tt("sub", ("P(sum) P(sum) -> P(sum)",), infinite=True),
        _tt("mul", ("P(sum) B -> P(sum)", "B P(sum) -> P(sum)")),
        _tt("div", ("P(sum) B -> P(sum)",)),
        _tt("maximum", ()),
        _tt("pow", ()),
        *[_ts("add", (), k) for k in (2.5, -2.5, float("inf"), float("-inf"))],  # the scalar may be inf (see add)
        *[_ts("sub", (), k) for k in (2.5, -2.5, float("inf"), float("-inf"))],
        *[_ts("mul", (SUM,), k) for k in (2.5, -2.5)],
        *[_ts("div", (SUM,), k) for k in (2.5, -2.5)],
        *[_ts(name, (), k) for name in ("rsub", "rdiv", "rpow") for k in (2.5, -2.5)],
        OpCase("relu_backward", "relu_backward", lambda g: (_r(g, 3, 4), torch.relu(_r(g, 3, 4))), {},
               ("P(sum) B -> P(sum)",), elementwise=True),
        OpCase("where", "where", lambda g: (_r(g, 3, 4) > 0, _r(g, 3, 4), _r(g, 3, 4)), {}, (), elementwise=True),
        _tt("minimum", ()),
        OpCase("gelu_backward", "gelu_backward", lambda g: (_r(g, 3, 4), _r(g, 3, 4)), {}, (), elementwise=True),
        OpCase("silu_backward", "silu_backward", lambda g: (_r(g, 3, 4), _r(g, 3, 4)), {}, ("P(sum) B -> P(sum)",),
               elementwise=True),
        *[_tt(n, (), small=True) for n in ("eq", "ne", "lt", "le", "gt", "ge")],
        *[OpCase(n, n, lambda g: (_r(g, 3, 4) > 0, _r(g, 3, 4) > 0), {}, (), elementwise=True, data=(0, 1))
          for n in ("logical_and", "logical_or")],
        OpCase("logical_not", "logical_not", lambda g: (_r(g, 3, 4) > 0,), {}, (), elementwise=True, data=(0,)),
        *[_unary(n, ALL3) for n in ("clone", "contiguous")],
        *[_unary(n) for n in ("sin", "cos", "isnan", "isfinite")],
        _unary("erf", monotone),
        OpCase("masked_fill", "masked_fill", lambda g: (_r(g, 3, 4), _r(g, 3, 4) > 0), {"value": 1.5}, _partials(
            "_", "B")[1:], elementwise=True),
        OpCase("masked_fill-0", "masked_fill", lambda g: (_r(g, 3, 4), _r(g, 3, 4) > 0), {"value": 0.0},
               _partials("_", "B"), elementwise=True),
    ]


def _reduction_cases() -> list[OpCase]:
    def x(g: torch.Generator) -> Args:
        return (_r(g, 4, 6),)

    return [
        OpCase("sum", "sum", x, {"dim": (1,)}, (SUM,)),
        OpCase("sum-all", "sum", x, {}, (SUM,)),
        OpCase("mean", "mean", x, {"dim": (1,)}, (SUM,)),
        OpCase("amax", "amax", x, {"dim": (1,)}, (MAX,)),
        OpCase("amin", "amin", x, {"dim": (0,), "keepdim": True}, (MIN,)),
        OpCase("index_scatter", "index_scatter", lambda g: (_r(g, 4), _ints(g, 6, 4)),
               {"shape": (4, 6), "dim": 1, "keepdim": False}, ("P(sum) B -> P(sum)",)),
        OpCase("max_dim", "max_dim", x, {"dim": 1}),
        OpCase("min_dim", "min_dim", x, {"dim": 0}),
        OpCase("argmax", "argmax", x, {"dim": 1}),
        OpCase("argmin", "argmin", x, {"dim": 0}),
        OpCase("topk", "topk", x, {"k": 2, "dim": 1}),
        OpCase("cumsum", "cumsum", x, {"dim": 1}, (SUM,)),
        OpCase("all", "all", lambda g: (_r(g, 4, 6) > -1,), {"dim": (1,)}, (MIN,), data=(0,)),
        OpCase("any", "any", lambda g: (_r(g, 4, 6) > 1,), {"dim": (1,)}, (MAX,), data=(0,)),
        OpCase("all-float", "all", x, {"dim": (1,)}),  # nonzero of each piece is not nonzero of the value
        OpCase("softmax", "softmax", x, {"dim": 1}),
        OpCase("log_softmax", "log_softmax", x, {"dim": 1}),
    ]


def _matrix_cases() -> list[OpCase]:
    both = ("P(sum) B -> P(sum)", "B P(sum) -> P(sum)")
    return [
        OpCase("matmul", "matmul", lambda g: (_r(g, 3, 4), _r(g, 4, 5)), {}, both),
        OpCase("linear", "linear", lambda g: (_r(g, 3, 4), _r(g, 5, 4), _r(g, 5)), {},
               ("P(sum) B P(sum) -> P(sum)", "S(1) S(1) P(sum) -> P(sum)")),
        # 2 input features split over 3 ranks: one rank holds none (an empty shard)
        OpCase("linear-empty-shard", "linear", lambda g: (_r(g, 3, 2), _r(g, 5, 2), _r(g, 5)), {},
               ("P(sum) B P(sum) -> P(sum)", "S(1) S(1) P(sum) -> P(sum)")),
        OpCase("linear-nobias", "linear", lambda g: (_r(g, 3, 4), _r(g, 5, 4)), {}, ("P(sum) B -> P(sum)",)),
        OpCase("tril", "triangle", lambda g: (_r(g, 2, 3, 4),), {"diagonal": 0, "upper": False}, ALL3),
        OpCase("triu", "triangle", lambda g: (_r(g, 4, 4),), {"diagonal": 1, "upper": True}, ALL3),
        OpCase("einsum", "einsum", lambda g: (_r(g, 3, 4), _r(g, 5, 4)), {"equation": "ik,jk->ij"}, both),
        OpCase("einsum-3", "einsum", lambda g: (_r(g, 2, 3), _r(g, 3, 4), _r(g, 2, 4)), {"equation": "bi,ij,bj->b"},
               ("P(sum) B B -> P(sum)", "B P(sum) B -> P(sum)", "B B P(sum) -> P(sum)")),
        OpCase("matmul_nd", "matmul_nd", lambda g: (_r(g, 2, 3, 5), _r(g, 5, 4)), {}, both),
        OpCase("linear_weight_grad", "linear_weight_grad", lambda g: (_r(g, 2, 3, 5), _r(g, 2, 3, 4)), {}, both),
        # linear's whole gradient (dy, w, x -> dx, dw, db): each output linear in dy, dx in w, dw in x
        OpCase("linear_backward", "linear_backward", lambda g: (_r(g, 2, 3, 5), _r(g, 5, 4), _r(g, 2, 3, 4)),
               {"parts": ("dx", "dw", "db")},
               ("P(sum) B B -> P(sum) P(sum) P(sum)", "B P(sum) B -> P(sum) B B", "B B P(sum) -> B P(sum) B",
                "B P(sum) P(sum) -> P(sum) P(sum) B", "B P(sum) S(2) -> P(sum) S(1) B",
                "B S(1) P(sum) -> S(2) P(sum) B")),
        OpCase("linear_backward-dw-db", "linear_backward", lambda g: (_r(g, 2, 3, 5), _r(g, 2, 3, 4)),
               {"parts": ("dw", "db")}, ("P(sum) B -> P(sum) P(sum)", "B P(sum) -> P(sum) B")),
        OpCase("linear_backward-dx", "linear_backward", lambda g: (_r(g, 2, 3, 5), _r(g, 5, 4)), {"parts": ("dx",)},
               both),
    ]


def _conv_cases() -> list[OpCase]:
    def conv_args(g: torch.Generator) -> Args:
        return (_r(g, *x_shape), _r(g, *w_shape), _r(g, 3))

    def pool_args(g: torch.Generator) -> Args:
        return (_r(g, 2, 3, 6, 6),)

    x_shape, w_shape, y_shape = (2, 4, 4, 4), (3, 4, 3, 3), (2, 3, 4, 4)  # (N, C, H, W), (O, C, kh, kw), (N, O, H, W)
    conv_keeps = ("P(sum) B P(sum) -> P(sum)", "B P(sum) P(sum) -> P(sum)", "S(1) S(1) P(sum) -> P(sum)")
    return [
        OpCase("conv2d", "conv2d", conv_args, _CONV, conv_keeps),
        OpCase("conv_transpose2d", "conv_transpose2d", lambda g: (_r(g, 2, 4, 3, 3), _r(g, 4, 3, 3, 3), _r(g, 3)),
               {"stride": (2, 2), "padding": (1, 1), "output_padding": (1, 1), "groups": 1, "dilation": (1, 1)},
               ("P(sum) B P(sum) -> P(sum)", "B P(sum) P(sum) -> P(sum)", "S(1) S(0) P(sum) -> P(sum)")),
        # 2 input channels split over 3 ranks: one rank holds none (an empty shard)
        OpCase("conv2d-empty-shard", "conv2d", lambda g: (_r(g, 1, 2, 4, 4), _r(g, 3, 2, 3, 3), _r(g, 3)), _CONV,
               conv_keeps),
        OpCase("conv2d_input_grad", "conv2d_input_grad", lambda g: (_r(g, *y_shape), _r(g, *w_shape)),
               dict(_CONV, input_shape=x_shape), ("P(sum) B -> P(sum)", "B P(sum) -> P(sum)")),
        OpCase("conv2d_weight_grad", "conv2d_weight_grad", lambda g: (_r(g, *y_shape), _r(g, *x_shape)),
               dict(_CONV, weight_shape=w_shape), ("P(sum) B -> P(sum)", "B P(sum) -> P(sum)")),
        OpCase("max_pool2d", "max_pool2d", pool_args, _MAXPOOL, (MAX,)),
        OpCase("max_pool2d_backward", "max_pool2d_backward", lambda g: (_r(g, 2, 3, 3, 3), _r(g, 2, 3, 6, 6)),
               _MAXPOOL, ("P(sum) B -> P(sum)",)),
        OpCase("avg_pool2d", "avg_pool2d", pool_args, _AVGPOOL, (SUM,)),
        OpCase("avg_pool2d_backward", "avg_pool2d_backward", lambda g: (_r(g, 2, 3, 3, 3),),
               dict(_AVGPOOL, input_shape=(2, 3, 6, 6)), (SUM,)),
        # overlapping windows: an input gets the sum of several windows' gradients
        OpCase("max_pool2d_backward-overlap", "max_pool2d_backward", lambda g: (_r(g, 2, 3, 5, 5), _r(g, 2, 3, 6, 6)),
               dict(_MAXPOOL, stride=(1, 1)), ("P(sum) B -> P(sum)",)),
        OpCase("avg_pool2d_backward-overlap", "avg_pool2d_backward", lambda g: (_r(g, 2, 3, 5, 5),),
               dict(_AVGPOOL, stride=(1, 1), input_shape=(2, 3, 6, 6)), (SUM,)),
        OpCase("adaptive_avg_pool2d", "adaptive_avg_pool2d", pool_args, {"output_size": (2, 2)}, (SUM,)),
        OpCase("interpolate", "interpolate", lambda g: (_r(g, 2, 3, 4, 4),),
               {"size": (6, 5), "mode": "bicubic", "align_corners": False}, (SUM,)),
        OpCase("interpolate_backward", "interpolate_backward", lambda g: (_r(g, 2, 3, 6, 5),),
               {"input_shape": (2, 3, 4, 4), "size": (6, 5), "mode": "bilinear", "align_corners": None}, (SUM,)),
        OpCase("adaptive_avg_pool2d_backward", "adaptive_avg_pool2d_backward", lambda g: (_r(g, 2, 3, 2, 2),),
               {"input_shape": (2, 3, 6, 6)}, (SUM,)),
        OpCase("adaptive_avg_pool2d_backward-overlap", "adaptive_avg_pool2d_backward", lambda g: (_r(g, 2, 3, 2, 2),),
               {"input_shape": (2, 3, 5, 5)}, (SUM,)),  # 5 -> 2: windows [0, 3) and [2, 5) share a row
    ]


_MASK = torch.tensor([[True, False, True, True], [False, False, False, False], [True, True, False, True]])


def _indexing_cases() -> list[OpCase]:
    def rows(g: torch.Generator) -> Args:
        return (_r(g, 6, 4),)

    slice_attrs = {"dim": 0, "start": 1, "stop": 5, "step": 2}
    return [
        OpCase("slice", "slice", rows, slice_attrs, _partials("_")),
        OpCase("slice_backward", "slice_backward", lambda g: (_r(g, 2, 4),), dict(slice_attrs, size=6), (SUM,)),
        OpCase("index_select", "index_select", lambda g: (_r(g, 5, 4), torch.tensor([3, 0, 3])), {"dim": 0},
               _partials("_", "B")),
        OpCase("index_select_backward", "index_select_backward", lambda g: (_r(g, 3, 4), torch.tensor([3, 0, 3])),
               {"dim": 0, "size": 5}, ("P(sum) B -> P(sum)",)),
        OpCase("gather", "gather", lambda g: (_r(g, 4, 5), _ints(g, 5, 4, 3)), {"dim": 1}, _partials("_", "B")),
        OpCase("gather_backward", "gather_backward", lambda g: (_r(g, 4, 3), _ints(g, 5, 4, 3)),
               {"dim": 1, "shape": (4, 5)}, ("P(sum) B -> P(sum)",)),
        OpCase("masked_select", "masked_select", lambda g: (_r(g, 3, 4), _MASK), {}, _partials("_", "B")),
        OpCase("masked_select_backward", "masked_select_backward", lambda g: (_r(g, int(_MASK.sum())), _MASK), {},
               ("P(sum) B -> P(sum)",)),
        OpCase("cat", "cat", lambda g: (_r(g, 2, 3), _r(g, 3, 3)), {"dim": 0}, _partials("_", "_")),
        OpCase("bucket_flatten", "bucket_flatten", lambda g: (_r(g, 2, 3), _r(g, 4)), {}, _partials("_", "_")),
        OpCase("bucket_split", "bucket_split", lambda g: (_r(g, 10),), {"shapes": ((2, 3), (4,))},
               tuple(f"{k} -> {k} {k}" for k in ("P(sum)", "P(max)", "P(min)"))),
        OpCase("bucket_unshard", "bucket_unshard", lambda g: (_r(g, 10),), {"shapes": ((2, 3), (4,)), "parts": 2},
               ()),
        OpCase("reshape", "reshape", lambda g: (_r(g, 4, 6),), {"shape": (6, 4)}, _partials("_")),
        OpCase("permute", "permute", lambda g: (_r(g, 4, 6),), {"dims": (1, 0)}, _partials("_")),
        OpCase("unsqueeze", "unsqueeze", lambda g: (_r(g, 4, 6),), {"dim": 1}, _partials("_")),
        OpCase("squeeze", "squeeze", lambda g: (_r(g, 4, 1, 3),), {"dim": 1}, _partials("_")),
        OpCase("expand", "expand", lambda g: (_r(g, 4, 1),), {"shape": (4, 3)}, _partials("_")),
        OpCase("reshape_permute", "reshape_permute", lambda g: (_r(g, 2, 3, 4),),
               {"shape": (2, 3, 2, 2), "dims": (0, 2, 1, 3)}, _partials("_")),
        OpCase("permute_reshape", "permute_reshape", lambda g: (_r(g, 2, 2, 3, 2),),
               {"dims": (0, 2, 1, 3), "shape": (2, 3, 4)}, _partials("_")),
    ]


def _model_cases() -> list[OpCase]:
    def qkv(g: torch.Generator) -> Args:
        return tuple(_r(g, 1, 2, 3, 2) for _ in range(3))  # (batch, heads, tokens, head dim)

    sdpa_attrs = {"is_causal": False, "scale": None}
    norm = {"normalized_ndim": 1, "eps": 1e-5}
    return [
        OpCase("layer_norm", "layer_norm", lambda g: (_r(g, 3, 4), _r(g, 4), _r(g, 4)), norm),
        OpCase("rms_norm", "rms_norm", lambda g: (_r(g, 3, 4), _r(g, 4)), norm),
        # (dy, x, saved statistics (3, 1)..., params): the forward's mean and rstd are inputs of the backward
        OpCase("layer_norm_backward", "layer_norm_backward",
               lambda g: (_r(g, 3, 4), _r(g, 3, 4), _r(g, 3, 1), _r(g, 3, 1).abs() + 0.5, _r(g, 4), _r(g, 4)),
               norm | {"n_stats": 2}),
        OpCase("rms_norm_backward", "rms_norm_backward",
               lambda g: (_r(g, 3, 4), _r(g, 3, 4), _r(g, 3, 1).abs() + 0.5, _r(g, 4)), norm | {"n_stats": 1}),
        OpCase("embedding", "embedding", lambda g: (_ints(g, 5, 2, 3), _r(g, 5, 4)), {"padding_idx": None}),
        OpCase("embedding_backward", "embedding_backward", lambda g: (_r(g, 2, 3, 4), _ints(g, 5, 2, 3)),
               {"num_rows": 5, "padding_idx": None, "rows_split": False}, ("P(sum) B -> P(sum)",)),
        OpCase("pick", "pick", lambda g: (_r(g, 3, 5), _ints(g, 5, 3)), {"ignore_index": -100, "name": "nll"},
               ("P(sum) B -> P(sum)",)),
        OpCase("unpick", "unpick", lambda g: (_r(g, 3), _ints(g, 5, 3)),
               {"num_classes": 5, "ignore_index": -100, "class_split": False}, ("P(sum) B -> P(sum)",)),
        # outputs (out, logsumexp): the logsumexp does not depend on v
        OpCase("sdpa", "scaled_dot_product_attention", qkv, sdpa_attrs, ("B B P(sum) -> P(sum) B",)),
        # inputs (dy, q, k, v, out, logsumexp): linear in dy, and in (v, out) together
        OpCase("sdpa_backward", "sdpa_backward", lambda g: (_r(g, 1, 2, 3, 2),) + qkv(g) + (_r(g, 1, 2, 3, 2),
                                                                                           _r(g, 1, 2, 3)),
               sdpa_attrs, ("P(sum) B B B B B -> P(sum) P(sum) P(sum)", "B B B P(sum) P(sum) B -> P(sum) P(sum) B")),
    ]


def _optimizer_cases() -> list[OpCase]:
    """Updates are elementwise in (parameter, gradient, state); no partial signature."""
    def tensors(g: torch.Generator, n: int) -> Args:
        return tuple(_r(g, 3, 4) for _ in range(n))

    adam = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    return [
        OpCase("sgd_update", "sgd_update", lambda g: tensors(g, 2) + (0.1,), {"weight_decay": 0.0}, elementwise=True),
        OpCase("sgd_update-maximize", "sgd_update", lambda g: tensors(g, 2) + (0.1,), {"maximize": True},
               elementwise=True),
        OpCase("sgd_momentum_update", "sgd_momentum_update", lambda g: tensors(g, 3) + (0.1, 1.0), {"momentum": 0.9},
               elementwise=True),
        OpCase("adam_update_multi", "adam_update_multi", lambda g: tensors(g, 3) + (_r(g, 3, 4).abs(), 0.1, 3), adam,
               elementwise=True),
        # compiled clip_grad_norm_: the norm of several gradients at once, then their scaling by one factor
        OpCase("grad_norm_multi", "grad_norm_multi", lambda g: (_r(g, 3, 4), _r(g, 3, 5)), {"norm_type": 2.0}),
        OpCase("grad_norm_multi-inf", "grad_norm_multi", lambda g: (_r(g, 3, 4), _r(g, 3, 5)),
               {"norm_type": float("inf")}),
        *[OpCase(f"scale_multi-{k}", "scale_multi", lambda g, k=k: (_r(g, 3, 4), _r(g, 3, 5), torch.tensor(k)), {})
          for k in (0.5, -0.5)],  # a negative factor turns a P(max) piece into a P(min) one
    ]


def _expert_cases() -> list[OpCase]:
    """nn.MoE's router (softmax, top-2, renormalised; and its gradient), and the expert exchange (nn.Graph's
    expert parallel): two stacked experts (w1, w2, w3) on top-2 routing of 4 tokens. No partial input is declared;
    the flips go through the tokens (and, for the backward, the tokens x), in which the SwiGLU experts are not
    linear."""
    def exchange(g: torch.Generator) -> Args:
        return (_r(g, 4, 6), _r(g, 4, 2).softmax(-1), _ints(g, 2, 4, 2), _r(g, 2, 5, 6), _r(g, 2, 6, 5),
                _r(g, 2, 5, 6))

    def routed(g: torch.Generator) -> Args:  # d top, d probs, probs, index: each row's 2 experts distinct
        probs = _r(g, 4, 3).softmax(-1)
        return (_r(g, 4, 2), _r(g, 4, 3), probs, torch.topk(probs, 2, dim=-1).indices)

    return [
        OpCase("topk_router", "topk_router", lambda g: (_r(g, 4, 3),), {"k": 2, "normalize": True}),
        OpCase("topk_router_backward", "topk_router_backward", routed, {"normalize": True}, data=(0, 1)),
        OpCase("expert_exchange", "expert_exchange", exchange, data=(0,)),
        OpCase("expert_exchange_backward", "expert_exchange_backward", lambda g: (_r(g, 4, 6),) + exchange(g),
               data=(1,)),
    ]


CASES: list[OpCase] = _elementwise_cases() + _reduction_cases() + _matrix_cases() + _conv_cases() + \
    _indexing_cases() + _model_cases() + _optimizer_cases() + _expert_cases()
BY_ID = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"


def data_positions(case: OpCase, args: Args) -> list[int]:
    """Positions (among the tensor inputs) that may be partial: ``case.data``, or the floating-point ones."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if case.data is not None:
        return list(case.data)
    return [k for k, a in enumerate(tensors) if a.dtype.is_floating_point]
