"""In-place operators, views and ``x[...] = v``: common torch code must write where torch writes (issue 13, part 1).

Before, ``p -= lr * p.grad`` rebound ``p`` to a new tensor (no ``__isub__``), ``x[:, 0].fill_(7)`` filled a copy,
and ``x.view(12).fill_(5)`` changed ``x`` for some SBPs only: all silently. Each case runs the same code on torch
and on sbpflow tensors of every layout, and compares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import sbpflow
from harness import PLACEMENTS, randn
from sbpflow import nn
from sbpflow import sbp as S
from sbpflow.errors import AutogradError, IndexOutOfRangeError, OpError, ShapeError

B, PSUM, PMAX = S.broadcast, S.partial_sum, S.partial_max
LAYOUTS = [("1", (B,)), ("2", (S.split(0),)), ("3", (S.split(1),)), ("2", (B,)), ("2", (PSUM,)), ("3", (PMAX,)),
           ("2x2", (S.split(0), S.split(1))), ("2x2", (PSUM, S.split(0))), (None, None)]
IDS = [f"{p}-{'_'.join(map(str, s))}" if p else "local" for p, s in LAYOUTS]


def _make(value: torch.Tensor, pname: str | None, sbp: Any) -> sbpflow.Tensor:
    if pname is None:
        return sbpflow.tensor(value)
    return sbpflow.tensor(value, placement=PLACEMENTS[pname], sbp=sbp)


def _same_as_torch(fn: Callable[[Any], Any], pname: str | None, sbp: Any, shape: tuple[int, ...] = (3, 4)) -> None:
    """Runs ``fn`` on a torch tensor and on an sbpflow one of the layout; both must end with the same values."""
    value = randn(*shape)
    ours, theirs = _make(value, pname, sbp), value.clone()
    before = ours._version
    with sbpflow.no_grad():
        fn(ours)
    fn(theirs)
    torch.testing.assert_close(torch.as_tensor(ours.numpy()), theirs)
    if not torch.equal(theirs, value):
        assert ours._version > before  # a write bumps the version counter
    if pname is not None:
        assert (ours.placement, ours.sbp) == (PLACEMENTS[pname], sbp)  # written in its own layout


# -- in-place operators ------------------------------------------------------------------------------------------


def _isub(x: Any) -> None:
    x -= 0.5 * x


def _iadd(x: Any) -> None:
    x += torch.ones(4) if isinstance(x, torch.Tensor) else sbpflow.ones(4, placement=x.placement)


def _imul_idiv(x: Any) -> None:
    x *= 3
    x /= 2


@pytest.mark.parametrize("fn", [_isub, _iadd, _imul_idiv], ids=["-=", "+=", "*= /="])
@pytest.mark.parametrize(("pname", "sbp"), LAYOUTS, ids=IDS)
def test_augmented_assignment_is_in_place(fn: Callable[[Any], None], pname: str | None, sbp: Any) -> None:
    if fn is _iadd and pname is None:
        pytest.skip("a local tensor takes local operands: covered by the other operators")
    value = randn(3, 4)
    x = _make(value, pname, sbp)
    alias = x
    _same_as_torch(fn, pname, sbp)
    with sbpflow.no_grad():
        fn(x)
    assert x is alias  # the same object, changed in place


def test_manual_sgd_step_with_isub_matches_torch() -> None:
    """The loop users write by hand: ``p -= lr * p.grad`` under no_grad updates the module's own parameters."""
    p2 = PLACEMENTS["2"]
    sbpflow.manual_seed(0)
    ours = nn.Linear(4, 3, placement=p2, sbp={"weight": S.split(0), "bias": S.split(0)})
    theirs = torch.nn.Linear(4, 3)
    with torch.no_grad():
        theirs.weight.copy_(torch.as_tensor(ours.weight.numpy()))
        theirs.bias.copy_(torch.as_tensor(ours.bias.numpy()))
    data = randn(5, 4, seed=3)
    for _ in range(3):
        loss = ours(sbpflow.tensor(data, placement=p2, sbp=S.split(0))).square().mean()
        loss.backward()
        ref = theirs(data).square().mean()
        ref.backward()
        with sbpflow.no_grad():
            for p in ours.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        with torch.no_grad():
            for q in theirs.parameters():
                q -= 0.1 * q.grad
                q.grad = None
    torch.testing.assert_close(torch.as_tensor(ours.weight.numpy()), theirs.weight.detach())
    torch.testing.assert_close(torch.as_tensor(ours.bias.numpy()), theirs.bias.detach())
    assert ours.weight.sbp == (S.split(0),) and ours.weight.is_leaf


def test_augmented_assignment_on_a_leaf_that_requires_grad_raises_under_grad() -> None:
    w = sbpflow.ones(2, placement=PLACEMENTS["2"], sbp=S.split(0), requires_grad=True)
    with pytest.raises(AutogradError, match=r"-= modifies a tensor in place while gradients are recorded"):
        w -= 1
    with pytest.raises(RuntimeError):  # torch refuses too
        t = torch.ones(2, requires_grad=True)
        t -= 1


def test_int_tensor_true_division_in_place_is_refused_like_torch() -> None:
    x = sbpflow.tensor([1, 2], placement=PLACEMENTS["2"], sbp=S.split(0))
    with pytest.raises(sbpflow.DTypeError, match=r"/= computes a float32 result"):
        x /= 2
    with pytest.raises(RuntimeError):
        t = torch.tensor([1, 2])
        t /= 2


def test_overwriting_a_tensor_saved_for_backward_raises_at_backward() -> None:
    x = sbpflow.tensor(randn(2, 3), placement=PLACEMENTS["2"], sbp=S.split(1), requires_grad=True)
    y = x * 2
    z = y * y  # saves y
    with sbpflow.no_grad():
        y += 1
    with pytest.raises(AutogradError, match="modified in place"):
        z.sum().backward()


# -- views: in-place writes reach the base ------------------------------------------------------------------------

VIEW_WRITES: dict[str, Callable[[Any], Any]] = {
    "x[:, 0].fill_(7)": lambda x: x[:, 0].fill_(7),
    "x.view(12).fill_(5)": lambda x: x.view(12).fill_(5),
    "x.view(12)[2:9:3].add_(1)": lambda x: x.view(12)[2:9:3].add_(1),
    "x[1].mul_(2)": lambda x: x[1].mul_(2),
    "x[..., 1:3].zero_()": lambda x: x[..., 1:3].zero_(),
    "x.t()[1].fill_(-1)": lambda x: x.t()[1].fill_(-1),
    "x.T[2:].neg_()": lambda x: x.T[2:].neg_(),
    "x.transpose(0, 1).reshape(12)[:5].fill_(4)": lambda x: x.transpose(0, 1).reshape(12)[:5].fill_(4),  # a copy
    "x[1:].reshape(8)[::3].fill_(4)": lambda x: x[1:].reshape(8)[::3].fill_(4),  # a view
    "x.narrow(1, 1, 2).mul_(3)": lambda x: x.narrow(1, 1, 2).mul_(3),
    "x.split(2)[1].fill_(8)": lambda x: x.split(2)[1].fill_(8),
    "x.chunk(2, dim=1)[0].add_(2)": lambda x: x.chunk(2, dim=1)[0].add_(2),
    "x.unsqueeze(0)[0, 2] += 1": lambda x: x.unsqueeze(0)[0, 2].add_(1),
    "x.flatten()[3:7].copy_(...)": lambda x: x.flatten()[3:7].copy_(
        torch.arange(4.0) if isinstance(x, torch.Tensor) else sbpflow.arange(4.0).to_global(x.placement, (B,) *
                                                                                           x.placement.ndim)
        if x.is_global else sbpflow.arange(4.0)),
    "x[0][1:3].fill_(6)": lambda x: x[0][1:3].fill_(6),
}


@pytest.mark.parametrize("name", sorted(VIEW_WRITES))
@pytest.mark.parametrize(("pname", "sbp"), LAYOUTS, ids=IDS)
def test_in_place_write_into_a_view_reaches_the_base(name: str, pname: str | None, sbp: Any) -> None:
    _same_as_torch(VIEW_WRITES[name], pname, sbp)


def test_view_that_torch_refuses_is_refused_at_the_write() -> None:
    x = sbpflow.zeros(3, 4, placement=PLACEMENTS["2"], sbp=S.split(0))
    with pytest.raises(RuntimeError):
        torch.zeros(3, 4).t().view(12)
    with pytest.raises(OpError, match=r"output of view\(\) cannot reach its input .* torch refuses that view\(\)"):
        x.t().view(12).fill_(1)


def test_a_tensor_index_copies_as_in_torch() -> None:
    idx = [0, 2]
    theirs = randn(3, 4)
    ours = sbpflow.tensor(theirs, placement=PLACEMENTS["2"], sbp=S.split(0))
    with sbpflow.no_grad():
        ours[sbpflow.tensor(idx, placement=PLACEMENTS["2"], sbp=B)].fill_(1)
    theirs[torch.tensor(idx)].fill_(1)
    torch.testing.assert_close(torch.as_tensor(ours.numpy()), theirs)


def test_in_place_write_into_an_expanded_view_is_refused() -> None:
    x = sbpflow.zeros(1, 3, placement=PLACEMENTS["2"], sbp=S.split(1))
    with pytest.raises(OpError, match=r"in-place write into the output of expand\(\) cannot reach its input"):
        x.expand(4, 3).fill_(1)


def test_a_view_does_not_keep_its_base_alive() -> None:
    import gc
    import weakref

    x = sbpflow.zeros(4, 4, placement=PLACEMENTS["2"], sbp=S.split(0))
    view = x[1:3]
    dead = weakref.ref(x)
    del x
    gc.collect()
    assert dead() is None
    view.fill_(1)  # nothing left to write to, and no error
    assert view.tolist() == [[1.0] * 4] * 2


# -- x[key] = value ----------------------------------------------------------------------------------------------

SETITEMS: dict[str, Callable[[Any], None]] = {
    "x[1] = 9": lambda x: x.__setitem__(1, 9.0),
    "x[:, 1:3] = t": lambda x: x.__setitem__((slice(None), slice(1, 3)), torch.tensor([5.0, 6.0])),
    "x[-1, ::2] = t(2)": lambda x: x.__setitem__((-1, slice(None, None, 2)), torch.tensor([[1.0, 2.0]])),
    "x[None, 0] = 3": lambda x: x.__setitem__((None, 0), 3),
    "x[..., -1] = t(3)": lambda x: x.__setitem__((Ellipsis, -1), torch.tensor([7.0, 8.0, 9.0])),
    "x[1:, 1:] = t(2, 3)": lambda x: x.__setitem__((slice(1, None), slice(1, None)), torch.arange(6.0).reshape(2, 3)),
    "x[5:] = 1 (empty)": lambda x: x.__setitem__(slice(5, None), 1.0),
    "x[x < 0] = 0": lambda x: x.__setitem__(x < 0, 0.0),
    "x[x > 0.5] = t(-1) (0-d)": lambda x: x.__setitem__(x > 0.5, torch.tensor(-1.0)),
    "x[:, 1][x[:, 1] < 0] = 9 (a view)": lambda x: x[:, 1].__setitem__(x[:, 1] < 0, 9.0),
}


@pytest.mark.parametrize("name", sorted(SETITEMS))
@pytest.mark.parametrize(("pname", "sbp"), LAYOUTS, ids=IDS)
def test_setitem_matches_torch(name: str, pname: str | None, sbp: Any) -> None:
    _same_as_torch(SETITEMS[name], pname, sbp)


@pytest.mark.parametrize("value_sbp", [(B,), (S.split(0),), (PSUM,)])
def test_setitem_takes_a_global_value_in_any_layout(value_sbp: Any) -> None:
    p3 = PLACEMENTS["3"]
    theirs = randn(5, 4)
    ours = sbpflow.tensor(theirs, placement=p3, sbp=S.split(0))
    value = randn(3, 4, seed=7)
    ours[1:4] = sbpflow.tensor(value, placement=p3, sbp=value_sbp)
    theirs[1:4] = value
    torch.testing.assert_close(torch.as_tensor(ours.numpy()), theirs)
    assert ours.sbp == (S.split(0),)


def test_setitem_errors_name_the_target() -> None:
    x = sbpflow.zeros(3, 4, placement=PLACEMENTS["2"], sbp=S.split(1))
    with pytest.raises(IndexOutOfRangeError, match=r"index 3 is out of range for dim 0 of size 3; target shape"):
        x[3] = 1
    with pytest.raises(ShapeError, match=r"broadcasts to the indexed shape \[3, 2\], but got shape \[3\]"):
        x[:, :2] = torch.ones(3)
    with pytest.raises(OpError, match=r"basic indexing"):
        x[sbpflow.tensor([0], placement=PLACEMENTS["2"], sbp=B)] = 1
    with pytest.raises(OpError, match=r"x\[mask\] = value takes a bool mask of x's shape \[3, 4\] and a scalar"):
        x[x[0] > 0] = 1
    with pytest.raises(OpError, match=r"global like the target"):
        x[0] = sbpflow.ones(4)
    w = sbpflow.zeros(3, placement=PLACEMENTS["2"], sbp=S.split(0), requires_grad=True)
    with pytest.raises(AutogradError, match=r"x\[\.\.\.\] = value writes in place while gradients are recorded"):
        w[0] = 1


TRACED_SETITEMS: dict[str, Callable[[Any, Any], None]] = {
    # (y, v) -> a write into y, with v a (2,) tensor of the step's inputs
    "y[0] = 1": lambda y, v: y.__setitem__(0, 1.0),
    "y[1:3, 1] = v[0]": lambda y, v: y.__setitem__((slice(1, 3), 1), v[0]),
    "y[:, 0] = 2 * v": lambda y, v: y.__setitem__((slice(None), 0), 2 * v.sum() + torch.zeros(4)),
    "y[::2] = v": lambda y, v: y.__setitem__(slice(None, None, 2), v),
    "y.view(8)[5:] = -1": lambda y, v: y.view(8).__setitem__(slice(5, None), -1.0),
    "y[3][1] = v[1]": lambda y, v: y[3].__setitem__(1, v[1]),
}


@pytest.mark.parametrize("name", sorted(TRACED_SETITEMS))
@pytest.mark.parametrize("sbp", [(S.split(1),), (S.split(0),), (B,)], ids=["S(1)", "S(0)", "B"])
def test_setitem_inside_a_traced_graph_matches_eager(name: str, sbp: Any) -> None:
    p2 = PLACEMENTS["2"]
    write = TRACED_SETITEMS[name]

    def step(x: sbpflow.Tensor, v: sbpflow.Tensor) -> sbpflow.Tensor:
        y = x * 2
        write(y, v)
        return y + 1

    class Step(nn.Graph):
        def build(self, x: sbpflow.Tensor, v: sbpflow.Tensor) -> sbpflow.Tensor:
            return step(x, v)

    x = sbpflow.tensor(randn(4, 2), placement=p2, sbp=sbp)
    v = sbpflow.tensor(randn(2), placement=p2, sbp=(B,))
    theirs_x, theirs_v = torch.as_tensor(x.numpy()), torch.as_tensor(v.numpy())
    want = theirs_x * 2
    write(want, theirs_v)
    with sbpflow.no_grad():
        torch.testing.assert_close(torch.as_tensor(step(x, v).numpy()), want + 1)  # eager is torch's
    torch.testing.assert_close(torch.as_tensor(Step()(x, v).numpy()), want + 1)


def test_setitem_inside_a_traced_graph_names_a_bad_value() -> None:
    p2 = PLACEMENTS["2"]

    class Step(nn.Graph):
        def build(self, x: sbpflow.Tensor) -> sbpflow.Tensor:
            y = x * 2
            y[0] = sbpflow.ones(3, placement=p2, sbp=B)
            return y

    with pytest.raises(ShapeError, match=r"does not broadcast to the indexed shape \[2\]"):
        Step()(sbpflow.ones(4, 2, placement=p2, sbp=S.split(1)))


def test_in_place_writes_through_views_trace_like_eager() -> None:
    p2 = PLACEMENTS["2"]

    def step(x: sbpflow.Tensor) -> sbpflow.Tensor:
        y = x * 2
        y.view(8).mul_(3)
        y.t().add_(1)
        return y

    class Step(nn.Graph):
        def build(self, x: sbpflow.Tensor) -> sbpflow.Tensor:
            return step(x)

    x = sbpflow.tensor(randn(4, 2), placement=p2, sbp=S.split(1))
    with sbpflow.no_grad():
        eager = step(x).numpy()
    torch.testing.assert_close(torch.as_tensor(Step()(x).numpy()), torch.as_tensor(eager))


# -- a view follows writes into its base (torch's views share storage) -------------------------------------------

BASE_WRITES: dict[str, tuple[Callable[[Any], Any], Callable[[Any], None]]] = {
    # (take the view, then write into the base or a sibling view)
    "x[1] after x.fill_": (lambda x: x[1], lambda x: x.fill_(2)),
    "x.t() after x[0] = 5": (lambda x: x.t(), lambda x: x.__setitem__(0, 5.0)),
    "x.view(12)[3:] after x *= 3": (lambda x: x.view(12)[3:], lambda x: x.mul_(3)),
    "x[:, 1] after sibling x[:, 1:3].zero_()": (lambda x: x[:, 1], lambda x: x[:, 1:3].zero_()),
    "x.split(2)[1] after x.add_(1)": (lambda x: x.split(2)[1], lambda x: x.add_(1)),
    "x.t().reshape(12) (a copy) after x.fill_": (lambda x: x.t().reshape(12), lambda x: x.fill_(2)),
}


@pytest.mark.parametrize("name", sorted(BASE_WRITES))
@pytest.mark.parametrize(("pname", "sbp"), LAYOUTS[::2], ids=IDS[::2])
def test_a_view_shows_later_writes_into_its_base(name: str, pname: str | None, sbp: Any) -> None:
    take, write = BASE_WRITES[name]
    value = randn(3, 4)
    ours, theirs = _make(value, pname, sbp), value.clone()
    ours_view, theirs_view = take(ours), take(theirs)
    with sbpflow.no_grad():
        write(ours)
    write(theirs)
    if pname == "1" or pname is None:  # one shard: the shard itself is the value
        torch.testing.assert_close(next(iter(ours_view.local_tensors().values())).cpu(), theirs_view)
    torch.testing.assert_close(torch.as_tensor(ours_view.numpy()), theirs_view)  # read directly
    torch.testing.assert_close(torch.as_tensor((ours_view * 1).numpy()), theirs_view * 1)  # read by an op
    with sbpflow.no_grad():
        ours_view.add_(10)  # a write into the refreshed view must not bring back its old values
    theirs_view.add_(10)
    torch.testing.assert_close(torch.as_tensor(ours.numpy()), theirs)


def test_a_view_of_a_parameter_follows_the_optimizer_step() -> None:
    """``opt.step()`` writes parameters in place, as torch's does: a view taken before shows the new values."""
    p2 = PLACEMENTS["2"]
    w = sbpflow.tensor(randn(3, 4), placement=p2, sbp=S.split(0), requires_grad=True)
    w_t = w.t()
    opt = sbpflow.optim.SGD([w], lr=0.5)
    (w * 2).sum().backward()
    version = w._version
    opt.step()
    assert w._version > version
    torch.testing.assert_close(torch.as_tensor(w_t.numpy()), torch.as_tensor(w.numpy()).t())


TOP_LEVEL_VIEWS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "reshape": (lambda x: sbpflow.reshape(x, (12,))[2:5], lambda x: torch.reshape(x, (12,))[2:5]),
    "transpose": (lambda x: sbpflow.transpose(x, 0, 1)[1], lambda x: torch.transpose(x, 0, 1)[1]),
    "permute": (lambda x: sbpflow.permute(x, (1, 0))[0], lambda x: torch.permute(x, (1, 0))[0]),
    "t": (lambda x: sbpflow.t(x)[3], lambda x: torch.t(x)[3]),
    "narrow": (lambda x: sbpflow.narrow(x, 1, 1, 2), lambda x: torch.narrow(x, 1, 1, 2)),
    "split": (lambda x: sbpflow.split(x, 2)[1], lambda x: torch.split(x, 2)[1]),
    "chunk": (lambda x: sbpflow.chunk(x, 2, 1)[1], lambda x: torch.chunk(x, 2, 1)[1]),
    "unsqueeze/squeeze": (lambda x: sbpflow.squeeze(sbpflow.unsqueeze(x, 0), 0)[2],
                          lambda x: torch.squeeze(torch.unsqueeze(x, 0), 0)[2]),
    "flatten/unflatten": (lambda x: sbpflow.unflatten(sbpflow.flatten(x), 0, (2, 6))[1],
                          lambda x: torch.unflatten(torch.flatten(x), 0, (2, 6))[1]),
}


@pytest.mark.parametrize("name", sorted(TOP_LEVEL_VIEWS))
def test_top_level_view_functions_are_views_as_in_torch(name: str) -> None:
    ours_fn, torch_fn = TOP_LEVEL_VIEWS[name]
    value = randn(3, 4)
    ours = sbpflow.tensor(value, placement=PLACEMENTS["2x2"], sbp=(S.split(0), S.split(1)))
    theirs = value.clone()
    ours_fn(ours).fill_(5.0)
    torch_fn(theirs).fill_(5.0)
    torch.testing.assert_close(torch.as_tensor(ours.numpy()), theirs)


@pytest.mark.parametrize(("pname", "sbp"), LAYOUTS, ids=IDS)
def test_detach_of_a_view_is_a_view_of_the_same_base(pname: str | None, sbp: Any) -> None:
    """``x[:, 1:3].detach()`` shares storage with ``x`` in torch: writes go both ways, as for the view itself."""
    value = randn(3, 4)
    ours, theirs = _make(value, pname, sbp), value.clone()
    mine, its = ours[:, 1:3].detach(), theirs[:, 1:3].detach()
    with sbpflow.no_grad():
        mine.mul_(3)
    its.mul_(3)
    torch.testing.assert_close(torch.as_tensor(ours.numpy()), theirs)  # the write reached the base
    ours.add_(1)
    theirs.add_(1)
    torch.testing.assert_close(torch.as_tensor(mine.numpy()), its)  # the base's later write shows in the view
    assert not mine.requires_grad and mine.grad_fn is None
