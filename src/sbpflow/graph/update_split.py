"""Updates per bucket: a multi-tensor optimizer update split by the collective its gradients wait for.

One ``adam_update_multi`` per parameter group waits for the last bucket, which nothing hides::

    compute:  ... backward ... split1 split2 split3 [wait for bucket 4] split4 update(all k)
    comm:     ............ bucket1  bucket2  bucket3 ............ bucket4

The update is elementwise per parameter, so it is cut into one update per collective, bitwise the same::

    compute:  ... backward ... split1 update1 split2 update2 split3 update3 split4 update4
    comm:     ............ bucket1  bucket2  bucket3 ............ bucket4
"""

from __future__ import annotations

import dataclasses

from .lower import registers
from .physical import PhysicalPlan, PNode

SPLITTABLE = {"adam_update_multi": 4}  # multi-tensor update op -> tensor lists per parameter (p, g, m, v)
GRADIENTS = 1  # the index of the gradient list among them


def update_per_bucket(plan: PhysicalPlan) -> PhysicalPlan:
    """``plan`` with each splittable update cut into one update per gradient collective (a bucket's or a solo
    all-reduce), each right after that collective's last node; the same plan if no update reads more than one.

    Gradients that wait for no collective (one rank, a tensor-parallel shard) join the first piece; an update
    after clipping reads one node and stays whole. DDP's ``optimizer.step()`` cannot start before its last
    bucket.

    >>> from sbpflow.graph.physical import PhysicalPlan
    >>> update_per_bucket(PhysicalPlan([], {}, {})).nodes
    []
    """
    producer = {b: n for n in plan.nodes for b in n.outputs}
    position = {n.id: i for i, n in enumerate(plan.nodes)}
    readers: dict[int, list[PNode]] = {}
    for n in plan.nodes:
        for b in n.inputs:
            readers.setdefault(b, []).append(n)
    by_id = {n.id: n for n in plan.nodes}
    reached: dict[int, PNode | None] = {}  # a reader of another phase -> the node it orders a piece through
    next_id = max((n.id for n in plan.nodes), default=-1) + 1
    after: dict[int, list[tuple[int, PNode]]] = {}  # plan position -> (what it waits for, piece) placed after it
    renamed: dict[int, tuple[int, ...]] = {}
    waited = {c for n in plan.nodes for c in n.control}  # an update another node waits for stays whole
    for node in plan.nodes:
        groups = _pieces(node, producer, position) if node.id not in waited else []
        pieces = [_piece(node, members, next_id + i) for i, members in enumerate(groups)]
        guarded = [_guarded(p, node, plan, readers, position, reached) for p in pieces]
        if len(pieces) < 2 or any(p is None for p in guarded):
            continue
        next_id += len(pieces)
        renamed[node.id] = tuple(p.id for p in pieces)
        floor = _tail(plan, position[node.id]) - 1
        for piece in guarded:
            assert piece is not None
            piece = _early_phase(piece, plan, producer, by_id)
            last = max([position[producer[b].id] for b in piece.inputs if b in producer]
                       + [position[c] for c in piece.control])
            after.setdefault(max(last, floor), []).append((last, piece))
    if not renamed:
        return plan
    nodes: list[PNode] = []
    for i, n in enumerate(plan.nodes):
        if n.id not in renamed:
            nodes.append(n)
        nodes.extend(piece for _, piece in sorted(after.get(i, []), key=lambda x: x[0]))
    out = dataclasses.replace(plan, nodes=nodes, registers={})
    out.registers = registers(out)
    return out


def _tail(plan: PhysicalPlan, at: int) -> int:
    """The first position of the run of bucket splits and updates that ends at position ``at`` (the whole update):
    no piece moves before it. A split, or a piece reading a solo all-reduce, waits for a collective in flight,
    and acting one earlier, among backward's nodes, would hold the compute thread there while backward's work
    was ready."""
    while at > 0 and (plan.nodes[at - 1].op == "bucket_split" or plan.nodes[at - 1].kind == "update"):
        at -= 1
    return at


def _guarded(piece: PNode, whole: PNode, plan: PhysicalPlan, readers: dict[int, list[PNode]],
             position: dict[int, int], reached: dict[int, PNode | None]) -> PNode | None:
    """``piece`` with control edges from every other reader of the buffers it writes in place (its parameters
    and moments), so that it overwrites nothing a forward or backward act has yet to read: the whole update
    was ordered after them by waiting for every gradient, a piece waits for fewer. A reader of another phase
    orders it through the first node of the piece's phase that it reaches and that acts once (a micro-batch
    reader through the all-reduce of a gradient sum it feeds, which acts after the sum's last micro-batch; not
    the sum itself, which acts, and sends a token, per micro-batch). None if one reaches none."""
    if any(whole.control_lead):
        return None
    sources = set(whole.control)
    for b in _written(piece):
        for reader in readers.get(b, ()):
            if reader.id == whole.id:
                continue
            if plan.steps(reader) == plan.steps(piece):  # a node sends a control token per act
                found: PNode | None = reader
            else:
                if reader.id not in reached:
                    reached[reader.id] = _reached(reader, piece, readers, plan)
                found = reached[reader.id]
            if found is None:
                return None
            sources.add(found.id)
    control = tuple(sorted(sources, key=lambda c: position[c]))
    return dataclasses.replace(piece, control=control, control_lead=())


def _written(piece: PNode) -> tuple[int, ...]:
    """The buffers an update overwrites: every tensor input but the gradients."""
    k = len(piece.inputs) // SPLITTABLE[piece.op or ""]
    return piece.inputs[:GRADIENTS * k] + piece.inputs[(GRADIENTS + 1) * k:]


def _early_phase(piece: PNode, plan: PhysicalPlan, producer: dict[int, PNode], by_id: dict[int, PNode]) -> PNode:
    """``piece`` in the micro phase when there is one micro-batch and all it waits for is in it: the executors
    run a phase's nodes in plan order (the in-order one) or by plan position among those ready (the actor
    runtime), and only there does a piece come before the next bucket's split."""
    waits = [producer[b] for b in piece.inputs if b in producer] + [by_id[c] for c in piece.control]
    if plan.micro_batches != 1 or piece.phase != "post" or any(n.phase == "post" for n in waits):
        return piece
    return dataclasses.replace(piece, phase="micro")


def _reached(start: PNode, piece: PNode, readers: dict[int, list[PNode]], plan: PhysicalPlan) -> PNode | None:
    """The first node of ``piece``'s phase and step count that ``start`` reaches through data edges (breadth
    first)."""
    seen, frontier = {start.id}, [start]
    while frontier:
        nxt = []
        for n in frontier:
            for b in n.outputs:
                for r in readers.get(b, ()):
                    if r.id in seen:
                        continue
                    if plan.steps(r) == plan.steps(piece) and r.phase == piece.phase and r.kind != "update":
                        return r  # (an update is being cut here too: not one to wait for)
                    seen.add(r.id)
                    nxt.append(r)
        frontier = nxt
    return None


def _pieces(node: PNode, producer: dict[int, PNode], position: dict[int, int]) -> list[list[int]]:
    """The parameter indices of a splittable update, grouped by the collective their gradient waits for, in
    the order those collectives end; [] for any other node."""
    lists = SPLITTABLE.get(node.op or "")
    if node.kind != "update" or lists is None:
        return []
    k = sum(how == "t" for how, _ in node.args) // lists
    groups: dict[int | None, list[int]] = {}
    for i in range(k):
        how, index = node.args[GRADIENTS * k + i]
        assert how == "t"
        groups.setdefault(_collective(producer.get(node.inputs[index])), []).append(i)
    if len(groups) < 2:
        return []
    keyed = sorted((key for key in groups if key is not None), key=lambda key: position[key])
    ordered = [groups[key] for key in keyed]
    ordered[0] = sorted(groups.get(None, []) + ordered[0])  # no collective to wait for: the first piece
    return ordered


def _collective(made_by: PNode | None) -> int | None:
    """The node whose end a gradient waits for: a bucket's split or a communication node; None otherwise."""
    if made_by is None:
        return None
    collective = made_by.kind == "boxing" and made_by.boxing is not None and bool(made_by.boxing.collectives())
    if made_by.op == "bucket_split" or made_by.is_comm or collective:
        return made_by.id
    return None


def _piece(node: PNode, members: list[int], node_id: int) -> PNode:
    """``node`` on parameters ``members`` only: each tensor list cut to them, the scalars kept."""
    lists = SPLITTABLE[node.op or ""]
    tensor_args = [a for a in node.args if a[0] == "t"]
    k = len(tensor_args) // lists
    picked = [tensor_args[j * k + i] for j in range(lists) for i in members]
    old = [index for _, index in picked]
    inputs = tuple(node.inputs[i] for i in old)
    in_sbps = tuple(node.in_sbps[i] for i in old) if node.in_sbps else ()
    args = tuple(("t", j) for j in range(len(picked))) + tuple(a for a in node.args if a[0] != "t")
    return dataclasses.replace(node, id=node_id, inputs=inputs, args=args, in_sbps=in_sbps)
