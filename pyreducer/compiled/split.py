"""Where a captured forward graph is cut so that each bucket becomes ready as backward reaches it.

Note [Splitting a compiled graph at buckets]
A backend that goes through AOTAutograd (inductor, aot_eager) turns a captured forward graph into
ONE autograd function: its backward produces every parameter's gradient when it returns, so every
AccumulateGrad hook fires at the end of the graph's backward and no all-reduce can start earlier.
Cut the forward graph into consecutive pieces and each piece is its own autograd function; backward
runs them last piece first, and a parameter's gradient is complete when the piece holding its FIRST
use in forward has run its backward (a parameter used twice, a tied weight, gets gradient from every
use). A bucket is ready when all its parameters are, so: when the piece holding the earliest first
use among its parameters finishes. A cut between the last node that reads an earlier bucket's
parameter and that first use, for every bucket, makes each bucket ready when eager backward would
make it ready (up to the piece's internal order), and no other cut helps any bucket. Of those
positions the earliest is taken: the parameter-free nodes between (an activation, dropout, a
reshape) join the piece that consumes their output, so that piece's compiler sees the activation
beside the layer that reads it. Cut at the first use instead, a Linear+ReLU chain handed each
ReLU's output to the next piece and each piece saved a bool mask for ReLU's backward besides:
inductor on this CPU (AVX2, torch 2.13) takes 3 ms to store a 128x1024 mask that eager writes in
0.2 ms, and mlp_large's forward split in 6 went from 31 to 53 ms. The cut before the graph's
earliest use is dropped (it would only split off a preamble without parameters), and a piece whose
values nothing later reads is merged into the next.

This module is pure FX: which node starts each piece, from the plan's bucket of each parameter.
pyreducer/compiled/backend.py compiles the pieces; the plan is the Reducer's, in force when dynamo
captures the graph (pyreducer/compiled/dynamo.py recaptures when the plan changes its buckets).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import fx


@dataclass
class Cut:
    """One piece of a split graph: nodes [start, end) of the graph's compute nodes (placeholders
    and output excluded), and the buckets whose earliest first use opens it."""
    start: int
    end: int
    buckets: list[int] = field(default_factory=list)
    params: list[str] = field(default_factory=list)  # the parameters it uses first, by name


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a split assigns to pieces: all but placeholders and the output."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _parameter_keys(node: fx.Node, param_of):
    """The parameter keys `node` reads (a get_attr of a parameter counts as reading it)."""
    sources = [node] if node.op == "get_attr" else []
    sources += [a for a in node.all_input_nodes if a.op in ("placeholder", "get_attr")]
    for source in sources:
        key = param_of(source)
        if key is not None:
            yield key, str(source.target)


def first_uses(gm: fx.GraphModule, param_of) -> dict[int, tuple[int, str]]:
    """Per parameter key, the index (in compute_nodes) of its first use and its graph name.

    Args:
        param_of: node -> parameter key or None, for placeholder and get_attr nodes (the caller
            knows how the graph carries parameters: lifted inputs or attributes).
    """
    uses = {}
    for index, node in enumerate(compute_nodes(gm)):
        for key, name in _parameter_keys(node, param_of):
            uses.setdefault(key, (index, name))
    return uses


def plan_cuts(gm: fx.GraphModule, param_of, bucket_of: dict) -> list[Cut]:
    """The pieces (Note [Splitting a compiled graph at buckets]) for a plan.

    Args:
        param_of: node -> parameter key or None (see first_uses).
        bucket_of: parameter key -> bucket index in the plan in force; keys absent are parameters
            the Reducer does not reduce (frozen, ignored): they open no piece.
    Returns one Cut per piece, in graph order, covering every compute node; a single Cut when the
    graph uses parameters of at most one bucket.
    """
    nodes = compute_nodes(gm)
    opening = {}  # node index -> (buckets, params) whose earliest first use is there
    earliest = {}  # bucket -> (index, param name)
    for key, (index, name) in first_uses(gm, param_of).items():
        bucket = bucket_of.get(key)
        if bucket is not None and (bucket not in earliest or index < earliest[bucket][0]):
            earliest[bucket] = (index, name)
    for bucket, (index, name) in earliest.items():
        entry = opening.setdefault(index, ([], []))
        entry[0].append(bucket)
        entry[1].append(name)
    starts = sorted(opening)
    if not nodes:
        return []
    starts = [0] + starts[1:] if starts else [0]
    reads = [any(key in bucket_of for key, _ in _parameter_keys(node, param_of)) for node in nodes]
    starts = _merge_dead_pieces(nodes, _after_last_reads(nodes, reads, starts))
    cuts = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(nodes)
        buckets, params = [], []
        for index in range(start, end):
            if index in opening:
                buckets += opening[index][0]
                params += opening[index][1]
        cuts.append(Cut(start, end, sorted(buckets), params))
    return cuts


def _after_last_reads(nodes: list[fx.Node], reads: list[bool], starts: list[int]) -> list[int]:
    """Each cut but the first moved back from its bucket's first use to just after the last node
    before it that reads a reduced parameter (reads[i]): the parameter-free nodes between
    (activations, dropout, reshapes) go to the piece that consumes them. Never between a node that
    returns a tuple and the getitems that take it apart (MultiheadAttention's (output, None)):
    the tuple would be a piece's output, which AOTAutograd refuses; then a later position, at
    worst the first use."""
    position = {node: i for i, node in enumerate(nodes)}

    def splits_a_tuple(cut: int, before: int) -> bool:
        return any(user.target is operator.getitem and position.get(user, -1) >= cut
                   for node in nodes[before:cut] for user in node.users)

    moved = starts[:1]
    for before, start in zip(starts, starts[1:]):
        last = next((i for i in range(start - 1, before - 1, -1) if reads[i]), None)
        cut = start if last is None else last + 1
        while cut < start and splits_a_tuple(cut, before):
            cut += 1
        moved.append(cut)
    return moved


def _merge_dead_pieces(nodes: list[fx.Node], starts: list[int]) -> list[int]:
    """Merges a piece none of whose values is read outside it (by a later piece or the output)
    into the next one (the last into the one before): such a piece has no output to hand on, and
    compiling it alone would give an autograd function with nothing to differentiate."""
    position = {node: i for i, node in enumerate(nodes)}
    kept = list(starts)
    changed = True
    while changed and len(kept) > 1:
        changed = False
        for i in range(len(kept)):
            start, end = kept[i], kept[i + 1] if i + 1 < len(kept) else len(nodes)
            if not any(position.get(user, len(nodes)) >= end  # the output counts as later
                       for k in range(start, end) for user in nodes[k].users):
                del kept[i + 1 if i + 1 < len(kept) else i]  # into the next, the last into
                changed = True                                 # the one before
                break
    return kept


def split(gm: fx.GraphModule, cuts: list[Cut]) -> fx.GraphModule:
    """gm split into one submodule per Cut (submod_0, submod_1, ... in graph order), called in
    order by the returned module's graph (torch.fx's split_module, which keeps autocast and
    grad-mode regions whole in each piece)."""
    piece = {}
    for i, cut in enumerate(cuts):
        for node in compute_nodes(gm)[cut.start:cut.end]:
            piece[node] = i
    return fx.passes.split_module.split_module(gm, None, lambda node: piece[node],
                                               keep_original_order=True)


def attribute(gm: fx.GraphModule, target: str):
    """The value a get_attr node reads (a dotted path below gm), or None."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
