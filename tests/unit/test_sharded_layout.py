"""The shards of a bucket plan (pyreducer/sharded/layout.py), table-driven; the whole states a
checkpoint carries (state.py: from_torch / as_torch / cut) round-trip; and what Note [Clipping
shards] rests on: a gradient's norm is the same over a 1-D view of its elements in memory order,
whatever the offset of that view."""
import pytest
import torch

from pyreducer.sharded import state
from pyreducer.sharded.layout import Layout, Piece, flat_view

# (buckets, numels, world size) -> every rank's pieces as (bucket, param, start, stop, offset)
TABLE = [
    # one bucket of 10 elements over 2 ranks: 5 each, parameter 1 cut in two
    (([[0, 1]], [4, 6], 2),
     {0: [(0, 0, 0, 4, 0), (0, 1, 0, 1, 4)], 1: [(0, 1, 1, 6, 0)]}),
    # padded: 7 elements over 3 ranks -> shards of 3 (2 padding elements at the end)
    (([[0]], [7], 3),
     {0: [(0, 0, 0, 3, 0)], 1: [(0, 0, 3, 6, 0)], 2: [(0, 0, 6, 7, 0)]}),
    # a rank with padding only: 1 element over 2 ranks
    (([[0]], [1], 2), {0: [(0, 0, 0, 1, 0)], 1: []}),
    # two buckets in launch order, slots in plan order (not index order)
    (([[2, 0], [1]], [2, 3, 4], 2),
     {0: [(0, 2, 0, 3, 0), (1, 1, 0, 2, 0)], 1: [(0, 2, 3, 4, 0), (0, 0, 0, 2, 1),
                                                (1, 1, 2, 3, 0)]}),
]


@pytest.mark.parametrize("case,expected", TABLE)
def test_pieces(case, expected):
    buckets, numels, world_size = case
    for rank, pieces in expected.items():
        layout = Layout(buckets, numels, world_size, rank)
        assert layout.pieces == [Piece(*p) for p in pieces]
    covered = sorted((p.param, p.start, p.stop) for r in range(world_size)
                     for p in Layout(buckets, numels, world_size, 0).pieces_of(r))
    for param, numel in enumerate(numels):  # every element owned once
        mine = [(a, b) for q, a, b in covered if q == param]
        assert mine[0][0] == 0 and mine[-1][1] == numel
        assert all(x[1] == y[0] for x, y in zip(mine, mine[1:]))


def test_layout_round_trips_and_compares():
    layout = Layout([[0, 1]], [4, 6], 2, 1)
    again = Layout.from_description(layout.describe())
    assert again.same_as(layout) and again.pieces == layout.pieces
    assert not Layout([[1, 0]], [4, 6], 2, 1).same_as(layout)
    assert not Layout([[0, 1]], [4, 6], 3, 1).same_as(layout)


def test_flat_view_is_memory_order():
    x = torch.arange(2 * 3 * 4 * 5.0).view(2, 3, 4, 5).contiguous(
        memory_format=torch.channels_last)
    view = flat_view(x)
    assert view.data_ptr() == x.data_ptr()
    assert torch.equal(view, x.permute(0, 2, 3, 1).reshape(-1))
    with pytest.raises(ValueError, match="not dense in memory"):
        flat_view(torch.zeros(4, 4)[:, ::2])


def test_whole_state_round_trip_channels_last():
    param = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    torch_state = dict(step=torch.tensor(3.0), exp_avg=torch.randn(2, 3, 4, 4))
    whole = state.from_torch(param, torch_state)
    assert whole["exp_avg"].dim() == 1 and whole["step"] is torch_state["step"]
    back = state.as_torch(param, whole)
    assert torch.equal(back["exp_avg"], torch_state["exp_avg"])
    assert back["exp_avg"].stride() == param.stride()
    layout = Layout([[0]], [param.numel()], 3, 1)
    (index, piece_state), = state.cut(layout, 0, whole).items()
    piece = layout.pieces[index]
    assert torch.equal(piece_state["exp_avg"], whole["exp_avg"][piece.start:piece.stop])


def test_from_torch_refuses_other_shapes():
    with pytest.raises(ValueError, match="expected the parameter's"):
        state.from_torch(torch.zeros(4, 4), dict(preconditioner=torch.zeros(4)))


@pytest.mark.parametrize("numel,start", [(1000, 0), (100003, 5), (4096, 333), (77, 76)])
def test_norm_of_a_view_in_memory_order(numel, start):
    gen = torch.Generator().manual_seed(numel)
    buffer = torch.randn(start + numel + 9, generator=gen)
    piece = buffer[start:start + numel]  # a slice of a shard, at any offset
    whole = piece.clone().view(-1, 1)  # the gradient as torch holds it
    assert torch.equal(torch.linalg.vector_norm(piece), torch.linalg.vector_norm(whole))
    assert torch.equal(torch._foreach_norm([piece])[0], torch.linalg.vector_norm(whole))


def test_report_lists_the_sharded_memory_per_rank():
    from pyreducer.observe.report import memory_text

    memory = dict(parameters=2**20, optimizer_state=2**19)
    timelines = [[dict(overlap=dict(memory=memory))], [dict()]]
    lines = memory_text(timelines)
    assert lines == ["rank 0 memory (sharded optimizer, MB): parameters 1.00, optimizer state 0.50"]
