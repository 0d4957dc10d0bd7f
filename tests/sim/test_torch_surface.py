"""The torch functions and Tensor methods that ported model files call (issue 32), against torch.

Each runs on local tensors and on global ones (split, and partial pieces where its rules let a partial pass),
forward and gradients, through the harness; where a split should stay, the test asserts that no collective ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
import sbpflow.nn.functional as F
from harness import PLACEMENTS, PSUM, B, check, randn
from partials import check_pieces
from sbpflow import sbp as S

S0, S1, S2 = S.split(0), S.split(1), S.split(2)


# -- einsum: signatures from the subscripts ----------------------------------------------------------------------

EINSUMS = [
    # equation, shapes, sbps (one per operand), the output SBP the subscripts give
    ("bij,bjk->bik", [(4, 3, 5), (4, 5, 2)], [S0, S0], S0),
    ("ik,jk->ij", [(3, 6), (4, 6)], [S1, S1], PSUM),
    ("ik,jk->ij", [(6, 5), (4, 5)], [S0, B], S0),
    ("i,j->ij", [(6,), (4,)], [B, S0], S1),
    ("bhqd,bhkd->bhqk", [(2, 4, 3, 5), (2, 4, 6, 5)], [S1, S1], S1),
    ("...d,d->...", [(2, 4, 6), (6,)], [S1, B], S1),
    ("ij->ji", [(4, 6)], [S0], S1),
    ("ij->", [(4, 6)], [S1], PSUM),
]


@pytest.mark.parametrize("equation,shapes,sbps,out_sbp", EINSUMS)
def test_einsum_keeps_the_split_its_subscripts_allow(equation: str, shapes: list[tuple[int, ...]],
                                                    sbps: list[object], out_sbp: object) -> None:
    values = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    check(lambda *xs: sbpflow.einsum(equation, *xs), lambda *xs: torch.einsum(equation, *xs), values, None)
    r = check(lambda *xs: sbpflow.einsum(equation, *xs), lambda *xs: torch.einsum(equation, *xs), values,
              PLACEMENTS["2"], [(s,) for s in sbps])
    assert r.out.sbp == (out_sbp,) and r.forward_log.counts() == {}


def test_einsum_is_linear_in_each_operand_on_partial_pieces() -> None:
    a, b = randn(3, 4), randn(5, 4, seed=1)
    out, log = check_pieces(lambda x, y: sbpflow.einsum("ik,jk->ij", x, y),
                            lambda x, y: torch.einsum("ik,jk->ij", x, y), [a, b], "2x2", [(PSUM, S0), (B, B)])
    assert log.counts() == {} and out.sbp[0] == PSUM


def test_einsum_refuses_mismatched_subscripts() -> None:
    with pytest.raises(sbpflow.ShapeError, match="einsum 'ij,jk->ik': subscript 'j' has sizes"):
        sbpflow.einsum("ij,jk->ik", sbpflow.ones(2, 3), sbpflow.ones(4, 2))


# -- sort, argsort, flip, roll: splits of the other dims stay ---------------------------------------------------


def test_sort_keeps_a_split_of_another_dim_and_gathers_its_own() -> None:
    x = randn(4, 6)
    for fn, ref in [(lambda t: t.sort(dim=1).values, lambda t: t.sort(dim=1).values),
                    (lambda t: t.sort(dim=1, descending=True).values, lambda t: t.sort(dim=1, descending=True).values),
                    (lambda t: t.argsort(dim=1), lambda t: t.argsort(dim=1))]:
        check(fn, ref, [x], None)
        kept = check(fn, ref, [x], PLACEMENTS["2"], [(S0,)])
        assert kept.out.sbp == (S0,) and kept.forward_log.counts() == {}
    gathered = check(lambda t: t.sort(dim=0).values, lambda t: t.sort(dim=0).values, [x], PLACEMENTS["2"], [(S0,)])
    # the planner's own boxing moves the split off the sorted dim (S(0) -> S(1), one all-to-all), then sorts per shard
    assert gathered.forward_log.counts() == {"all_to_all": 1} and gathered.out.sbp == (S1,)
    indices = sbpflow.tensor(x, placement=PLACEMENTS["2"], sbp=S0).sort(dim=0).indices
    np.testing.assert_array_equal(indices.numpy(), x.sort(dim=0).indices.numpy())


@pytest.mark.parametrize("pname", ["2", "3", "2x2"])
def test_flip_and_roll_keep_splits_of_the_dims_they_leave(pname: str) -> None:
    x = randn(4, 5, 6)
    sbp = (S0,) if pname != "2x2" else (S0, S2)
    cases = [(lambda t: t.flip(1), lambda t: t.flip(1)), (lambda t: t.roll(2, 1), lambda t: t.roll(2, 1)),
             (lambda t: t.roll((1, -2), (1, 2)), lambda t: t.roll((1, -2), (1, 2)))]
    for fn, ref in cases:
        check(fn, ref, [x], None)
    for fn, ref in cases[:2]:
        r = check(fn, ref, [x], PLACEMENTS[pname], [sbp])
        assert r.out.sbp == sbp and r.forward_log.counts() == {}
    check(lambda t: t.roll(3), lambda t: t.roll(3), [x], PLACEMENTS[pname], [sbp])  # flattened: any layout
    check(lambda t: t.flip((0, 2)), lambda t: t.flip((0, 2)), [x], PLACEMENTS[pname], [sbp])


def test_flip_passes_partial_pieces() -> None:
    out, log = check_pieces(lambda t: t.flip(0), lambda t: t.flip(0), [randn(4, 6)], "2", [(PSUM,)])
    assert log.counts() == {} and out.sbp == (PSUM,)


# -- tril / triu, norm, logsumexp, repeat, outer ------------------------------------------------------------------


@pytest.mark.parametrize("name,diagonal", [("tril", 0), ("tril", -1), ("triu", 1), ("triu", 0)])
def test_triangles_keep_batch_splits_and_partials(name: str, diagonal: int) -> None:
    x = randn(4, 5, 6)
    x[0, 0, 5] = float("inf")  # outside the lower triangle: torch gives 0 there, not inf * 0
    fn = lambda t: getattr(t, name)(diagonal)  # noqa: E731
    check(fn, fn, [x], None, grad=False)
    r = check(fn, fn, [randn(4, 5, 6)], PLACEMENTS["2"], [(S0,)])
    assert r.out.sbp == (S0,) and r.forward_log.counts() == {}
    out, log = check_pieces(fn, fn, [randn(5, 6)], "2", [(PSUM,)])
    assert log.counts() == {} and out.sbp == (PSUM,)


@pytest.mark.parametrize("p", ["fro", 2, 1, 3.0, float("inf"), float("-inf")])
def test_norm_against_torch_on_splits(p: object) -> None:
    x = randn(4, 6)
    check(lambda t: t.norm(p), lambda t: t.norm(p), [x], None)
    check(lambda t: t.norm(p, dim=1), lambda t: t.norm(p, dim=1), [x], PLACEMENTS["2"], [(S1,)])
    r = check(lambda t: t.norm(p, dim=1, keepdim=True), lambda t: t.norm(p, dim=1, keepdim=True), [x],
              PLACEMENTS["3"], [(S0,)])
    assert r.out.sbp == (S0,)


def test_logsumexp_and_normalize_against_torch() -> None:
    x = randn(4, 6) * 30  # large values: the shift by the max matters
    for pname, sbp in [("2", (S0,)), ("2", (S1,)), ("2x2", (S0, S1))]:
        check(lambda t: t.logsumexp(1), lambda t: t.logsumexp(1), [x], PLACEMENTS[pname], [sbp])
        check(lambda t: sbpflow.logsumexp(t, (0, 1), keepdim=True), lambda t: torch.logsumexp(t, (0, 1), True), [x],
              PLACEMENTS[pname], [sbp])
        check(lambda t: F.normalize(t, dim=1), lambda t: torch.nn.functional.normalize(t, dim=1), [x / 30],
              PLACEMENTS[pname], [sbp])
    check(lambda t: t.logsumexp(-1), lambda t: t.logsumexp(-1), [x], None)


def test_repeat_and_outer_against_torch() -> None:
    x = randn(3, 4)
    for sizes in [(2, 1), (1, 3), (2, 2, 3)]:
        check(lambda t, n=sizes: t.repeat(*n), lambda t, n=sizes: t.repeat(*n), [x], None)
        check(lambda t, n=sizes: t.repeat(n), lambda t, n=sizes: t.repeat(n), [x], PLACEMENTS["2"], [(S1,)])
    a, b = randn(5), randn(4, seed=1)
    check(sbpflow.outer, torch.outer, [a, b], None)
    r = check(sbpflow.outer, torch.outer, [a, b], PLACEMENTS["2"], [(S0,), (B,)])
    assert r.out.sbp == (S0,) and r.forward_log.counts() == {}


# -- F.one_hot, F.pad, leaky_relu, binary_cross_entropy_with_logits ----------------------------------------------


def test_one_hot_follows_its_input() -> None:
    labels = torch.tensor([[0, 3, 1], [2, 2, 0]])
    np.testing.assert_array_equal(F.one_hot(sbpflow.tensor(labels)).numpy(), torch.nn.functional.one_hot(labels))
    for sbp in [S0, S1]:
        x = sbpflow.tensor(labels, placement=PLACEMENTS["2"], sbp=sbp)
        out = F.one_hot(x, 5)
        assert out.sbp == (sbp,) and out.dtype == torch.int64
        np.testing.assert_array_equal(out.numpy(), torch.nn.functional.one_hot(labels, 5).numpy())


@pytest.mark.parametrize("pad", [(1, 2), (0, 1, 2, 0), (-1, 2)])
def test_pad_constant_against_torch(pad: tuple[int, ...]) -> None:
    x = randn(3, 4, 5)
    fn = lambda t: F.pad(t, pad, value=0.5)  # noqa: E731
    ref = lambda t: torch.nn.functional.pad(t, pad, value=0.5)  # noqa: E731
    check(fn, ref, [x], None)
    r = check(fn, ref, [x], PLACEMENTS["2"], [(S0,)])
    assert r.out.sbp == (S0,) and r.forward_log.counts() == {}


def test_leaky_relu_and_bce_with_logits_against_torch() -> None:
    x, y = randn(4, 6) * 3, (randn(4, 6, seed=1) > 0).float()
    w, pw = randn(6, seed=2).abs(), randn(6, seed=3).abs()
    tf = torch.nn.functional
    check(lambda t: F.leaky_relu(t, 0.2), lambda t: tf.leaky_relu(t, 0.2), [x], PLACEMENTS["2"], [(S1,)])
    for kw in [{}, {"reduction": "sum"}, {"reduction": "none"}]:
        check(lambda a, b, kw=kw: F.binary_cross_entropy_with_logits(a, b, **kw),
              lambda a, b, kw=kw: tf.binary_cross_entropy_with_logits(a, b, **kw), [x, y], PLACEMENTS["2"],
              [(S0,), (S0,)])
    check(lambda a, b, c, d: F.binary_cross_entropy_with_logits(a, b, weight=c, pos_weight=d),
          lambda a, b, c, d: tf.binary_cross_entropy_with_logits(a, b, weight=c, pos_weight=d), [x, y, w, pw], None,
          grad=[True, True, False, False])


# -- Tensor methods: new_*, type, cpu ------------------------------------------------------------------------------


def test_new_tensors_take_the_layout_and_dtype_of_their_tensor() -> None:
    x = sbpflow.tensor(randn(4, 6), placement=PLACEMENTS["2"], sbp=S0)
    z = x.new_zeros(3, 2)
    assert z.placement == x.placement and z.sbp == (B,) and z.dtype == torch.float32 and z.numpy().sum() == 0
    assert x.new_ones((2,), dtype=torch.int64).tolist() == [1, 1]
    assert x.new_full((2, 2), 7.0).tolist() == [[7.0, 7.0], [7.0, 7.0]]
    local = sbpflow.tensor([1, 2]).new_zeros(3)
    assert local.is_local and local.dtype == torch.int64 and local.tolist() == [0, 0, 0]


def test_type_and_cpu() -> None:
    x = sbpflow.tensor([1.5, 2.5])
    assert x.type() == torch.tensor([1.5]).type() == "torch.FloatTensor"
    assert x.type(torch.int64).tolist() == [1, 2] and x.type("torch.DoubleTensor").dtype == torch.float64
    assert x.cpu() is x
    with pytest.raises(sbpflow.OpError, match=r"x.cuda\(\) moves local tensors.*to_global"):
        sbpflow.zeros(2, placement=PLACEMENTS["2"], sbp=B).cuda()


# -- smaller habits ------------------------------------------------------------------------------------------------


def test_as_tensor_and_from_numpy() -> None:
    x = sbpflow.tensor(3.0)
    assert sbpflow.as_tensor(x) is x  # torch.as_tensor of a 0-d tensor failed with "len() of a 0-d tensor"
    assert sbpflow.as_tensor(torch.tensor(2.0)).tolist() == 2.0
    assert sbpflow.as_tensor(np.float32(1.5)).tolist() == 1.5
    assert sbpflow.as_tensor([1, 2], dtype=torch.float64).dtype == torch.float64
    array = np.arange(6.0).reshape(2, 3)
    y = sbpflow.from_numpy(array)
    array[0, 0] = 9.0  # shares memory, as torch.from_numpy
    assert y.tolist()[0][0] == 9.0 and y.dtype == torch.float64


def test_a_list_index_selects_rows_as_torch() -> None:
    x = randn(5, 3)
    check(lambda t: t[[0, 2, 4]], lambda t: t[[0, 2, 4]], [x], None)
    check(lambda t: t[:, [2, 0]], lambda t: t[:, [2, 0]], [x], PLACEMENTS["2"], [(S0,)])
    check(lambda t: t[[4, 1]], lambda t: t[[4, 1]], [x], PLACEMENTS["2"], [(S1,)])
    check(lambda t: t[:, [-1]], lambda t: t[:, [-1]], [x], PLACEMENTS["2"], [(S0,)])  # nanoGPT's v[:, [-1]]
    check(lambda t: t[None, ..., [-2, 0]], lambda t: t[None, ..., [-2, 0]], [x], None)
    with pytest.raises(sbpflow.OpError, match="a list of ints as an index"):
        sbpflow.tensor(x)[[0.5, 1]]


def test_explain_shows_once_in_a_repl(capsys: pytest.CaptureFixture[str]) -> None:
    x = sbpflow.zeros(4, 4, placement=PLACEMENTS["2"], sbp=S0)
    text = sbpflow.explain(x, sbp=B)
    assert capsys.readouterr().out == ""  # explain prints nothing itself
    assert repr(text) == str(text) and "all_gather" in text  # a REPL shows the text once, unquoted


def test_autocast_warning_is_shown_once_under_the_default_filter() -> None:
    import warnings

    x = sbpflow.randn(3, 3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # as IPython and python -W default: once per line, were it not keyed
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ x
            y = y + 1
            y = y.sum()
    assert [w.category for w in seen] == [sbpflow.AutocastWarning]


# -- what the coverage benchmark found missing in transformers, torchvision and nanoGPT ---------------------------


@pytest.mark.parametrize("mode,kw", [("nearest", {}), ("bilinear", {"align_corners": False}),
                                     ("bicubic", {"align_corners": False}), ("bilinear", {"align_corners": True})])
def test_interpolate_keeps_batch_and_channel_splits_and_partials(mode: str, kw: dict[str, object]) -> None:
    x = randn(2, 4, 5, 6)
    fn = lambda t: F.interpolate(t, size=(7, 4), mode=mode, **kw)  # noqa: E731
    ref = lambda t: torch.nn.functional.interpolate(t, size=(7, 4), mode=mode, **kw)  # noqa: E731
    check(fn, ref, [x], None)
    for sbp in [(S0,), (S1,)]:
        r = check(fn, ref, [x], PLACEMENTS["2"], [sbp])
        assert r.out.sbp == sbp and r.forward_log.counts() == {} and r.backward_log.counts() == {}
    out, log = check_pieces(fn, ref, [x], "2x2", [(PSUM, S1)])
    assert log.counts() == {} and out.sbp == (PSUM, S1)
    up = lambda t: F.interpolate(t, scale_factor=2, mode=mode, **kw)  # noqa: E731
    check(up, lambda t: torch.nn.functional.interpolate(t, scale_factor=2, mode=mode, **kw), [x], None)


def test_pixel_shuffle_repeat_interleave_baddbmm_l1_against_torch() -> None:
    x = randn(2, 8, 3, 3)
    check(nn_pixel_shuffle := sbpflow.nn.PixelShuffle(2), torch.nn.PixelShuffle(2), [x], PLACEMENTS["2"], [(S0,)])
    assert nn_pixel_shuffle.upscale_factor == 2
    y = randn(3, 4)
    for dim in [None, 0, 1]:
        check(lambda t, d=dim: t.repeat_interleave(2, d), lambda t, d=dim: t.repeat_interleave(2, d), [y], None)
    r = check(lambda t: t.repeat_interleave(3, 1), lambda t: t.repeat_interleave(3, 1), [y], PLACEMENTS["2"], [(S0,)])
    assert r.out.sbp == (S0,) and r.forward_log.counts() == {}
    a, b, c = randn(4, 3, 5), randn(4, 3, 2, seed=1), randn(4, 2, 5, seed=2)
    for beta, alpha in [(1.0, 1.0), (0.0, 0.5), (0.5, 2.0)]:
        check(lambda i, p, q, be=beta, al=alpha: sbpflow.baddbmm(i, p, q, beta=be, alpha=al),
              lambda i, p, q, be=beta, al=alpha: torch.baddbmm(i, p, q, beta=be, alpha=al), [a, b, c],
              PLACEMENTS["2"], [(S0,), (S0,), (S0,)], grad=[beta != 0, True, True])  # beta=0: input unused
    for reduction in ["mean", "sum", "none"]:
        check(lambda p, q, r=reduction: F.l1_loss(p, q, reduction=r),
              lambda p, q, r=reduction: torch.nn.functional.l1_loss(p, q, reduction=r), [y, randn(3, 4, seed=3)],
              PLACEMENTS["2"], [(S1,), (B,)])


def test_index_add_scatter_add_histc_nonzero_as_mixtral_uses_them() -> None:
    base, rows, index = randn(5, 3), randn(4, 3, seed=1), torch.tensor([0, 2, 2, 4])
    for pname, sbp in [(None, None), ("2", (S1,)), ("2", (B,))]:
        p = PLACEMENTS[pname] if pname else None
        ours = sbpflow.tensor(base, placement=p, sbp=sbp)
        with sbpflow.no_grad():
            ours.index_add_(0, sbpflow.tensor(index, placement=p, sbp=(B,) if p else None),
                            sbpflow.tensor(rows, placement=p, sbp=sbp))
        np.testing.assert_allclose(ours.numpy(), base.clone().index_add_(0, index, rows).numpy(), rtol=1e-6)
        assert ours.sbp == sbp if p else ours.is_local
    experts = torch.tensor([1, 3, 3, 0, 1, 1])
    counts = sbpflow.zeros(4).scatter_add_(0, sbpflow.tensor(experts), sbpflow.ones(6))
    np.testing.assert_array_equal(counts.numpy(), torch.zeros(4).scatter_add_(0, experts, torch.ones(6)).numpy())
    values = experts.float()
    np.testing.assert_array_equal(sbpflow.histc(sbpflow.tensor(values, placement=PLACEMENTS["2"], sbp=S0), bins=4,
                                                min=0, max=4).numpy(), torch.histc(values, bins=4, min=0, max=4))
    np.testing.assert_array_equal(sbpflow.histc(sbpflow.tensor(randn(20)), bins=5).numpy(),
                                  torch.histc(randn(20), bins=5).numpy())
    mask = torch.tensor([[0, 1, 0], [2, 0, 3]])
    for p in [None, PLACEMENTS["2"]]:
        hit = sbpflow.tensor(mask, placement=p, sbp=S0 if p else None).nonzero()
        np.testing.assert_array_equal(hit.numpy(), mask.nonzero().numpy())
    assert [t.tolist() for t in sbpflow.tensor(mask).nonzero(as_tuple=True)] == [[0, 1, 1], [1, 0, 2]]
    assert sbpflow.greater(sbpflow.tensor([1, 3]), 2).tolist() == [False, True]


def test_multinomial_empty_and_in_place_draws() -> None:
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.5]])
    sbpflow.manual_seed(3)
    drawn = sbpflow.multinomial(sbpflow.tensor(probs, placement=PLACEMENTS["2"], sbp=S0), 1)
    assert drawn.sbp == (B,) and drawn.numpy()[0, 0] == 2 and drawn.numpy()[1, 0] in (0, 3)
    sbpflow.manual_seed(3)
    assert sbpflow.multinomial(sbpflow.tensor(probs), 1).tolist() == drawn.tolist()  # the layout does not matter
    many = sbpflow.multinomial(sbpflow.tensor([0.2, 0.8]), 4000, replacement=True)
    assert abs(many.float().mean().item() - 0.8) < 0.03
    assert sbpflow.empty(2, 3).shape == (2, 3) and sbpflow.empty_like(sbpflow.ones(2)).tolist() == [0.0, 0.0]
    w = sbpflow.zeros(300, 200, placement=PLACEMENTS["2"], sbp=S1)
    assert w.uniform_(-1.0, 3.0) is w and w.sbp == (S1,)
    values = torch.as_tensor(w.numpy())
    assert values.min() >= -1.0 and values.max() < 3.0 and abs(values.mean().item() - 1.0) < 0.03
    w.normal_(2.0, 0.5)
    values = torch.as_tensor(w.numpy())
    assert abs(values.mean().item() - 2.0) < 0.01 and abs(values.std().item() - 0.5) < 0.01


def test_buffer_and_typed_tensor_names() -> None:
    m = sbpflow.nn.Module()
    m.inv_freq = sbpflow.nn.Buffer(sbpflow.arange(3.0), persistent=False)
    m.table = sbpflow.nn.Buffer(sbpflow.ones(2))
    assert [n for n, _ in m.named_buffers()] == ["inv_freq", "table"] and list(m.state_dict()) == ["table"]
    m.to_global(PLACEMENTS["2"])
    assert m.inv_freq.placement == PLACEMENTS["2"]
    assert sbpflow.LongTensor([1, 2]).dtype == torch.int64 and sbpflow.BoolTensor([1, 0]).tolist() == [True, False]
    assert sbpflow.FloatTensor([[1, 2]]).dtype == torch.float32


def test_torch_module_names_that_training_scripts_call() -> None:
    assert sbpflow.jit.is_tracing() is False and sbpflow.jit.is_scripting() is False
    seen = []

    class Probe(sbpflow.nn.Module):
        def forward(self, x: sbpflow.Tensor) -> sbpflow.Tensor:
            seen.append(sbpflow.jit.is_tracing())
            return x * 2

    class G(sbpflow.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.m = Probe()

        def build(self, x: sbpflow.Tensor) -> sbpflow.Tensor:
            return self.m(x)

    x = sbpflow.ones(2, placement=PLACEMENTS["2"], sbp=B)
    assert G()(x).tolist() == [2.0, 2.0] and seen == [True]
    model = sbpflow.nn.Linear(2, 2)
    assert sbpflow.compile(model) is model
    assert sbpflow.backends.cuda.matmul is torch.backends.cuda.matmul
    assert sbpflow.distributed.get_rank() == 0 and sbpflow.distributed.get_world_size() == 1
    assert sbpflow.cuda.amp.GradScaler is sbpflow.GradScaler and isinstance(sbpflow.cuda.is_bf16_supported(), bool)


def test_the_first_compile_prints_nothing(tmp_path: object) -> None:
    """HiGHS printed its banner from C++ at the first SBP selection of every process; a fresh process shows it."""
    import os
    import subprocess
    import sys

    script = (
        "import sbpflow\n"
        "from sbpflow import nn\n"
        "p = sbpflow.placement('cpu', [0, 1])\n"
        "m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to_global(p)\n"
        "class G(nn.Graph):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.m = m\n"
        "    def build(self, x):\n"
        "        return self.m(x)\n"
        "g = G()\n"
        "g(sbpflow.randn(6, 4, placement=p, sbp=sbpflow.sbp.split(0)))\n"
        "print('done')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "done\n"
