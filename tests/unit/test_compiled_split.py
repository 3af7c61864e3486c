"""Where a compiled graph is cut (pyreducer/compiled/split.py, Note [Splitting a compiled graph at
buckets]): pure FX, checked on traced functional models whose parameters are graph attributes."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from pyreducer.compiled import split


class Chain(nn.Module):
    """Four functional linear layers; optionally the first weight reused by the last (tied)."""

    def __init__(self, tied=False):
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(8, 8) * 0.3) for _ in range(4)])
        self.tied = tied

    def forward(self, x):
        for k in range(4):
            x = torch.tanh(F.linear(x, self.w[0] if self.tied and k == 3 else self.w[k]))
        return x


def _traced(module):
    gm = fx.symbolic_trace(module)
    params = dict(module.named_parameters())

    def param_of(node):
        value = split.attribute(gm, str(node.target)) if node.op == "get_attr" else None
        return next((name for name, p in params.items() if p is value), None)
    return gm, param_of


def _first_use_index(gm, target):
    """Index of the node reading `target`; unused parameters (tied's w.3) sort last."""
    return next((i for i, n in enumerate(split.compute_nodes(gm)) if str(n.target) == target),
                1 << 30)


CASES = [  # (model, bucket of each parameter, expected buckets opening each piece)
    ("a bucket per layer", Chain(), {"w.0": 3, "w.1": 2, "w.2": 1, "w.3": 0},
     [[3], [2], [1], [0]]),
    ("two layers per bucket", Chain(), {"w.0": 1, "w.1": 1, "w.2": 0, "w.3": 0}, [[1], [0]]),
    ("one bucket: no cut", Chain(), {"w.0": 0, "w.1": 0, "w.2": 0, "w.3": 0}, [[0]]),
    ("a frozen layer opens nothing", Chain(), {"w.0": 2, "w.2": 1, "w.3": 0}, [[2], [1], [0]]),
    # the tied weight's first use is the first layer: its bucket opens the first piece, and
    # its second use (the last layer) opens nothing
    ("tied weight", Chain(tied=True), {"w.0": 2, "w.1": 1, "w.2": 0, "w.3": 0},
     [[2], [1], [0]]),
]


@pytest.mark.parametrize("what,model,bucket_of,expected", CASES, ids=[c[0] for c in CASES])
def test_pieces_open_where_each_bucket_is_first_used(what, model, bucket_of, expected):
    gm, param_of = _traced(model)
    cuts = split.plan_cuts(gm, param_of, bucket_of)
    assert [c.buckets for c in cuts] == expected
    nodes = split.compute_nodes(gm)
    assert cuts[0].start == 0 and cuts[-1].end == len(nodes)  # every node in one piece
    assert all(a.end == b.start for a, b in zip(cuts, cuts[1:]))
    reads = [any(param_of(a) in bucket_of for a in [n, *n.all_input_nodes]) for n in nodes]
    for cut in cuts[1:]:  # a later piece opens just after the last parameter read before its
        first = min(_first_use_index(gm, f"w.{k}") for k, b in  # bucket's first use
                    ((int(n.split(".")[1]), b) for n, b in bucket_of.items())
                    if b in cut.buckets)
        assert cut.start <= first < cut.end and reads[cut.start - 1], (what, cut)
        assert not any(reads[cut.start:first]), (what, cut)  # nothing but parameter-free nodes
        assert nodes[cut.start].target is torch.tanh, (what, cut)  # the activation moved


def test_the_split_module_computes_what_the_graph_did():
    model = Chain()
    gm, param_of = _traced(model)
    cuts = split.plan_cuts(gm, param_of, {"w.0": 3, "w.1": 2, "w.2": 1, "w.3": 0})
    pieces = split.split(gm, cuts)
    assert len([n for n, _ in pieces.named_children() if n.startswith("submod_")]) == 4
    x = torch.randn(5, 8)
    assert torch.equal(pieces(x), model(x))


def test_a_piece_nothing_reads_is_merged():
    """A piece whose values no later node reads (here the unused product of w.1) would hand
    nothing on: it joins the next piece."""
    class DeadEnd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.Parameter(torch.randn(4, 4)) for _ in range(3))

        def forward(self, x):
            h = x @ self.a
            self.b.sum()  # used, but its value goes nowhere
            return torch.tanh(h @ self.c)

    module = DeadEnd()
    gm = fx.symbolic_trace(module)
    gm.graph.eliminate_dead_code = lambda: None  # keep the dead node (tracing kept it)
    params = dict(module.named_parameters())

    def param_of(node):
        value = split.attribute(gm, str(node.target)) if node.op == "get_attr" else None
        return next((n for n, p in params.items() if p is value), None)
    cuts = split.plan_cuts(gm, param_of, {"a": 2, "b": 1, "c": 0})
    assert [c.buckets for c in cuts] == [[2], [0, 1]], cuts
    x = torch.randn(3, 4)
    assert torch.equal(split.split(gm, cuts)(x), module(x))


def test_a_cut_never_separates_a_tuple_from_its_getitems():
    """The cut after the last parameter read must not fall between a node that returns a tuple
    (here slogdet of a parameter; in a transformer, MultiheadAttention's (output, None)) and the
    getitems that take it apart: the tuple would be a piece's output, which AOTAutograd refuses.
    It moves on, here to the next bucket's first use."""
    class TupleOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.eye(4) * 2)
            self.b = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            out = torch.linalg.slogdet(self.a)
            sign, logdet = out[0], out[1]
            return torch.tanh(F.linear(x, self.b) * logdet * sign)

    module = TupleOut()
    gm, param_of = _traced(module)
    cuts = split.plan_cuts(gm, param_of, {"a": 1, "b": 0})
    nodes = split.compute_nodes(gm)
    assert [c.buckets for c in cuts] == [[1], [0]], cuts
    tuple_node = next(i for i, n in enumerate(nodes) if n.target is torch.linalg.slogdet)
    getitems = [i for i, n in enumerate(nodes) if n.target is operator.getitem]
    assert len(getitems) == 2 and all(i < cuts[1].start for i in getitems), (cuts, nodes)
    assert cuts[1].start == _first_use_index(gm, "b") > tuple_node
    x = torch.randn(3, 4)
    assert torch.equal(split.split(gm, cuts)(x), module(x))
