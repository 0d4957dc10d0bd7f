"""Updates per bucket (graph.update_split): a multi-tensor optimizer update is cut by the gradient collective each
parameter waits for, so early buckets' parameters update while later buckets are on the wire, with the same
numbers."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from sbpflow import boxing
from sbpflow.boxing import CostModel
from sbpflow.demo.train_gpt import build, parameter_values, random_batches
from sbpflow.graph.fuse import members
from sbpflow.graph.update_split import update_per_bucket
from sbpflow.graph.verify import verify
from sbpflow.models.gpt import GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


# a link whose latency is near zero: every gradient goes out alone (graph.bucket's solo rule), so this small GPT
# has one all-reduce per gradient, where the default model packs them all into one bucket
FAST = CostModel().with_link("cpu", "intra", alpha=1e-9, beta=1 / 2e9)


def _train(spec: str | None, m: int, split: bool, clip: float | None = None,
           model: CostModel = FAST) -> tuple[list[float], dict[str, np.ndarray], Any]:
    trainer = build(CONFIG, spec, graph=True, micro_batches=m, clip=clip)
    trainer.graph.config.update_per_bucket = split
    with boxing.cost_model(model):
        losses = [trainer.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, 3, 8,
                                                                               CONFIG.block_size, seed=3)]
    return losses, parameter_values(trainer), trainer.graph._compiled().plan


def _updates(plan: Any) -> list[Any]:
    return [n for n in plan.nodes if n.kind == "update" and n.op == "adam_update_multi"]


def _ancestors(plan: Any, node: Any) -> set[int]:
    """Ids of the nodes ``node`` waits for, through data and control edges."""
    producer = {b: n for n in plan.nodes for b in n.outputs}
    by_id = {n.id: n for n in plan.nodes}
    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for up in [producer[b] for b in n.inputs if b in producer] + [by_id[c] for c in n.control]:
            if up.id not in seen:
                seen.add(up.id)
                stack.append(up)
    return seen


@pytest.mark.parametrize("spec, m", [("dp=2", 1), ("dp=2", 4), ("dp=2,tp=2", 1), ("dp=2,pp=2", 4)])
def test_updates_follow_their_buckets_with_the_same_numbers(spec: str, m: int) -> None:
    losses, params, plan = _train(spec, m, split=True)  # small buckets: several per step
    whole_losses, whole_params, whole_plan = _train(spec, m, split=False)
    pieces, wholes = _updates(plan), _updates(whole_plan)
    assert len(pieces) > len(wholes)
    # the same parameters are updated, each once
    inputs = sorted(b for n in pieces for b in n.inputs[:len(n.inputs) // 4])
    assert inputs == sorted(b for n in wholes for b in n.inputs[:len(n.inputs) // 4])
    # each piece reads the results of one collective (a bucket's split or a solo all-reduce) and follows it
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    producer = {b: n for n in plan.nodes for b in n.outputs}
    for piece in pieces:
        k = len(piece.inputs) // 4
        made = [producer[b] for b in piece.inputs[k:2 * k]]
        assert len({n.id for n in made if n.op == "bucket_split" or n.kind == "boxing"}) <= 1
        assert position[piece.id] > max(position[n.id] for n in made)
    # the same kernel on fewer tensors: bitwise the same training
    assert losses == whole_losses
    for name in params:
        np.testing.assert_array_equal(params[name], whole_params[name], err_msg=name)


@pytest.mark.parametrize("spec, m", [("dp=2", 1), ("dp=2", 4), ("dp=2,tp=2", 1), ("dp=2,pp=2", 4)])
def test_a_piece_runs_after_every_reader_of_what_it_overwrites(spec: str, m: int) -> None:
    """A piece waits for fewer gradients than the whole update did, so its control edges must order it after
    every forward and backward node that reads its parameters (or it could overwrite one before that read)."""
    _, _, plan = _train(spec, m, split=True)
    readers: dict[int, list[Any]] = {}
    for n in plan.nodes:
        for b in n.inputs:
            readers.setdefault(b, []).append(n)
    pieces = _updates(plan)
    assert len(pieces) > 2
    for piece in pieces:
        before = _ancestors(plan, piece)
        k = len(piece.inputs) // 4
        for b in piece.inputs[:k] + piece.inputs[2 * k:]:  # parameters and moments, written in place
            others = [r for r in readers[b] if r.id != piece.id]
            late = [r.label() for r in others if r.id not in before]
            assert not late, f"{piece.label()} may overwrite %{b} before {late} read it"


def test_micro_batch_readers_are_ordered_through_a_sum() -> None:
    """With micro-batches the pieces are post-phase nodes, and a forward or backward reader acts m times: the
    piece's edge comes from a post-phase node that the reader feeds (the sum of a gradient), which acts after
    the last micro-batch."""
    _, _, plan = _train("dp=2", 4, split=True)
    by_id = {n.id: n for n in plan.nodes}
    pieces = _updates(plan)
    assert pieces and all(p.phase == "post" for p in pieces)
    # an accumulate acts (and sends a token) per micro-batch: an edge from one would free the piece too early
    assert all(by_id[c].phase != "micro" and by_id[c].kind not in ("accumulate", "pack")
               for p in pieces for c in p.control)


def test_with_one_micro_batch_pieces_interleave_with_the_bucket_splits_after_backward() -> None:
    """m = 1, the benchmark's GPT under the default model (4 buckets): each piece moves into the micro phase and
    comes right after its bucket's split, before the next split (which waits for the next bucket), and after
    backward's last node (a piece waits for a collective, and acting it earlier would hold backward)."""
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.0)
    trainer = build(config, "dp=2", clip=None, graph=True)
    ids, targets = next(random_batches(256, 1, 8, 128, seed=1))
    trainer.graph.compile_only(*trainer.inputs(ids, targets))
    plan = trainer.graph.plan
    kinds = [("split" if n.op == "bucket_split" else "update") for n in plan.nodes
             if n.op == "bucket_split" or n.kind == "update"]
    assert kinds.count("split") == 4 and len(kinds) > 6
    assert kinds[0] == "split" and kinds[-1] == "update"
    assert all(a != b or a == "update" for a, b in zip(kinds, kinds[1:], strict=False))  # no two splits in a row
    pieces = _updates(plan)
    assert all(n.phase == "micro" for n in pieces)
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    backward = max(i for i, n in enumerate(plan.nodes)  # a fused node: where the nodes it runs act
                   if any(m.op in ("linear_weight_grad", "embedding_backward") for m in members([n])))
    assert min(position[n.id] for n in pieces) > backward


def test_clipping_and_one_rank_keep_one_update_per_group() -> None:
    # clipping reads every gradient first: the update waits for one node, and stays whole
    _, _, clipped = _train("dp=2", 1, split=True, clip=1.0)
    _, _, clipped_whole = _train("dp=2", 1, split=False, clip=1.0)
    assert len(_updates(clipped)) == len(_updates(clipped_whole))
    # one rank: no collective to wait for
    _, _, single = _train("dp=1", 1, split=True)
    _, _, single_whole = _train("dp=1", 1, split=False)
    assert len(_updates(single)) == len(_updates(single_whole))


def test_the_pass_leaves_a_plan_without_collectives_alone_and_verifies() -> None:
    _, _, plan = _train("dp=1", 1, split=False)
    assert update_per_bucket(plan) is plan
    _, _, whole = _train("dp=2", 1, split=False)
    split = update_per_bucket(whole)
    verify(split)
    assert len(_updates(split)) > len(_updates(whole))


def test_an_update_that_another_node_waits_for_stays_whole() -> None:
    """A control edge on the update (none of today's passes makes one) would have no single node to point at
    once it is cut: such an update is left as it is."""
    _, _, whole = _train("dp=2", 1, split=False)
    updates = _updates(whole)
    last = whole.nodes[-1]
    waiting = dataclasses.replace(last, control=(*last.control, updates[0].id))
    plan = dataclasses.replace(whole, nodes=[*whole.nodes[:-1], waiting])
    split = update_per_bucket(plan)
    assert updates[0].id in {n.id for n in split.nodes}  # kept whole
    assert len(_updates(split)) > len(updates)  # the other group's update is still cut
    verify(split)


def test_matches_one_device() -> None:
    losses, params, _ = _train("dp=2", 4, split=True)
    single = build(CONFIG, None, clip=None)
    single_losses = [single.step(ids, targets) for ids, targets in random_batches(CONFIG.vocab_size, 3, 8,
                                                                                 CONFIG.block_size, seed=3)]
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
    for name, value in parameter_values(single).items():
        np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
