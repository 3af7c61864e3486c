"""The shards of a bucket plan (pyreducer/sharded/layout.py), table-driven; the whole states a
checkpoint carries (state.py: from_torch / as_torch / cut) round-trip; and what Note [Clipping
shards] rests on: a gradient's norm is the same over a 1-D view of its elements in memory order,
whatever the offset of that view."""
import pytest
import torch

from pyreducer.sharded import state
from pyreducer._ext import _C
from pyreducer.sharded.layout import Layout, Piece, flat_view

# (buckets, numels, world size) -> every rank's pieces as (bucket, param, start, stop, offset);
# float32 parameters, so shards of Gloo's ring all-reduce chunks (shard_numel below)
TABLE = [
    # one bucket of 10 elements over 2 ranks: chunks of 6, parameter 1 cut in two
    (([[0, 1]], [4, 6], 2),
     {0: [(0, 0, 0, 4, 0), (0, 1, 0, 2, 4)], 1: [(0, 1, 2, 6, 0)]}),
    # 7 elements over 3 ranks -> chunks of 4: the last rank's is padding only
    (([[0]], [7], 3),
     {0: [(0, 0, 0, 4, 0)], 1: [(0, 0, 4, 7, 0)], 2: []}),
    # a rank with padding only: 1 element over 2 ranks
    (([[0]], [1], 2), {0: [(0, 0, 0, 1, 0)], 1: []}),
    # two buckets in launch order, slots in plan order (not index order)
    (([[2, 0], [1]], [2, 3, 4], 2),
     {0: [(0, 2, 0, 4, 0), (1, 1, 0, 2, 0)], 1: [(0, 0, 0, 2, 0), (1, 1, 2, 3, 0)]}),
]


@pytest.mark.parametrize("case,expected", TABLE)
def test_pieces(case, expected):
    buckets, numels, world_size = case
    sizes = [4] * len(numels)
    for rank, pieces in expected.items():
        layout = Layout(buckets, numels, sizes, world_size, rank)
        assert layout.pieces == [Piece(*p) for p in pieces]
    covered = sorted((p.param, p.start, p.stop) for r in range(world_size)
                     for p in Layout(buckets, numels, sizes, world_size, 0).pieces_of(r))
    for param, numel in enumerate(numels):  # every element owned once
        mine = [(a, b) for q, a, b in covered if q == param]
        assert mine[0][0] == 0 and mine[-1][1] == numel
        assert all(x[1] == y[0] for x, y in zip(mine, mine[1:]))


# (numel, shards, element size) -> shard elements, worked out from gloo/allreduce.cc ring():
# segments = round_up(max(ceil(bytes / 1 MiB), 2 shards), shards), segment bytes = round_up(
# ceil(bytes / segments), element size), a rank's chunk = segments / shards segments
SHARD_NUMEL = [
    ((10, 2, 4), 6),            # 4 segments of 3 elements, 2 per rank
    ((7, 3, 4), 4),             # 6 segments of 2 (the last rank's chunk begins past the end)
    ((1001, 4, 2), 252),        # 8 segments of 126 half-precision elements (ceil would be 251)
    ((3_000_001, 4, 4), 750_003),    # 12 MB: 12 segments of 250,001, 3 per rank
    ((3_000_001, 3, 4), 1_000_004),  # 12 segments, 4 per rank
    ((5, 1, 4), 5), ((0, 2, 4), 0),
]


@pytest.mark.parametrize("args,expected", SHARD_NUMEL)
def test_shard_numel_is_gloos_chunk(args, expected):
    assert _C.shard_numel(*args) == expected
    numel, shards, _ = args
    assert expected * shards >= numel


def test_shard_numel_refuses_nonsense():
    with pytest.raises(ValueError, match="expected numel >= 0, shards >= 1"):
        _C.shard_numel(10, 0, 4)


def test_layout_round_trips_and_compares():
    layout = Layout([[0, 1]], [4, 6], [4, 4], 2, 1)
    again = Layout.from_description(layout.describe())
    assert again.same_as(layout) and again.pieces == layout.pieces
    assert not Layout([[1, 0]], [4, 6], [4, 4], 2, 1).same_as(layout)
    assert not Layout([[0, 1]], [4, 6], [4, 4], 3, 1).same_as(layout)
    big = Layout([[0]], [3_000_001], [4], 4, 1)  # 12 segments of Gloo's; in float16, 8
    assert big.shard_numel == [750_003]
    assert not Layout([[0]], [3_000_001], [2], 4, 1).same_as(big)


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
    layout = Layout([[0]], [param.numel()], [4], 3, 1)
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

    memory = dict(parameters=2**20, gradient_buckets=2**20, optimizer_state=2**19)
    after = dict(memory, gradient_buckets=0)
    timelines = [[dict(overlap=dict(memory=memory, memory_after_update=after))], [dict()]]
    lines = memory_text(timelines)
    assert lines == [
        "rank 0 memory at the step (sharded optimizer, MB): parameters 1.00, gradient buckets "
        "1.00, optimizer state 0.50",
        "rank 0 memory after the update (sharded optimizer, MB): parameters 1.00, gradient "
        "buckets 0.00, optimizer state 0.50"]
