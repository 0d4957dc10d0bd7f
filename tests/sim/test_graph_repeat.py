"""Repeated layers in SBP selection (graph/repeat.py): which nodes are tied, and that tying changes no plan.

The GPT's blocks are found from the traced graph alone: a forward op that reads the variable
``model.h.<i>.<role>`` belongs to block ``i``. Interior blocks must share one class per role, deeper models
must add no classes, and the tied selection must choose what the per-node program chooses on dp2 x tp2.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest

import sbpflow
from sbpflow.demo.train_gpt import build, random_batches
from sbpflow.graph.repeat import op_classes
from sbpflow.graph.select import Candidate, signature_key
from sbpflow.models.gpt import GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_VARIABLE = re.compile(r"model\.h\.(\d+)\.(.+)")


def _compiled(n_layer: int, strategy: str, selection: str = "greedy") -> Any:
    """The GPT's compiled step; with "greedy", its logical graph holds the traced choices, what selection
    starts from."""
    config = GPTConfig(vocab_size=100, block_size=16, n_layer=n_layer, n_head=4, n_embd=32, dropout=0.0)
    trainer = build(config, strategy, graph=True, executor="inorder")
    trainer.graph.config.set_sbp_selection(selection)
    ids, targets = next(random_batches(100, 1, 4, 16, seed=1))
    trainer.step(ids, targets)
    return trainer.graph._compiled()


def _classes(g: Any) -> dict[int, int]:
    current = {n.id: Candidate(tuple(n.in_sbps), tuple(g.values[v].sbp for v in n.outputs))
               for n in g.nodes if n.kind == "op"}
    return op_classes(g, lambda n: (signature_key(g, n), current[n.id]))


def _block_ops(g: Any) -> dict[tuple[str, str], dict[int, int]]:
    """(op, role) -> {block: node id} for the ops that read a block's variable."""
    out: dict[tuple[str, str], dict[int, int]] = {}
    for n in g.nodes:
        for vid in n.inputs if n.kind == "op" and n.phase == "micro" else ():
            producer = g.nodes[g.values[vid].producer]
            found = BLOCK_VARIABLE.fullmatch(producer.name) if producer.kind == "variable" else None
            if found:
                out.setdefault((n.name, found.group(2)), {})[int(found.group(1))] = n.id
    return out


def test_interior_blocks_share_one_class_per_role() -> None:
    n_layer = 6
    g = _compiled(n_layer, "dp=2,tp=2").logical
    classes = _classes(g)
    by_role = _block_ops(g)
    assert len(by_role) >= 10  # linear q/k/v/c_proj/c_fc/mlp c_proj, layer_norm 1/2, their backward matmuls
    for (op, role), blocks in by_role.items():
        assert sorted(blocks) == list(range(n_layer)), (op, role)
        interior = {classes[blocks[i]] for i in range(1, n_layer - 1)}
        assert len(interior) == 1, f"{op} reading {role}: interior blocks in classes {interior}"
    # roles are told apart even where the op and its metadata agree: the two LayerNorms of a block
    assert classes[by_role[("layer_norm", "ln_1.weight")][2]] != classes[by_role[("layer_norm", "ln_2.weight")][2]]
    for rep in set(classes.values()):  # a class never mixes ops or metadata
        members = [g.nodes[nid] for nid, r in classes.items() if r == rep]
        assert len({signature_key(g, n) for n in members}) == 1


def test_deeper_models_add_no_classes() -> None:
    """Each block added to the GPT ties into the existing classes, and its reads into the existing edges
    (the optimizer's fused update reads every gradient alike): the program keeps about its size, where the
    per-node one grows with the graph (only inputs of fused nodes whose candidates treat them apart add a few
    variables)."""
    shallow, deep = _compiled(4, "dp=2", "ilp"), _compiled(7, "dp=2", "ilp")
    ops_shallow = sum(n.kind == "op" for n in shallow.logical.nodes)
    ops_deep = sum(n.kind == "op" for n in deep.logical.nodes)
    assert ops_deep > 1.5 * ops_shallow  # three blocks of forward and backward ops more
    assert deep.report.selection.classes == shallow.report.selection.classes
    assert deep.report.selection.variables < 1.1 * shallow.report.selection.variables


def _megatron_plan(method: str) -> tuple[Any, Any, Any]:
    config = GPTConfig(vocab_size=100, block_size=64, n_layer=3, n_head=4, n_embd=64, dropout=0.0)
    trainer = build(config, "dp=2,tp=2", graph=True, clip=None, executor="inorder")
    trainer.graph.config.set_sbp_selection(method)
    ids, targets = next(random_batches(100, 1, 32, 64, seed=1))
    trainer.step(ids, targets)
    return trainer.graph.logical, trainer.graph.plan, trainer.graph._compiled().report.selection


def _collectives(plan: Any) -> Counter[tuple[Any, ...]]:
    return Counter((s.kind, s.axis, s.src.sbp, s.dst.sbp) for n in plan.collectives(0) for s in n.boxing.steps)


def test_tied_selection_chooses_what_the_per_node_program_chooses() -> None:
    merged_graph, merged_plan, merged = _megatron_plan("ilp")
    plain_graph, plain_plan, plain = _megatron_plan("ilp-unmerged")
    assert merged.classes < plain.classes and merged.variables < plain.variables
    assert merged.chosen_cost < merged.greedy_cost
    signatures = [[(n.name, n.in_sbps, tuple(g.values[v].sbp for v in n.outputs)) for n in g.nodes if n.kind == "op"]
                  for g in (merged_graph, plain_graph)]
    assert signatures[0] == signatures[1]
    assert _collectives(merged_plan) == _collectives(plain_plan)
    tensor_axis_reduces = sum(count for (kind, axis, src, _), count in _collectives(merged_plan).items()
                              if kind == "all_reduce" and axis == 1 and isinstance(src[1], sbpflow.sbp.Partial))
    assert tensor_axis_reduces == 4 * 3


def test_unknown_selection_method_is_refused() -> None:
    trainer = build(GPTConfig(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=8), "dp=2", graph=True)
    with pytest.raises(sbpflow.SbpflowError, match="'ilp-unmerged'.*'ilpp'"):
        trainer.graph.config.set_sbp_selection("ilpp")
