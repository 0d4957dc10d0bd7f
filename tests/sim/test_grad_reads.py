"""Eager autograd keeps only what gradients read (``grad_reads`` in ``sbpflow.ops.schema.op``).

An op whose gradient reads no value of some input (add, views, casts, log_softmax, ...) keeps that input as a
shell: metadata and autograd identity, no data. Then the input's memory is freed as soon as nothing else holds
it, as in torch: the logits of a language model are freed once the loss is computed, and a residual branch's
output once it is added. These tests check that such inputs are shells, that every such op's gradients are
unchanged by it, and that the logits' storage is really gone before backward.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest
import torch

import sbpflow
from harness import PLACEMENTS
from opcases import CASES, OpCase
from sbpflow import sbp as S
from sbpflow.demo.train_gpt import build
from sbpflow.errors import MetaTensorError
from sbpflow.models.gpt import GPTConfig
from sbpflow.ops.schema import REGISTRY

SHELLING = [c for c in CASES if REGISTRY[c.op].grad_reads is not None and REGISTRY[c.op].backward_fn is not None]


def _run(case: OpCase, placement: Any) -> tuple[list[Any], list[np.ndarray | None]]:
    """The op on computed (non-leaf) inputs, backward from a seeded upstream: (recorded inputs, leaf grads)."""
    gen = torch.Generator().manual_seed(0)
    values = case.args(gen)
    leaves, args = [], []
    for v in values:
        if not isinstance(v, torch.Tensor):
            args.append(v)
            continue
        t = sbpflow.tensor(v, placement=placement, sbp=S.broadcast if placement is not None else None)
        if v.dtype.is_floating_point:
            t.requires_grad_(True)
            leaves.append(t)
            t = t * 1.0  # computed: a shell candidate
        args.append(t)
    out = REGISTRY[case.op](*args, **case.attrs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if o.requires_grad]
    if not outs:  # a cast to an integer type: nothing to differentiate
        return [], []
    loss = sum((o * sbpflow.tensor(torch.randn(tuple(o.shape), generator=gen, dtype=o.dtype), placement=placement,
                                   sbp=S.broadcast if placement is not None else None)).sum() for o in outs)
    recorded = list(outs[0].grad_fn.inputs)
    loss.backward()  # type: ignore[union-attr]
    return recorded, [None if t.grad is None else t.grad.numpy() for t in leaves]


@pytest.mark.parametrize("where", ["local", "2"])
@pytest.mark.parametrize("case", SHELLING, ids=str)
def test_unread_inputs_are_shells_and_gradients_stay_the_same(case: OpCase, where: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    placement = None if where == "local" else PLACEMENTS[where]
    recorded, grads = _run(case, placement)
    reads = REGISTRY[case.op].grad_reads
    assert reads is not None
    for i, t in enumerate(recorded):
        assert t.is_meta == (i not in reads and t.grad_fn is not None), (case.op, i)
    monkeypatch.setattr(REGISTRY[case.op], "grad_reads", None)  # keep every input whole
    full, want = _run(case, placement)
    assert not any(t.is_meta for t in full)
    assert len(grads) == len(want)
    for got, expected in zip(grads, want, strict=True):
        assert (got is None) == (expected is None)
        if got is not None:
            np.testing.assert_array_equal(got, expected)


def test_a_shell_refuses_its_data() -> None:
    x = sbpflow.randn(4, 3, placement=PLACEMENTS["2"], sbp=S.split(0), requires_grad=True) * 2.0
    shell = x._shell()
    assert (shell.shape, shell.dtype, shell.placement, shell.sbp) == (x.shape, x.dtype, x.placement, x.sbp)
    assert shell.grad_fn is x.grad_fn and shell.is_meta
    with pytest.raises(MetaTensorError, match=r"shape \[4, 3\]"):
        shell.numpy()


@pytest.mark.parametrize("strategy", [None, "dp=1", "dp=2", "tp=2"])
def test_gpt_logits_are_freed_before_backward(strategy: str | None) -> None:
    """Only the log-softmax output is kept for the loss's gradient (as torch's cross_entropy does): the logits
    and their reshaped view die with the caller's last reference, not at the end of backward."""
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    trainer = build(cfg, strategy)
    ids = np.random.default_rng(0).integers(0, 64, (4, 9))
    x, y = trainer.inputs(ids[:, :-1], ids[:, 1:])
    logits, loss = trainer.model(x, y)
    storages = [weakref.ref(t) for t in logits.local_tensors().values()]
    del logits
    gc.collect()
    assert storages and all(ref() is None for ref in storages)
    loss.backward()
    assert all(p.grad is not None for p in trainer.model.parameters())
